// heads: the drafter's glue between its block pass and its heads, each one launch into a given
// output (each was an array operation or three, with its allocation).
//
// gather_rows_f32(src [n, width], rows [m], m, width, dst [m, width])
//   dst[i] = src[rows[i]]: the draft rows of a block (mask-fill harvest: rows 1..b-1 of each
//   session's block) before the final norm. Grid (m, ceil(width / 256)).
//
// logit_scale_f32(logits [n], n, scale, cap, out [n])
//   v = logits * scale, then cap * tanh(v / cap) when cap > 0 (DFlash's output multiplier and final
//   soft cap), in that order. Grid ceil(n / 256).
//
// confidence_features_f32(hidden [B * nd, d], w1 [V, r] or null, anchors [B], drafts [B, nd], B, nd,
//                         d, r, out [B * nd, d + r])
//   Row k of session b: [h_k ; W1[x_{k-1}]] with x_{-1} the anchor and x_{k-1} = drafts[b, k - 1]
//   (the chain's own previous draft, read on the device): the confidence head's features.
//   Grid (B * nd, ceil((d + r) / 256)).
//
// markov_logits_f32(logits [B * nd, V], w1 [V, r] or null, w2 [r, V], anchors [B], picks [B] or null,
//                   slot, B, nd, V, r, drafts [B, nd], out [B, V])
//   Slot `slot` of the sampled Markov chain: out[b] = logits[b * nd + slot] + w2^T w1[x_{slot-1}],
//   the greedy chain's bias (markov_chain, csrc/argmax.cu): summed over r in increasing order with
//   round-to-nearest multiplies and adds, then one rounded add. x_{-1} is the anchor, x_{slot-1} the
//   previous slot's pick picks[b] (read on the device; a bad row's -1 reads row 0, as the greedy chain
//   does), which CTA (b, 0) also stores into drafts[b, slot - 1]. Without w1 (no Markov head) out is
//   the slot's row. slot = nd only stores the last pick (out unused). Grid (B, ceil(V / 256)).
//
// Copies and one product per element: exact, and independent of the batch.
#include "common.cuh"

constexpr int kHeadThreads = 256;

extern "C" __global__ void __launch_bounds__(kHeadThreads)
    gather_rows_f32(const float* __restrict__ src, const int* __restrict__ rows, int m, int width,
                    float* __restrict__ dst) {
  const int i = blockIdx.x, j = blockIdx.y * kHeadThreads + threadIdx.x;
  if (i < m && j < width) dst[(int64_t)i * width + j] = src[(int64_t)rows[i] * width + j];
}

extern "C" __global__ void __launch_bounds__(kHeadThreads)
    logit_scale_f32(const float* __restrict__ logits, long long n, float scale, float cap, float* __restrict__ out) {
  const int64_t i = (int64_t)blockIdx.x * kHeadThreads + threadIdx.x;
  if (i >= n) return;
  const float v = logits[i] * scale;
  out[i] = cap > 0.f ? tanhf(v / cap) * cap : v;
}

extern "C" __global__ void __launch_bounds__(kHeadThreads)
    confidence_features_f32(const float* __restrict__ hidden, const float* __restrict__ w1, const int* __restrict__ anchors,
                            const int* __restrict__ drafts, int sessions, int nd, int d, int r, float* __restrict__ out) {
  const int row = blockIdx.x, j = blockIdx.y * kHeadThreads + threadIdx.x;
  if (row >= sessions * nd || j >= d + r) return;
  const int b = row / nd, k = row - b * nd;
  float v;
  if (j < d) {
    v = hidden[(int64_t)row * d + j];
  } else {
    const int prev = k == 0 ? anchors[b] : drafts[b * nd + k - 1];
    v = w1[(int64_t)prev * r + j - d];
  }
  out[(int64_t)row * (d + r) + j] = v;
}

extern "C" __global__ void __launch_bounds__(kHeadThreads)
    markov_logits_f32(const float* __restrict__ logits, const float* __restrict__ w1, const float* __restrict__ w2,
                      const int* __restrict__ anchors, const int* __restrict__ picks, int slot, int sessions, int nd,
                      int vocab, int r, int* __restrict__ drafts, float* __restrict__ out) {
  const int b = blockIdx.x, j = blockIdx.y * kHeadThreads + threadIdx.x;
  if (b >= sessions) return;
  const int prev = slot == 0 ? anchors[b] : picks[b];
  if (slot > 0 && blockIdx.y == 0 && threadIdx.x == 0) drafts[b * nd + slot - 1] = prev;
  if (slot >= nd || j >= vocab) return;
  float bias = 0.0f;
  if (w1 != nullptr) {
    const float* emb = w1 + (int64_t)(prev < 0 || prev >= vocab ? 0 : prev) * r;
#pragma unroll 1
    for (int i = 0; i < r; ++i) bias = __fadd_rn(bias, __fmul_rn(emb[i], w2[(int64_t)i * vocab + j]));
  }
  const float x = logits[((int64_t)b * nd + slot) * vocab + j];
  out[(int64_t)b * vocab + j] = w1 != nullptr ? __fadd_rn(x, bias) : x;
}
