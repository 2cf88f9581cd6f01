// linear_f32.cuh: the f32 kernel's tile (csrc/linear.cu states its grid and its order), shared by
// the product (linear.cu) and the grouped expert product (moe.cu): one GEMM, whatever the caller.
#pragma once
#include "common.cuh"
#include "rowsplit.cuh"

constexpr int kLinearWarps = 4;     // warps of a CTA, each over its own ks of the split
constexpr int kLinearRowTile = 16;  // rows whose accumulators a thread holds at once (two sessions' verify)
constexpr int kLinearSmemRows = 8;  // rows of a tile whose warp sums go through shared memory at once
constexpr int kLinearInFlight = 4;  // weight vectors a thread loads before using them

// Storage bits of one entry, and the first n (< E: the last vector of a ragged N, or an unaligned
// w) entries at p as a vector, 0 bits (+0) after them: the same values a 16-byte load gives.
DSPARK_DEVICE uint32_t storage_bits(float v) { return __float_as_uint(v); }
DSPARK_DEVICE uint32_t storage_bits(f16_t v) { return v.bits; }
DSPARK_DEVICE uint32_t storage_bits(bf16_t v) { return v.bits; }

template <typename T>
DSPARK_DEVICE Vec16 load_ragged(const T* p, int n) {
  constexpr int E = VecWidth<T>::n;
  Vec16 v{{0u, 0u, 0u, 0u}};
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (e < n) v.w[e * (int)sizeof(T) / 4] |= storage_bits(p[e]) << (8 * (e * (int)sizeof(T) % 4));
  return v;
}

// One column tile and K split of a block of `rows` output rows from output row `row0` (the whole
// product: row0 0; an expert's rows in the grouped product, moe.cu). Output row row0 + r reads x row
// row0 + r, or x_rows[row0 + r] (Gather with a map; Gather without one reads row0 + r through the same
// shared row table, so one instantiation serves both grouped products). The splits' partials are part[s][row][n], part_rows rows
// per split; the tile's CTAs meet at `ticket`.
template <typename T, bool Gather>
DSPARK_DEVICE void linear_tile(const float* __restrict__ x, const int* __restrict__ x_rows, const T* __restrict__ w,
                               int row0, int rows, int K, int N, int kchunk, int splits, int tile, int s,
                               float* __restrict__ out, float* __restrict__ part, int part_rows, unsigned* ticket) {
  constexpr int E = VecWidth<T>::n;
  constexpr int C = 32 * E;
  constexpr int W = kLinearWarps, R = kLinearRowTile, U = kLinearInFlight;
  constexpr int H = kLinearSmemRows;
  __shared__ float red[W * H * C];  // every warp's sums of H rows of the tile, [warp][row][column]
  __shared__ int xr[Gather ? R : 1];  // Gather: the x rows of the row tile
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col0 = tile * C, c0 = col0 + lane * E;
  const int cols = min(C, N - col0);  // columns of this tile
  const int lo = s * kchunk, hi = min(K, lo + kchunk);
  const bool vec = (((long long)N * (long long)sizeof(T)) % 16 == 0) &&
                   !(reinterpret_cast<unsigned long long>(w) & 15ull) && c0 + E <= N;
  float* __restrict__ dst = splits == 1 ? out : part + (long long)s * part_rows * N;

  for (int r0 = 0; r0 < rows; r0 += R) {
    const int nr = min(R, rows - r0);
    const float* __restrict__ xt = x + (long long)(row0 + r0) * K;
    if (Gather) {  // the barrier at the end of the previous row tile keeps these writes after its reads
      const int r = row0 + r0 + (int)threadIdx.x;
      if (threadIdx.x < R) xr[threadIdx.x] = (int)threadIdx.x < nr ? (x_rows ? x_rows[r] : r) : 0;
      __syncthreads();
    }
    float acc[R][E];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < E; ++e) acc[r][e] = 0.f;
    for (int k0 = lo + warp; k0 < hi; k0 += W * U) {
      Vec16 raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = k0 + u * W;
        if (k < hi) {
          const T* __restrict__ wk = w + (long long)k * N + c0;
          raw[u] = vec ? load16(wk) : load_ragged(wk, N - c0);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = k0 + u * W;
        if (k < hi) {
          float wv[E];
          unpack16(raw[u], wv, w);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (r < nr) {
              const float xv = Gather ? x[(long long)xr[r] * K + k] : xt[(long long)r * K + k];
#pragma unroll
              for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] + xv * wv[e];
            }
          }
        }
      }
    }
#pragma unroll
    for (int h = 0; h < R; h += H) {  // H rows at a time (uniform: every thread sees the same nr)
      if (h < nr) {
#pragma unroll
        for (int r = 0; r < H; ++r)
#pragma unroll
          for (int e = 0; e < E; ++e) red[(warp * H + r) * C + lane * E + e] = acc[h + r][e];
        __syncthreads();
        for (int i = threadIdx.x; i < min(H, nr - h) * C; i += blockDim.x) {
          const int r = i / C, c = i % C;
          if (c < cols) {
            float v = red[r * C + c];
#pragma unroll
            for (int g = 1; g < W; ++g) v = v + red[(g * H + r) * C + c];
            dst[(long long)(row0 + r0 + h + r) * N + col0 + c] = v;
          }
        }
        __syncthreads();  // red is rewritten next
      }
    }
  }

  if (splits == 1) return;
  if (!split_arrive(ticket, (unsigned)splits, /*all_wrote=*/true)) return;
  for (int i = threadIdx.x; i < rows * cols; i += blockDim.x) {
    const long long at = (long long)(row0 + i / cols) * N + col0 + i % cols;
    const volatile float* p = part + at;  // other CTAs' partials: from L2
    float v = p[0];
    for (int t = 1; t < splits; ++t) v = v + p[(long long)t * part_rows * N];
    out[at] = v;
  }
}
