// tensor_core: sm_80's asynchronous copies and warp-level MMA, one spelling for every executor.
//
//   cp_async16(dst, src, valid)  cp.async.cg.shared.global, 16 bytes; zero-filled (src unread)
//                                when !valid
//   cp_async4(dst, src)          cp.async.ca.shared.global, 4 bytes
//   cp_async_f32x4(dst, src, valid)  4 floats: one 16-byte copy where src is 16-byte aligned, four
//                                of 4 bytes where it is not; zeros when !valid (src unread)
//   cp_async_commit()            cp.async.commit_group
//   cp_async_wait<N>()           cp.async.wait_group N: all but the newest N groups have landed
//                                (this thread's copies only: a __syncthreads must follow before
//                                other threads read them)
//   ldmatrix_x4 / _x4_trans / _x2_trans   ldmatrix.sync.aligned.m8n8.x{4,2}[.trans].shared.b16
//   mma_16816<T>(d, a, b)        mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32, d = a b + d
//
// Fragment layouts and the simt emulation (and how far it is from the hardware's arithmetic) are
// documented in simt/tensor_core.h. On the device these are inline PTX; under DSPARK_SIMT they call
// the runtime's emulation. DSPARK_TENSOR_CORES is 1 where they exist (sm_80+ and simt); kernels
// keep a CUDA-core path for the rest.
#pragma once
#include "common.cuh"

#if defined(DSPARK_SIMT) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define DSPARK_TENSOR_CORES 1
#else
#define DSPARK_TENSOR_CORES 0
#endif

#if !defined(DSPARK_SIMT) && DSPARK_TENSOR_CORES
DSPARK_DEVICE uint32_t smem_address(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
#endif

DSPARK_DEVICE void cp_async16(void* dst, const void* src, bool valid) {
#if defined(DSPARK_SIMT)
  simt::cp_async(dst, src, 16, valid ? 16 : 0);
#elif DSPARK_TENSOR_CORES
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
#else
  *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#endif
}

DSPARK_DEVICE void cp_async4(void* dst, const void* src) {
#if defined(DSPARK_SIMT)
  simt::cp_async(dst, src, 4, 4);
#elif DSPARK_TENSOR_CORES
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_address(dst)), "l"(src) : "memory");
#else
  *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
#endif
}

DSPARK_DEVICE void cp_async_f32x4(float* dst, const float* src, bool valid) {
  if (!valid || (reinterpret_cast<unsigned long long>(src) & 15ull) == 0) {
    cp_async16(dst, src, valid);
  } else {
#pragma unroll
    for (int u = 0; u < 4; ++u) cp_async4(dst + u, src + u);
  }
}

DSPARK_DEVICE void cp_async_commit() {
#if defined(DSPARK_SIMT)
  simt::cp_async_commit();
#elif DSPARK_TENSOR_CORES
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
DSPARK_DEVICE void cp_async_wait() {
#if defined(DSPARK_SIMT)
  simt::cp_async_wait(N);
#elif DSPARK_TENSOR_CORES
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Without tensor cores (the host pass of nvcc, pre-sm_80 devices) the matrix ops are declared but
// empty: kernels take their CUDA-core path there and never call them.
DSPARK_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(DSPARK_SIMT)
  simt::ldmatrix<4, false>(r, row);
#elif DSPARK_TENSOR_CORES
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row))
               : "memory");
#endif
}

DSPARK_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if defined(DSPARK_SIMT)
  simt::ldmatrix<4, true>(r, row);
#elif DSPARK_TENSOR_CORES
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row))
               : "memory");
#endif
}

DSPARK_DEVICE void ldmatrix_x2_trans(uint32_t (&r)[2], const void* row) {
#if defined(DSPARK_SIMT)
  simt::ldmatrix<2, true>(r, row);
#elif DSPARK_TENSOR_CORES
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_address(row))
               : "memory");
#endif
}

template <typename T>
DSPARK_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<bf16_t>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(DSPARK_SIMT)
  const uint32_t b[2] = {b0, b1};
  simt::mma_m16n8k16<true>(d, a, b, d);
#elif DSPARK_TENSOR_CORES
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

template <>
__device__ __forceinline__ void mma_16816<f16_t>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(DSPARK_SIMT)
  const uint32_t b[2] = {b0, b1};
  simt::mma_m16n8k16<false>(d, a, b, d);
#elif DSPARK_TENSOR_CORES
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
