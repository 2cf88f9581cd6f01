// fp8: e4m3fn bytes to f32, exactly (the checkpoints' block-scaled FP8 weights; dspark.ops.fp8).
//
//   bits s eeee mmm: e > 0: (-1)^s (1 + m / 8) 2^(e - 7); e == 0: (-1)^s m 2^-9 (subnormal);
//   0x7F / 0xFF: NaN (the loader refuses weights holding them); no infinities.
// Every value is exact in f32 (and in bf16 and f16): the normal ones by moving the fields into an
// f32's (exponent bias 127 = 7 + 120, the 3 mantissa bits on top of its 23), the subnormal ones as
// the integer m times 2^-9. dspark.ops.fp8.e4m3_decode is the NumPy twin.
#pragma once
#include "common.cuh"

constexpr int kFp8Block = 128;  // the scale block: 128 x 128 weights share one scale

DSPARK_DEVICE float e4m3_to_float(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u, sign = (b & 0x80u) << 24;
  if (e == 0u) {
    const float v = (float)m * __uint_as_float(0x3b000000u);  // m 2^-9
    return __uint_as_float(__float_as_uint(v) | sign);
  }
  if (e == 15u && m == 7u) return __uint_as_float(sign | 0x7fc00000u);
  return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// The scale of weight (k, n) of an FP8 matrix of N columns: scale[k / 128][n / 128] of its
// ceil(K / 128) x ceil(N / 128) grid (blocks cut by K or N included).
DSPARK_DEVICE float fp8_block_scale(const float* __restrict__ scale, int k, int n, int N) {
  return scale[(int64_t)(k / kFp8Block) * ((N + kFp8Block - 1) / kFp8Block) + n / kFp8Block];
}
