// attention: row-invariant GQA attention over per-session KV caches plus the block's own K/V,
// split across CTAs at fixed absolute key positions (flash-decoding).
//
// Inputs: q [rows, Hq, D], k_blk, v_blk [rows, Hkv, D], k_caches / v_caches (pointer tables over
// sessions of [Hkv, capacity_b, D]), row_indptr [B+1], pos [B], capacity [B]. Row i of session b is
// at absolute position pos_b + i. Keys at p < pos_b come from the cache (slot p; p % capacity_b in
// block mode, the drafter's ring), keys at p >= pos_b from the session's block rows. Row i sees
//   causal (block_mode 0): [0, pos_b + i]                        trunk prefill / decode / verify
//   block  (block_mode 1): [max(0, pos_b - window), pos_b + n_b)  drafter: window + whole block
//   rows   (block_mode 2): keys p with |p - (pos_b + i)| < window drafter: a window per row, both
//                          directions, as dflash.model._attention_mask masks a non-causal sliding layer
// (attn_row_lo / attn_row_hi). In block modes the split numbering starts at row 0's first key.
//
// Splits. The key axis is cut at fixed absolute positions (AttnSplits, attention.cuh: short splits
// near the start, a fixed number per octave of position beyond, up to a longest split), independent
// of the launch, the batch and the row. A row's result is, for the splits j = j0, j0+1, .. its keys reach (j0 = the
// split of its first visible key), the partial (m_j, l_j, acc_j) of its keys in split j, merged in
// increasing j from (-inf, 0, 0) (attn_merge, attention.cuh), then out = A / L.
// Inside a split, tiles [64 t, 64 t + 64) in increasing t, online softmax per tile:
//   s_k   = (q . k_k) * scale                        q.k as in attn_scores; invisible keys -inf
//   m'    = max(m, max_k s_k)                        (exact, in any order)
//   p_k   = round_T(exp(s_k - m'))                   p rounded to the storage dtype (the MMA input)
//   l     = l * exp(m - m') + sum_k p_k              sum: lanes' 2 keys, quad butterfly, warps 0..7
//   acc   = acc * exp(m - m') + sum_k p_k v_k        p.v as in attn_pv, chained from the scaled acc
// A tile without a visible key leaves the row's state untouched; a split without one is not merged.
// Every step is a function of the row's own keys and positions, so a verify row equals the decode
// step at its position and a session alone equals itself in any batch, bitwise.
//
// One kernel computes exactly that in either of two modes, which the launch plan
// (dspark/ops/attention.py) picks; the tests compare them bitwise at every split count:
//   slots == 0, serial: grid (row chunks, Hkv, B). A CTA walks all the splits of its rows in
//     order; at each split's end ([E] __syncthreads, merge into registers, [F], one thread per
//     item merges (m, l)) it folds the split in; writes out.
//   slots == S, split-parallel: grid (row chunks x S, Hkv, B), one split per CTA (split j0 + slot,
//     the largest splits launched first); writes the partial (m, l, acc) to part_ml / part_acc
//     [rows, Hq, S, (2 | D)]; then attention_combine_<dt>, grid (rows, Hq), merges a row's
//     partials in increasing slot and writes out.
// A CTA owns the items (row, query head) of rows [c R, c R + R) of session b times the
// G = Hq / Hkv heads of kv head h, R = rows_per_cta <= 16 MT / G: a verify block of every session
// is one CTA per (split, kv head), so its K/V are read once.
//
// CTA: 8 warps. Key tiles are double-buffered through cp.async (tile t + 1 lands while tile t is
// computed; one stage for f32 at D = 256, where two do not fit). Per tile:
//   [A] wait_group 0 + __syncthreads: tile t is in shared memory, tile t - 1 is consumed
//   issue tile t + 1; warp w scores keys 8 w..8 w+7 for all items (attn_scores), masks, writes
//   its row maxima; [B] __syncthreads; every lane forms m', p (rounded, to shared memory) and its
//   row sums; [C] __syncthreads; warp w scales and accumulates its D / 8 output dims (attn_pv);
//   one thread per item updates (m, l) (l: warp sums added in warp order).
// bf16 / f16 use tensor cores (ldmatrix + mma.sync m16n8k16, f32 accumulate); f32 storage and
// pre-sm_80 devices use CUDA cores in the same fragment layout. simt emulates the MMA in a stated
// order (simt/tensor_core.h): it agrees with the hardware within 18 * 2^-23 of each MMA's absolute
// sum, far inside the tolerance the tests allow against the NumPy reference (attention_ref).
#include "attention.cuh"
#include "reduce.cuh"

template <typename T>
struct AttnArgs {
  const T* q;
  const T* k_blk;
  const T* v_blk;
  const T* const* k_caches;
  const T* const* v_caches;
  const int* row_indptr;
  const int* pos;
  const int* capacity;
  int hq, hkv, rows_per_cta, block_mode, window;
  float scale;
  AttnSplits splits;
  int slots;        // S: the partial buffer's split dimension (split-parallel); 0: serial
  float* part_acc;  // [rows, Hq, S, D]; the prompt kernel's merged output, [rows, Hq, D]
  float* part_ml;   // [rows, Hq, S, 2]
  T* out;
};

// [attn_row_lo, attn_row_hi): the keys row i of a session of n rows at pos sees (modes above).
DSPARK_DEVICE int attn_row_lo(int mode, int pos, int i, int window) {
  return mode == 2 ? max(0, pos + i - window + 1) : mode == 1 ? max(0, pos - window) : 0;
}
DSPARK_DEVICE int attn_row_hi(int mode, int pos, int n, int i, int window) {
  return mode == 2 ? min(pos + n, pos + i + window) : mode == 1 ? pos + n : pos + i + 1;
}

template <typename T, int D, int MT, int STAGES>
DSPARK_DEVICE void attention_cta(const AttnArgs<T>& a) {
  using L = AttnLayout<T, D, MT, STAGES>;
  constexpr int NT = D / 64;
  const bool serial = a.slots == 0;  // uniform over the grid
  const int b = blockIdx.z, h = blockIdx.y;
  const int chunk = serial ? (int)blockIdx.x : (int)blockIdx.x / a.slots;
  const int slot = serial ? 0 : a.slots - 1 - (int)blockIdx.x % a.slots;
  const int row0 = a.row_indptr[b], n = a.row_indptr[b + 1] - row0;
  const int r0 = chunk * a.rows_per_cta;
  const int rows = min(a.rows_per_cta, n - r0);
  if (rows <= 0) return;  // the whole CTA leaves together
  const int G = a.hq / a.hkv, items = rows * G, pos = a.pos[b], mode = a.block_mode;
  // Keys some item of this CTA sees: [lo, hi); item j sees [item_lo(j), item_hi(j)).
  const int lo = attn_row_lo(mode, pos, r0, a.window);
  const int hi = attn_row_hi(mode, pos, n, r0 + rows - 1, a.window);
  const int j_lo = a.splits.index(lo), j_end = a.splits.index(hi - 1);
  // Split-parallel slots count from the session's first split (attention_combine's numbering).
  const int j_first = serial ? j_lo : a.splits.index(attn_row_lo(mode, pos, 0, a.window)) + slot;
  const int j_last = serial ? j_end : j_first;
  if (j_first < j_lo || j_first > j_end) return;  // no key of this chunk lies in the slot's split

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  DSPARK_DYNAMIC_SMEM(unsigned char, smem);
#if defined(DSPARK_SIMT)
  if (L::kBytes > simt::dynamic_smem_size() || items > L::kItems || (int)blockDim.x != kAttnThreads)
    simt::fault("attention: launch plan does not match the kernel (shared_mem " +
                std::to_string(simt::dynamic_smem_size()) + " < " + std::to_string(L::kBytes) + ", items " +
                std::to_string(items) + " > " + std::to_string(L::kItems) + ", or block != 256)");
#endif
  const L sm = L::carve(smem);
  const int mtiles = (items + 15) / 16;
  auto item_lo = [&](int j) { return j >= items ? lo : attn_row_lo(mode, pos, r0 + j / G, a.window); };
  auto item_hi = [&](int j) { return j >= items ? lo : attn_row_hi(mode, pos, n, r0 + j / G, a.window); };
  int row_lo[MT][2], row_hi[MT][2];  // item_lo / item_hi of this lane's fragment rows 16 mt + g + 8 half
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_lo[mt][half] = item_lo(16 * mt + g + 8 * half);
      row_hi[mt][half] = item_hi(16 * mt + g + 8 * half);
    }

  AttnKeys<T> src;
  src.pos = pos;
  src.capacity = a.capacity[b];
  src.ring = a.block_mode != 0;
  src.k_cache = a.k_caches[b] + (int64_t)h * src.capacity * D;
  src.v_cache = a.v_caches[b] + (int64_t)h * src.capacity * D;
  src.blk_stride = (int64_t)a.hkv * D;
  src.k_blk = a.k_blk + ((int64_t)row0 * a.hkv + h) * D;
  src.v_blk = a.v_blk + ((int64_t)row0 * a.hkv + h) * D;

  // Item j = (row r0 + j / G, query head h G + j % G): the query heads of one kv head are adjacent.
  {
    constexpr int kVec = 16 / (int)sizeof(T), kChunks = D / kVec;
    for (int c = tid; c < L::kItems * kChunks; c += blockDim.x) {
      const int j = c / kChunks, col = (c % kChunks) * kVec;
      const bool valid = j < items;
      const T* q = a.q + ((int64_t)(row0 + r0 + j / G) * a.hq + h * G + j % G) * D + col;
      cp_async16(sm.q + j * L::kRow + col, valid ? q : a.q, valid);
    }
  }
  for (int j = tid; j < L::kItems; j += blockDim.x) {
    sm.m[j] = sm.mm[j] = -dspark_inf();
    sm.l[j] = sm.ll[j] = 0.f;
  }

  float o[MT][NT][4], acc[MT][NT][4];  // this split's output; the merged one (serial)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[mt][nt][c] = acc[mt][nt][c] = 0.f;

  const int k_lo = max(lo, (int)a.splits.start(j_first)), k_hi = a.splits.end(j_last, hi);
  int j = j_first, split_lo = k_lo, split_hi = a.splits.end(j, hi);
  int t0 = k_lo / kAttnTile * kAttnTile, stage = 0;
  attn_issue_tile<T, D>(src, t0, k_lo, k_hi, sm.k, sm.v);
  cp_async_commit();

  for (; t0 < k_hi; t0 += kAttnTile) {
    T* ks = sm.k + stage * L::kKV;
    T* vs = sm.v + stage * L::kKV;
    cp_async_wait<0>();
    __syncthreads();  // [A]
    if (STAGES == 2 && t0 + kAttnTile < k_hi) {
      attn_issue_tile<T, D>(src, t0 + kAttnTile, k_lo, k_hi, sm.k + (stage ^ 1) * L::kKV, sm.v + (stage ^ 1) * L::kKV);
      cp_async_commit();
    }

    float s[MT][4];
    attn_scores<T, D, MT>(s, sm.q, ks, mtiles);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt < mtiles) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float mx = -dspark_inf();
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int p = t0 + 8 * warp + 2 * t4 + e, c = 2 * half + e;
            // A select, not arithmetic: an invisible key stays out whatever it holds.
            s[mt][c] = p >= row_lo[mt][half] && p < row_hi[mt][half] ? __fmul_rn(s[mt][c], a.scale) : -dspark_inf();
            mx = fmaxf(mx, s[mt][c]);
          }
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
          if (t4 == 0) sm.red_max[warp * L::kItems + 16 * mt + g + 8 * half] = mx;
        }
      }
    }
    __syncthreads();  // [B]

    // m' of a row: the max of its running max and the warps' tile maxima. Rows without a visible
    // key in this tile keep m and get alpha = 1, p = 0.
    auto tile_max = [&](int row, bool& seen) {
      seen = max(item_lo(row), t0) < min(item_hi(row), t0 + kAttnTile);
      float m = sm.m[row];
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) m = fmaxf(m, sm.red_max[w * L::kItems + row]);
      return m;
    };
    float alpha[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt < mtiles) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = 16 * mt + g + 8 * half;
          bool seen;
          const float m_new = tile_max(row, seen), m_old = sm.m[row];
          alpha[mt][half] = seen ? expf(__fsub_rn(m_old, m_new)) : 1.f;
          float pr[2];
          T pt[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = s[mt][2 * half + e];
            pt[e] = from_float<T>(seen && x != -dspark_inf() ? expf(__fsub_rn(x, m_new)) : 0.f);
            pr[e] = to_float(pt[e]);
          }
          T* pp = sm.p + row * L::kPRow + 8 * warp + 2 * t4;
          pp[0] = pt[0];
          pp[1] = pt[1];
          float sum = __fadd_rn(pr[0], pr[1]);
          sum = __fadd_rn(sum, __shfl_xor_sync(kFullMask, sum, 1));
          sum = __fadd_rn(sum, __shfl_xor_sync(kFullMask, sum, 2));
          if (t4 == 0) sm.red_sum[warp * L::kItems + row] = sum;
        }
      } else {
        alpha[mt][0] = alpha[mt][1] = 1.f;
      }
    }
    __syncthreads();  // [C]

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[mt][nt][c] = __fmul_rn(o[mt][nt][c], alpha[mt][c >> 1]);
    attn_pv<T, D, MT>(o, sm.p, vs, mtiles);
    if (tid < items) {
      bool seen;
      const float m_new = tile_max(tid, seen);
      if (seen) {
        float l_tile = sm.red_sum[tid];
#pragma unroll
        for (int w = 1; w < kAttnWarps; ++w) l_tile = __fadd_rn(l_tile, sm.red_sum[w * L::kItems + tid]);
        sm.l[tid] = __fadd_rn(__fmul_rn(sm.l[tid], expf(__fsub_rn(sm.m[tid], m_new))), l_tile);
        sm.m[tid] = m_new;
      }
    }

    if (STAGES == 1 && t0 + kAttnTile < k_hi) {
      __syncthreads();  // the single stage is consumed
      attn_issue_tile<T, D>(src, t0 + kAttnTile, k_lo, k_hi, sm.k, sm.v);
      cp_async_commit();
    }
    if (STAGES == 2) stage ^= 1;

    if (serial) {
      if (t0 + kAttnTile >= split_hi) {
        // Split j is complete: merge it into (mm, ll, acc) for the items that saw a key of it.
        __syncthreads();  // [E] its (m, l) are final
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (mt < mtiles) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int row = 16 * mt + g + 8 * half;
              if (max(split_lo, row_lo[mt][half]) < min(row_hi[mt][half], split_hi)) {
                const AttnMergeFactors f = attn_merge_factors(sm.mm[row], sm.m[row]);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                  for (int e = 0; e < 2; ++e)
                    acc[mt][nt][2 * half + e] = attn_merge(acc[mt][nt][2 * half + e], o[mt][nt][2 * half + e], f);
              }
            }
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) o[mt][nt][c] = 0.f;
        }
        __syncthreads();  // [F] every lane has read mm and m
        if (tid < items) {
          if (max(split_lo, item_lo(tid)) < min(item_hi(tid), split_hi)) {
            const AttnMergeFactors f = attn_merge_factors(sm.mm[tid], sm.m[tid]);
            sm.ll[tid] = attn_merge(sm.ll[tid], sm.l[tid], f);
            sm.mm[tid] = f.m;
          }
          sm.m[tid] = -dspark_inf();
          sm.l[tid] = 0.f;
        }
        ++j;
        split_lo = split_hi;
        split_hi = a.splits.end(j, hi);
      }
    }
  }
  __syncthreads();  // [G] the last (m, l) / (mm, ll) are visible

  const int dim0 = warp * (D / 8) + 2 * t4;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (mt >= mtiles) break;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = 16 * mt + g + 8 * half;
      const int64_t item = (int64_t)(row0 + r0 + row / G) * a.hq + h * G + row % G;
      if (serial) {
        if (row < items) {
          const float l = sm.ll[row];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            attn_store2(a.out + item * D + dim0 + 8 * nt, __fdiv_rn(acc[mt][nt][2 * half], l),
                        __fdiv_rn(acc[mt][nt][2 * half + 1], l));
        }
      } else {
        if (max(split_lo, row_lo[mt][half]) < min(row_hi[mt][half], split_hi)) {
          float* part = a.part_acc + (item * a.slots + slot) * D + dim0;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            *reinterpret_cast<float2*>(part + 8 * nt) = make_float2(o[mt][nt][2 * half], o[mt][nt][2 * half + 1]);
        }
      }
    }
  }
  if (!serial) {
    if (tid < items && max(split_lo, item_lo(tid)) < min(item_hi(tid), split_hi)) {
      const int64_t item = (int64_t)(row0 + r0 + tid / G) * a.hq + h * G + tid % G;
      *reinterpret_cast<float2*>(a.part_ml + (item * a.slots + slot) * 2) = make_float2(sm.m[tid], sm.l[tid]);
    }
  }
}

// One CTA per (row, query head), 64 threads; thread x owns dims x, x + 64, ...: merges the row's
// partials (the slots of the splits its keys reach) in increasing slot with attn_merge (the serial
// kernel's arithmetic) and writes out.
template <typename T>
DSPARK_DEVICE void attention_combine(const int* __restrict__ row_indptr, const int* __restrict__ pos_arr, int sessions,
                                     int block_mode, int window, AttnSplits splits, int slots, int hq, int d,
                                     const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                     T* __restrict__ out) {
  const int row = blockIdx.x, head = blockIdx.y;
  int b = 0, top = sessions;  // the session of `row`: row_indptr[b] <= row < row_indptr[b + 1]
  while (top - b > 1) {
    const int mid = (b + top) / 2;
    if (row_indptr[mid] <= row) b = mid;
    else top = mid;
  }
  const int pos = pos_arr[b], n = row_indptr[b + 1] - row_indptr[b], i = row - row_indptr[b];
  const int base = splits.index(attn_row_lo(block_mode, pos, 0, window));  // slot 0's split
  const int first = splits.index(attn_row_lo(block_mode, pos, i, window)) - base;
  const int count = splits.index(attn_row_hi(block_mode, pos, n, i, window) - 1) - base + 1;
  const int64_t item = (int64_t)row * hq + head;
  const float* ml = part_ml + item * slots * 2;
  const float* acc = part_acc + item * slots * d;
  for (int x = threadIdx.x; x < d; x += blockDim.x) {
    float m = -dspark_inf(), l = 0.f, A = 0.f;
    for (int s = first; s < count; ++s) {
      const AttnMergeFactors f = attn_merge_factors(m, ml[2 * s]);
      A = attn_merge(A, acc[(int64_t)s * d + x], f);
      l = attn_merge(l, ml[2 * s + 1], f);
      m = f.m;
    }
    out[item * d + x] = from_float<T>(__fdiv_rn(A, l));
  }
}

#define DSPARK_ATTENTION_PARAMS(T)                                                                               \
  const T *__restrict__ q, const T *__restrict__ k_blk, const T *__restrict__ v_blk,                             \
      const T *const *__restrict__ k_caches, const T *const *__restrict__ v_caches,                              \
      const int *__restrict__ row_indptr, const int *__restrict__ pos, const int *__restrict__ capacity, int hq, \
      int hkv, int rows_per_cta, int block_mode, int window, float scale, int split_keys, int split_octave,       \
      int split_max, int slots, float *__restrict__ part_acc, float *__restrict__ part_ml, T *__restrict__ out

#define DSPARK_ATTENTION_ARGS                                                                                    \
  AttnArgs<T_> {                                                                                                 \
    q, k_blk, v_blk, k_caches, v_caches, row_indptr, pos, capacity, hq, hkv, rows_per_cta, block_mode, window,   \
        scale, AttnSplits{split_keys, split_octave, split_max}, slots, part_acc, part_ml, out                               \
  }

// (MT, STAGES) per dtype and head dim: 16 MT items per CTA; dspark/ops/attention.py (CONFIGS)
// holds the same table. One CTA per SM at D = 256 (shared memory), two below.
#define DSPARK_ATTENTION_ENTRY_NAMED(NAME, T, D, MT, STAGES, MINB)                                              \
  extern "C" __global__ void __launch_bounds__(kAttnThreads, MINB) NAME(DSPARK_ATTENTION_PARAMS(T)) {            \
    using T_ = T;                                                                                                 \
    attention_cta<T, D, MT, STAGES>(DSPARK_ATTENTION_ARGS);                                                       \
  }
#define DSPARK_ATTENTION_ENTRY(SUF, T, D, MT, STAGES, MINB) \
  DSPARK_ATTENTION_ENTRY_NAMED(attention_##SUF##_d##D, T, D, MT, STAGES, MINB)

DSPARK_ATTENTION_ENTRY(f32, float, 64, 2, 2, 2)
DSPARK_ATTENTION_ENTRY(f32, float, 128, 2, 2, 1)
DSPARK_ATTENTION_ENTRY(f32, float, 256, 2, 1, 1)
DSPARK_ATTENTION_ENTRY(f16, f16_t, 64, 4, 2, 2)
DSPARK_ATTENTION_ENTRY(f16, f16_t, 128, 4, 2, 2)
DSPARK_ATTENTION_ENTRY(f16, f16_t, 256, 4, 2, 1)
DSPARK_ATTENTION_ENTRY(bf16, bf16_t, 64, 4, 2, 2)
DSPARK_ATTENTION_ENTRY(bf16, bf16_t, 128, 4, 2, 2)
DSPARK_ATTENTION_ENTRY(bf16, bf16_t, 256, 4, 2, 1)
// Where a device's shared memory per CTA does not hold the shapes above (SMALL_CONFIGS: sm_80's 163 KB at
// D = 256, sm_86 / sm_89's 99 KB at f32 D = 128 and 16-bit D = 256): one stage, fewer m-tiles. The same
// bits: an item's sums do not depend on its CTA's other items or on the prefetch depth.
DSPARK_ATTENTION_ENTRY_NAMED(attention_f32_d128_m1s1, float, 128, 1, 1, 1)
DSPARK_ATTENTION_ENTRY_NAMED(attention_f32_d256_m1s1, float, 256, 1, 1, 1)
DSPARK_ATTENTION_ENTRY_NAMED(attention_f16_d256_m4s1, f16_t, 256, 4, 1, 1)
DSPARK_ATTENTION_ENTRY_NAMED(attention_bf16_d256_m4s1, bf16_t, 256, 4, 1, 1)
DSPARK_ATTENTION_ENTRY_NAMED(attention_f16_d256_m2s1, f16_t, 256, 2, 1, 1)
DSPARK_ATTENTION_ENTRY_NAMED(attention_bf16_d256_m2s1, bf16_t, 256, 2, 1, 1)

#define DSPARK_ATTENTION_COMBINE(SUF, T)                                                                         \
  extern "C" __global__ void attention_combine_##SUF(                                                            \
      const int* __restrict__ row_indptr, const int* __restrict__ pos, int sessions, int block_mode, int window, \
      int split_keys, int split_octave, int split_max, int slots, int hq, int head_dim,                          \
      const float* __restrict__ part_acc,                                                                        \
      const float* __restrict__ part_ml, T* __restrict__ out) {                                                  \
    attention_combine<T>(row_indptr, pos, sessions, block_mode, window, AttnSplits{split_keys, split_octave, split_max}, \
                         slots, hq, head_dim, part_acc, part_ml, out);                                           \
  }

DSPARK_ATTENTION_COMBINE(f32, float)
DSPARK_ATTENTION_COMBINE(f16, f16_t)
DSPARK_ATTENTION_COMBINE(bf16, bf16_t)

// ---- prompt attention: many query rows of one causal pass on tensor cores -------------------------
// attention_prompt_<dt>_d<D> (f16 / bf16 K/V): the serial kernel's result for every row, bit for bit,
// with the work laid out for long prompts. Same arguments as attention_<dt>_d<D> (causal mode,
// slots 0), the same kind of CTA -> items map (items (row r0 + j / G, head h G + j % G)) with 128
// items per CTA (8 warps: each K/V tile serves twice the serial kernel's rows, half the re-reads
// through L2), and the same splits, walked in order and merged as the serial kernel merges them;
// which CTA holds an item changes none of its bits. What differs is who
// computes what: warp w owns items [16 w, 16 w + 16) (one m-tile) for all 64 keys of a tile and all
// D dims (flash-attention 2's split), so a tile's row maxima and sums stay in the warp's registers
// and p goes from the q.k accumulators straight into the p.v MMA's A fragments, with no shared
// memory round trip and one barrier pair per operand. Each step keeps the serial kernel's order:
//   q.k     per (item, key): MMAs over d in increasing k-steps of 16 from 0 (attn_scores' chain)
//   max     exact; row sums: per 8-key group the lane's 2 keys, then the quad butterfly (xor 1, 2),
//           then the 8 groups added in key order (the serial kernel's warps 0..7)
//   p.v     o scaled by alpha, then MMAs over the tile's keys in steps of 16 (attn_pv's chain)
//   merge   at a split's end, into (mm, ll, acc) with attn_merge (acc: the item's f32 row of part_acc)
// so a prompt row equals the verify row and the decode step at its position (tests compare them
// bitwise on simt; on a GPU an MMA's result is a function of its own operands alone). Tiles past
// the last key of all the warp's items are skipped (the serial kernel adds p = 0 to such rows,
// which leaves any accumulator but -0 as it is).
// Shared memory (prompt_shared_mem_bytes in dspark/ops/attention.py): K and V [64][D + pad] of
// the current tile (one buffer each: V's copy lands while q.k runs, the next K's while p.v runs) and
// q [128][D + pad]. The merged output over the splits so far (acc, f32) lives in global memory,
// part_acc [rows][Hq][D] (each item's row where its output goes): each thread reads and writes only
// its own float2s there, at a split's end, so it needs no barrier, and L2 holds a running CTA's 128 KB
// (D 256). Out of shared memory, it leaves 135 KB at D = 256: a CTA of 8 warps per SM on sm_90 and
// sm_80 (two warps per scheduler, one issuing while the other waits). CTAs go longest first (the
// last row chunk first).
constexpr int kAttnPromptWarps = 8, kAttnPromptThreads = 32 * kAttnPromptWarps;
template <typename T, int D>
struct AttnPromptLayout {
  static constexpr int kItems = 16 * kAttnPromptWarps;
  static constexpr int kRow = D + 16 / (int)sizeof(T);
  static constexpr int kKV = kAttnTile * kRow;
  static constexpr size_t kBytes = sizeof(T) * ((size_t)2 * kKV + (size_t)kItems * kRow);
};

template <typename T, int D>
DSPARK_DEVICE void attention_prompt_cta(const AttnArgs<T>& a) {
  using L = AttnPromptLayout<T, D>;
  constexpr int NT = D / 8;  // n-tiles of the output's dims
  const int b = blockIdx.z, h = blockIdx.y;
  const int row0 = a.row_indptr[b], n = a.row_indptr[b + 1] - row0;
  const int chunks = (n + a.rows_per_cta - 1) / a.rows_per_cta;
  const int chunk = chunks - 1 - (int)blockIdx.x;  // longest first
  if (chunk < 0) return;                           // the whole CTA leaves together
  const int r0 = chunk * a.rows_per_cta, rows = min(a.rows_per_cta, n - r0);
  const int G = a.hq / a.hkv, items = rows * G, pos = a.pos[b];
  const int lo = 0, hi = pos + r0 + rows;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  DSPARK_DYNAMIC_SMEM(unsigned char, smem);
#if defined(DSPARK_SIMT)
  if (L::kBytes > simt::dynamic_smem_size() || items > L::kItems || (int)blockDim.x != kAttnPromptThreads ||
      a.block_mode)
    simt::fault("attention_prompt: launch plan does not match the kernel (shared_mem " +
                std::to_string(simt::dynamic_smem_size()) + " < " + std::to_string(L::kBytes) + ", items " +
                std::to_string(items) + " > " + std::to_string(L::kItems) + ", block != " +
                std::to_string(kAttnPromptThreads) + ", or block mode)");
#endif
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + L::kKV;
  T* qs = vs + L::kKV;
  // The thread's acc elements of its item in rows g + 8 half of the warp's 16, in part_acc (computed
  // where used: two live pointers through the key loop would spill at D = 256). Items past the
  // CTA's are never merged nor stored.
  auto acc_row = [&](int half) -> float* {
    const int j = 16 * warp + g + 8 * half;
    return a.part_acc + ((int64_t)(row0 + r0 + j / G) * a.hq + h * G + j % G) * D + 2 * t4;
  };

  auto item_hi = [&](int j) { return j >= items ? lo : pos + r0 + j / G + 1; };
  const int hi_g[2] = {item_hi(16 * warp + g), item_hi(16 * warp + g + 8)};
  const int last = min(items, 16 * warp + 16) - 1;  // the warp's last item: its rows' keys end there
  const int warp_hi = last < 16 * warp ? lo : item_hi(last);

  AttnKeys<T> src;
  src.pos = pos;
  src.capacity = a.capacity[b];
  src.ring = false;
  src.k_cache = a.k_caches[b] + (int64_t)h * src.capacity * D;
  src.v_cache = a.v_caches[b] + (int64_t)h * src.capacity * D;
  src.blk_stride = (int64_t)a.hkv * D;
  src.k_blk = a.k_blk + ((int64_t)row0 * a.hkv + h) * D;
  src.v_blk = a.v_blk + ((int64_t)row0 * a.hkv + h) * D;

  {  // q of the CTA's items, zero past them
    constexpr int kVec = 16 / (int)sizeof(T), kChunks = D / kVec;
    for (int c = tid; c < L::kItems * kChunks; c += blockDim.x) {
      const int j = c / kChunks, col = (c % kChunks) * kVec;
      const bool valid = j < items;
      const T* q = a.q + ((int64_t)(row0 + r0 + j / G) * a.hq + h * G + j % G) * D + col;
      cp_async16(qs + j * L::kRow + col, valid ? q : a.q, valid);
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half)  // the elements this thread merges and stores, and no others
    if (16 * warp + g + 8 * half < items)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) *reinterpret_cast<float2*>(acc_row(half) + 8 * nt) = make_float2(0.f, 0.f);

  // Issue K or V of key positions [t0, t0 + 64) into its buffer, zero outside [lo, hi).
  auto issue = [&](int t0, bool values) {
    constexpr int kVec = 16 / (int)sizeof(T), kChunks = D / kVec;
    T* dst = values ? vs : ks;
    const T* cache = values ? src.v_cache : src.k_cache;
    const T* blk = values ? src.v_blk : src.k_blk;
    for (int c = tid; c < kAttnTile * kChunks; c += blockDim.x) {
      const int k = c / kChunks, col = (c % kChunks) * kVec, p = t0 + k;
      const bool valid = p >= lo && p < hi, in_blk = valid && p >= src.pos;
      const int64_t off = !valid ? 0 : in_blk ? (int64_t)(p - src.pos) * src.blk_stride + col : (int64_t)p * D + col;
      cp_async16(dst + k * L::kRow + col, (in_blk ? blk : cache) + off, valid);
    }
    cp_async_commit();
  };

  float o[NT][4];
  float m[2] = {-dspark_inf(), -dspark_inf()}, l[2] = {0.f, 0.f};    // this split, rows g and g + 8
  float mm[2] = {-dspark_inf(), -dspark_inf()}, ll[2] = {0.f, 0.f};  // merged over the splits so far
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[nt][c] = 0.f;

  int j = a.splits.index(lo), split_lo = lo, split_hi = a.splits.end(j, hi);
  issue(0, false);  // with q: one group
  issue(0, true);
  for (int t0 = 0; t0 < hi; t0 += kAttnTile) {
    const bool work = t0 < warp_hi;  // uniform over the warp
    const bool more = t0 + kAttnTile < hi;
    cp_async_wait<1>();
    __syncthreads();  // [A] K (and q) of this tile are in shared memory

    float s[8][4];
    if (work) {
      const T* krow = ks + (lane & 7) * L::kRow + 8 * (lane >> 3);
      const T* qrow = qs + (16 * warp + (lane & 15)) * L::kRow + 8 * (lane >> 4);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nt][c] = 0.f;
#pragma unroll
      for (int d0 = 0; d0 < D; d0 += 32) {
        uint32_t qa0[4], qa1[4];
        ldmatrix_x4(qa0, qrow + d0);
        ldmatrix_x4(qa1, qrow + d0 + 16);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          uint32_t kb[4];
          ldmatrix_x4(kb, krow + 8 * nt * L::kRow + d0);
          mma_16816<T>(s[nt], qa0, kb[0], kb[1]);
          mma_16816<T>(s[nt], qa1, kb[2], kb[3]);
        }
      }
    }
    __syncthreads();  // [B] every warp is done with K
    if (more) issue(t0 + kAttnTile, false);
    else cp_async_commit();  // an empty group keeps the count

    uint32_t pa[4][4];  // p as the A fragments of the 4 key steps
    float alpha[2] = {1.f, 1.f};
    if (work) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const bool seen = max(lo, t0) < min(hi_g[half], t0 + kAttnTile);
        float mx = -dspark_inf();
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int p = t0 + 8 * nt + 2 * t4 + e, c = 2 * half + e;
            s[nt][c] = p >= lo && p < hi_g[half] ? __fmul_rn(s[nt][c], a.scale) : -dspark_inf();
            mx = fmaxf(mx, s[nt][c]);
          }
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
        const float m_new = fmaxf(m[half], mx);
        float l_tile = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          T pt[2];
          float pr[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = s[nt][2 * half + e];
            pt[e] = from_float<T>(seen && x != -dspark_inf() ? expf(__fsub_rn(x, m_new)) : 0.f);
            pr[e] = to_float(pt[e]);
          }
          pa[nt >> 1][half + 2 * (nt & 1)] = (uint32_t)pt[0].bits | (uint32_t)pt[1].bits << 16;
          float sum = __fadd_rn(pr[0], pr[1]);
          sum = __fadd_rn(sum, __shfl_xor_sync(kFullMask, sum, 1));
          sum = __fadd_rn(sum, __shfl_xor_sync(kFullMask, sum, 2));
          l_tile = nt == 0 ? sum : __fadd_rn(l_tile, sum);
        }
        if (seen) {
          alpha[half] = expf(__fsub_rn(m[half], m_new));
          l[half] = __fadd_rn(__fmul_rn(l[half], expf(__fsub_rn(m[half], m_new))), l_tile);
          m[half] = m_new;
        }
      }
    }
    cp_async_wait<1>();
    __syncthreads();  // [C] V of this tile is in shared memory

    if (work) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[nt][c] = __fmul_rn(o[nt][c], alpha[c >> 1]);
      const T* vrow = vs + ((lane & 7) + 8 * ((lane >> 3) & 1)) * L::kRow + 8 * (lane >> 4);
#pragma unroll
      for (int ks4 = 0; ks4 < 4; ++ks4) {
#pragma unroll
        for (int np = 0; np < NT; np += 2) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, vrow + 16 * ks4 * L::kRow + 8 * np);
          mma_16816<T>(o[np], pa[ks4], r[0], r[1]);
          mma_16816<T>(o[np + 1], pa[ks4], r[2], r[3]);
        }
      }
    }
    __syncthreads();  // [D] every warp is done with V
    if (more) issue(t0 + kAttnTile, true);
    else cp_async_commit();

    if (t0 + kAttnTile >= split_hi) {  // split j is complete: merge it (the serial kernel's [E], [F])
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (split_lo < min(hi_g[half], split_hi)) {
          const AttnMergeFactors f = attn_merge_factors(mm[half], m[half]);
          float* row = acc_row(half);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            float2 v = *reinterpret_cast<const float2*>(row + 8 * nt);
            v.x = attn_merge(v.x, o[nt][2 * half], f);
            v.y = attn_merge(v.y, o[nt][2 * half + 1], f);
            *reinterpret_cast<float2*>(row + 8 * nt) = v;
          }
          ll[half] = attn_merge(ll[half], l[half], f);
          mm[half] = f.m;
        }
        m[half] = -dspark_inf();
        l[half] = 0.f;
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[nt][c] = 0.f;
      ++j;
      split_lo = split_hi;
      split_hi = a.splits.end(j, hi);
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int item_j = 16 * warp + g + 8 * half;
    if (item_j < items) {
      const int64_t item = (int64_t)(row0 + r0 + item_j / G) * a.hq + h * G + item_j % G;
      const float* row = acc_row(half);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float2 v = *reinterpret_cast<const float2*>(row + 8 * nt);
        attn_store2(a.out + item * D + 8 * nt + 2 * t4, __fdiv_rn(v.x, ll[half]), __fdiv_rn(v.y, ll[half]));
      }
    }
  }
}

#define DSPARK_ATTENTION_PROMPT_ENTRY(SUF, T, D)                                                                 \
  extern "C" __global__ void __launch_bounds__(kAttnPromptThreads, 1) attention_prompt_##SUF##_d##D(            \
      DSPARK_ATTENTION_PARAMS(T)) {                                                                               \
    using T_ = T;                                                                                                 \
    attention_prompt_cta<T, D>(DSPARK_ATTENTION_ARGS);                                                            \
  }

DSPARK_ATTENTION_PROMPT_ENTRY(f16, f16_t, 64)
DSPARK_ATTENTION_PROMPT_ENTRY(f16, f16_t, 128)
DSPARK_ATTENTION_PROMPT_ENTRY(f16, f16_t, 256)
DSPARK_ATTENTION_PROMPT_ENTRY(bf16, bf16_t, 64)
DSPARK_ATTENTION_PROMPT_ENTRY(bf16, bf16_t, 128)
DSPARK_ATTENTION_PROMPT_ENTRY(bf16, bf16_t, 256)

// ---- probes: the building blocks against their documented semantics --------------------------
// tests/kernels/test_attention.py runs them on every executor: on simt they pin the emulation to
// the PTX ISA's layouts, on a GPU they pin the hardware to the same expectations.
//
// attention_mma_probe_<dt>: one warp. a [16][16] (A, row-major), kt [8][16] (B transposed: the
// K-tile layout, B[k][n] = kt[n][k]), vm [16][16] (the V-tile layout, B[k][n] = vm[k][n]),
// c [16][8]. regs [2][32][12]: per lane, packed by hand from the documented fragment layouts (0)
// and loaded by ldmatrix (1): A (4 words), B from kt (ldmatrix_x4, 2 words used), B from vm
// columns 0..7 (ldmatrix_x2_trans, 2), B of vm's two n-tiles (ldmatrix_x4_trans, 4).
// d [16][8] = A B + C with B from kt, through the hand-packed fragments and the C layout.
template <typename T>
DSPARK_DEVICE uint32_t attn_probe_pack(T lo, T hi) {
  return (uint32_t)lo.bits | (uint32_t)hi.bits << 16;
}

template <typename T>
DSPARK_DEVICE void attention_mma_probe(const T* a, const T* kt, const T* vm, const float* c, unsigned* regs, float* d) {
  DSPARK_DYNAMIC_SMEM(T, smem);  // a | kt | vm at elements 0, 256, 384: rows of 16 (32 bytes)
  const int l = threadIdx.x, g = l >> 2, t = 2 * (l & 3);
  for (int i = l; i < 16 * 16; i += 32) {
    smem[i] = a[i];
    smem[384 + i] = vm[i];
    if (i < 8 * 16) smem[256 + i] = kt[i];
  }
  __syncthreads();
  uint32_t man[12], ldm[12];
  man[0] = attn_probe_pack(a[g * 16 + t], a[g * 16 + t + 1]);
  man[1] = attn_probe_pack(a[(g + 8) * 16 + t], a[(g + 8) * 16 + t + 1]);
  man[2] = attn_probe_pack(a[g * 16 + t + 8], a[g * 16 + t + 9]);
  man[3] = attn_probe_pack(a[(g + 8) * 16 + t + 8], a[(g + 8) * 16 + t + 9]);
  man[4] = attn_probe_pack(kt[g * 16 + t], kt[g * 16 + t + 1]);
  man[5] = attn_probe_pack(kt[g * 16 + t + 8], kt[g * 16 + t + 9]);
  for (int nt = 0; nt < 2; ++nt) {
    const int n = 8 * nt + g;
    man[8 + 2 * nt] = attn_probe_pack(vm[t * 16 + n], vm[(t + 1) * 16 + n]);
    man[9 + 2 * nt] = attn_probe_pack(vm[(t + 8) * 16 + n], vm[(t + 9) * 16 + n]);
  }
  man[6] = man[8];
  man[7] = man[9];
  uint32_t r4[4], r2[2];
  ldmatrix_x4(r4, smem + (l & 15) * 16 + 8 * (l >> 4));
  for (int i = 0; i < 4; ++i) ldm[i] = r4[i];
  ldmatrix_x4(r4, smem + 256 + (l & 7) * 16 + 8 * ((l >> 3) & 1));  // matrices 2, 3 repeat 0, 1
  ldm[4] = r4[0];
  ldm[5] = r4[1];
  ldmatrix_x2_trans(r2, smem + 384 + (l & 15) * 16);
  ldm[6] = r2[0];
  ldm[7] = r2[1];
  ldmatrix_x4_trans(r4, smem + 384 + ((l & 7) + 8 * ((l >> 3) & 1)) * 16 + 8 * (l >> 4));
  for (int i = 0; i < 4; ++i) ldm[8 + i] = r4[i];
  for (int i = 0; i < 12; ++i) {
    regs[l * 12 + i] = man[i];
    regs[(32 + l) * 12 + i] = ldm[i];
  }
  float acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = c[(g + 8 * (i >> 1)) * 8 + t + (i & 1)];
  const uint32_t fa[4] = {man[0], man[1], man[2], man[3]};
  mma_16816<T>(acc, fa, man[4], man[5]);
  for (int i = 0; i < 4; ++i) d[(g + 8 * (i >> 1)) * 8 + t + (i & 1)] = acc[i];
}

extern "C" __global__ void attention_mma_probe_bf16(const bf16_t* __restrict__ a, const bf16_t* __restrict__ kt,
                                                    const bf16_t* __restrict__ vm, const float* __restrict__ c,
                                                    unsigned* __restrict__ regs, float* __restrict__ d) {
  attention_mma_probe<bf16_t>(a, kt, vm, c, regs, d);
}

extern "C" __global__ void attention_mma_probe_f16(const f16_t* __restrict__ a, const f16_t* __restrict__ kt,
                                                   const f16_t* __restrict__ vm, const float* __restrict__ c,
                                                   unsigned* __restrict__ regs, float* __restrict__ d) {
  attention_mma_probe<f16_t>(a, kt, vm, c, regs, d);
}

// attention_cp_async_probe: thread i copies src[4i .. 4i+4) (16 bytes) into shared slot i with
// cp.async (zero-filled for odd i when zfill) and commits; then, per `wait`,
//   0: wait_group 0                                   correct
//   1: commit a second, empty group, wait_group 1     correct: the copy's group is not the newest
//   2: wait_group 1                                   wrong: the copy's group is the newest
//   3: no wait                                        wrong
// then __syncthreads and out[4i ..] = slot (i + 1) % n. The wrong ones exist to be caught.
extern "C" __global__ void attention_cp_async_probe(const float* __restrict__ src, float* __restrict__ out,
                                                    int wait, int zfill) {
  DSPARK_DYNAMIC_SMEM(float, slots);
  const int i = threadIdx.x, n = blockDim.x;
  cp_async16(slots + 4 * i, src + 4 * i, !(zfill && (i & 1)));
  cp_async_commit();
  if (wait == 0) cp_async_wait<0>();
  if (wait == 1) cp_async_commit();
  if (wait == 1 || wait == 2) cp_async_wait<1>();
  __syncthreads();
  const int j = (i + 1) % n;
  for (int e = 0; e < 4; ++e) out[4 * i + e] = slots[4 * j + e];
}
