// Shared by every kernel: the portable prelude (nvcc, NVRTC, and the simt host build), storage
// dtypes and their conversions.
//
// Storage dtypes are f32, f16 and bf16; math is always f32. f16/bf16 are plain 16-bit structs
// with our own round-to-nearest-even conversions instead of cuda_fp16.h, so NVRTC needs no
// CUDA headers and the host build converts bit-for-bit as the device does.
#pragma once

#if defined(DSPARK_SIMT)
#include "simt/simt.h"
#elif defined(__CUDACC_RTC__)
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

// Dynamic shared memory as `T* name`. The host build has no `extern __shared__`.
#if defined(DSPARK_SIMT)
#define DSPARK_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(::simt::dynamic_smem())
#else
#define DSPARK_DYNAMIC_SMEM(T, name)                      \
  extern __shared__ __align__(16) unsigned char name##_raw_[]; \
  T* name = reinterpret_cast<T*>(name##_raw_)
#endif

#define DSPARK_DEVICE static __device__ __forceinline__

struct f16_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};

// A load served by L2, past this SM's L1: data that another CTA of the launch wrote before a
// ticket (L1 is not coherent between SMs). The host build has one memory.
DSPARK_DEVICE float load_l2(const float* p) {
#if defined(DSPARK_SIMT)
  return *p;
#else
  return __ldcg(p);
#endif
}
// v, with its arithmetic hidden from the optimizer: an empty asm that may change it. For a value
// computed once before a loop that ptxas would otherwise re-derive inside it (linear_mma's column
// tiles). The host build returns v.
DSPARK_DEVICE int opaque_int(int v) {
#if !defined(DSPARK_SIMT)
  asm volatile("" : "+r"(v));
#endif
  return v;
}
DSPARK_DEVICE float dspark_inf() { return __int_as_float(0x7f800000); }
DSPARK_DEVICE bool dspark_isnan(float x) { return x != x; }

DSPARK_DEVICE float to_float(float x) { return x; }
DSPARK_DEVICE float to_float(bf16_t x) { return __uint_as_float((uint32_t)x.bits << 16); }
DSPARK_DEVICE float to_float(f16_t x) {
  uint32_t h = x.bits;
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return __uint_as_float(sign);
    // subnormal: value = man * 2^-24, exact in f32
    float v = (float)man * __uint_as_float(0x33800000u);
    return sign ? -v : v;
  }
  return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

template <typename T>
DSPARK_DEVICE T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  uint32_t u = __float_as_uint(x);
  bf16_t r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = (uint16_t)((u >> 16) | 0x40u);  // quiet NaN, sign kept
    return r;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  r.bits = (uint16_t)(u >> 16);
  return r;
}
template <>
__device__ __forceinline__ f16_t from_float<f16_t>(float x) {
  uint32_t u = __float_as_uint(x);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  f16_t r;
  if (a > 0x7f800000u) { r.bits = (uint16_t)(sign | 0x7e00u); return r; }  // NaN
  if (a >= 0x477ff000u) { r.bits = (uint16_t)(sign | 0x7c00u); return r; }  // rounds to inf
  if (a < 0x38800000u) {
    // f16 subnormal or zero: round a * 2^24 to an integer, ties to even.
    if (a < 0x33000000u) { r.bits = (uint16_t)sign; return r; }  // below half the smallest subnormal
    uint32_t e = a >> 23;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;  // value = m * 2^(e-150), subnormal unit 2^-24
    uint32_t q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    r.bits = (uint16_t)(sign | q);
    return r;
  }
  // normal: rebias exponent, round the 13 dropped mantissa bits to nearest even
  uint32_t v = a - 0x38000000u;
  v += 0xfffu + ((v >> 13) & 1u);
  r.bits = (uint16_t)(sign | (v >> 13));
  return r;
}
