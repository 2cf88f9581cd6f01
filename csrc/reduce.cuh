// Warp reductions in one fixed order (xor butterfly), so every launch of the same shape reduces
// identically and every lane gets the same total.
#pragma once
#include "common.cuh"

constexpr unsigned kFullMask = 0xffffffffu;

DSPARK_DEVICE float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
