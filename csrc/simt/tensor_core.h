// simt: sm_80's warp-level matrix instructions, for csrc/tensor_core.cuh.
//
//   ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16
//     Lane 8 i + r (i < count) gives the address of row r of matrix i: eight 16-bit elements,
//     16 bytes, 16-byte aligned, in shared memory. Lane l receives in register i the word holding
//     elements (l / 4, 2 (l % 4)) [low half] and (l / 4, 2 (l % 4) + 1) [high half] of matrix i;
//     with .trans, elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
//   mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32   D = A B + C
//     A 16x16, B 16x8, C and D 16x8 f32. With g = l / 4 and t = l % 4, lane l holds
//       a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]  a[2] = A[g][2t+8, 2t+9]  a[3] = A[g+8][2t+8, 2t+9]
//       b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//       c[i] = C[g + 8 (i / 2)][2t + i % 2]   (and d likewise)
//     (the PTX ISA's "Matrix Fragments for mma.m16n8k16"; lower index in the low half).
//
// The emulated MMA's arithmetic, the order the kernels' tolerances refer to: every product
// A[r][k] B[k][c] is exact (16-bit floats have at most 11 significant bits, so the product fits a
// double exactly); d = C[r][c], then + product k for k = 0..15 in increasing k, each sum in double;
// the result is rounded once to f32, to nearest even. With S = |C| + sum_k |A[r][k] B[k][c]|, the
// emulation is within 2^-24 S of the exact value (the double sums add 17 * 2^-53 S at most).
// The hardware also forms exact products but adds them in a fixed-point sum aligned to the largest
// term and truncated, not rounded per add (Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior of
// NVIDIA tensor cores", 2021, measured Volta to Ampere; at least 23 fraction bits survive), so it is
// within 17 * 2^-23 S of the exact value, and the two differ by at most 18 * 2^-23 S (about
// 2.2e-6 S) per instruction. In attention that is below 1e-5 of the output, far inside the bf16 /
// f16 test tolerance (1e-2); the layout probe (tests/kernels/test_attention.py) asserts this bound.
// Row invariance never depends on it: it compares a kernel with itself on one executor.
#pragma once

namespace simt {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) bits = sign | 0x7f800000u | (man << 13);
  else if (exp) bits = sign | ((exp + 112u) << 23) | (man << 13);
  else {
    const float v = (float)man * 5.9604644775390625e-8f;  // man * 2^-24, exact
    return sign ? -v : v;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void check_shared_rows(const char* op, const void* const* rows, int count);

// Element (r, c) of matrix i of an ldmatrix: a function, not a lambda, so that it is not instrumented either.
SIMT_NOT_INSTRUMENTED inline uint32_t ldmatrix_element(const void* const* in, int i, int r, int c) {
  const unsigned char* row = *static_cast<const unsigned char* const*>(in[8 * i + r]);
  uint16_t v;
  std::memcpy(&v, row + 2 * c, 2);
  return (uint32_t)v;
}

template <int N, bool kTrans>
SIMT_NOT_INSTRUMENTED inline void ldmatrix_lanes(const void* const* in, void* const* out) {
  check_shared_rows(kTrans ? "ldmatrix.trans" : "ldmatrix", in, 8 * N);
  count_ldmatrix(in, N);
  auto elem = [&](int i, int r, int c) { return ldmatrix_element(in, i, r, c); };
  for (int l = 0; l < kWarpSize; ++l) {
    uint32_t* reg = static_cast<uint32_t*>(out[l]);
    const int a = l / 4, b = 2 * (l % 4);
    for (int i = 0; i < N; ++i)
      reg[i] = kTrans ? elem(i, b, a) | elem(i, b + 1, a) << 16 : elem(i, a, b) | elem(i, a, b + 1) << 16;
  }
}

// `row` is this lane's row address; `reg` receives N words.
template <int N, bool kTrans>
inline void ldmatrix(uint32_t* reg, const void* row) {
  warp_collective(kTrans ? "ldmatrix.trans" : "ldmatrix", &row, reg, &ldmatrix_lanes<N, kTrans>);
}

struct MmaOperands {
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
};

template <bool kBf16>
SIMT_NOT_INSTRUMENTED inline void mma_m16n8k16_lanes(const void* const* in, void* const* out) {
  count_mma();
  float A[16][16], B[16][8], C[16][8];
  auto lo = [](uint32_t w) { return kBf16 ? bf16_to_float((uint16_t)w) : half_to_float((uint16_t)w); };
  auto hi = [](uint32_t w) { return kBf16 ? bf16_to_float((uint16_t)(w >> 16)) : half_to_float((uint16_t)(w >> 16)); };
  for (int l = 0; l < kWarpSize; ++l) {
    const MmaOperands& o = *static_cast<const MmaOperands*>(in[l]);
    const int g = l / 4, t = 2 * (l % 4);
    for (int j = 0; j < 4; ++j) {
      const int r = g + 8 * (j & 1), c = t + 8 * (j >> 1);
      A[r][c] = lo(o.a[j]);
      A[r][c + 1] = hi(o.a[j]);
    }
    for (int j = 0; j < 2; ++j) {
      B[t + 8 * j][g] = lo(o.b[j]);
      B[t + 8 * j + 1][g] = hi(o.b[j]);
    }
    for (int i = 0; i < 4; ++i) C[g + 8 * (i / 2)][t + i % 2] = o.c[i];
  }
  for (int l = 0; l < kWarpSize; ++l) {
    float* d = static_cast<float*>(out[l]);
    const int g = l / 4, t = 2 * (l % 4);
    for (int i = 0; i < 4; ++i) {
      const int r = g + 8 * (i / 2), c = t + i % 2;
      double s = C[r][c];
      for (int k = 0; k < 16; ++k) s += (double)A[r][k] * (double)B[k][c];
      d[i] = (float)s;
    }
  }
}

// d = a b + c for this lane's fragments (d may alias c).
template <bool kBf16>
inline void mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
  MmaOperands o;
  for (int i = 0; i < 4; ++i) o.a[i] = a[i], o.c[i] = c[i];
  o.b[0] = b[0];
  o.b[1] = b[1];
  float r[4];
  warp_collective(kBf16 ? "mma.sync.bf16" : "mma.sync.f16", &o, r, &mma_m16n8k16_lanes<kBf16>);
  for (int i = 0; i < 4; ++i) d[i] = r[i];
}

}  // namespace simt
