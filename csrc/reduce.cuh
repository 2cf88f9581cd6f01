// Warp and block reductions in one fixed order (xor butterfly, then warp 0 over the warp
// partials), so every launch of the same shape reduces identically.
#pragma once
#include "common.cuh"

constexpr unsigned kFullMask = 0xffffffffu;

DSPARK_DEVICE float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

DSPARK_DEVICE float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// (value, index) pair: larger value wins, ties go to the lower index; index INT_MAX = empty.
struct ArgBest {
  float v;
  int i;
};

DSPARK_DEVICE bool arg_better(float v, int i, const ArgBest& b) {
  return v > b.v || (v == b.v && i < b.i);
}

DSPARK_DEVICE ArgBest warp_argmax(ArgBest b) {
  for (int o = 16; o > 0; o >>= 1) {
    float v = __shfl_xor_sync(kFullMask, b.v, o);
    int i = __shfl_xor_sync(kFullMask, b.i, o);
    if (arg_better(v, i, b)) b = ArgBest{v, i};
  }
  return b;
}

// Block-wide argmax; blockDim.x must be a multiple of 32. `scratch` holds 32 entries.
// Every thread gets the result.
DSPARK_DEVICE ArgBest block_argmax(ArgBest b, ArgBest* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  b = warp_argmax(b);
  if (lane == 0) scratch[warp] = b;
  __syncthreads();
  if (warp == 0) {
    ArgBest w = lane < nwarps ? scratch[lane] : ArgBest{-dspark_inf(), 0x7fffffff};
    w = warp_argmax(w);
    if (lane == 0) scratch[0] = w;
  }
  __syncthreads();
  ArgBest r = scratch[0];
  __syncthreads();  // scratch is reused by the caller's next reduction
  return r;
}

// Block-wide OR of a flag; every thread gets the result.
DSPARK_DEVICE bool block_any(bool p) { return __syncthreads_or(p) != 0; }
