// The product (product.h) compiled for AVX2 + F16C: 8-float vectors, tiles of 4 rows x 3 vectors
// (12 accumulators of the 16 registers). module.cpp picks it at run time where the CPU has both.
// No FMA in the target: a multiply and an add stay two roundings, as in the baseline build.
#include <cstddef>
#include <cstdint>
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#ifndef __F16C__
#define __F16C__ 1  // Clang's attribute leaves the macro undefined; the intrinsic is usable under it
#endif
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#endif

#define DSPARK_CPU_ISA avx2
#define DSPARK_CPU_AVX2 1
#define DSPARK_LANES 8
#define DSPARK_TILE_ROWS 4
#define DSPARK_TILE_VECS 3
#include "product.h"

namespace dspark_cpu {
void product_avx2(int dtype, const float* x, const void* w, int layout, float* out, ptrdiff_t rows, ptrdiff_t K, ptrdiff_t N,
                  ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t strip, ptrdiff_t kblock, float* acc, float* buf) {
  avx2::product_columns(dtype, x, w, layout, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
}
void product_fp8_avx2(const float* x, const uint8_t* q, const float* scale, float* out, ptrdiff_t rows, ptrdiff_t K,
                      ptrdiff_t N, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t strip, ptrdiff_t kblock, float* acc, float* buf) {
  avx2::fp8_columns(x, q, scale, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
}
}  // namespace dspark_cpu

#include "target_pop.h"
