// argmax: row argmax over the vocabulary, and the fused greedy accept of a verify block.
//
// argmax_rows_<dt>(logits [rows, V], rows, V, out [rows], nan_flag [rows])
//   grid.x = rows, block.x = a multiple of 32 (<= 1024). Each thread scans a strided slice of
//   the row, then block_argmax combines (larger value, then lower index). NaN entries are
//   skipped and flagged; out = -1 only when every entry is NaN. Exact on any block size, so the
//   result of a row never depends on how many rows share the launch.
//
// greedy_accept_<dt>(logits [cols, V], cand [cols], col_indptr [B+1], V, m [B], next [B],
//                    nan_flag [B])
//   grid.x = B sessions, one block each. Session b owns columns col_indptr[b] .. [b+1]: its
//   candidates are [anchor, d_1 .. d_{vt-1}] and column j predicts the token after cand[j].
//   Walks columns in order and stops at the first mismatch: m = number of drafts accepted,
//   next = argmax(column m). Only the columns it examines are scanned for NaN. A session with
//   no columns gets m = -1, next = -1.
//
// markov_chain_<dt>(logits [B*nd, V], w1 [V, r], w2 [r, V], anchors [B], nd, V, r,
//                   drafts [B, nd], nan_flag [B])
//   grid.x = B sessions. The drafter's Markov head, serial over the nd slots of a session:
//   x_k = argmax(logits_k + w2^T w1[x_{k-1}]), x_{-1} = anchor. The bias of column j is summed
//   over r in increasing order with explicit round-to-nearest multiplies and adds (no FMA
//   contraction), so the NumPy reference reproduces it bit for bit and the argmax is exact.
#include "common.cuh"
#include "reduce.cuh"

template <typename T>
DSPARK_DEVICE ArgBest row_argmax(const T* __restrict__ row, int vocab, bool* saw_nan, ArgBest* scratch) {
  ArgBest b{-dspark_inf(), 0x7fffffff};
  bool nan = false;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    float v = to_float(row[j]);
    if (dspark_isnan(v)) {
      nan = true;
      continue;
    }
    if (v > b.v || (v == b.v && j < b.i)) b = ArgBest{v, j};
  }
  *saw_nan = block_any(nan);
  return block_argmax(b, scratch);
}

template <typename T>
DSPARK_DEVICE void argmax_rows(const T* __restrict__ logits, int rows, int vocab, int* __restrict__ out,
                               int* __restrict__ nan_flag) {
  __shared__ ArgBest scratch[32];
  const int r = blockIdx.x;
  if (r >= rows) return;
  bool nan;
  ArgBest b = row_argmax(logits + (int64_t)r * vocab, vocab, &nan, scratch);
  if (threadIdx.x == 0) {
    out[r] = b.i == 0x7fffffff ? -1 : b.i;
    nan_flag[r] = nan ? 1 : 0;
  }
}

template <typename T>
DSPARK_DEVICE void greedy_accept(const T* __restrict__ logits, const int* __restrict__ cand,
                                 const int* __restrict__ col_indptr, int vocab, int* __restrict__ m_out,
                                 int* __restrict__ next_out, int* __restrict__ nan_flag) {
  __shared__ ArgBest scratch[32];
  const int s = blockIdx.x;
  const int c0 = col_indptr[s], vt = col_indptr[s + 1] - c0;
  int m = -1, next = -1;
  bool any_nan = false;
  for (int j = 0; j < vt; ++j) {
    bool nan;
    ArgBest b = row_argmax(logits + (int64_t)(c0 + j) * vocab, vocab, &nan, scratch);
    any_nan = any_nan || nan;
    int pred = b.i == 0x7fffffff ? -1 : b.i;
    if (j == vt - 1 || pred != cand[c0 + j + 1]) {
      m = j;
      next = pred;
      break;
    }
  }
  if (threadIdx.x == 0) {
    m_out[s] = m;
    next_out[s] = next;
    nan_flag[s] = any_nan ? 1 : 0;
  }
}

template <typename T>
DSPARK_DEVICE void markov_chain(const T* __restrict__ logits, const float* __restrict__ w1,
                                const float* __restrict__ w2, const int* __restrict__ anchors, int nd, int vocab,
                                int rank, int* __restrict__ drafts, int* __restrict__ nan_flag) {
  __shared__ ArgBest scratch[32];
  DSPARK_DYNAMIC_SMEM(float, emb);  // w1[x_{k-1}], rank floats
  const int s = blockIdx.x;
  int prev = anchors[s];
  bool any_nan = false;
  for (int k = 0; k < nd; ++k) {
    for (int i = threadIdx.x; i < rank; i += blockDim.x) emb[i] = w1[(int64_t)prev * rank + i];
    __syncthreads();
    const T* row = logits + ((int64_t)s * nd + k) * vocab;
    ArgBest b{-dspark_inf(), 0x7fffffff};
    bool nan = false;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
      float bias = 0.0f;
      for (int i = 0; i < rank; ++i) bias = __fadd_rn(bias, __fmul_rn(emb[i], w2[(int64_t)i * vocab + j]));
      float v = __fadd_rn(to_float(row[j]), bias);
      if (dspark_isnan(v)) {
        nan = true;
        continue;
      }
      if (v > b.v) b = ArgBest{v, j};
    }
    any_nan = block_any(nan) || any_nan;
    b = block_argmax(b, scratch);  // also fences emb before the next slot overwrites it
    prev = b.i == 0x7fffffff ? 0 : b.i;
    if (threadIdx.x == 0) drafts[s * nd + k] = b.i == 0x7fffffff ? -1 : b.i;
  }
  if (threadIdx.x == 0) nan_flag[s] = any_nan ? 1 : 0;
}

#define DSPARK_ARGMAX_ENTRIES(SUF, T)                                                                   \
  extern "C" __global__ void __launch_bounds__(1024)                                                    \
      argmax_rows_##SUF(const T* __restrict__ logits, int rows, int vocab, int* __restrict__ out,       \
                        int* __restrict__ nan_flag) {                                                   \
    argmax_rows<T>(logits, rows, vocab, out, nan_flag);                                                 \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(1024)                                                    \
      greedy_accept_##SUF(const T* __restrict__ logits, const int* __restrict__ cand,                   \
                          const int* __restrict__ col_indptr, int vocab, int* __restrict__ m_out,       \
                          int* __restrict__ next_out, int* __restrict__ nan_flag) {                     \
    greedy_accept<T>(logits, cand, col_indptr, vocab, m_out, next_out, nan_flag);                       \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(1024)                                                    \
      markov_chain_##SUF(const T* __restrict__ logits, const float* __restrict__ w1,                    \
                         const float* __restrict__ w2, const int* __restrict__ anchors, int nd,         \
                         int vocab, int rank, int* __restrict__ drafts, int* __restrict__ nan_flag) {   \
    markov_chain<T>(logits, w1, w2, anchors, nd, vocab, rank, drafts, nan_flag);                        \
  }

DSPARK_ARGMAX_ENTRIES(f32, float)
DSPARK_ARGMAX_ENTRIES(f16, f16_t)
DSPARK_ARGMAX_ENTRIES(bf16, bf16_t)
