// linear_fp8: out f32 [rows, N] = round_T(x) [rows, K] @ W [K, N] for FP8 weights (W8A16), x f32; W
// stored as q, e4m3fn bytes [K, N] row-major (1 byte a weight), and scale, f32
// [ceil(K / 128)][ceil(N / 128)], one per 128 x 128 block (fp8.cuh; dspark.ops.fp8).
//
// The weights are dequantized in registers and never exist in memory as 16-bit values:
//   W[k, n] = round_T(fl32(e4m3(q[k, n]) * scale[k / 128][n / 128]))   T = bf16 or f16, both RNE
// then multiplied in linear_mma.cuh's order: the activations rounded to T, mma.sync m16n8k16 with
// f32 accumulation in k-steps of 16, K in chunks of `kchunk` whose partials are added in index order.
// The host (dspark.ops.linear.fp8_plan) takes kchunk a multiple of the 128-row scale block and, like
// every split of dspark's products, from (K, N) alone: the order of out[r, n], and so row r's bits,
// are the same for every row count, tile shape and mode (row invariance, DESIGN section 3).
// dspark.ops.linear.linear_fp8_ref is the twin: linear_mma_ref over dspark.ops.fp8.dequantize(q, scale, T).
//
// linear_fp8_<t>_m<BM>(x, q, scale, rows, K, N, kchunk, grid_splits, out, part, tickets): the grid,
// modes, part and tickets of linear_mma_<t>_m<BM> (linear_mma.cuh's header). Two ways to the MMAs:
// * BM 16 and 32, the decode shapes (decode, verify, a prompt's tail, batched decode: a few rows, where
//   the bytes are the cost): linear_fp8.cuh's Fp8Stream. No weight touches shared memory: each lane
//   loads 8 (BM 16) or 4 (BM 32) bytes of four rows per k-step straight into the registers that become
//   its B fragments, one iteration ahead, and decodes them there (on sm_89+ one cvt.rn.f16x2.e4m3x2 per
//   byte pair). 4 warps of 64 columns or 8 of 32: a 256-column tile. Split mode only (a chunk per CTA).
// * BM 64 and 128, the prompt shapes: linear_mma's tile over MmaWeightsFp8's B tiles. Each thread takes
//   8-column chunks of rows of the tile, 8 bytes each (one 8-byte load where N % 8 == 0 and q is 8-byte
//   aligned, else byte loads; zero past K and N), all in one column of one 128 x 128 block, so with one
//   scale, one tile ahead in registers like the activations; after the tile's MMAs it decodes, scales
//   and rounds them into the shared-memory stage.
//
// The decode alone is fp8.cu's fp8_decode_e4m3 (its test, and a family small enough to rebuild fast).
#include "linear_fp8.cuh"  // Fp8Stream, and MmaWeightsFp8 (shared with moe.cu)

template <typename T, typename Cfg, bool SWIGLU = false>
DSPARK_DEVICE void linear_fp8(const float* __restrict__ x, const uint8_t* __restrict__ q,
                              const float* __restrict__ scale, int rows, int K, int N, int kchunk, int grid_splits,
                              float* __restrict__ out, float* __restrict__ part, unsigned* __restrict__ tickets) {
  const MmaWeightsFp8<T, Cfg> wt{q, scale, K, N, N % 8 == 0 && !(reinterpret_cast<unsigned long long>(q) & 7ull)};
  mma_gemm<T, Cfg, MmaWeightsFp8<T, Cfg>, false, SWIGLU>(x, wt, rows, K, N, kchunk, grid_splits, out, part, tickets);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define DSPARK_LINEAR_FP8_BODY(PATH, T, CFG, SWIGLU) __trap();
#else
#define DSPARK_LINEAR_FP8_BODY(PATH, T, CFG, SWIGLU) \
  PATH<T, CFG, SWIGLU>(x, q, scale, rows, K, N, kchunk, grid_splits, out, part, tickets);
#endif

// PATH: linear_fp8_stream (the decode shapes, BM 16 and 32) or linear_fp8 (the stage path). The decode
// shapes: dspark/ops/linear.py (FP8_STREAM) holds the same table.
using Fp8StreamM16 = Fp8StreamConfig<16, 4, 8>;  // 4 warps of 64 columns: BN 256
using Fp8StreamM32 = Fp8StreamConfig<32, 8, 4, 1>;  // 8 warps of 32 columns: BN 256 (ptxas left alone caps it at
                                                    // 128 registers and spills)
#define DSPARK_LINEAR_FP8_ENTRY(NAME, T, PATH, CFG, SWIGLU)                                                  \
  extern "C" __global__ void __launch_bounds__(CFG::THREADS, CFG::MIN_CTAS) NAME(                            \
      const float* __restrict__ x, const uint8_t* __restrict__ q, const float* __restrict__ scale, int rows,  \
      int K, int N, int kchunk, int grid_splits, float* __restrict__ out, float* __restrict__ part,           \
      unsigned* __restrict__ tickets) {                                                                      \
    DSPARK_LINEAR_FP8_BODY(PATH, T, CFG, SWIGLU)                                                             \
  }

DSPARK_LINEAR_FP8_ENTRY(linear_fp8_bf16_m16, bf16_t, linear_fp8_stream, Fp8StreamM16, false)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_bf16_m32, bf16_t, linear_fp8_stream, Fp8StreamM32, false)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_bf16_m64, bf16_t, linear_fp8, MmaGemmM64, false)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_bf16_m128, bf16_t, linear_fp8, MmaGemmM128, false)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_f16_m16, f16_t, linear_fp8_stream, Fp8StreamM16, false)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_f16_m32, f16_t, linear_fp8_stream, Fp8StreamM32, false)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_f16_m64, f16_t, linear_fp8, MmaGemmM64, false)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_f16_m128, f16_t, linear_fp8, MmaGemmM128, false)

// linear_fp8_<dt>_swiglu_m<BM>(gate_up, q, scale, ...): an MLP's down product over its gate|up product,
// the SwiGLU in the activation stage (dspark.ops.swiglu_linear). Not at 64 rows: there the held gate|up
// take the shape from two CTAs per SM to one (154 registers against 125 on sm_90).
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_bf16_swiglu_m16, bf16_t, linear_fp8_stream, Fp8StreamM16, true)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_bf16_swiglu_m32, bf16_t, linear_fp8_stream, Fp8StreamM32, true)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_bf16_swiglu_m128, bf16_t, linear_fp8, MmaGemmM128, true)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_f16_swiglu_m16, f16_t, linear_fp8_stream, Fp8StreamM16, true)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_f16_swiglu_m32, f16_t, linear_fp8_stream, Fp8StreamM32, true)
DSPARK_LINEAR_FP8_ENTRY(linear_fp8_f16_swiglu_m128, f16_t, linear_fp8, MmaGemmM128, true)

// linear_place_columns(src [rows, width], rows, width, dst [rows, N], N, at): dst[r, at + c] = src[r, c],
// one thread per entry: a run's product placed in its columns of a fused output (dspark.ops.linear.
// ColumnRuns, whose runs are FP8 beside 16-bit weights), as a launch a recorded round replays.
extern "C" __global__ void linear_place_columns(const float* __restrict__ src, int rows, int width,
                                                float* __restrict__ dst, int N, int at) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < (long long)rows * width) dst[i / width * N + at + i % width] = src[i];
}
