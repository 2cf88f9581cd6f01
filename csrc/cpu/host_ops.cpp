// The numpy backend's native paths for the ops whose NumPy references cost most per step after the
// product: the gated delta rule's walk over the columns (dspark.ops.gdn), RMSNorm (dspark.ops.norm)
// and attention's two products per key tile (dspark.ops.attention). Each does exactly its reference's arithmetic, operation for operation (f32,
// no contracted multiply-add, NumPy's pairwise sums: pairwise.h), so the two give the same bits
// and dspark.ops.host checks them against each other in the tests.
#include <cmath>
#include <cstddef>
#include <cstring>
#include <vector>

#include "pairwise.h"

namespace dspark_cpu {

// gdn.delta_rule_ref, one column of one value head: S [dv, dk] in place, o [dv].
//   S = S * alpha;  u = sum_j S[i, j] k[j];  delta = beta (v - u);  S = S + delta k^T;  o = sum_j S[i, j] q[j]
// dk is a multiple of 8 up to 128 (gdn.SUPPORTED_DK), so each row's pairwise sums are one vector
// of eight running sums and the tree. Rows go kRows at a time: independent chains of adds.
constexpr int kRows = 4;

template <int R>
static void delta_rows(const float* from, float* S, const float* q, const float* k, const float* v, f8 a8,
                       float beta, int dk, float* o) {
  f8 r[R] = {};
  for (int j = 0; j < dk; j += 8) {
    const f8 kj = load8(k + j);
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
      const f8 s = load8(from + i * dk + j) * a8;
      store8(S + i * dk + j, s);
      r[i] = j ? r[i] + s * kj : s * kj;
    }
  }
  f8 d8[R];
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) d8[i] = splat8(beta * (v[i] - tree8(r[i])));
  for (int j = 0; j < dk; j += 8) {
    const f8 kj = load8(k + j), qj = load8(q + j);
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
      const f8 s = load8(S + i * dk + j) + d8[i] * kj;
      store8(S + i * dk + j, s);
      r[i] = j ? r[i] + s * qj : s * qj;
    }
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) o[i] = tree8(r[i]);
}

// The state moves from `from` to S (the same array, or the column's checkpoint).
static void delta_step(const float* from, float* S, const float* q, const float* k, const float* v, float alpha,
                       float beta, int dv, int dk, float* o) {
  const f8 a8 = splat8(alpha);
  int i = 0;
  for (; i + kRows <= dv; i += kRows)
    delta_rows<kRows>(from + ptrdiff_t(i) * dk, S + ptrdiff_t(i) * dk, q, k, v + i, a8, beta, dk, o + i);
  for (; i < dv; ++i) delta_rows<1>(from + ptrdiff_t(i) * dk, S + ptrdiff_t(i) * dk, q, k, v + i, a8, beta, dk, o + i);
}

// gdn.gdn_scan_ref's walk: session b's columns indptr[b] .. indptr[b + 1] in order from its state
// S[b] [H, dv, dk] (updated in place); q, k [cols, H, dk], v [cols, H, dv], alpha, beta [cols, H]
// -> out [cols, H, dv], and ckpt [cols, H, dv, dk] (the state after each column) when not null.
// Only the (session, head) pairs p0 .. p1 - 1 (p = b H + h): each pair's walk touches its own state,
// outputs and checkpoints alone, so module.cpp splits the pairs across threads with the same bits.
void delta_columns(float* S, const float* q, const float* k, const float* v, const float* alpha, const float* beta,
                   const int* indptr, int heads, int dv, int dk, float* out, float* ckpt, int p0, int p1) {
  const ptrdiff_t state = ptrdiff_t(dv) * dk;
  for (int p = p0; p < p1; ++p) {
    const int b = p / heads, h = p % heads;
    float* live = S + (ptrdiff_t(b) * heads + h) * state;
    const float* from = live;
    for (int c = indptr[b]; c < indptr[b + 1]; ++c) {  // with checkpoints, each column's state lands there
      const ptrdiff_t ch = ptrdiff_t(c) * heads + h;
      float* to = ckpt ? ckpt + ch * state : live;
      delta_step(from, to, q + ch * dk, k + ch * dk, v + ch * dv, alpha[ch], beta[ch], dv, dk, out + ch * dv);
      from = to;
    }
    if (from != live) std::memcpy(live, from, sizeof(float) * state);
  }
}

// norm.rmsnorm_numpy over rows of n: y = (x / sqrt(mean(x * x) + eps)) * weight.
void rmsnorm(const float* x, const float* weight, float eps, ptrdiff_t rows, ptrdiff_t n, float* y) {
  std::vector<float> sq(n);
  for (ptrdiff_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    for (ptrdiff_t j = 0; j < n; ++j) sq[j] = xr[j] * xr[j];
    const float ms = pairwise_sum(sq.data(), n) / float(n);
    const float root = std::sqrt(ms + eps);
    for (ptrdiff_t j = 0; j < n; ++j) y[r * n + j] = (xr[j] / root) * weight[j];
  }
}

static inline f4 load4(const float* p) {
  f4 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

static inline void store4(float* p, f4 v) { __builtin_memcpy(p, &v, sizeof v); }

// x[i] = x[i] + x[i + h] for h = len / 2, len / 4, ..., 1 (len a power of two): attention's
// _halving_sum, leaving the sum in x[0]; four lanes at a time while the halves are that long.
static inline void halve(float* x, int len) {
  int h = len / 2;
  for (; h >= 4; h /= 2)
    for (int i = 0; i < h; i += 4) store4(x + i, load4(x + i) + load4(x + i + h));
  for (; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) x[i] = x[i] + x[i + h];
}

// attention._attend's scores before the scale: s [n, hkv, g, L] = the halving sum over D of
// q [n, hkv, g, D] * k [hkv, L, D] (D a power of two, at least 4).
void attention_scores(const float* q, const float* k, int n, int hkv, int g, int L, int D, float* s) {
  std::vector<float> buf(D);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < hkv; ++h)
      for (int j = 0; j < g; ++j) {
        const ptrdiff_t row = (ptrdiff_t(i) * hkv + h) * g + j;
        const float* qr = q + row * D;
        for (int t = 0; t < L; ++t) {
          const float* kr = k + (ptrdiff_t(h) * L + t) * D;
          for (int d = 0; d < D / 2; d += 4)  // the first halving with the products
            store4(buf.data() + d, load4(qr + d) * load4(kr + d) + load4(qr + d + D / 2) * load4(kr + d + D / 2));
          halve(buf.data(), D / 2);
          s[row * L + t] = buf[0];
        }
      }
}

// attention._attend's p.v: o [n, hkv, g, D] = the halving sum over L of p [n, hkv, g, L] *
// v [hkv, L, D] (L a power of two), D columns (a multiple of 4) at once.
void attention_weighted(const float* p, const float* v, int n, int hkv, int g, int L, int D, float* o) {
  std::vector<float> buf(ptrdiff_t(L / 2) * D);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < hkv; ++h)
      for (int j = 0; j < g; ++j) {
        const ptrdiff_t row = (ptrdiff_t(i) * hkv + h) * g + j;
        const float* pr = p + row * L;
        const float* vh = v + ptrdiff_t(h) * L * D;
        for (int t = 0; t < L / 2; ++t) {  // the first halving with the products
          const f4 a = f4{pr[t], pr[t], pr[t], pr[t]}, b = f4{pr[t + L / 2], pr[t + L / 2], pr[t + L / 2], pr[t + L / 2]};
          const float* va = vh + ptrdiff_t(t) * D;
          const float* vb = vh + ptrdiff_t(t + L / 2) * D;
          float* out = buf.data() + ptrdiff_t(t) * D;
          for (int d = 0; d < D; d += 4) store4(out + d, a * load4(va + d) + b * load4(vb + d));
        }
        for (int half = L / 4; half >= 1; half /= 2)
          for (int t = 0; t < half; ++t) {
            float* a = buf.data() + ptrdiff_t(t) * D;
            const float* b = buf.data() + ptrdiff_t(t + half) * D;
            for (int d = 0; d < D; d += 4) store4(a + d, load4(a + d) + load4(b + d));
          }
        std::memcpy(o + row * D, buf.data(), sizeof(float) * D);
      }
}

}  // namespace dspark_cpu
