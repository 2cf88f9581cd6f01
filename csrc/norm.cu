// norm: RMSNorm over the last axis of a row in one fixed order: alone (a warp per row), and with the
// residual add before it or the embedding gather before the first one (the trunk's and drafter's
// layer boundaries, a row over several CTAs: one launch where the glue took three).
//
// rmsnorm_f32(x [rows, n], weight [n], rows, n, eps, out [rows, n])
//   grid.x = rows, block 32: block i normalises row i (a row per CTA: the few rows of a decode step or
//   a verify spread over as many SMs as they can). Lane l sums
//   x[l]^2, x[l + 32]^2, ... in that order, then warp_sum's xor butterfly (offsets 16 .. 1) gives
//   every lane the row's total s; r = sqrt(s / n + eps) and out[j] = (x[j] / r) * weight[j].
//
// rmsnorm_gated_f32(x [rows, n], gates [tokens, ld], ld, column, heads, weight [n], rows, n, eps, out [rows, n])
//   The gdn's gated output norm over a prompt's o [tokens, heads, n] (rows = tokens heads): rmsnorm_f32's
//   row, each output times SiLU of its gate, out[j] = ((x[j] / r) * weight[j]) * (z[j] * sigmoid(z[j]))
//   (activation.cuh's silu_gate), the gates of row i read where the projection holds them, at
//   gates[i / heads][column + (i % heads) n + j]. Bitwise the decode scan's gated norm (gdn_scan.cu, D).
//
// add_rmsnorm_f32(x [rows, n], y [rows, n] or null, weight, rows, n, eps, out, tap or null, tap_stride,
//                 tickets [rows])
//   The residual stream's step: x[j] <- x[j] + y[j] (f32, in place), then out = rmsnorm(x) exactly as
//   rmsnorm_f32 (the same lanes sum the same squares in the same order), and, for a tap layer, the new
//   x also to tap + row * tap_stride (a column block of the pass's taps [rows, n_taps * n]). out may be x.
//
// embed_rmsnorm_<dt>(table [V, n] of dt, ids [rows], rows, n, scale, weight, eps, x [rows, n], out,
//                    tap or null, tap_stride, tickets [rows])
//   x = widen(table[ids[row]]) * scale (exact widening of f16 / bf16; scale 1 is exact), then out =
//   rmsnorm(x) as above, and the tap copy.
//
// Both: grid (rows, ceil(n / kRowChunk)), block kRowThreads. CTA (row, c) writes columns
// [c * kRowChunk, (c + 1) * kRowChunk) of its row's new x, every load of a thread issued before any
// use (one memory round trip), so a verify's few rows move their bytes on many SMs. The last of the
// row's CTAs to arrive at tickets[row] (zero at rest, put back to zero) normalises the whole row:
// its threads stage the row's new x from L2 a piece at a time (every load in flight at once), warp
// 0 sums the squares from shared memory in rmsnorm_f32's lane order, and every thread writes its
// share of out.
//
// Why a kernel: an array library's reduction (CuPy's mean over an axis) picks its block layout,
// and with it each row's summation order, from the whole array's shape, so a row's norm could
// depend on how many rows share the call. Here the order is a function of n alone. Multiplies and
// adds are never contracted (-fmad=false), so the NumPy twins (dspark.ops.norm.rmsnorm_ref and
// add_rmsnorm_ref) reproduce every bit.
#include "activation.cuh"
#include "common.cuh"
#include "reduce.cuh"
#include "rowsplit.cuh"

constexpr int kNormWarps = 1;  // rows (warps) per CTA

// out[0..n) = gate(j, (x / sqrt(sum x^2 / n + eps)) * weight) by one whole warp, lanes in order.
template <typename Gate>
DSPARK_DEVICE void norm_row(const float* __restrict__ xr, const float* __restrict__ weight, int n, float eps,
                            float* __restrict__ yr, int lane, Gate gate) {
  float ss = 0.f;
  for (int j = lane; j < n; j += 32) {
    const float v = xr[j];
    ss += v * v;
  }
  const float r = sqrtf(warp_sum(ss) / (float)n + eps);
  for (int j = lane; j < n; j += 32) yr[j] = gate(j, (xr[j] / r) * weight[j]);
}

struct NoGate {
  __device__ __forceinline__ float operator()(int, float v) const { return v; }
};

struct SiluGate {  // v * SiLU(z[j])
  const float* __restrict__ zr;
  __device__ __forceinline__ float operator()(int j, float v) const { return silu_gate(v, zr[j]); }
};

extern "C" __global__ void __launch_bounds__(kNormWarps * 32)
    rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ weight, int rows, int n, float eps,
                float* __restrict__ out) {
  const int row = blockIdx.x * kNormWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= rows) return;  // whole warps leave together: the butterfly below sees full warps
  norm_row(x + (int64_t)row * n, weight, n, eps, out + (int64_t)row * n, lane, NoGate{});
}

extern "C" __global__ void __launch_bounds__(kNormWarps * 32)
    rmsnorm_gated_f32(const float* __restrict__ x, const float* __restrict__ gates, long long ld, long long column,
                      int heads, const float* __restrict__ weight, int rows, int n, float eps, float* __restrict__ out) {
  const int row = blockIdx.x * kNormWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float* __restrict__ zr = gates + (int64_t)(row / heads) * ld + column + (int64_t)(row % heads) * n;
  norm_row(x + (int64_t)row * n, weight, n, eps, out + (int64_t)row * n, lane, SiluGate{zr});
}

constexpr int kRowThreads = 256;                // the row kernels' CTA (dspark.ops.norm.ROW_THREADS)
constexpr int kRowPer = 4;                       // columns a thread writes: a CTA's chunk of the row
constexpr int kRowChunk = kRowThreads * kRowPer;  // (dspark.ops.norm.ROW_CHUNK)
constexpr int kRowPieceLoads = 32;               // a thread's loads of one staged piece, all in flight
constexpr int kRowPiece = kRowThreads * kRowPieceLoads;  // floats staged at once: a multiple of 32
constexpr int kRowStoreBatch = 16;               // the norm's weights a thread loads before it stores
constexpr int kRowCtasPerSm = 3;                 // registers capped for three CTAs an SM (a prompt's many rows)

// piece[0, kRowPiece) = x[p0, p0 + kRowPiece) of the row (0 past n), read from L2 (load_l2: other
// CTAs of the launch wrote it), every load of a thread in flight before the first store.
DSPARK_DEVICE void stage_piece(const float* xr, int p0, int n, float* piece) {
  float v[kRowPieceLoads];
#pragma unroll
  for (int i = 0; i < kRowPieceLoads; ++i) {
    const int j = p0 + threadIdx.x + i * kRowThreads;
    v[i] = j < n ? load_l2(xr + j) : 0.f;
  }
#pragma unroll
  for (int i = 0; i < kRowPieceLoads; ++i) piece[threadIdx.x + i * kRowThreads] = v[i];
  __syncthreads();
}

// out[0..n) = rmsnorm(x[0..n)) by the row's last CTA, x written by every CTA of the row; the sum by
// warp 0 in norm_row's lane order (each piece starts on a multiple of 32, so lane l meets x[l],
// x[l + 32], ... in order). out may be x: a piece is staged before its norm is written.
DSPARK_DEVICE void norm_row_tail(const float* xr, const float* __restrict__ weight, int n, float eps, float* yr) {
  __shared__ float piece[kRowPiece];
  __shared__ float r_row;
  const int t = threadIdx.x;
  float ss = 0.f;
  for (int p0 = 0; p0 < n; p0 += kRowPiece) {
    stage_piece(xr, p0, n, piece);
    if (t < 32) {
      const int pn = min(kRowPiece, n - p0);
      for (int k = t; k < pn; k += 32) {
        const float f = piece[k];
        ss += f * f;
      }
    }
    __syncthreads();  // the piece is restaged next
  }
  if (t < 32) {
    const float r = sqrtf(warp_sum(ss) / (float)n + eps);
    if (t == 0) r_row = r;
  }
  __syncthreads();
  const float r = r_row;
  for (int p0 = 0; p0 < n; p0 += kRowPiece) {
    if (n > kRowPiece) stage_piece(xr, p0, n, piece);  // else the row is the piece still staged
#pragma unroll
    for (int h = 0; h < kRowPieceLoads; h += kRowStoreBatch) {
      float a[kRowStoreBatch], w[kRowStoreBatch];  // a batch's loads before its first store (out may alias)
#pragma unroll
      for (int i = 0; i < kRowStoreBatch; ++i) {
        const int j = p0 + t + (h + i) * kRowThreads;
        w[i] = j < n ? weight[j] : 0.f;
        a[i] = piece[t + (h + i) * kRowThreads] / r;
      }
#pragma unroll
      for (int i = 0; i < kRowStoreBatch; ++i) {
        const int j = p0 + t + (h + i) * kRowThreads;
        if (j < n) yr[j] = a[i] * w[i];
      }
    }
    __syncthreads();  // the piece is restaged next
  }
}

// The row kernels' shape: `source(j)` is column j's new x (of this CTA's chunk); the chunk is
// written to x (when `write_x`) and the tap, then the row's last CTA norms it.
template <typename Source>
DSPARK_DEVICE void row_step(Source source, bool write_x, float* x, const float* __restrict__ weight, int n,
                            float eps, float* out, float* __restrict__ tap, long long tap_stride,
                            unsigned* __restrict__ tickets) {
  const int row = blockIdx.x, chunks = gridDim.y;
  float* xr = x + (int64_t)row * n;
  float* __restrict__ tr = tap ? tap + row * tap_stride : nullptr;
  const int j0 = (int)blockIdx.y * kRowChunk + threadIdx.x;
  float v[kRowPer];
#pragma unroll
  for (int i = 0; i < kRowPer; ++i) {  // every load before any store: one round trip
    const int j = j0 + i * kRowThreads;
    v[i] = j < n ? source(j) : 0.f;
  }
#pragma unroll
  for (int i = 0; i < kRowPer; ++i) {
    const int j = j0 + i * kRowThreads;
    if (j >= n) continue;
    if (write_x) xr[j] = v[i];
    if (tr) tr[j] = v[i];
  }
  if (chunks > 1) {
    if (!split_arrive(tickets + row, (unsigned)chunks, /*all_wrote=*/true)) return;
  } else {
    __syncthreads();  // one CTA holds the row: its threads' writes are visible past the barrier
  }
  norm_row_tail(xr, weight, n, eps, out + (int64_t)row * n);
}

struct ResidualSum {  // x[j] + y[j]: the residual stream after the sublayer (y null: x as it is)
  const float* xr;
  const float* __restrict__ yr;
  __device__ __forceinline__ float operator()(int j) const { return yr ? xr[j] + yr[j] : xr[j]; }
};

template <typename T>
struct EmbeddingRow {  // widen(table[id][j]) * scale
  const T* __restrict__ er;
  float scale;
  __device__ __forceinline__ float operator()(int j) const { return to_float(er[j]) * scale; }
};

extern "C" __global__ void __launch_bounds__(kRowThreads, kRowCtasPerSm)
    add_rmsnorm_f32(float* x, const float* __restrict__ y, const float* __restrict__ weight, int rows, int n,
                    float eps, float* out, float* __restrict__ tap, long long tap_stride,
                    unsigned* __restrict__ tickets) {
  const int64_t at = (int64_t)blockIdx.x * n;
  row_step(ResidualSum{x + at, y ? y + at : nullptr}, y != nullptr, x, weight, n, eps, out, tap, tap_stride,
           tickets);
}

#define DSPARK_EMBED_RMSNORM(SUF, T)                                                                             \
  extern "C" __global__ void __launch_bounds__(kRowThreads, kRowCtasPerSm) embed_rmsnorm_##SUF(                                \
      const T* __restrict__ table, const int* __restrict__ ids, int rows, int n, float scale,                    \
      const float* __restrict__ weight, float eps, float* x, float* out, float* __restrict__ tap,                \
      long long tap_stride, unsigned* __restrict__ tickets) {                                                    \
    row_step(EmbeddingRow<T>{table + (int64_t)ids[blockIdx.x] * n, scale}, true, x, weight, n, eps, out, tap,     \
             tap_stride, tickets);                                                                               \
  }

DSPARK_EMBED_RMSNORM(f32, float)
DSPARK_EMBED_RMSNORM(f16, f16_t)
DSPARK_EMBED_RMSNORM(bf16, bf16_t)
