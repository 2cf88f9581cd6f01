// NumPy's float32 sum over a contiguous axis (pairwise summation, numpy/_core/src/umath/
// loops_utils.h.src, `pairwise_sum`): the numpy backend's references reduce with it, so their
// native paths do too, term for term.
//
//   n < 8:      0 + a[0] + a[1] + ...                          (in order)
//   n <= 128:   eight running sums r[j] = a[j] + a[j + 8] + a[j + 16] + ...,
//               ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the n % 8 last terms in order
//   n > 128:    the sum of the first n2 = n / 2 - (n / 2) % 8 terms plus the sum of the rest
#pragma once

#include <cstddef>

namespace dspark_cpu {

// The eight running sums as two 4-float vectors (lo: r0..r3, hi: r4..r7), which every x86-64 holds
// in registers: r = a[0:8], r = r + a[8:16], ...
typedef float f4 __attribute__((vector_size(16)));

struct f8 {
  f4 lo, hi;
};

inline f8 load8(const float* p) {
  f8 v;
  __builtin_memcpy(&v.lo, p, sizeof v.lo);
  __builtin_memcpy(&v.hi, p + 4, sizeof v.hi);
  return v;
}

inline void store8(float* p, f8 v) {
  __builtin_memcpy(p, &v.lo, sizeof v.lo);
  __builtin_memcpy(p + 4, &v.hi, sizeof v.hi);
}

inline f8 splat8(float s) { return f8{f4{s, s, s, s}, f4{s, s, s, s}}; }
inline f8 operator+(f8 a, f8 b) { return f8{a.lo + b.lo, a.hi + b.hi}; }
inline f8 operator*(f8 a, f8 b) { return f8{a.lo * b.lo, a.hi * b.hi}; }

inline float tree8(f8 r) {
  return ((r.lo[0] + r.lo[1]) + (r.lo[2] + r.lo[3])) + ((r.hi[0] + r.hi[1]) + (r.hi[2] + r.hi[3]));
}

inline float pairwise_sum(const float* a, ptrdiff_t n) {
  if (n < 8) {
    float res = 0.0f;
    for (ptrdiff_t i = 0; i < n; ++i) res = res + a[i];
    return res;
  }
  if (n <= 128) {
    f8 r = load8(a);
    ptrdiff_t i = 8;
    for (; i < n - (n % 8); i += 8) r = r + load8(a + i);
    float res = tree8(r);
    for (; i < n; ++i) res = res + a[i];
    return res;
  }
  ptrdiff_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

}  // namespace dspark_cpu
