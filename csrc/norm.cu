// norm: RMSNorm over the last axis of a row, one warp per row, in one fixed order; with the
// residual add before it and the embedding gather before the first one (the trunk's and drafter's
// layer boundaries: one launch where the glue took three).
//
// rmsnorm_f32(x [rows, n], weight [n], rows, n, eps, out [rows, n])
//   grid.x = rows, block 32: block i normalises row i (a row per CTA: the few rows of a decode step or
//   a verify spread over as many SMs as they can). Lane l sums
//   x[l]^2, x[l + 32]^2, ... in that order, then warp_sum's xor butterfly (offsets 16 .. 1) gives
//   every lane the row's total s; r = sqrt(s / n + eps) and out[j] = (x[j] / r) * weight[j].
//
// add_rmsnorm_f32(x [rows, n], y [rows, n] or null, weight, rows, n, eps, out, tap or null, tap_stride)
//   The residual stream's step: x[j] <- x[j] + y[j] (f32, in place), then out = rmsnorm(x) exactly as
//   rmsnorm_f32 (the same lanes sum the same squares in the same order), and, for a tap layer, the new
//   x also to tap + row * tap_stride (a column block of the pass's taps [rows, n_taps * n]).
//
// embed_rmsnorm_<dt>(table [V, n] of dt, ids [rows], rows, n, scale, weight, eps, x [rows, n], out,
//                    tap or null, tap_stride)
//   x = widen(table[ids[row]]) * scale (exact widening of f16 / bf16; scale 1 is exact), then out =
//   rmsnorm(x) as above, and the tap copy.
//
// Why a kernel: an array library's reduction (CuPy's mean over an axis) picks its block layout,
// and with it each row's summation order, from the whole array's shape, so a row's norm could
// depend on how many rows share the call. Here the order is a function of n alone. Multiplies and
// adds are never contracted (-fmad=false), so the NumPy twins (dspark.ops.norm.rmsnorm_ref and
// add_rmsnorm_ref) reproduce every bit.
#include "common.cuh"
#include "reduce.cuh"

constexpr int kNormWarps = 1;  // rows (warps) per CTA

// out[0..n) = (x / sqrt(sum x^2 / n + eps)) * weight by one whole warp, lanes in order.
DSPARK_DEVICE void norm_row(const float* __restrict__ xr, const float* __restrict__ weight, int n, float eps,
                            float* __restrict__ yr, int lane) {
  float ss = 0.f;
  for (int j = lane; j < n; j += 32) {
    const float v = xr[j];
    ss += v * v;
  }
  const float r = sqrtf(warp_sum(ss) / (float)n + eps);
  for (int j = lane; j < n; j += 32) yr[j] = (xr[j] / r) * weight[j];
}

extern "C" __global__ void __launch_bounds__(kNormWarps * 32)
    rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ weight, int rows, int n, float eps,
                float* __restrict__ out) {
  const int row = blockIdx.x * kNormWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= rows) return;  // whole warps leave together: the butterfly below sees full warps
  norm_row(x + (int64_t)row * n, weight, n, eps, out + (int64_t)row * n, lane);
}

extern "C" __global__ void __launch_bounds__(kNormWarps * 32)
    add_rmsnorm_f32(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ weight, int rows,
                    int n, float eps, float* __restrict__ out, float* __restrict__ tap, long long tap_stride) {
  const int row = blockIdx.x * kNormWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= rows) return;
  float* __restrict__ xr = x + (int64_t)row * n;
  float* __restrict__ tr = tap ? tap + row * tap_stride : nullptr;
  for (int j = lane; j < n; j += 32) {  // each lane rewrites, then reads back, only its own entries
    const float v = y ? xr[j] + y[(int64_t)row * n + j] : xr[j];
    xr[j] = v;
    if (tr) tr[j] = v;
  }
  norm_row(xr, weight, n, eps, out + (int64_t)row * n, lane);
}

template <typename T>
DSPARK_DEVICE void embed_rmsnorm(const T* __restrict__ table, const int* __restrict__ ids, int rows, int n,
                                 float scale, const float* __restrict__ weight, float eps, float* __restrict__ x,
                                 float* __restrict__ out, float* __restrict__ tap, long long tap_stride) {
  const int row = blockIdx.x * kNormWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* __restrict__ er = table + (int64_t)ids[row] * n;
  float* __restrict__ xr = x + (int64_t)row * n;
  float* __restrict__ tr = tap ? tap + row * tap_stride : nullptr;
  for (int j = lane; j < n; j += 32) {
    const float v = to_float(er[j]) * scale;
    xr[j] = v;
    if (tr) tr[j] = v;
  }
  norm_row(xr, weight, n, eps, out + (int64_t)row * n, lane);
}

#define DSPARK_EMBED_RMSNORM(SUF, T)                                                                             \
  extern "C" __global__ void __launch_bounds__(kNormWarps * 32) embed_rmsnorm_##SUF(                            \
      const T* __restrict__ table, const int* __restrict__ ids, int rows, int n, float scale,                    \
      const float* __restrict__ weight, float eps, float* __restrict__ x, float* __restrict__ out,               \
      float* __restrict__ tap, long long tap_stride) {                                                           \
    embed_rmsnorm<T>(table, ids, rows, n, scale, weight, eps, x, out, tap, tap_stride);                           \
  }

DSPARK_EMBED_RMSNORM(f32, float)
DSPARK_EMBED_RMSNORM(f16, f16_t)
DSPARK_EMBED_RMSNORM(bf16, bf16_t)
