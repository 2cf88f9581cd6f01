// The product (product.h) compiled for AVX-512F: 16-float vectors, tiles of 8 rows x 3 vectors (24
// accumulators of the 32 registers), so a verify's 8 rows take each weight from one load. module.cpp
// picks it at run time where the CPU has AVX-512F. The target holds FMA instructions, but the build's
// -ffp-contract=off keeps a = a + x w two roundings, as in the other builds (the same bits).
#include <cstddef>
#include <cstdint>
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f")
#endif

#define DSPARK_CPU_ISA avx512
#define DSPARK_CPU_AVX512 1
#define DSPARK_LANES 16
#define DSPARK_TILE_ROWS 8
#define DSPARK_TILE_VECS 3
#include "product.h"

namespace dspark_cpu {
void product_avx512(int dtype, const float* x, const void* w, int layout, float* out, ptrdiff_t rows, ptrdiff_t K,
                    ptrdiff_t N, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t strip, ptrdiff_t kblock, float* acc, float* buf) {
  avx512::product_columns(dtype, x, w, layout, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
}
void product_fp8_avx512(const float* x, const uint8_t* q, const float* scale, float* out, ptrdiff_t rows, ptrdiff_t K,
                      ptrdiff_t N, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t strip, ptrdiff_t kblock, float* acc, float* buf) {
  avx512::fp8_columns(x, q, scale, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
}
}  // namespace dspark_cpu

#include "target_pop.h"
