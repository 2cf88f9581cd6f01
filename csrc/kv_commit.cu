// kv_commit: copy the kept rows of every session's verify scratch into its cache, for every
// attention layer, in one launch (DESIGN section 2, step 8).
//
// kv_commit_rows(src [2L]   pointer table: K scratch of layers 0..L-1, then V scratch; each
//                           [rows, Hkv, D], ragged over sessions by row_indptr
//                dst [2LB]  pointer table: K caches (index l * B + b), then V caches; each
//                           [Hkv, capacity, D]
//                row_indptr [B+1], pos [B], keep [B], capacity [L * B], heads, row_words, ring)
//   Grid (B, L, 2), any multiple of 32 threads. CTA (b, l, z) copies K (z = 0) or V (z = 1) of
//   layer l, session b: scratch row row_indptr[b] + r goes to cache slot pos_b + r, or
//   (pos_b + r) % capacity when `ring` (the drafter's KV), for r < keep_b and every head.
//   A copy needs no dtype: a row of one head is `row_words` 16-byte words (D * itemsize / 16).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(1024)
    kv_commit_rows(const uint4* const* __restrict__ src, uint4** __restrict__ dst, const int* __restrict__ row_indptr,
                   const int* __restrict__ pos, const int* __restrict__ keep, const int* __restrict__ capacity,
                   int heads, int row_words, int ring) {
  const int b = blockIdx.x, layer = blockIdx.y, kv = blockIdx.z;
  const int sessions = gridDim.x, layers = gridDim.y;
  const int cache = layer * sessions + b;
  const uint4* __restrict__ from = src[kv * layers + layer];
  uint4* __restrict__ to = dst[kv * layers * sessions + cache];
  const int row0 = row_indptr[b], p0 = pos[b], cap = capacity[cache];
  const int per_row = heads * row_words;
  const int words = keep[b] * per_row;
  for (int c = threadIdx.x; c < words; c += blockDim.x) {
    const int r = c / per_row, h = (c - r * per_row) / row_words, w = c - r * per_row - h * row_words;
    const int slot = ring ? (p0 + r) % cap : p0 + r;
    to[((int64_t)h * cap + slot) * row_words + w] = from[((int64_t)(row0 + r) * heads + h) * row_words + w];
  }
}
