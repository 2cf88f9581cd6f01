// Philox4x32-10 (Salmon et al., SC'11; Random123), dspark's stream layout for its draws, and the
// float transforms of the output words: uniforms, Gumbel noise, and a float32 log and exp that
// are bit-exact across nvcc/NVRTC, the simt host build and their NumPy twins in dspark/philox.py.
//
// Stream layout. A draw is a pure function of (session seed, tag, counter, slot, index):
//   key     = (seed lo, seed hi)
//   counter = (n lo, n hi, tag << 24 | slot, index >> 2),  output word = index & 3
// n is the absolute position of the token drawn (kTagPick) or the session's 64-bit round counter
// (the rejection sampler's tags, continued across bursts), tag names the purpose (PhiloxTag), slot
// the position inside the round (draft slot, accept test), index the vocabulary entry for
// per-token noise (0 for a scalar draw). Philox is a bijection of the counter for a fixed key, so
// distinct (tag, n, slot, index >> 2) never share a block. Rejection sampling never reuses a word;
// the coupled sampler reuses a position's noise on purpose (the drafter's proposal and the
// target's pick there share it, and a position drafted again next round sees it again), which is
// what makes its stream plain decode's. Nothing depends on where a row sits in a batch.
//
// Why our own log and exp: the host's logf/expf and NumPy's can differ in the last bit, and the
// device ones differ again. These are fixed sequences of IEEE float32 operations (musl/FreeBSD
// logf, Cephes expf), written with __fmul_rn/__fadd_rn/__fdiv_rn so nvcc cannot contract them
// into FMAs (the simt build uses -ffp-contract=off), and NumPy replays the same sequence.
// Both stay within 1 ulp of the true result on the ranges used here.
#pragma once
#include "common.cuh"

// ---- Philox4x32-10 ----------------------------------------------------------------------------
struct Philox4 {
  uint32_t x, y, z, w;
};

DSPARK_DEVICE Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;  // round multipliers
  const uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;  // Weyl key bumps
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += W0;
      k1 += W1;
    }
    const uint32_t hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
    const uint32_t hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
    c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
  }
  return c;
}

DSPARK_DEVICE uint32_t philox_word(const Philox4& b, int i) {
  return i == 0 ? b.x : i == 1 ? b.y : i == 2 ? b.z : b.w;
}

// ---- streams ----------------------------------------------------------------------------------
// Purposes of a draw; mirrored by dspark.philox.Tag. 0 is unused so a forgotten tag shows.
enum PhiloxTag : uint32_t {
  kTagPick = 1,      // the Gumbel-max pick of the token at absolute position n: plain sampled
                     // decode, every first anchor, the coupled drafter and verify (slot 0)
  kTagDraft = 2,     // rejection sampling: drafter slots (slot = draft slot)
  kTagAccept = 3,    // rejection sampling: the accept test of draft j (slot = j)
  kTagResidual = 4,  // rejection sampling: the residual draw after a reject
  kTagBonus = 5,     // rejection sampling: the bonus draw after a full accept
};
constexpr uint32_t kPhiloxSlotBits = 24;

// The Philox block holding words index & ~3 .. index | 3 of the draw (seed, n, stream, index),
// where stream = tag << 24 | slot.
DSPARK_DEVICE Philox4 philox_draw_block(uint64_t seed, uint64_t n, uint32_t stream, uint32_t index) {
  Philox4 c{(uint32_t)n, (uint32_t)(n >> 32), stream, index >> 2};
  return philox4x32_10(c, (uint32_t)seed, (uint32_t)(seed >> 32));
}

// ---- IEEE float32 steps that the compiler must keep as written --------------------------------
#if defined(DSPARK_SIMT)
DSPARK_DEVICE float philox_fdiv(float a, float b) { return a / b; }  // -ffp-contract=off, SSE
DSPARK_DEVICE double philox_dmul(double a, double b) { return a * b; }
#else
DSPARK_DEVICE float philox_fdiv(float a, float b) { return __fdiv_rn(a, b); }
DSPARK_DEVICE double philox_dmul(double a, double b) { return __dmul_rn(a, b); }
#endif

// ---- uniforms: exact integer forms ------------------------------------------------------------
// [0, 1): the top 24 bits times 2^-24. Used by the accept test u * q < p (u = 0 is harmless).
DSPARK_DEVICE float philox_uniform(uint32_t x) { return (float)(x >> 8) * __uint_as_float(0x33800000u); }

// (0, 1) open: the midpoints ((x >> 9) + 1/2) * 2^-23 = (2 (x >> 9) + 1) * 2^-24, exact in f32.
// Gumbel noise needs both log(u) != -inf (u > 0) and -log(u) > 0 (u < 1): the [0, 1) form would
// give log(0), the (0, 1] form ((x >> 8) + 1) * 2^-24 would give -log(1) = 0 and an infinite
// Gumbel once in 2^24 words, i.e. in ~1% of 151936-way draws. The open form costs one bit.
DSPARK_DEVICE float philox_uniform_open(uint32_t x) {
  return (float)(((x >> 9) << 1) | 1u) * __uint_as_float(0x33800000u);
}

// ---- bit-exact log and exp --------------------------------------------------------------------
// log(x) for positive normal x (musl/FreeBSD logf): x = 2^k (1 + f) with 1 + f in
// [sqrt(2)/2, sqrt(2)), s = f / (2 + f), log(1 + f) = f - f^2/2 + s (f^2/2 + R(s^2)).
DSPARK_DEVICE float philox_log(float x) {
  const float ln2_hi = __uint_as_float(0x3f317180u), ln2_lo = __uint_as_float(0x3717f7d1u);
  const float Lg1 = __uint_as_float(0x3f2aaaaau), Lg2 = __uint_as_float(0x3eccce13u);
  const float Lg3 = __uint_as_float(0x3e91e9eeu), Lg4 = __uint_as_float(0x3e789e26u);
  uint32_t ix = __float_as_uint(x) + (0x3f800000u - 0x3f3504f3u);
  const int k = (int)(ix >> 23) - 0x7f;
  ix = (ix & 0x007fffffu) + 0x3f3504f3u;
  const float f = __fadd_rn(__uint_as_float(ix), -1.0f);  // exact (Sterbenz)
  const float s = philox_fdiv(f, __fadd_rn(2.0f, f));
  const float z = __fmul_rn(s, s), w = __fmul_rn(z, z);
  const float t1 = __fmul_rn(w, __fadd_rn(Lg2, __fmul_rn(w, Lg4)));
  const float t2 = __fmul_rn(z, __fadd_rn(Lg1, __fmul_rn(w, Lg3)));
  const float R = __fadd_rn(t2, t1);
  const float hfsq = __fmul_rn(__fmul_rn(0.5f, f), f);
  const float dk = (float)k;
  // s (hfsq + R) + dk ln2_lo - hfsq + f + dk ln2_hi, left to right
  float r = __fadd_rn(__fmul_rn(s, __fadd_rn(hfsq, R)), __fmul_rn(dk, ln2_lo));
  r = __fadd_rn(__fadd_rn(r, -hfsq), f);
  return __fadd_rn(r, __fmul_rn(dk, ln2_hi));
}

// exp(d) for d <= 0 (Cephes expf): d = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-7 polynomial,
// times 2^n. Returns 0 below -87 (and for -inf or NaN), where exp leaves the normal range: such
// weights lie far below the 2^-32 fixed-point floor of the sampler anyway.
DSPARK_DEVICE float philox_exp(float d) {
  if (!(d >= -87.0f)) return 0.0f;
  const float log2e = __uint_as_float(0x3fb8aa3bu);
  const float c1 = __uint_as_float(0x3f318000u), c2 = __uint_as_float(0xb95e8083u);  // ln2 = c1 - c2
  const float round = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = __fadd_rn(__fadd_rn(__fmul_rn(d, log2e), round), -round);
  const float r = __fadd_rn(__fadd_rn(d, -__fmul_rn(n, c1)), -__fmul_rn(n, c2));
  float p = __uint_as_float(0x39506967u);
  p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3ab743ceu));
  p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3c088908u));
  p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3d2aa9c1u));
  p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3e2aaaaau));
  p = __fadd_rn(__fmul_rn(p, r), 0.5f);
  const float y = __fadd_rn(__fadd_rn(__fmul_rn(p, __fmul_rn(r, r)), r), 1.0f);
  return __fmul_rn(y, __uint_as_float((uint32_t)((int)n + 127) << 23));  // n in [-126, 0]
}

// Gumbel(0, 1) noise -log(-log(u)), u open: -log(u) lies in [2^-24, 16.7], so both logs are
// finite and the result lies in [-2.9, 16.7].
DSPARK_DEVICE float philox_gumbel(uint32_t x) { return -philox_log(-philox_log(philox_uniform_open(x))); }
