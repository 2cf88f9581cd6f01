// argmax: row argmax over the vocabulary, the fused greedy accept of a verify block, and the
// drafter's Markov chain. Every row is split across S = ceil(V / kSliceElems) CTAs (the chain's
// across ceil(V / kMarkovSlice)) and merged exactly by the last CTA to arrive (csrc/rowsplit.cuh), so a row's result never depends on the
// batch. Lowest index on ties; NaN entries are skipped and flagged, never chosen.
//
// argmax_rows_<dt>(logits [rows, V], rows, V, out [rows], nan_flag [rows], part, tickets)
//   grid.x = rows * S (CTA x = row * S + slice), block.x = a multiple of 32 (<= 256). out = -1
//   only when every entry of the row is NaN. part: 4 * rows * S words of per-CTA partials;
//   tickets: rows zeroed counters (left zeroed).
//
// greedy_accept_<dt>(logits [cols, V], cand [cols], col_indptr [B+1], B, V, m [B], next [B],
//                    nan_flag [B], part, tickets)
//   grid.x = cols * S: every column's argmax in parallel. Session b owns columns col_indptr[b] ..
//   [b+1]: its candidates are [anchor, d_1 .. d_{vt-1}] and column j predicts the token after
//   cand[j]. The last of the session's S * vt CTAs walks the merged columns in order and stops at
//   the first mismatch: m = number of drafts accepted, next = argmax(column m). nan_flag covers
//   only the columns it examines. A session with no columns gets m = -1, next = -1 (written by
//   the finisher of a neighbouring session). part: 4 * cols * S words; tickets: B.
//
// markov_chain_<dt>(logits [B*nd, V], w1 [V, r], w2 [r, V], anchors [B], nd, V, r,
//                   drafts [B, nd], nan_flag [B], part, tickets, slot)
//   The drafter's Markov head, serial over the nd slots of a session:
//   x_k = argmax(logits_k + w2^T w1[x_{k-1}]), x_{-1} = anchor. S = ceil(V / kMarkovSlice) (an
//   entry reads r rows of w2: an eighth of argmax's slice keeps a launch's CTAs on every SM at one
//   session). slot = k >= 0: one launch per
//   slot, grid.x = B * S; slot k reads x_{k-1} from drafts (the last launch wrote it) and its
//   last CTA writes x_k. slot = -1 (only when S = 1): grid.x = B, each CTA runs every slot. The
//   bias of column j is summed over r in increasing order with explicit round-to-nearest
//   multiplies and adds (no FMA contraction), so the NumPy reference reproduces it bit for bit.
//   Dynamic shared memory: 4 * r bytes. part: 4 * B * S words; tickets: B.
#include "common.cuh"
#include "rowsplit.cuh"

constexpr int kAcceptChunk = 64;  // verify columns greedy_accept's last CTA merges at once
constexpr int kMarkovSlice = 1024;  // markov_chain's entries per CTA (MARKOV_SLICE), a multiple of 8

struct ArgmaxSmem {
  SplitPartial scratch[kSplitThreads + 1];
  int pred[kAcceptChunk];
  unsigned nan[kAcceptChunk];
  int m, next;
};

// The partial (key, 0, 0, nan) of entries [lo, hi) of a row; every thread gets it.
template <typename T>
DSPARK_DEVICE SplitPartial slice_argmax(const T* __restrict__ row, int lo, int hi, SplitPartial* scratch) {
  unsigned long long best = 0;
  unsigned nan = 0;
  slice_for_each(row, lo, hi, [&](int i, float v) {
    if (dspark_isnan(v)) {
      nan = 1;
    } else {
      const unsigned long long k = arg_key(v, i);
      best = k > best ? k : best;
    }
  });
  return block_split_merge(SplitPartial{best, 0ull, 0ull, nan}, scratch);
}

template <typename T>
DSPARK_DEVICE void argmax_rows(const T* __restrict__ logits, int rows, int vocab, int* __restrict__ out,
                               int* __restrict__ nan_flag, unsigned long long* __restrict__ part,
                               unsigned* __restrict__ tickets) {
  __shared__ ArgmaxSmem sm;
  const int S = (vocab + kSliceElems - 1) / kSliceElems;
  const int r = blockIdx.x / S, s = blockIdx.x % S;
  if (r >= rows) return;
  SplitPartial p = slice_argmax(logits + (int64_t)r * vocab, slice_lo(s), slice_hi(s, vocab), sm.scratch);
  unsigned long long* mine = part + kPartWords * ((int64_t)r * S);
  if (S > 1) store_split_partial(mine + kPartWords * s, p);
  if (!split_arrive(tickets + r, (unsigned)S)) return;
  if (S > 1) p = merge_split_partials(mine, S, sm.scratch);
  if (threadIdx.x == 0) {
    out[r] = arg_key_index(p.key);
    nan_flag[r] = p.flags ? 1 : 0;
  }
}

// The session owning column c: the largest b < B with indptr[b] <= c.
DSPARK_DEVICE int session_of(const int* __restrict__ indptr, int B, int c) {
  int lo = 0, hi = B;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (indptr[mid] <= c) lo = mid;
    else hi = mid;
  }
  return lo;
}

template <typename T>
DSPARK_DEVICE void greedy_accept(const T* __restrict__ logits, const int* __restrict__ cand,
                                 const int* __restrict__ col_indptr, int B, int vocab, int* __restrict__ m_out,
                                 int* __restrict__ next_out, int* __restrict__ nan_flag,
                                 unsigned long long* __restrict__ part, unsigned* __restrict__ tickets) {
  __shared__ ArgmaxSmem sm;
  const int S = (vocab + kSliceElems - 1) / kSliceElems;
  const int c = blockIdx.x / S, s = blockIdx.x % S;
  const int b = session_of(col_indptr, B, c);
  const int c0 = col_indptr[b], vt = col_indptr[b + 1] - c0;
  const SplitPartial p = slice_argmax(logits + (int64_t)c * vocab, slice_lo(s), slice_hi(s, vocab), sm.scratch);
  store_split_partial(part + kPartWords * ((int64_t)c * S + s), p);
  if (!split_arrive(tickets + b, (unsigned)(S * vt))) return;

  // The columns' merges run side by side, a warp per column (lane l folds slices l, l + 32, ...);
  // then thread 0 walks them in order, kAcceptChunk columns at a time.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int m = -1, next = -1;
  bool any_nan = false;  // thread 0's
  for (int j0 = 0; j0 < vt && m < 0; j0 += kAcceptChunk) {
    const int n = min(kAcceptChunk, vt - j0);
    for (int jj = warp; jj < n; jj += nwarps) {
      const unsigned long long* col = part + kPartWords * ((int64_t)(c0 + j0 + jj) * S);
      unsigned long long key = 0;
      unsigned flags = 0;
      for (int i = lane; i < S; i += 32) {
        const unsigned long long k = load_shared_u64(col + kPartWords * i);
        key = k > key ? k : key;
        flags |= (unsigned)load_shared_u64(col + kPartWords * i + 3);
      }
      for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long k = __shfl_xor_sync(0xffffffffu, key, o);
        key = k > key ? k : key;
        flags |= __shfl_xor_sync(0xffffffffu, flags, o);
      }
      if (lane == 0) {
        sm.pred[jj] = arg_key_index(key);
        sm.nan[jj] = flags;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      sm.m = -1;
      for (int jj = 0; jj < n; ++jj) {
        const int j = j0 + jj;
        any_nan = any_nan || sm.nan[jj];
        if (j == vt - 1 || sm.pred[jj] != cand[c0 + j + 1]) {
          sm.m = j;
          sm.next = sm.pred[jj];
          break;
        }
      }
    }
    __syncthreads();
    m = sm.m;
    next = sm.next;
    __syncthreads();  // sm.pred is rewritten by the next chunk
  }
  if (threadIdx.x == 0) {
    m_out[b] = m;
    next_out[b] = next;
    nan_flag[b] = any_nan ? 1 : 0;
    // Sessions without columns have no CTA: the finisher of the next non-empty session writes
    // the empty ones before it, the last non-empty one those after it.
    for (int e = b - 1; e >= 0 && col_indptr[e + 1] == col_indptr[e]; --e) m_out[e] = next_out[e] = -1, nan_flag[e] = 0;
    if (col_indptr[b + 1] == col_indptr[B])
      for (int e = b + 1; e < B; ++e) m_out[e] = next_out[e] = -1, nan_flag[e] = 0;
  }
}

// One slot of session sb over entries [lo, hi): the partial (key, 0, 0, nan) of logits + bias(prev).
template <typename T>
DSPARK_DEVICE SplitPartial markov_slot(const T* __restrict__ row, const float* __restrict__ w1,
                                       const float* __restrict__ w2, int prev, int vocab, int rank, int lo, int hi,
                                       float* emb, SplitPartial* scratch) {
  for (int i = threadIdx.x; i < rank; i += blockDim.x) emb[i] = w1[(int64_t)prev * rank + i];
  __syncthreads();
  unsigned long long best = 0;
  unsigned nan = 0;
  slice_for_each_rolled(row, lo, hi, [&](int j, float x) {
    // four rows of w2 loaded at a time, added in increasing order as the reference does
    const float* col = w2 + j;
    float bias = 0.0f;
    int i = 0;
#pragma unroll 1
    for (; i + 4 <= rank; i += 4) {
      const float c0 = col[(int64_t)i * vocab], c1 = col[(int64_t)(i + 1) * vocab];
      const float c2 = col[(int64_t)(i + 2) * vocab], c3 = col[(int64_t)(i + 3) * vocab];
      bias = __fadd_rn(bias, __fmul_rn(emb[i], c0));
      bias = __fadd_rn(bias, __fmul_rn(emb[i + 1], c1));
      bias = __fadd_rn(bias, __fmul_rn(emb[i + 2], c2));
      bias = __fadd_rn(bias, __fmul_rn(emb[i + 3], c3));
    }
#pragma unroll 1
    for (; i < rank; ++i) bias = __fadd_rn(bias, __fmul_rn(emb[i], col[(int64_t)i * vocab]));
    const float v = __fadd_rn(x, bias);
    if (dspark_isnan(v)) {
      nan = 1;
    } else {
      const unsigned long long k = arg_key(v, j);
      best = k > best ? k : best;
    }
  });
  return block_split_merge(SplitPartial{best, 0ull, 0ull, nan}, scratch);  // its barriers fence emb too
}

template <typename T>
DSPARK_DEVICE void markov_chain(const T* __restrict__ logits, const float* __restrict__ w1,
                                const float* __restrict__ w2, const int* __restrict__ anchors, int nd, int vocab,
                                int rank, int* __restrict__ drafts, int* __restrict__ nan_flag,
                                unsigned long long* __restrict__ part, unsigned* __restrict__ tickets, int slot) {
  __shared__ ArgmaxSmem sm;
  DSPARK_DYNAMIC_SMEM(float, emb);  // w1[x_{k-1}], rank floats
  const int S = (vocab + kMarkovSlice - 1) / kMarkovSlice;
  if (slot < 0) {  // S = 1: every slot in this CTA
    const int b = blockIdx.x;
    int prev = anchors[b];
    bool any_nan = false;
    for (int k = 0; k < nd; ++k) {
      const SplitPartial p = markov_slot(logits + ((int64_t)b * nd + k) * vocab, w1, w2, prev, vocab, rank, 0,
                                         vocab, emb, sm.scratch);
      any_nan = any_nan || p.flags;
      const int x = arg_key_index(p.key);
      prev = x < 0 ? 0 : x;
      if (threadIdx.x == 0) drafts[b * nd + k] = x;
    }
    if (threadIdx.x == 0) nan_flag[b] = any_nan ? 1 : 0;
    return;
  }
  const int b = blockIdx.x / S, s = blockIdx.x % S;
  const int before = slot ? drafts[b * nd + slot - 1] : anchors[b];
  const int lo = s * kMarkovSlice;
  SplitPartial p = markov_slot(logits + ((int64_t)b * nd + slot) * vocab, w1, w2, before < 0 ? 0 : before, vocab,
                               rank, lo, lo + min(kMarkovSlice, vocab - lo), emb, sm.scratch);
  unsigned long long* mine = part + kPartWords * ((int64_t)b * S);
  if (S > 1) store_split_partial(mine + kPartWords * s, p);
  if (!split_arrive(tickets + b, (unsigned)S)) return;
  if (S > 1) p = merge_split_partials(mine, S, sm.scratch);
  if (threadIdx.x == 0) {
    drafts[b * nd + slot] = arg_key_index(p.key);
    nan_flag[b] = (slot ? nan_flag[b] : 0) | (p.flags ? 1 : 0);
  }
}

#define DSPARK_ARGMAX_ENTRIES(SUF, T)                                                                        \
  extern "C" __global__ void __launch_bounds__(kSplitThreads)                                                   \
      argmax_rows_##SUF(const T* __restrict__ logits, int rows, int vocab, int* __restrict__ out,            \
                        int* __restrict__ nan_flag, unsigned long long* __restrict__ part,                   \
                        unsigned* __restrict__ tickets) {                                                    \
    argmax_rows<T>(logits, rows, vocab, out, nan_flag, part, tickets);                                       \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(kSplitThreads)                                                   \
      greedy_accept_##SUF(const T* __restrict__ logits, const int* __restrict__ cand,                        \
                          const int* __restrict__ col_indptr, int sessions, int vocab, int* __restrict__ m_out, \
                          int* __restrict__ next_out, int* __restrict__ nan_flag,                            \
                          unsigned long long* __restrict__ part, unsigned* __restrict__ tickets) {           \
    greedy_accept<T>(logits, cand, col_indptr, sessions, vocab, m_out, next_out, nan_flag, part, tickets);   \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(kSplitThreads)                                                   \
      markov_chain_##SUF(const T* __restrict__ logits, const float* __restrict__ w1,                         \
                         const float* __restrict__ w2, const int* __restrict__ anchors, int nd, int vocab,   \
                         int rank, int* __restrict__ drafts, int* __restrict__ nan_flag,                     \
                         unsigned long long* __restrict__ part, unsigned* __restrict__ tickets, int slot) {  \
    markov_chain<T>(logits, w1, w2, anchors, nd, vocab, rank, drafts, nan_flag, part, tickets, slot);        \
  }

DSPARK_ARGMAX_ENTRIES(f32, float)
DSPARK_ARGMAX_ENTRIES(f16, f16_t)
DSPARK_ARGMAX_ENTRIES(bf16, bf16_t)
