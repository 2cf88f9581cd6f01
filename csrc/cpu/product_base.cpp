// The product (product.h) for any CPU: 4-float vectors (SSE2 on x86-64), tiles of 4 rows x 3
// vectors. The same bits as the AVX2 build.
#include <cstddef>

#define DSPARK_CPU_ISA base
#include "product.h"

namespace dspark_cpu {
void product_base(int dtype, const float* x, const void* w, int layout, float* out, ptrdiff_t rows, ptrdiff_t K, ptrdiff_t N,
                  ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t strip, ptrdiff_t kblock, float* acc, float* buf) {
  base::product_columns(dtype, x, w, layout, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
}
void product_fp8_base(const float* x, const uint8_t* q, const float* scale, float* out, ptrdiff_t rows, ptrdiff_t K,
                      ptrdiff_t N, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t strip, ptrdiff_t kblock, float* acc, float* buf) {
  base::fp8_columns(x, q, scale, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
}
}  // namespace dspark_cpu
