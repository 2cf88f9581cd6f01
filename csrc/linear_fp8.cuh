// linear_fp8.cuh: the FP8 weights' B-tile loader of the tensor-core GEMM (linear_mma.cuh), shared by
// the dense product (linear_fp8.cu) and the grouped expert product (moe.cu), so that both dequantize
// with one arithmetic: W[k, n] = round_T(fl32(e4m3(q[k, n]) * scale[k / 128][n / 128])), the bytes
// decoded in registers on their way to shared memory (linear_fp8.cu's header states the tiling).
#pragma once
#include "common.cuh"
#include "fp8.cuh"
#include "linear_mma.cuh"

// An e4m3 byte (not a NaN pattern: the loader refuses them) to f32 in a few instructions: its sign and
// 7 magnitude bits placed at an f32's bits 31 and 26..20 are e4m3 * 2^-120 exactly, its subnormals
// (m 2^-9) included as f32 subnormals (-ftz=false), and the multiply by 2^120 is exact: fp8.cuh's
// e4m3_to_float for every other byte, without its branches.
DSPARK_DEVICE float e4m3_exact(uint32_t b) {
  return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * __uint_as_float(0x7b800000u);  // 2^120
}

// Round to nearest even of a finite or infinite f32 pair (never NaN here: finite e4m3 times a finite
// scale): T's rounding without from_float's NaN test. On the device one cvt.rn.<T>x2.f32 for the
// pair (no .ftz: subnormals kept; the same rounding for every finite and infinite f32), where the
// integer rounding takes about nine; under simt, or where DSPARK_FP8_PACK_IN_INTEGERS is defined
// (moe.cu), that integer rounding: the same bits.
template <typename T>
DSPARK_DEVICE uint32_t pack2_finite(float lo, float hi) {
  return mma_pack2<T>(lo, hi);
}
template <>
__device__ __forceinline__ uint32_t pack2_finite<bf16_t>(float lo, float hi) {
#if defined(DSPARK_SIMT) || defined(DSPARK_FP8_PACK_IN_INTEGERS)
  const uint32_t a = __float_as_uint(lo), b = __float_as_uint(hi);
  return ((a + 0x7fffu + ((a >> 16) & 1u)) >> 16) | ((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u);
#else
  uint32_t out;  // the first source is the upper half
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
#endif
}
#if !defined(DSPARK_SIMT) && !defined(DSPARK_FP8_PACK_IN_INTEGERS)
template <>
__device__ __forceinline__ uint32_t pack2_finite<f16_t>(float lo, float hi) {
  uint32_t out;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}
#endif

// Two e4m3 bytes of `word` (at bit `shift` and shift + 8) dequantized, fl32(e4m3 * s), and rounded
// into one T pair.
template <typename T>
DSPARK_DEVICE uint32_t fp8_pair(uint32_t word, int shift, float s) {
  return pack2_finite<T>(e4m3_exact(word >> shift) * s, e4m3_exact(word >> (shift + 8)) * s);
}

template <typename T, typename Cfg>
struct MmaWeightsFp8 {
  using C = Cfg;
  // A thread's chunks of a tile share one column (THREADS is a multiple of a row's chunks) and the
  // tile's BK rows lie in one 128-row block (BK divides 128): one scale per thread per tile.
  static_assert(C::THREADS % (C::BN / 8) == 0 && kFp8Block % C::BK == 0, "one scale per thread and tile");
  const uint8_t* __restrict__ q;
  const float* __restrict__ scale;
  int K, N;
  bool vec;  // 8-byte loads of q
  struct Held {
    uint2 raw[C::B_VECS];
    float s;
  };

  __device__ __forceinline__ void fetch(T*, int k, int n0, Held& h) const {
    const int blocks_n = (N + kFp8Block - 1) / kFp8Block;
    const int col = 8 * (threadIdx.x % (C::BN / 8)), n = n0 + col;
    h.s = n < N ? scale[(int64_t)(k / kFp8Block) * blocks_n + n / kFp8Block] : 0.f;
#pragma unroll
    for (int i = 0; i < C::B_VECS; ++i) {
      const int kk = k + (threadIdx.x + i * C::THREADS) / (C::BN / 8);
      h.raw[i] = make_uint2(0u, 0u);
      if (kk < K && n < N) {
        const uint8_t* p = q + (int64_t)kk * N + n;
        if (vec) {
          h.raw[i] = *reinterpret_cast<const uint2*>(p);
        } else {
          uint32_t lo = 0u, hi = 0u;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (n + j < N) lo |= (uint32_t)p[j] << (8 * j);
            if (n + 4 + j < N) hi |= (uint32_t)p[4 + j] << (8 * j);
          }
          h.raw[i] = make_uint2(lo, hi);
        }
      }
    }
  }

  __device__ __forceinline__ void place(T* stage, const Held& h) const {
    const int col = 8 * (threadIdx.x % (C::BN / 8));
#pragma unroll
    for (int i = 0; i < C::B_VECS; ++i) {
      const int kr = (threadIdx.x + i * C::THREADS) / (C::BN / 8);
      const uint2 r = h.raw[i];
      *reinterpret_cast<uint4*>(stage + kr * C::B_ROW + col) =
          make_uint4(fp8_pair<T>(r.x, 0, h.s), fp8_pair<T>(r.x, 16, h.s), fp8_pair<T>(r.y, 0, h.s),
                     fp8_pair<T>(r.y, 16, h.s));
    }
  }
};
