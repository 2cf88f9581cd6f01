// attention helpers: the split rule, the shared-memory layout of one CTA, the key-tile loader and
// the two tile-math paths (tensor cores for f16/bf16, CUDA cores for f32). See attention.cu.
#pragma once
#include "common.cuh"
#include "tensor_core.cuh"

constexpr int kAttnTile = 64;   // keys per tile; tiles sit at absolute positions [64 t, 64 t + 64)
constexpr int kAttnWarps = 8;
constexpr int kAttnThreads = 32 * kAttnWarps;

// Where the splits are: fixed absolute positions, the same for every row, launch and batch.
// Split j covers [start(j), start(j + 1)). Below 2 B (B = per_octave * min_keys) every split is
// min_keys long; each octave [2^k B, 2^(k+1) B) above (k >= 1) is cut into per_octave splits of
// 2^k min_keys, until that reaches max_keys (= min_keys 2^K): from 2^K B on, every split is
// max_keys long. Short contexts get short splits (enough CTAs), long ones splits that amortise
// their partials; the boundaries never move. min_keys is a multiple of kAttnTile, so splits are
// whole tiles. dspark/ops/attention.py (SplitRule) computes the same.
struct AttnSplits {
  int min_keys, per_octave, max_keys;

  __device__ __forceinline__ int cap_octave() const {  // K
    int k = 0;
    while ((min_keys << k) < max_keys) ++k;
    return k;
  }
  __device__ __forceinline__ int index(int p) const {
    const int64_t base = (int64_t)per_octave * min_keys, q = p / base;
    if (q < 2) return p / min_keys;
    int k = 1;
    while ((q >> (k + 1)) != 0) ++k;  // 2^k <= q < 2^(k+1)
    const int cap = cap_octave();
    if (k >= cap) return per_octave * (cap + 1) + (int)((p - (base << cap)) / max_keys);
    return per_octave * (k + 1) + (int)((p - (base << k)) / ((int64_t)min_keys << k));
  }
  __device__ __forceinline__ int64_t start(int j) const {
    if (j < 2 * per_octave) return (int64_t)j * min_keys;
    const int64_t base = (int64_t)per_octave * min_keys;
    const int k = j / per_octave - 1, cap = cap_octave();
    if (k >= cap) return (base << cap) + (int64_t)(j - per_octave * (cap + 1)) * max_keys;
    return (base << k) + (int64_t)(j % per_octave) * ((int64_t)min_keys << k);
  }
  // The end of split j, clipped to hi (the split's last position may lie past int's range).
  __device__ __forceinline__ int end(int j, int hi) const {
    const int64_t e = start(j + 1);
    return e < hi ? (int)e : hi;
  }
};

// Shared memory of one CTA (dspark/ops/attention.py, shared_mem_bytes, computes the same size):
//   k, v   [STAGES][kAttnTile][D + pad]  key tiles in the storage dtype; pad = 16 bytes keeps the
//                                        ldmatrix rows (and the f32 path's reads) off one bank
//   q      [16 MT][D + pad]              the CTA's items (query row x GQA head), zero-padded
//   p      [16 MT][kAttnTile + pad]      softmax weights of the current tile, in the storage dtype
//   red_max, red_sum [kAttnWarps][16 MT] per-warp partial row max and row sum of the tile
//   m, l   [16 MT]                       running max and sum of the current split
//   mm, ll [16 MT]                       the merged max and sum of the splits so far (serial kernel)
template <typename T, int D, int MT, int STAGES>
struct AttnLayout {
  static constexpr int kItems = 16 * MT;
  static constexpr int kPad = 16 / (int)sizeof(T);
  static constexpr int kRow = D + kPad;
  static constexpr int kPRow = kAttnTile + kPad;
  static constexpr int kKV = kAttnTile * kRow;
  static constexpr size_t kBytes = sizeof(T) * ((size_t)2 * STAGES * kKV + (size_t)kItems * (kRow + kPRow)) +
                                   sizeof(float) * (size_t)(2 * kAttnWarps + 4) * kItems;
  T* k;
  T* v;
  T* q;
  T* p;
  float* red_max;
  float* red_sum;
  float* m;
  float* l;
  float* mm;
  float* ll;

  DSPARK_DEVICE AttnLayout carve(unsigned char* base) {
    AttnLayout s;
    T* t = reinterpret_cast<T*>(base);
    s.k = t;
    s.v = s.k + STAGES * kKV;
    s.q = s.v + STAGES * kKV;
    s.p = s.q + kItems * kRow;
    s.red_max = reinterpret_cast<float*>(s.p + kItems * kPRow);
    s.red_sum = s.red_max + kAttnWarps * kItems;
    s.m = s.red_sum + kAttnWarps * kItems;
    s.l = s.m + kItems;
    s.mm = s.l + kItems;
    s.ll = s.mm + kItems;
    return s;
  }
};

// Where the keys of one (session, kv head) live. Position p < pos is committed: cache slot p
// (p % capacity in a ring). Position p >= pos is block row p - pos of the session's scratch.
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

// Issue the copies of key positions [t0, t0 + kAttnTile) into one stage: 16-byte cp.async chunks,
// zero-filled outside [lo, hi) (those keys are masked, but must stay finite: 0 * NaN is NaN).
template <typename T, int D>
DSPARK_DEVICE void attn_issue_tile(const AttnKeys<T>& src, int t0, int lo, int hi, T* ks, T* vs) {
  constexpr int kVec = 16 / (int)sizeof(T), kChunks = D / kVec, kRow = D + kVec;
  for (int c = threadIdx.x; c < kAttnTile * kChunks; c += blockDim.x) {
    const int k = c / kChunks, col = (c % kChunks) * kVec, p = t0 + k;
    const bool valid = p >= lo && p < hi, blk = valid && p >= src.pos;
    const int64_t off = !valid ? 0
                        : blk  ? (int64_t)(p - src.pos) * src.blk_stride + col
                               : (int64_t)(src.ring ? p % src.capacity : p) * D + col;
    cp_async16(ks + k * kRow + col, (blk ? src.k_blk : src.k_cache) + off, valid);
    cp_async16(vs + k * kRow + col, (blk ? src.v_blk : src.v_cache) + off, valid);
  }
}

template <typename T>
constexpr bool kAttnMma = sizeof(T) == 2 && DSPARK_TENSOR_CORES;

// Fragments. Warp w owns keys [8 w, 8 w + 8) of a tile for q.k, and output dims
// [w D/8, (w+1) D/8) for p.v. In both, lane l (g = l / 4, t = l % 4) holds element c of m-tile mt
// at row 16 mt + g + 8 (c / 2), column 2 t + c % 2 (of its 8 keys, or of n-tile nt of its dims):
// the mma.sync C layout, which the CUDA-core path keeps too.
//
// q.k: s[mt][c] = sum over d of q[row][d] k[key][d]. Tensor cores: m16n8k16 MMAs over d in
// increasing steps of 16, chained through the accumulator from 0. CUDA cores (f32): one fmaf chain
// per element in increasing d, from 0.
template <typename T, int D, int MT>
DSPARK_DEVICE void attn_scores(float (&s)[MT][4], const T* qs, const T* ks, int mtiles) {
  constexpr int kRow = D + 16 / (int)sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int c = 0; c < 4; ++c) s[mt][c] = 0.f;
  if constexpr (kAttnMma<T>) {
    // ldmatrix of K: lane l addresses key 8 w + l % 8, dims d0 + 8 (l / 8): matrices 0..3 are the
    // B fragments (b0, b1) of k-steps d0 and d0 + 16. Of Q (A fragments): row l % 16, dims + 8 (l / 16).
    const T* krow = ks + (warp * 8 + (lane & 7)) * kRow + 8 * (lane >> 3);
    const T* qrow = qs + (lane & 15) * kRow + 8 * (lane >> 4);
#pragma unroll
    for (int d0 = 0; d0 < D; d0 += 32) {
      uint32_t kb[4];
      ldmatrix_x4(kb, krow + d0);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt < mtiles) {
          uint32_t qa[4];
          ldmatrix_x4(qa, qrow + mt * 16 * kRow + d0);
          mma_16816<T>(s[mt], qa, kb[0], kb[1]);
          ldmatrix_x4(qa, qrow + mt * 16 * kRow + d0 + 16);
          mma_16816<T>(s[mt], qa, kb[2], kb[3]);
        }
      }
    }
  } else {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt >= mtiles) continue;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const T* qr = qs + (16 * mt + g + 8 * (c >> 1)) * kRow;
        const T* kr = ks + (8 * warp + 2 * t + (c & 1)) * kRow;
        float a = 0.f;
#pragma unroll 4
        for (int d = 0; d < D; ++d) a = fmaf(to_float(qr[d]), to_float(kr[d]), a);
        s[mt][c] = a;
      }
    }
  }
}

// p.v: o[mt][nt][c] += sum over the tile's keys of p[row][key] v[key][dim], o already scaled.
// Tensor cores: MMAs over keys in increasing steps of 16, chained through o. CUDA cores: one fmaf
// chain per element over keys 0..63 in order, from o.
template <typename T, int D, int MT>
DSPARK_DEVICE void attn_pv(float (&o)[MT][D / 64][4], const T* ps, const T* vs, int mtiles) {
  constexpr int NT = D / 64, kRow = D + 16 / (int)sizeof(T), kPRow = kAttnTile + 16 / (int)sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int dim0 = warp * (D / 8);
  if constexpr (kAttnMma<T>) {
    const T* prow = ps + (lane & 15) * kPRow + 8 * (lane >> 4);
#pragma unroll
    for (int k0 = 0; k0 < kAttnTile; k0 += 16) {
      // ldmatrix.trans of V: matrix i = l / 8 holds keys k0 + 8 (i % 2).., dims + 8 (i / 2): the
      // B fragments (b0, b1) of n-tiles np and np + 1 (x2: one n-tile, lanes 0..15).
      uint32_t vb[NT][2];
      if constexpr (NT == 1) {
        ldmatrix_x2_trans(vb[0], vs + (k0 + (lane & 15)) * kRow + dim0);
      } else {
#pragma unroll
        for (int np = 0; np < NT; np += 2) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, vs + (k0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kRow + dim0 + 8 * np + 8 * (lane >> 4));
          vb[np][0] = r[0];
          vb[np][1] = r[1];
          vb[np + 1][0] = r[2];
          vb[np + 1][1] = r[3];
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt < mtiles) {
          uint32_t pa[4];
          ldmatrix_x4(pa, prow + mt * 16 * kPRow + k0);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma_16816<T>(o[mt][nt], pa, vb[nt][0], vb[nt][1]);
        }
      }
    }
  } else {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt >= mtiles) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const T* pr = ps + (16 * mt + g + 8 * (c >> 1)) * kPRow;
          const T* vc = vs + dim0 + 8 * nt + 2 * t + (c & 1);
          float a = o[mt][nt][c];
#pragma unroll 4
          for (int k = 0; k < kAttnTile; ++k) a = fmaf(to_float(pr[k]), to_float(vc[k * kRow]), a);
          o[mt][nt][c] = a;
        }
    }
  }
}

// Two adjacent output elements, rounded to the storage dtype, in one store.
template <typename T>
DSPARK_DEVICE void attn_store2(T* p, float a, float b) {
  struct alignas(2 * sizeof(T)) Pair {
    T x, y;
  };
  Pair v;
  v.x = from_float<T>(a);
  v.y = from_float<T>(b);
  *reinterpret_cast<Pair*>(p) = v;
}

// The merge of split partials, in increasing split order, from (M, L, A) = (-inf, 0, 0):
//   M' = max(M, m_j), fa = exp(M - M'), fb = exp(m_j - M'), L' = L fa + l_j fb, A' = A fa + acc_j fb
// Explicit roundings (no FMA contraction), so the serial kernel and the combine kernel, compiled
// apart, compute it bit for bit alike.
struct AttnMergeFactors {
  float m, fa, fb;
};

DSPARK_DEVICE AttnMergeFactors attn_merge_factors(float m_run, float m_split) {
  const float m = fmaxf(m_run, m_split);
  return AttnMergeFactors{m, expf(__fsub_rn(m_run, m)), expf(__fsub_rn(m_split, m))};
}

DSPARK_DEVICE float attn_merge(float run, float split, const AttnMergeFactors& f) {
  return __fadd_rn(__fmul_rn(run, f.fa), __fmul_rn(split, f.fb));
}
