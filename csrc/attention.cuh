// attention helpers: 16-byte vector packs and the key tile that one CTA stages in shared memory.
//
// A key tile is kAttnTile consecutive absolute positions [t0, t0 + kAttnTile). Tiles sit at
// absolute positions (t0 a multiple of kAttnTile) so that the reduction order of a query row
// depends only on where its keys are, never on how many rows or sessions share the launch.
#pragma once
#include "common.cuh"

constexpr int kAttnTile = 64;

// N elements of T loaded or stored as one aligned vector (16, 8 or 4 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N) AttnPack {
  T v[N];
};

template <typename T, int N>
DSPARK_DEVICE AttnPack<T, N> attn_load(const T* p) {
  return *reinterpret_cast<const AttnPack<T, N>*>(p);
}

template <typename T, int N>
DSPARK_DEVICE void attn_store(T* p, const AttnPack<T, N>& x) {
  *reinterpret_cast<AttnPack<T, N>*>(p) = x;
}

// Shared-memory layout of one CTA, carved for its own item count (the launch plan in
// dspark/ops/attention.py sizes the same regions for the largest CTA of the launch):
//   k      [kAttnTile][D + kVec]  storage dtype; the 16-byte pad makes the row-per-lane reads of
//                                 the q.k loop bank-conflict free
//   v      [kAttnTile][D]         storage dtype; read along D, so no pad
//   q      [items][D]   f32       the CTA's query rows x GQA heads, widened once
//   acc    [items][D]   f32       running un-normalised output
//   p      [warps][kAttnTile] f32 one warp's softmax weights of the current tile
//   ml     [items][2]   f32       running max m and denominator l
template <typename T, int D>
struct AttnSmem {
  static constexpr int kVec = 16 / (int)sizeof(T);
  static constexpr int kKStride = D + kVec;
  T* k;
  T* v;
  float* q;
  float* acc;
  float* p;
  float* ml;

  DSPARK_DEVICE AttnSmem carve(unsigned char* base, int items, int warps) {
    AttnSmem s;
    s.k = reinterpret_cast<T*>(base);
    base += sizeof(T) * kAttnTile * kKStride;
    s.v = reinterpret_cast<T*>(base);
    base += sizeof(T) * kAttnTile * D;
    s.q = reinterpret_cast<float*>(base);
    s.acc = s.q + items * D;
    s.p = s.acc + items * D;
    s.ml = s.p + warps * kAttnTile;
    return s;
  }
};

// Where the keys of one (session, kv head) live. Position p < pos is committed: cache slot p
// (or p % capacity for a ring). Position p >= pos is block row p - pos of the session's scratch.
template <typename T>
struct AttnKeys {
  const T* k_cache;  // [capacity, D] of this kv head
  const T* v_cache;
  const T* k_blk;    // row 0 of the session's scratch, this kv head; rows are hkv * D apart
  const T* v_blk;
  int64_t blk_stride;
  int pos, capacity;
  bool ring;
};

// Stage positions [t0, t0 + kAttnTile) into shared memory: a raw copy in 16-byte words. Each
// thread issues kAttnLoadBatch chunks' loads before it stores any, to keep loads in flight.
// Positions outside [lo, hi) are zero-filled: they are masked, but stay finite in any case.
constexpr int kAttnLoadBatch = 4;

template <typename T, int D>
DSPARK_DEVICE void attn_load_tile(const AttnKeys<T>& src, int t0, int lo, int hi, const AttnSmem<T, D>& sm) {
  constexpr int kVec = AttnSmem<T, D>::kVec;
  constexpr int kChunks = D / kVec;  // 16-byte chunks per row
  constexpr int kTotal = kAttnTile * kChunks;
  for (int c0 = threadIdx.x; c0 < kTotal; c0 += kAttnLoadBatch * blockDim.x) {
    uint4 kx[kAttnLoadBatch], vx[kAttnLoadBatch];
#pragma unroll
    for (int u = 0; u < kAttnLoadBatch; ++u) {
      const int c = c0 + u * blockDim.x, p = t0 + c / kChunks, col = (c % kChunks) * kVec;
      kx[u] = vx[u] = make_uint4(0u, 0u, 0u, 0u);
      if (c < kTotal && p >= lo && p < hi) {
        const bool committed = p < src.pos;
        const int64_t off = committed ? (int64_t)(src.ring ? p % src.capacity : p) * D + col
                                      : (int64_t)(p - src.pos) * src.blk_stride + col;
        kx[u] = *reinterpret_cast<const uint4*>((committed ? src.k_cache : src.k_blk) + off);
        vx[u] = *reinterpret_cast<const uint4*>((committed ? src.v_cache : src.v_blk) + off);
      }
    }
#pragma unroll
    for (int u = 0; u < kAttnLoadBatch; ++u) {
      const int c = c0 + u * blockDim.x, k = c / kChunks, col = (c % kChunks) * kVec;
      if (c < kTotal) {
        *reinterpret_cast<uint4*>(sm.k + k * AttnSmem<T, D>::kKStride + col) = kx[u];
        *reinterpret_cast<uint4*>(sm.v + k * D + col) = vx[u];
      }
    }
  }
}

// q.k over D in one fixed order: four partial sums a_j over d = j (mod 4) in increasing d, then
// (a0 + a1) + (a2 + a3). Two keys per call (rows k0 and k1 of the padded tile) so that each
// broadcast read of q (f32 in shared memory) serves both.
template <typename T, int D>
DSPARK_DEVICE float2 attn_dot2(const float* q, const T* k0, const T* k1) {
  constexpr int kVec = AttnSmem<T, D>::kVec;
  float a[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll 2
  for (int d = 0; d < D; d += kVec) {
    const AttnPack<T, kVec> x0 = attn_load<T, kVec>(k0 + d), x1 = attn_load<T, kVec>(k1 + d);
#pragma unroll
    for (int e = 0; e < kVec; e += 4) {
      const float4 qx = *reinterpret_cast<const float4*>(q + d + e);
      const float qv[4] = {qx.x, qx.y, qx.z, qx.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[0][i] += qv[i] * to_float(x0.v[e + i]);
        a[1][i] += qv[i] * to_float(x1.v[e + i]);
      }
    }
  }
  return make_float2((a[0][0] + a[0][1]) + (a[0][2] + a[0][3]), (a[1][0] + a[1][1]) + (a[1][2] + a[1][3]));
}
