// attention: row-invariant GQA attention over per-session KV caches plus the block's own K/V.
//
// attention_<dt>_d<D>(q [rows, Hq, D], k_blk, v_blk [rows, Hkv, D], k_caches, v_caches (pointer
//                     tables over sessions of [Hkv, capacity_b, D]), row_indptr [B+1], pos [B],
//                     capacity [B], hq, hkv, rows_per_cta, block_mode, window, scale,
//                     out [rows, Hq, D])
//   Row i of session b is at absolute position pos_b + i. Keys at p < pos_b come from the cache
//   (slot p; slot p % capacity_b in block mode, the drafter's ring), keys at p >= pos_b from the
//   session's block rows. Row i sees
//     causal (block_mode 0): [0, pos_b + i]                        trunk prefill / decode / verify
//     block  (block_mode 1): [max(0, pos_b - window), pos_b + n_b)  drafter: window + whole block
//
// Grid (chunks, Hkv, B), blockDim.x = 32 * warps. CTA (c, h, b) owns rows [c R, c R + R) of session
// b (R = rows_per_cta, fixed by G alone) times the G = Hq / Hkv query heads of kv head h: its
// "items". It walks key tiles [64t, 64t + 64) in increasing t, stages each once in shared memory
// for all of its items, and warps take items round-robin. A decode or verify block fits one CTA,
// so K/V are read once per (session, kv head) and verify moves about the bytes decode moves.
//
// Reduction order, per item and tile (one warp), the same whatever else is in the launch:
//   s_k   = dot(q, k_k) * scale, dot as in attn_dot2; keys the item cannot see get -inf
//   m'    = max(m, max_k s_k)                       (exact: max has no order)
//   p_k   = exp(s_k - m')
//   l     = l * exp(m - m') + sum_k p_k             sum: xor butterfly over lanes of p_k + p_{k+32}
//   acc_d = acc_d * exp(m - m') + sum_k p_k v_kd    sum: k increasing over the visible keys, from 0
//   out   = acc / l
// A tile with no visible key is skipped: the running state stays bit-identical. So a verify row
// equals the decode step at its position, and a session alone equals itself in any batch.
// dspark/ops/attention.py: attention_ref is the NumPy twin of this recurrence.
#include "attention.cuh"
#include "reduce.cuh"

// One item against one staged tile; keys [klo, khi) of the tile are visible (klo < khi).
template <typename T, int D>
DSPARK_DEVICE void attn_tile_step(const AttnSmem<T, D>& sm, int item, int klo, int khi, float scale) {
  constexpr int kDims = D / 32;  // output dims per lane: [lane * kDims, lane * kDims + kDims)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* q = sm.q + item * D;
  float* acc = sm.acc + item * D + lane * kDims;
  float* ml = sm.ml + 2 * item;
  float* p = sm.p + warp * kAttnTile;

  // Both of the lane's keys are scored, then masked: the select (not arithmetic) keeps an
  // invisible key out of every sum, whatever it holds.
  const float2 dots = attn_dot2<T, D>(q, sm.k + lane * AttnSmem<T, D>::kKStride,
                                      sm.k + (lane + 32) * AttnSmem<T, D>::kKStride);
  const float s[2] = {lane >= klo && lane < khi ? dots.x * scale : -dspark_inf(),
                      lane + 32 >= klo && lane + 32 < khi ? dots.y * scale : -dspark_inf()};
  const float m_old = ml[0], l_old = ml[1];
  const float m_new = fmaxf(m_old, warp_max(fmaxf(s[0], s[1])));
  const float p0 = expf(s[0] - m_new), p1 = expf(s[1] - m_new);
  const float l_tile = warp_sum(p0 + p1);
  const float alpha = expf(m_old - m_new);  // 0 on the first visible tile (m_old = -inf)
  p[lane] = p0;
  p[lane + 32] = p1;
  __syncwarp();

  float pv[kDims];
#pragma unroll
  for (int c = 0; c < kDims; ++c) pv[c] = 0.f;
  for (int k = klo; k < khi; ++k) {
    const float pk = p[k];
    const AttnPack<T, kDims> v = attn_load<T, kDims>(sm.v + k * D + lane * kDims);
#pragma unroll
    for (int c = 0; c < kDims; ++c) pv[c] += pk * to_float(v.v[c]);
  }
#pragma unroll
  for (int c = 0; c < kDims; ++c) acc[c] = acc[c] * alpha + pv[c];
  // Order this item's reads of p before the next item's writes. (The next item's shuffles already
  // make the lanes meet; __syncwarp is what also orders shared memory.)
  __syncwarp();
  if (lane == 0) {
    ml[0] = m_new;
    ml[1] = l_old * alpha + l_tile;
  }
}

template <typename T, int D>
DSPARK_DEVICE void attention(const T* __restrict__ q, const T* __restrict__ k_blk, const T* __restrict__ v_blk,
                             const T* const* __restrict__ k_caches, const T* const* __restrict__ v_caches,
                             const int* __restrict__ row_indptr, const int* __restrict__ pos_arr,
                             const int* __restrict__ capacity, int hq, int hkv, int rows_per_cta, int block_mode,
                             int window, float scale, T* __restrict__ out) {
  const int b = blockIdx.z, h = blockIdx.y;
  const int row0 = row_indptr[b], n = row_indptr[b + 1] - row0;
  const int r0 = blockIdx.x * rows_per_cta;  // first row of this CTA within the session
  const int rows = min(rows_per_cta, n - r0);
  if (rows <= 0) return;  // the whole CTA leaves together
  const int G = hq / hkv, items = rows * G;
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5, lane = threadIdx.x & 31;

  DSPARK_DYNAMIC_SMEM(unsigned char, smem);
  const AttnSmem<T, D> sm = AttnSmem<T, D>::carve(smem, items, warps);

  AttnKeys<T> src;
  src.pos = pos_arr[b];
  src.capacity = capacity[b];
  src.ring = block_mode != 0;
  src.k_cache = k_caches[b] + (int64_t)h * src.capacity * D;
  src.v_cache = v_caches[b] + (int64_t)h * src.capacity * D;
  src.blk_stride = (int64_t)hkv * D;
  src.k_blk = k_blk + ((int64_t)row0 * hkv + h) * D;
  src.v_blk = v_blk + ((int64_t)row0 * hkv + h) * D;
  // Keys visible to some item of this CTA: [lo, hi).
  const int lo = block_mode ? max(0, src.pos - window) : 0;
  const int hi = block_mode ? src.pos + n : src.pos + r0 + rows;

  // Item j = (row r0 + j / G, query head h G + j % G). Query heads of one kv head are adjacent.
  for (int e = threadIdx.x; e < items * D; e += blockDim.x) {
    const int j = e / D, d = e - j * D;
    sm.q[e] = to_float(q[((int64_t)(row0 + r0 + j / G) * hq + h * G + j % G) * D + d]);
    sm.acc[e] = 0.f;
  }
  for (int j = threadIdx.x; j < items; j += blockDim.x) {
    sm.ml[2 * j] = -dspark_inf();
    sm.ml[2 * j + 1] = 0.f;
  }

  for (int t0 = lo / kAttnTile * kAttnTile; t0 < hi; t0 += kAttnTile) {
    __syncthreads();  // the previous tile is consumed (and, at first, the staging is visible)
    attn_load_tile<T, D>(src, t0, lo, hi, sm);
    __syncthreads();
    for (int j = warp; j < items; j += warps) {
      const int item_hi = block_mode ? hi : src.pos + r0 + j / G + 1;
      const int klo = max(lo - t0, 0), khi = min(item_hi - t0, kAttnTile);
      if (klo < khi) attn_tile_step<T, D>(sm, j, klo, khi, scale);
    }
  }
  __syncthreads();  // the last tile's ml updates are visible

  constexpr int kDims = D / 32;
  for (int j = warp; j < items; j += warps) {
    const float l = sm.ml[2 * j + 1];
    AttnPack<T, kDims> o;
#pragma unroll
    for (int c = 0; c < kDims; ++c) o.v[c] = from_float<T>(sm.acc[j * D + lane * kDims + c] / l);
    attn_store(out + ((int64_t)(row0 + r0 + j / G) * hq + h * G + j % G) * D + lane * kDims, o);
  }
}

// __launch_bounds__(256, 2): with no occupancy target of ours, ptxas picks 64 registers and spills.
#define DSPARK_ATTENTION_ENTRY(SUF, T, D)                                                                   \
  extern "C" __global__ void __launch_bounds__(256, 2) attention_##SUF##_d##D(                              \
      const T* __restrict__ q, const T* __restrict__ k_blk, const T* __restrict__ v_blk,                    \
      const T* const* __restrict__ k_caches, const T* const* __restrict__ v_caches,                         \
      const int* __restrict__ row_indptr, const int* __restrict__ pos, const int* __restrict__ capacity,    \
      int hq, int hkv, int rows_per_cta, int block_mode, int window, float scale, T* __restrict__ out) {    \
    attention<T, D>(q, k_blk, v_blk, k_caches, v_caches, row_indptr, pos, capacity, hq, hkv, rows_per_cta,  \
                    block_mode, window, scale, out);                                                        \
  }

DSPARK_ATTENTION_ENTRY(f32, float, 64)
DSPARK_ATTENTION_ENTRY(f32, float, 128)
DSPARK_ATTENTION_ENTRY(f16, f16_t, 64)
DSPARK_ATTENTION_ENTRY(f16, f16_t, 128)
DSPARK_ATTENTION_ENTRY(bf16, bf16_t, 64)
DSPARK_ATTENTION_ENTRY(bf16, bf16_t, 128)
