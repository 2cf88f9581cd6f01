// fp8: the e4m3 decode of fp8.cuh alone, one thread per byte: fp8_decode_e4m3(q, n, out), out[i] =
// e4m3(q[i]) as f32. What the FP8 products (linear_fp8.cu) decode with; its test compares all 256
// byte patterns with ml_dtypes (tests/kernels/test_fp8.py).
#include "common.cuh"
#include "fp8.cuh"

extern "C" __global__ void fp8_decode_e4m3(const uint8_t* __restrict__ q, int n, float* __restrict__ out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = e4m3_to_float(q[i]);
}
