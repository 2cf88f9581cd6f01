// linear: out f32 [rows, N] = x f32 [rows, K] @ w [K, N], w row-major as stored.
//
// f32 weights (linear_f32, below): f32 multiplies and adds on CUDA cores. Built for speculation's
// skinny GEMMs (1 .. 16 rows, K and N in the thousands): memory-bound, so each weight is read once
// per row tile, as stored, with 16-byte loads. The template serves any storage dtype; 16-bit
// weights take the tensor-core GEMM instead (linear_mma_<dt>_m<BM>, linear_mma.cuh, at the end).
//
// linear_<dt>(x [rows, K], w [K, N], rows, K, N, kchunk, splits, out [rows, N], part, tickets)
//   Columns: CTA tiles of C = 32 * E columns, E = 16 / sizeof(T) (one 16-byte vector per lane:
//   128 columns for f32, 256 for f16/bf16); T = ceil(N / C) tiles. K: `splits` CTAs per tile,
//   split s taking rows [s * kchunk, min(K, (s + 1) * kchunk)) of w. grid.x = T * splits,
//   CTA x = tile * splits + s; block 128 = 4 warps. The host (dspark.ops.linear.split_plan) picks
//   kchunk and splits from (K, N) alone, never from rows.
//   Rows go in tiles of 16 inside the CTA (any rows: the CTA loops over the tiles); lane l of warp
//   g holds columns [tile * C + l * E, + E) of every row of the tile and walks k = lo + g, lo + g + 4,
//   ... (4 vectors in flight), reading x[r, k] as a warp-wide broadcast.
//   Static shared memory: the 4 warps' sums of 8 rows at a time (4 * 8 * C floats: 16 / 32 KiB).
//   part: splits * rows * N floats, the splits' partials as part[s][r][n] (unused when
//   splits = 1); tickets: T zeroed counters (left zeroed).
//
// Summation order of out[r, n], a function of (K, N) alone, so a row is bitwise the same
// whatever the other rows (row invariance, DESIGN section 3):
//   a_g   = (((0 + x[r,k0] w[k0,n]) + x[r,k1] w[k1,n]) + ...)   k = lo + g, lo + g + 4, ... < hi
//   p_s   = ((a_0 + a_1) + a_2) + a_3                            the CTA's 4 warps, in order
//   out   = ((p_0 + p_1) + p_2) + ... + p_{splits-1}              by the last CTA of the tile
// Multiplies and adds are never contracted (-fmad=false), so dspark.ops.linear.linear_ref
// reproduces every bit. The last CTA of a tile to arrive (rowsplit.cuh's ticket) reads the
// partials of every split in index order, so arrival order does not matter.
//
// Weights: 16-byte loads when a row of w is a whole number of vectors (N * sizeof(T) % 16 == 0)
// and w is 16-byte aligned; otherwise, and in the last vector of a ragged N, scalar loads. Same
// order either way.
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

template <typename T>
DSPARK_DEVICE void linear_gemm(const float* __restrict__ x, const T* __restrict__ w, int rows, int K, int N,
                               int kchunk, int splits, float* __restrict__ out, float* __restrict__ part,
                               unsigned* __restrict__ tickets) {
  constexpr int E = VecWidth<T>::n;
  constexpr int C = 32 * E;
  constexpr int W = kLinearWarps, R = kLinearRowTile, U = kLinearInFlight;
  constexpr int H = kLinearSmemRows;
  __shared__ float red[W * H * C];  // every warp's sums of H rows of the tile, [warp][row][column]
  const int tile = blockIdx.x / splits, s = blockIdx.x % splits;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col0 = tile * C, c0 = col0 + lane * E;
  const int cols = min(C, N - col0);  // columns of this tile
  const int lo = s * kchunk, hi = min(K, lo + kchunk);
  const bool vec = (((long long)N * (long long)sizeof(T)) % 16 == 0) &&
                   !(reinterpret_cast<unsigned long long>(w) & 15ull) && c0 + E <= N;
  float* __restrict__ dst = splits == 1 ? out : part + (long long)s * rows * N;

  for (int r0 = 0; r0 < rows; r0 += R) {
    const int nr = min(R, rows - r0);
    const float* __restrict__ xt = x + (long long)r0 * K;
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
              const float xv = xt[(long long)r * K + k];
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
            dst[(long long)(r0 + h + r) * N + col0 + c] = v;
          }
        }
        __syncthreads();  // red is rewritten next
      }
    }
  }

  if (splits == 1) return;
  if (!split_arrive(tickets + tile, (unsigned)splits, /*all_wrote=*/true)) return;
  for (int i = threadIdx.x; i < rows * cols; i += blockDim.x) {
    const long long at = (long long)(i / cols) * N + col0 + i % cols;
    const volatile float* p = part + at;  // other CTAs' partials: from L2
    float v = p[0];
    for (int t = 1; t < splits; ++t) v = v + p[(long long)t * rows * N];
    out[at] = v;
  }
}

#define DSPARK_LINEAR_ENTRY(SUF, T)                                                                      \
  extern "C" __global__ void __launch_bounds__(kLinearWarps * 32)                                         \
      linear_##SUF(const float* __restrict__ x, const T* __restrict__ w, int rows, int K, int N, int kchunk, \
                   int splits, float* __restrict__ out, float* __restrict__ part, unsigned* __restrict__ tickets) { \
    linear_gemm<T>(x, w, rows, K, N, kchunk, splits, out, part, tickets);                                  \
  }

DSPARK_LINEAR_ENTRY(f32, float)

// ---- 16-bit weights: the tensor-core GEMM (linear_mma.cuh) ------------------------------------------
// linear_mma_<dt>_m<BM>: one entry per weight dtype and tile shape (BM rows per tile); the header of
// linear_mma.cuh states the order every shape shares. Devices without tensor cores never run them
// (dspark.ops.linear refuses 16-bit weights there).
#include "linear_mma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define DSPARK_LINEAR_MMA_BODY(T, CFG) __trap();
#else
#define DSPARK_LINEAR_MMA_BODY(T, CFG) linear_mma<T, CFG>(x, w, rows, K, N, kchunk, grid_splits, out, part, tickets);
#endif

#define DSPARK_LINEAR_MMA_ENTRY(SUF, T, BM, CFG)                                                               \
  extern "C" __global__ void __launch_bounds__(CFG::THREADS) linear_mma_##SUF##_m##BM(                      \
      const float* __restrict__ x, const T* __restrict__ w, int rows, int K, int N, int kchunk, int grid_splits, \
      float* __restrict__ out, float* __restrict__ part, unsigned* __restrict__ tickets) {                   \
    DSPARK_LINEAR_MMA_BODY(T, CFG)                                                                           \
  }

DSPARK_LINEAR_MMA_ENTRY(bf16, bf16_t, 16, MmaGemmM16)
DSPARK_LINEAR_MMA_ENTRY(bf16, bf16_t, 32, MmaGemmM32)
DSPARK_LINEAR_MMA_ENTRY(bf16, bf16_t, 64, MmaGemmM64)
DSPARK_LINEAR_MMA_ENTRY(bf16, bf16_t, 128, MmaGemmM128)
DSPARK_LINEAR_MMA_ENTRY(f16, f16_t, 16, MmaGemmM16)
DSPARK_LINEAR_MMA_ENTRY(f16, f16_t, 32, MmaGemmM32)
DSPARK_LINEAR_MMA_ENTRY(f16, f16_t, 64, MmaGemmM64)
DSPARK_LINEAR_MMA_ENTRY(f16, f16_t, 128, MmaGemmM128)
