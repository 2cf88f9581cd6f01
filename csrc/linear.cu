// linear: out f32 [rows, N] = x f32 [rows, K] @ w [K, N], w row-major as stored.
//
// f32 weights (linear_f32, below): f32 multiplies and adds on CUDA cores. Built for speculation's
// skinny GEMMs (1 .. 16 rows, K and N in the thousands): memory-bound, so each weight is read once
// per row tile, as stored, with 16-byte loads. The template (linear_f32.cuh, beside the grouped
// expert product's use of it in moe.cu) serves any storage dtype; 16-bit
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
#include "linear_f32.cuh"

template <typename T>
DSPARK_DEVICE void linear_gemm(const float* __restrict__ x, const T* __restrict__ w, int rows, int K, int N,
                               int kchunk, int splits, float* __restrict__ out, float* __restrict__ part,
                               unsigned* __restrict__ tickets) {
  const int tile = blockIdx.x / splits;
  linear_tile<T, false>(x, nullptr, w, 0, rows, K, N, kchunk, splits, tile, blockIdx.x % splits, out, part, rows,
                        tickets + tile);
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

// One entry of the tensor-core GEMM: NAME(x of XT, w of T, ...) running FN<T, CFG> over it (linear_mma:
// x f32; linear_mma_a16: x already T; linear_mma_swiglu: x an MLP's gate|up, linear_mma.cuh's SWIGLU).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define DSPARK_LINEAR_MMA_CALL(FN, T, CFG) __trap();
#else
#define DSPARK_LINEAR_MMA_CALL(FN, T, CFG) FN<T, CFG>(x, w, rows, K, N, kchunk, grid_splits, out, part, tickets);
#endif
#define DSPARK_LINEAR_MMA_ENTRY(NAME, XT, FN, T, CFG)                                                           \
  extern "C" __global__ void __launch_bounds__(CFG::THREADS) NAME(                                             \
      const XT* __restrict__ x, const T* __restrict__ w, int rows, int K, int N, int kchunk, int grid_splits,   \
      float* __restrict__ out, float* __restrict__ part, unsigned* __restrict__ tickets) {                     \
    DSPARK_LINEAR_MMA_CALL(FN, T, CFG)                                                                         \
  }

// linear_mma_<dt>_a16_<shape>(xh, w, ...): the prompt shapes over activations already rounded to the
// weights' type (round_activations_<dt> below); the same bits as linear_mma_<dt>_<shape> over their f32.
DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_a16_m64, bf16_t, linear_mma_a16, bf16_t, MmaGemmM64)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_a16_m128, bf16_t, linear_mma_a16, bf16_t, MmaGemmM128)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_a16_m128n256, bf16_t, linear_mma_a16, bf16_t, MmaGemmM128N256)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_a16_m64, f16_t, linear_mma_a16, f16_t, MmaGemmM64)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_a16_m128, f16_t, linear_mma_a16, f16_t, MmaGemmM128)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_a16_m128n256, f16_t, linear_mma_a16, f16_t, MmaGemmM128N256)

// round_swiglu_<dt>(gate_up f32 [rows, 2F], rows, F, out T [rows, F]): out = round_T(SiLU(gate) * up), the
// activations swiglu_f32 writes rounded as round_activations rounds them, in one launch: what a prompt's
// down product reads (linear_mma_<dt>_a16_<shape>; F % 4 == 0, so a thread's four never cross a row).
template <typename T>
DSPARK_DEVICE void round_swiglu(const float* __restrict__ gate_up, int rows, int F, T* __restrict__ out) {
  const long long i = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= (long long)rows * F) return;
  const long long r = i / F, j = i - r * F;
  const float* g = gate_up + r * 2 * F + j;
  float a[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) a[e] = swiglu_value(g[e], g[F + e]);
  *reinterpret_cast<uint2*>(out + i) = make_uint2(mma_pack2<T>(a[0], a[1]), mma_pack2<T>(a[2], a[3]));
}
extern "C" __global__ void round_swiglu_bf16(const float* __restrict__ gate_up, int rows, int F, bf16_t* __restrict__ out) {
  round_swiglu<bf16_t>(gate_up, rows, F, out);
}
extern "C" __global__ void round_swiglu_f16(const float* __restrict__ gate_up, int rows, int F, f16_t* __restrict__ out) {
  round_swiglu<f16_t>(gate_up, rows, F, out);
}

// round_gate_<dt>(o T [rows, heads * D], gate f32 or null, rows, heads, D, gate_stride, gate_head,
//                 out T [rows, heads * D]): out = round_T(widen(o) * act_sigmoid(g)), g the gate
// attn_gate_<dt> reads (Qwen3.5's, after each head's query), or round_T(widen(o)) without one: the
// activations attn_gate writes, rounded as round_activations rounds them, in one launch (what a
// prompt's output projection reads: linear_mma_<dt>_a16_<shape>). D % 4 == 0, so a thread's four
// never cross a head.
template <typename T>
DSPARK_DEVICE void round_gate(const T* __restrict__ o, const float* __restrict__ gate, int rows, int heads, int D,
                              long long gate_stride, int gate_head, T* __restrict__ out) {
  const long long i = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
  const long long width = (long long)heads * D;
  if (i >= rows * width) return;
  float a[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) a[e] = to_float(o[i + e]);
  if (gate) {
    const long long r = i / width, c = i - r * width, h = c / D;
    const float* g = gate + r * gate_stride + h * gate_head + (c - h * D);
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = a[e] * act_sigmoid(g[e]);
  }
  *reinterpret_cast<uint2*>(out + i) = make_uint2(mma_pack2<T>(a[0], a[1]), mma_pack2<T>(a[2], a[3]));
}
extern "C" __global__ void round_gate_bf16(const bf16_t* __restrict__ o, const float* __restrict__ gate, int rows,
                                           int heads, int D, long long gate_stride, int gate_head,
                                           bf16_t* __restrict__ out) {
  round_gate<bf16_t>(o, gate, rows, heads, D, gate_stride, gate_head, out);
}
extern "C" __global__ void round_gate_f16(const f16_t* __restrict__ o, const float* __restrict__ gate, int rows,
                                          int heads, int D, long long gate_stride, int gate_head,
                                          f16_t* __restrict__ out) {
  round_gate<f16_t>(o, gate, rows, heads, D, gate_stride, gate_head, out);
}

// round_activations_<dt>(x f32 [n], n, out T [n]): out = round_T(x) as the GEMM's A stage rounds it
// (mma_pack2: from_float's bits), four a thread (n % 4 == 0, out 8-byte aligned; x read by float4
// where it is 16-byte aligned); what the a16 entries read.
template <typename T>
DSPARK_DEVICE void round_activations(const float* __restrict__ x, long long n, T* __restrict__ out) {
  const long long i = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  const float4 v = (reinterpret_cast<unsigned long long>(x) & 15ull) == 0
                       ? *reinterpret_cast<const float4*>(x + i) : make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
  *reinterpret_cast<uint2*>(out + i) = make_uint2(mma_pack2<T>(v.x, v.y), mma_pack2<T>(v.z, v.w));
}
extern "C" __global__ void round_activations_bf16(const float* __restrict__ x, long long n, bf16_t* __restrict__ out) {
  round_activations<bf16_t>(x, n, out);
}
extern "C" __global__ void round_activations_f16(const float* __restrict__ x, long long n, f16_t* __restrict__ out) {
  round_activations<f16_t>(x, n, out);
}

DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_m16, float, linear_mma, bf16_t, MmaGemmM16)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_m32, float, linear_mma, bf16_t, MmaGemmM32)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_m64, float, linear_mma, bf16_t, MmaGemmM64)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_m128, float, linear_mma, bf16_t, MmaGemmM128)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_m128n256, float, linear_mma, bf16_t, MmaGemmM128N256)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_m16, float, linear_mma, f16_t, MmaGemmM16)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_m32, float, linear_mma, f16_t, MmaGemmM32)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_m64, float, linear_mma, f16_t, MmaGemmM64)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_m128, float, linear_mma, f16_t, MmaGemmM128)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_m128n256, float, linear_mma, f16_t, MmaGemmM128N256)

// linear_mma_<dt>_swiglu_m<BM>(gate_up, w, ...): an MLP's down product over its gate|up product [rows, 2K]
// (linear_mma.cuh's SWIGLU mode; K here is the down product's, half gate_up's width): bitwise the entry
// without _swiglu over swiglu_f32's output, one launch and no f32 activations in memory.
DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_swiglu_m16, float, linear_mma_swiglu, bf16_t, MmaGemmM16)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_swiglu_m32, float, linear_mma_swiglu, bf16_t, MmaGemmM32)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_swiglu_m64, float, linear_mma_swiglu, bf16_t, MmaGemmM64)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_bf16_swiglu_m128, float, linear_mma_swiglu, bf16_t, MmaGemmM128)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_swiglu_m16, float, linear_mma_swiglu, f16_t, MmaGemmM16)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_swiglu_m32, float, linear_mma_swiglu, f16_t, MmaGemmM32)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_swiglu_m64, float, linear_mma_swiglu, f16_t, MmaGemmM64)
DSPARK_LINEAR_MMA_ENTRY(linear_mma_f16_swiglu_m128, float, linear_mma_swiglu, f16_t, MmaGemmM128)

// linear_mma_<dt>_gated_m<BM>(o, w, ..., gate, gate_stride, gate_head, head_dim): an attention's output
// projection over its output o [rows, K] as T and its gates, or none (linear_mma.cuh's GATED mode):
// bitwise the entry without _gated over attn_gate_<dt>'s output, one launch and no f32 copy of o.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define DSPARK_LINEAR_MMA_GATED_CALL(T, CFG) __trap();
#else
#define DSPARK_LINEAR_MMA_GATED_CALL(T, CFG) \
  linear_mma_gated<T, CFG>(x, w, rows, K, N, kchunk, grid_splits, out, part, tickets, gate, gate_stride, gate_head, head_dim);
#endif
#define DSPARK_LINEAR_MMA_GATED_ENTRY(NAME, T, CFG)                                                             \
  extern "C" __global__ void __launch_bounds__(CFG::THREADS) NAME(                                             \
      const T* __restrict__ x, const T* __restrict__ w, int rows, int K, int N, int kchunk, int grid_splits,   \
      float* __restrict__ out, float* __restrict__ part, unsigned* __restrict__ tickets,                       \
      const float* __restrict__ gate, long long gate_stride, int gate_head, int head_dim) {                    \
    DSPARK_LINEAR_MMA_GATED_CALL(T, CFG)                                                                       \
  }

DSPARK_LINEAR_MMA_GATED_ENTRY(linear_mma_bf16_gated_m16, bf16_t, MmaGemmM16)
DSPARK_LINEAR_MMA_GATED_ENTRY(linear_mma_bf16_gated_m32, bf16_t, MmaGemmM32)
DSPARK_LINEAR_MMA_GATED_ENTRY(linear_mma_bf16_gated_m64, bf16_t, MmaGemmM64)
DSPARK_LINEAR_MMA_GATED_ENTRY(linear_mma_bf16_gated_m128, bf16_t, MmaGemmM128)
DSPARK_LINEAR_MMA_GATED_ENTRY(linear_mma_f16_gated_m16, f16_t, MmaGemmM16)
DSPARK_LINEAR_MMA_GATED_ENTRY(linear_mma_f16_gated_m32, f16_t, MmaGemmM32)
DSPARK_LINEAR_MMA_GATED_ENTRY(linear_mma_f16_gated_m64, f16_t, MmaGemmM64)
DSPARK_LINEAR_MMA_GATED_ENTRY(linear_mma_f16_gated_m128, f16_t, MmaGemmM128)
