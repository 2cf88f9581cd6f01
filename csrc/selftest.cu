// selftest: small kernels that check the simt runtime itself (and, on a GPU, that the runtime
// agrees with hardware). Two are wrong on purpose and exist to be caught:
//   selftest_racy_shift    a missing __syncthreads: correct only when threads happen to run in
//                          index order; the randomised schedule exposes it.
//   selftest_oob_write     writes one element past the end; the AddressSanitizer build catches it.
// The others exercise each warp and block primitive against a NumPy expectation.
#include "common.cuh"
#include "reduce.cuh"
#include "tensor_core.cuh"

// out[i] = in[i-1] (out[0] = in[0]) through shared memory.
extern "C" __global__ void selftest_shift(const float* __restrict__ in, float* __restrict__ out, int n) {
  __shared__ float buf[1024];
  int i = threadIdx.x;
  if (i < n) buf[i] = in[i];
  __syncthreads();
  if (i < n) out[i] = i ? buf[i - 1] : in[0];
}

extern "C" __global__ void selftest_racy_shift(const float* __restrict__ in, float* __restrict__ out, int n) {
  __shared__ float buf[1024];
  int i = threadIdx.x;
  if (i < n) buf[i] = in[i];
  // BUG (deliberate): no __syncthreads() here.
  if (i < n) out[i] = i ? buf[i - 1] : in[0];
}

// Every thread writes out[threadIdx.x], including the ones past n.
extern "C" __global__ void selftest_oob_write(float* __restrict__ out, int n) {
  (void)n;
  out[threadIdx.x] = 1.0f;
}

// Half of a warp reaches a full-mask shuffle: hardware would hang; simt must report it.
extern "C" __global__ void selftest_partial_warp(float* __restrict__ out) {
  float v = (float)threadIdx.x;
  if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

// Per thread t of a block of blockDim.x threads (n = blockDim.x, lane = t % 32), 12 outputs:
//  0 shfl from lane 0 of the warp   1 shfl_xor 5   2 shfl_down 3   3 shfl_up 2
//  4 ballot(t odd) as float bits    5 any(t == 7)  6 all(t < n)    7 warp_sum(t)
//  8 syncthreads_count(t % 3 == 0)  9 syncthreads_or(t == n-1)  10 syncthreads_and(t >= 0)
// 11 atomicAdd on a shared counter: the block total of (t + 1)
extern "C" __global__ void selftest_primitives(float* __restrict__ out) {
  __shared__ int counter;
  const int t = threadIdx.x, n = blockDim.x;
  if (t == 0) counter = 0;
  __syncthreads();
  float v = (float)t;
  float* o = out + (size_t)t * 12;
  o[0] = __shfl_sync(kFullMask, v, 0);
  o[1] = __shfl_xor_sync(kFullMask, v, 5);
  o[2] = __shfl_down_sync(kFullMask, v, 3);
  o[3] = __shfl_up_sync(kFullMask, v, 2);
  o[4] = __uint_as_float(__ballot_sync(kFullMask, t & 1));
  o[5] = (float)__any_sync(kFullMask, t == 7);
  o[6] = (float)__all_sync(kFullMask, t < n);
  o[7] = warp_sum(v);
  o[8] = (float)__syncthreads_count(t % 3 == 0);
  o[9] = (float)__syncthreads_or(t == n - 1);
  o[10] = (float)__syncthreads_and(t >= 0);
  atomicAdd(&counter, t + 1);
  __syncthreads();
  o[11] = (float)counter;
}

// 3-D grid and block: out[block linear][thread linear] = (bx + 10 by + 100 bz) * 1000 + tx + 10 ty + 100 tz
extern "C" __global__ void selftest_indexing(float* __restrict__ out) {
  int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  out[(size_t)b * blockDim.x * blockDim.y * blockDim.z + t] =
      (float)((blockIdx.x + 10 * blockIdx.y + 100 * blockIdx.z) * 1000 + threadIdx.x + 10 * threadIdx.y +
              100 * threadIdx.z);
}

// The order blocks start in: the k-th block of the launch to arrive writes its linear index to order[k]
// (*arrivals zero beforehand).
extern "C" __global__ void selftest_arrival(unsigned* __restrict__ arrivals, int* __restrict__ order) {
  if (threadIdx.x == 0)
    order[atomicAdd(arrivals, 1u)] = (int)(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
}

// Dynamic shared memory: reverse n floats within the block.
extern "C" __global__ void selftest_dynamic_smem(const float* __restrict__ in, float* __restrict__ out, int n) {
  DSPARK_DYNAMIC_SMEM(float, buf);
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = in[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = buf[n - 1 - i];
}

// Round-trips f32 through f16 and bf16 with the device conversions: out16 / outb16 bits.
extern "C" __global__ void selftest_convert(const float* __restrict__ in, int n, f16_t* __restrict__ h,
                                            bf16_t* __restrict__ b, float* __restrict__ back) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  h[i] = from_float<f16_t>(in[i]);
  b[i] = from_float<bf16_t>(in[i]);
  back[2 * i] = to_float(h[i]);
  back[2 * i + 1] = to_float(b[i]);
}

// Shared-memory bank conflicts, counted by hand in tests/kernels/test_simt_wavefronts.py against the
// counting build: one warp stores n floats into shared memory (lane l the floats l, l + 32, ..: no
// conflict), then lane l loads the `width`-byte element (a float, float2 or float4) at element index
// l * stride and writes it to out[l] (widths in floats).
template <typename V>
DSPARK_DEVICE void selftest_bank_read(const float* in, float* out, int n, int stride) {
  DSPARK_DYNAMIC_SMEM(float, buf);
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = in[i];
  __syncthreads();
  reinterpret_cast<V*>(out)[threadIdx.x] = reinterpret_cast<const V*>(buf)[threadIdx.x * stride];
}

extern "C" __global__ void selftest_bank_read_b4(const float* __restrict__ in, float* __restrict__ out, int n,
                                                 int stride) {
  selftest_bank_read<float>(in, out, n, stride);
}
extern "C" __global__ void selftest_bank_read_b8(const float* __restrict__ in, float* __restrict__ out, int n,
                                                 int stride) {
  selftest_bank_read<float2>(in, out, n, stride);
}
extern "C" __global__ void selftest_bank_read_b16(const float* __restrict__ in, float* __restrict__ out, int n,
                                                  int stride) {
  selftest_bank_read<float4>(in, out, n, stride);
}

// The same 4-byte read from a static __shared__ array (1024 floats).
extern "C" __global__ void selftest_bank_read_static(const float* __restrict__ in, float* __restrict__ out,
                                                     int stride) {
  __shared__ float buf[1024];
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) buf[i] = in[i];
  __syncthreads();
  out[threadIdx.x] = buf[(threadIdx.x * stride) % 1024];
}

// ldmatrix_x4 over 16-byte rows `row_stride` floats apart (lane l gives row l): per 8x8 matrix one
// phase of its eight rows. out[4 l + i]: lane l's register i, as bits.
extern "C" __global__ void selftest_ldmatrix_rows(const float* __restrict__ in, float* __restrict__ out, int n,
                                                  int row_stride) {
  DSPARK_DYNAMIC_SMEM(float, buf);
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = in[i];
  __syncthreads();
#if DSPARK_TENSOR_CORES
  uint32_t r[4];
  ldmatrix_x4(r, buf + threadIdx.x * row_stride);
  for (int i = 0; i < 4; ++i) out[4 * threadIdx.x + i] = __uint_as_float(r[i]);
#endif
}
