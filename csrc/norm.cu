// norm: RMSNorm over the last axis of a row, one warp per row, in one fixed order.
//
// rmsnorm_f32(x [rows, n], weight [n], rows, n, eps, out [rows, n])
//   grid.x = ceil(rows / 8), block 256: warp w of block i normalises row 8 i + w. Lane l sums
//   x[l]^2, x[l + 32]^2, ... in that order, then warp_sum's xor butterfly (offsets 16 .. 1) gives
//   every lane the row's total s; r = sqrt(s / n + eps) and out[j] = (x[j] / r) * weight[j].
//
// Why a kernel: an array library's reduction (CuPy's mean over an axis) picks its block layout,
// and with it each row's summation order, from the whole array's shape, so a row's norm could
// depend on how many rows share the call. Here the order is a function of n alone. Multiplies and
// adds are never contracted (-fmad=false), so the NumPy twin (dspark.ops.norm.rmsnorm_ref)
// reproduces every bit.
#include "common.cuh"
#include "reduce.cuh"

constexpr int kNormWarps = 8;

extern "C" __global__ void __launch_bounds__(kNormWarps * 32)
    rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ weight, int rows, int n, float eps,
                float* __restrict__ out) {
  const int row = blockIdx.x * kNormWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= rows) return;  // whole warps leave together: the butterfly below sees full warps
  const float* __restrict__ xr = x + (int64_t)row * n;
  float ss = 0.f;
  for (int j = lane; j < n; j += 32) {
    const float v = xr[j];
    ss += v * v;
  }
  const float r = sqrtf(warp_sum(ss) / (float)n + eps);
  float* __restrict__ yr = out + (int64_t)row * n;
  for (int j = lane; j < n; j += 32) yr[j] = (xr[j] / r) * weight[j];
}
