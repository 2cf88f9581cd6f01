// snapshot: batched copies of recurrent state (gdn matrix states and conv windows) through
// pointer tables, one launch for every tensor of every session.
//
// snapshot_copy_f32(src [n] -> float[sizes[i]], dst [n] -> float[sizes[i]], sizes [n] int64, n)
//   dst[i][:] = src[i][:] for every i. Serves snapshot save (live -> snap) and restore
//   (snap -> live).
//
// checkpoint_select_f32(state_ckpt [cols, state_size], conv_ckpt [cols, conv_size],
//                       states [B] -> float[state_size], conv_windows [B] -> float[conv_size],
//                       snap_states [B] or null, snap_convs [B] or null, col_indptr [B+1],
//                       keep [B], state_size, conv_size)
//   Rolls session b back to the state after its first keep_b verify columns: copies checkpoint
//   column col_indptr[b] + keep_b - 1 into its live state and conv window. keep_b = 0 means
//   "before the verify": it copies the snapshot instead, or leaves the session alone when no
//   snapshot tables are given (the op refuses that case; see dspark/ops/snapshot.py).
//
// checkpoint_select_layers_f32(state_ckpts [L] -> [cols, state_size], conv_ckpts [L] -> [cols, conv_size],
//                              states [L * B] -> float[state_size], conv_windows [L * B] -> float[conv_size],
//                              col_indptr [B+1], keep [B], sessions, state_size, conv_size)
//   checkpoint_select_f32 for every gdn layer at once (entry l * B + b of the state tables is layer l
//   of session b), with a session that keeps nothing left as it is: a verify never writes the live
//   state, so keep_b = 0 means the state before it. Grid (L * B, chunks): one launch per round.
//
// Grid (tensors, chunks): block (i, y) copies tensor i (session b for checkpoint_select) with a
// grid-stride loop over y, 4 floats per thread per step when both ends are 16-byte aligned.
// Pure copies: exact, and independent of the schedule.
#include "common.cuh"

// dst[0..n) = src[0..n) by the blocks of one grid column (blockIdx.y, gridDim.y).
DSPARK_DEVICE void snapshot_copy_span(float* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  const int64_t first = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
  const int64_t step = (int64_t)gridDim.y * blockDim.x;
  int64_t tail = 0;
  if (((reinterpret_cast<unsigned long long>(dst) | reinterpret_cast<unsigned long long>(src)) & 15u) == 0) {
    const int64_t n4 = n / 4;
    for (int64_t i = first; i < n4; i += step)
      reinterpret_cast<float4*>(dst)[i] = reinterpret_cast<const float4*>(src)[i];
    tail = n4 * 4;
  }
  for (int64_t i = tail + first; i < n; i += step) dst[i] = src[i];
}

extern "C" __global__ void __launch_bounds__(256)
    snapshot_copy_f32(const float* const* __restrict__ src, float* const* __restrict__ dst,
                      const long long* __restrict__ sizes, int n) {
  const int i = blockIdx.x;
  if (i < n) snapshot_copy_span(dst[i], src[i], sizes[i]);
}

extern "C" __global__ void __launch_bounds__(256)
    checkpoint_select_f32(const float* __restrict__ state_ckpt, const float* __restrict__ conv_ckpt,
                          float* const* __restrict__ states, float* const* __restrict__ conv_windows,
                          const float* const* __restrict__ snap_states, const float* const* __restrict__ snap_convs,
                          const int* __restrict__ col_indptr, const int* __restrict__ keep, long long state_size,
                          int conv_size) {
  const int b = blockIdx.x;
  const int c0 = col_indptr[b], t = col_indptr[b + 1] - c0, k = keep[b];
  const float *state_src, *conv_src;
  if (k >= 1 && k <= t) {
    state_src = state_ckpt + (int64_t)(c0 + k - 1) * state_size;
    conv_src = conv_ckpt + (int64_t)(c0 + k - 1) * conv_size;
  } else if (k == 0 && snap_states && snap_convs) {
    state_src = snap_states[b];
    conv_src = snap_convs[b];
  } else {
    return;  // keep out of range: the op has already refused it
  }
  snapshot_copy_span(states[b], state_src, state_size);
  snapshot_copy_span(conv_windows[b], conv_src, conv_size);
}

extern "C" __global__ void __launch_bounds__(256)
    checkpoint_select_layers_f32(const float* const* __restrict__ state_ckpts, const float* const* __restrict__ conv_ckpts,
                                 float* const* __restrict__ states, float* const* __restrict__ conv_windows,
                                 const int* __restrict__ col_indptr, const int* __restrict__ keep, int sessions,
                                 long long state_size, int conv_size) {
  const int b = blockIdx.x % sessions, layer = blockIdx.x / sessions;
  const int c0 = col_indptr[b], t = col_indptr[b + 1] - c0, k = keep[b];
  if (k < 1 || k > t) return;  // nothing kept (or out of range, which the op has refused)
  const int64_t col = c0 + k - 1;
  snapshot_copy_span(states[blockIdx.x], state_ckpts[layer] + col * state_size, state_size);
  snapshot_copy_span(conv_windows[blockIdx.x], conv_ckpts[layer] + col * conv_size, conv_size);
}
