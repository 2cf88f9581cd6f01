// linear_mma: the tensor-core GEMM for 16-bit weights, out f32 [rows, N] = round_T(x) [rows, K] @ w [K, N],
// x f32, w bf16 or f16 row-major as stored, f32 accumulation (mma.sync m16n8k16). One fixed order
// per output, a function of (K, N) alone, so a row's bits never depend on how many rows share the
// launch: prompt, verify, decode and batched rows of the same input are bitwise equal.
//
// The order of out[r, n] (dspark.ops.linear.linear_mma_ref reproduces the simt bits):
//   a      = round_T(x[r, :])                               activations rounded to the weight's type (RNE)
//   chunks = [c kchunk, min(K, (c + 1) kchunk)), c = 0 .. splits - 1   kchunk a multiple of 32, from (K, N)
//   P_c    = mma(.. mma(mma(0, a[s0], w[s0]), a[s1], w[s1]) ..)    k-steps s of 16 in increasing order over
//                                                                 the chunk, zero past K, chained from +0
//   out    = ((-0 + P_0) + P_1) + ... + P_{splits-1}            f32 adds in chunk order
// Only k-steps holding a k of the chunk run, whatever the tile's BK, so every tile shape below takes
// the same steps. The MMA is one instruction per k-step: the hardware's sum of 16 exact products and
// the accumulator (simt/tensor_core.h states the emulation, within 18 * 2^-23 of it per instruction).
//
// linear_mma_<dt>_m<BM>(x, w, rows, K, N, kchunk, grid_splits, out, part, tickets)
//   A CTA owns a tile of BM rows x at most BN columns; grid (column tiles * grid_splits, row tiles), N's
//   groups of 8 columns dealt evenly over the column tiles (mma_tile_column: the plan may take more
//   tiles than ceil(N / BN), so that a launch of few rows fills the SMs in whole waves).
//   grid_splits == 1 ("fold"): the CTA walks all of K and folds each chunk's partial into its running
//     sum in registers at the chunk's end (the prompt pass: no partials leave the SM); CTAs take
//     their tiles in groups of kMmaGroupRows row tiles (L2 reuse).
//   grid_splits == splits ("split"): CTA x = tile * splits + c takes chunk c alone and, with more than
//     one chunk, writes P_c to part[c][r][n]; the last CTA of the tile (rowsplit.cuh's ticket;
//     tickets[row tile * column tiles + column tile], zero at rest) folds them in index order.
//     Few rows: enough CTAs to stream the weights at full bandwidth from one row tile.
//   Both modes compute the same bits; dspark.ops.linear.mma_plan picks the tile shape (by rows) and
//   the mode (by CTAs). Row tiles may be sized by the row count; the K order may not.
//
// Tile shapes (MmaGemmConfig, BK 32, 4 stages): BM 16 / 32 (BN 256, 4 warps 1 x 4: decode, verify,
// batched decode) and 64 / 128 (BN 128, 8 warps 2 x 4: wide batches and prompts), and a prompt's wide
// tile 128 x 256 (8 warps of 64 x 64, 3 stages, the chunks' running total in shared memory: the
// accumulators alone fill the registers). Warp (wm, wn) owns rows [wm WM, +WM) and columns
// [wn WN, +WN) of the tile: MT = WM / 16 m-tiles by NT = WN / 8 n-tiles. Each weight is read once
// per row tile, at its stored width.
//
// Pipeline (STAGES buffers of A [BM][BK + 8] and B [BK][BN + 8] in dynamic shared memory; the 16-byte
// pad keeps ldmatrix rows off one bank):
//   B (weights): cp.async 16-byte chunks STAGES - 1 tiles ahead, zero-filled past K and N; scalar
//     loads where N % 8 or w's alignment forbid 16-byte chunks (same values, same order).
//   A (activations): float4 loads one tile ahead into registers, issued before the tile's MMAs and
//     rounded and stored to shared memory after them (scalar loads where K % 4 or x's alignment
//     forbid float4); or (A16: a prompt's tiles) activations rounded once beforehand, by cp.async as B.
//   Per tile: wait_group STAGES - 2, __syncthreads, issue the next tiles, then per k-step ldmatrix
//   A (x4) and B (x4.trans, two n-tiles) and the warp's MT x NT MMAs.
//
// Prologue and epilogue (for fusing the small kernels around the product): every activation passes
// through mma_prologue(row, k, v) on its way from the float4 load to the rounding, and every output
// through mma_epilogue(row, n, v) at the one store that writes `out` (the fold mode's, or the last
// CTA's in split mode). Both act elementwise outside the K loop: an RMSNorm's row scale (computed
// before the product, as today's norm kernel does) goes in the prologue, a residual add or an
// activation in the epilogue, and a row's K order stays the one above. Today both are the identity.
// Two neighbours are fused so far: an MLP's SwiGLU (MmaGemm's SWIGLU mode, linear_mma_<dt>_swiglu_m<BM>:
// the down product reads gate|up [rows, 2K] and stages SiLU(gate) * up, the bits swiglu_f32 writes) and
// the attention's output gate (GATED, linear_mma_<dt>_gated_m<BM>: o as T and its gates, attn_gate's bits).
#pragma once
#include "activation.cuh"
#include "common.cuh"
#include "rowsplit.cuh"
#include "tensor_core.cuh"

// SHARED_TOTAL: the running total of the K chunks kept in shared memory, each thread's own elements
// (a fold reads and writes only what the thread wrote), not in registers beside the accumulators:
// that lets a warp hold twice the outputs (the prompt's 128 x 256 tile, 64 x 64 a warp).
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_, bool SHARED_TOTAL_ = false>
struct MmaGemmConfig {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
  static constexpr bool SHARED_TOTAL = SHARED_TOTAL_;
  static constexpr int WARPS = WARPS_M * WARPS_N, THREADS = 32 * WARPS, MIN_CTAS = 0;  // __launch_bounds__: none
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, MT = WM / 16, NT = WN / 8;
  static constexpr int A_ROW = BK + 8, B_ROW = BN + 8;  // shared-memory row strides, in elements
  static constexpr int A_STAGE = BM * A_ROW, B_STAGE = BK * B_ROW;
  static constexpr int A_VECS = BM * BK / 4 / THREADS;  // float4s of x per thread per tile
  static constexpr int B_VECS = BK * BN / 8 / THREADS;  // 16-byte chunks of w per thread per tile
  static constexpr int STAGE_BYTES = 2 * STAGES * (A_STAGE + B_STAGE);
  static constexpr int SMEM_BYTES = STAGE_BYTES + (SHARED_TOTAL ? 4 * BM * BN : 0);
  static_assert(WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0 && 32 % BK == 0, "tile shape");
  static_assert(A_VECS * THREADS * 4 == BM * BK && B_VECS * THREADS * 8 == BK * BN, "loads per thread");
};

// Fold mode's CTA order: the CTAs of a wave take kMmaGroupRows row tiles by as many column tiles as
// fit, so the activations and weights a wave reads (about 45 MB for an H200's 132 CTAs of a
// 128 x 128 tile at K = 5120) stay in L2 while it runs. Which CTA takes a tile changes no bit.
constexpr int kMmaGroupRows = 8;

// The prologue and epilogue hooks (identity): see the header.
DSPARK_DEVICE float mma_prologue(int /*row*/, int /*k*/, float v) { return v; }
DSPARK_DEVICE float mma_epilogue(int /*row*/, int /*n*/, float v) { return v; }

// Round to nearest even of a finite or infinite f32 pair: T's rounding without from_float's NaN test.
// On the device one cvt.rn.<T>x2.f32 for the pair (no .ftz: subnormals kept; the same rounding for
// every finite and infinite f32), where the integer rounding takes about nine; under simt, or where
// DSPARK_MMA_PACK_IN_INTEGERS is defined (moe.cu: its 16-row tile at its register cap), that integer
// rounding: the same bits.
template <typename T>
DSPARK_DEVICE uint32_t pack2_finite(float lo, float hi) {
  return (uint32_t)from_float<T>(lo).bits | (uint32_t)from_float<T>(hi).bits << 16;
}
template <>
__device__ __forceinline__ uint32_t pack2_finite<bf16_t>(float lo, float hi) {
#if defined(DSPARK_SIMT) || defined(DSPARK_MMA_PACK_IN_INTEGERS)
  const uint32_t a = __float_as_uint(lo), b = __float_as_uint(hi);
  return ((a + 0x7fffu + ((a >> 16) & 1u)) >> 16) | ((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u);
#else
  uint32_t out;  // the first source is the upper half
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
#endif
}
#if !defined(DSPARK_SIMT) && !defined(DSPARK_MMA_PACK_IN_INTEGERS)
template <>
__device__ __forceinline__ uint32_t pack2_finite<f16_t>(float lo, float hi) {
  uint32_t out;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}
#endif

// A pair of activations rounded to T as from_float rounds them (a NaN keeps its sign and top payload
// bits, quieted): pack2_finite, and from_float itself where either is a NaN.
template <typename T>
DSPARK_DEVICE uint32_t mma_pack2(float lo, float hi) {
#if defined(DSPARK_SIMT) || defined(DSPARK_MMA_PACK_IN_INTEGERS)
  return (uint32_t)from_float<T>(lo).bits | (uint32_t)from_float<T>(hi).bits << 16;
#else
  if (dspark_isnan(lo) || dspark_isnan(hi))
    return (uint32_t)from_float<T>(lo).bits | (uint32_t)from_float<T>(hi).bits << 16;
  return pack2_finite<T>(lo, hi);
#endif
}

// A tile's rows are rows [r0, r0 + BM) of a block of `rows` output rows starting at output row
// `row0` (the whole product: row0 0; an expert's group of the grouped product, moe.cu: its first
// grouped row). Output row row0 + r reads x row row0 + r, or x_rows[row0 + r] where the product
// gathers its rows (Gather with a map: the grouped product's first projection reads each token's
// row; Gather without one reads row0 + r, so one instantiation serves both grouped products).
// SWIGLU: x is an MLP's gate|up product [rows, 2K] and the activations are SiLU(gate) * up of its
// halves (activation.cuh's swiglu_value: bitwise what swiglu_f32 writes), so the down product reads
// gate|up itself and no f32 activations are written and read back between two launches. Both halves
// load with the tile's other loads and are combined where the stage is stored, after the tile's MMAs.
// GATED: the activations are an attention's output o [rows, K] as T, each widened and, where the model
// gates it, times the sigmoid of its gate (head h = k / head_dim's gate at gate[row * gate_stride +
// h * gate_head + k % head_dim]): activation.cuh's act_sigmoid, bitwise what attn_gate_<t> writes.
// A16: the activations come as T already (xh, rounded by round_activations_<t> from the same f32, so the
// stage holds the same values), copied into the stage by cp.async like the weights: half the bytes of
// the f32 x through L2, and no register staging.
template <typename T, typename Cfg, bool Gather = false, bool A16_ = false, bool SWIGLU_ = false, bool GATED_ = false>
struct MmaGemm {
  using C = Cfg;
  static constexpr bool A16 = A16_, SWIGLU = SWIGLU_, GATED = GATED_;
  static_assert(A16 + SWIGLU + GATED <= 1, "one activation source");
  static constexpr int A_HELD = C::A_VECS * (SWIGLU || GATED ? 2 : 1);  // float4s a thread holds from load to store
  static constexpr int A_CHUNKS = C::BM * C::BK / 8 / C::THREADS;  // A16: 16-byte chunks per thread per tile
  const float* __restrict__ x;
  const int* __restrict__ x_rows;  // Gather: the x row of each output row
  int rows, K, N;
  int row0;           // the block's first output row
  int r0, n0;         // the tile's first row (in the block) and column
  int n1;             // the tile's column end (at most n0 + BN and N): mma_tile_column
  bool x_vec;         // float4 loads of x (uniform over the launch)
  T* sa;              // A stages
  T* sb;              // B stages
  const T* __restrict__ xh = nullptr;  // A16: the activations [rows, K] as T (K % 8 == 0)
  const T* __restrict__ xo = nullptr;  // GATED: the attention's output [rows, K]
  const float* __restrict__ gate = nullptr;  // GATED: the gates (none: o widened alone)
  long long gate_stride = 0;
  int gate_head = 0, head_dim = 1;

  __device__ __forceinline__ int64_t x_row(int r) const {
    return Gather && x_rows ? (int64_t)x_rows[row0 + r] : (int64_t)(row0 + r);
  }

  // A tile kt (columns [k, k + BK)): thread-owned float4s of x, after the prologue; SWIGLU: the gate
  // halves in v[0 .. A_VECS) and the up halves in v[A_VECS ..), zero past rows and K (SiLU(0) * 0 = +0,
  // the zero the other modes store there), combined by store_a.
  __device__ __forceinline__ void load_a(int k, float4 (&v)[A_HELD]) const {
#pragma unroll
    for (int i = 0; i < C::A_VECS; ++i) {
      const int c = threadIdx.x + i * C::THREADS, row = c / (C::BK / 4), col = k + 4 * (c % (C::BK / 4));
      const int r = r0 + row;
      float e[4] = {0.f, 0.f, 0.f, 0.f}, u[4] = {0.f, 0.f, 0.f, 0.f};
      if constexpr (GATED) {  // o's bits held as they load (store_a widens them): the loads stay in flight
        if (r < rows && x_vec) {  // 8 bytes of o, 16 of gates, all in one head (head_dim % 4 == 0)
          const int64_t xr = x_row(r);
          if (col < K) {
            const uint2 b = *reinterpret_cast<const uint2*>(xo + xr * K + col);
            e[0] = __uint_as_float(b.x & 0xffffu), e[1] = __uint_as_float(b.x >> 16);
            e[2] = __uint_as_float(b.y & 0xffffu), e[3] = __uint_as_float(b.y >> 16);
            if (gate) {
              const int h = col / head_dim;
              const float4 g =
                  *reinterpret_cast<const float4*>(gate + xr * gate_stride + (int64_t)h * gate_head + (col - h * head_dim));
              u[0] = g.x, u[1] = g.y, u[2] = g.z, u[3] = g.w;
            }
          }
        } else if (r < rows) {
          const int64_t xr = x_row(r);
#pragma unroll
          for (int j = 0; j < 4; ++j)
            if (col + j < K) {
              e[j] = __uint_as_float(xo[xr * K + col + j].bits);
              if (gate) {
                const int h = (col + j) / head_dim;
                u[j] = gate[xr * gate_stride + (int64_t)h * gate_head + (col + j - h * head_dim)];
              }
            }
        }
      } else if (r < rows) {
        const float* p = x + x_row(r) * (SWIGLU ? 2 * (int64_t)K : (int64_t)K) + col;
        if (x_vec) {
          if (col < K) {
            const float4 f = *reinterpret_cast<const float4*>(p);
            e[0] = f.x, e[1] = f.y, e[2] = f.z, e[3] = f.w;
            if constexpr (SWIGLU) {
              const float4 h = *reinterpret_cast<const float4*>(p + K);
              u[0] = h.x, u[1] = h.y, u[2] = h.z, u[3] = h.w;
            }
          }
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j)
            if (col + j < K) {
              e[j] = p[j];
              if constexpr (SWIGLU) u[j] = p[K + j];
            }
        }
      }
      if constexpr (SWIGLU || GATED) {
        v[C::A_VECS + i] = make_float4(u[0], u[1], u[2], u[3]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) e[j] = r < rows && col + j < K ? mma_prologue(r, col + j, e[j]) : 0.f;
      }
      v[i] = make_float4(e[0], e[1], e[2], e[3]);
    }
  }

  // A16: tile kt (columns [k, k + BK)) of xh straight into `stage`, 16 bytes a copy, zero past rows and K.
  __device__ __forceinline__ void copy_a(int stage, int k) const {
    static_assert(!A16 || A_CHUNKS * C::THREADS * 8 == C::BM * C::BK, "A16 copies per thread");
    T* dst = sa + stage * C::A_STAGE;
#pragma unroll
    for (int i = 0; i < A_CHUNKS; ++i) {
      const int c = threadIdx.x + i * C::THREADS, row = c / (C::BK / 8), col = 8 * (c % (C::BK / 8));
      const int r = r0 + row;
      const bool valid = r < rows && k + col < K;  // K % 8 == 0: a chunk is wholly in or out
      cp_async16(dst + row * C::A_ROW + col, valid ? xh + x_row(r) * K + k + col : xh, valid);
    }
  }

  // Tile kt of A into `stage`: copied (A16), or loaded into v now and stored by store_a later.
  __device__ __forceinline__ void start_a(int stage, int k, float4 (&v)[A_HELD]) const {
    if constexpr (A16)
      copy_a(stage, k);
    else
      load_a(k, v);
  }

  __device__ __forceinline__ void finish_a(int stage, const float4 (&v)[A_HELD]) const {
    if constexpr (!A16) store_a(stage, v);
  }

  // GATED: o's bits as load_a holds them (zero past rows and K), widened as attn_gate widens them.
  static __device__ __forceinline__ float gated_widen(float held) {
    T t;
    t.bits = (uint16_t)__float_as_uint(held);
    return to_float(t);
  }

  __device__ __forceinline__ void store_a(int stage, const float4 (&v)[A_HELD]) const {
    T* dst = sa + stage * C::A_STAGE;
#pragma unroll
    for (int i = 0; i < C::A_VECS; ++i) {
      const int c = threadIdx.x + i * C::THREADS, row = c / (C::BK / 4), col = 4 * (c % (C::BK / 4));
      float4 a = v[i];
      if constexpr (SWIGLU) {
        const float4 u = v[C::A_VECS + i];
        a = make_float4(swiglu_value(a.x, u.x), swiglu_value(a.y, u.y), swiglu_value(a.z, u.z),
                        swiglu_value(a.w, u.w));
      }
      if constexpr (GATED) {
        a = make_float4(gated_widen(a.x), gated_widen(a.y), gated_widen(a.z), gated_widen(a.w));
        if (gate) {
          const float4 u = v[C::A_VECS + i];
          a = make_float4(a.x * act_sigmoid(u.x), a.y * act_sigmoid(u.y), a.z * act_sigmoid(u.z),
                          a.w * act_sigmoid(u.w));
        }
      }
      *reinterpret_cast<uint2*>(dst + row * C::A_ROW + col) =
          make_uint2(mma_pack2<T>(a.x, a.y), mma_pack2<T>(a.z, a.w));
    }
  }
};

// Where a B tile (rows [k, k + BK) of w, columns [n0, n0 + BN), zero outside [0, K) x [n0, n1)) comes
// from. `fetch` starts the tile's loads for a stage, `place` finishes them into it once the MMAs of
// the current tile are issued (the A tile's register staging, one tile ahead). 16-bit weights:
// cp.async straight into shared memory, nothing held. (FP8 weights: linear_fp8.cu's MmaWeightsFp8,
// bytes held in registers and dequantized into the stage.)
template <typename T, typename Cfg>
struct MmaWeights16 {
  using C = Cfg;
  const T* __restrict__ w;
  int K, N;
  bool vec;  // 16-byte chunks of w (N % 8 == 0 and w 16-byte aligned)
  struct Held {};

  __device__ __forceinline__ void fetch(T* stage, int k, int n0, int n1, Held&) const {
#pragma unroll
    for (int i = 0; i < C::B_VECS; ++i) {
      const int c = threadIdx.x + i * C::THREADS, kr = c / (C::BN / 8), col = 8 * (c % (C::BN / 8));
      const int kk = k + kr, n = n0 + col;
      T* d = stage + kr * C::B_ROW + col;
      if (vec) {
        const bool valid = kk < K && n < n1;  // N % 8 == 0, so n1 too: a chunk is wholly in or out
        cp_async16(d, valid ? w + (int64_t)kk * N + n : w, valid);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          T v;
          v.bits = 0;
          if (kk < K && n + j < n1) v = w[(int64_t)kk * N + n + j];
          d[j] = v;
        }
      }
    }
  }

  __device__ __forceinline__ void place(T*, const Held&) const {}
};

// One warp's MMAs over one B/A stage: k-steps [0, steps) of the tile.
template <typename T, typename Cfg>
DSPARK_DEVICE void mma_tile_steps(float (&acc)[Cfg::MT][Cfg::NT][4], const T* sa, const T* sb, int steps) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / Cfg::WARPS_N, wn = warp % Cfg::WARPS_N;
  const T* arow = sa + (wm * Cfg::WM + (lane & 15)) * Cfg::A_ROW + 8 * (lane >> 4);
  const T* brow = sb + ((lane & 7) + 8 * ((lane >> 3) & 1)) * Cfg::B_ROW + wn * Cfg::WN + 8 * (lane >> 4);
#pragma unroll
  for (int s = 0; s < Cfg::BK / 16; ++s) {
    if (s < steps) {
      uint32_t a[Cfg::MT][4], b[Cfg::NT][2];
#pragma unroll
      for (int mt = 0; mt < Cfg::MT; ++mt) ldmatrix_x4(a[mt], arow + mt * 16 * Cfg::A_ROW + 16 * s);
#pragma unroll
      for (int np = 0; np < Cfg::NT; np += 2) {
        uint32_t r[4];
        ldmatrix_x4_trans(r, brow + 16 * s * Cfg::B_ROW + 8 * np);
        b[np][0] = r[0], b[np][1] = r[1], b[np + 1][0] = r[2], b[np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < Cfg::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < Cfg::NT; ++nt) mma_16816<T>(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
    }
  }
}

// Split mode's end: once every CTA of the tile wrote its chunk's partial (part[c][r][n], part_rows
// rows per chunk), the last to arrive at `ticket` adds them in index order from -0 into out for the
// tile's output rows [r_first, r_first + nr) and columns [n0, n1): the header's order.
DSPARK_DEVICE void mma_fold_partials(const float* __restrict__ part, float* __restrict__ out, unsigned* ticket,
                                     int splits, int part_rows, int N, int r_first, int nr, int n0, int n1) {
  if (!split_arrive(ticket, (unsigned)splits, /*all_wrote=*/true)) return;
  const int nc = n1 - n0;
  for (int i = threadIdx.x; i < nr * nc; i += blockDim.x) {
    const int r = r_first + i / nc, n = n0 + i % nc;
    const volatile float* p = part + (int64_t)r * N + n;  // other CTAs' partials: from L2
    float v = -0.f;
    for (int c = 0; c < splits; ++c) v = v + p[(int64_t)c * part_rows * N];
    out[(int64_t)r * N + n] = mma_epilogue(r, n, v);
  }
}

// One tile of the product over weight source Wt (MmaWeights16 here, MmaWeightsFp8 in linear_fp8.cu: the
// K order of the header whatever the source, since every source puts the same kind of tile in the
// stages), its K chunks folded in registers (grid_splits 1) or chunk `split` alone
// with its partial in part[split][row][n] (part_rows rows per chunk) and the fold by the last of the
// tile's CTAs to arrive at tickets[row_tile * col_tiles + tile]. The order of every output is the
// header's, whatever the tile. (The ticket's address is formed after the K loop: formed before it,
// ptxas gives the 16-row shape 74 more registers.)
template <typename T, typename Cfg, bool Gather, typename Wt, bool A16, bool SWIGLU, bool GATED>
DSPARK_DEVICE void mma_tile(const MmaGemm<T, Cfg, Gather, A16, SWIGLU, GATED>& g, const Wt& wt, int kchunk, int grid_splits, int split,
                            float* __restrict__ out, float* __restrict__ part, int part_rows,
                            unsigned* __restrict__ tickets, int row_tile, int tile, int col_tiles) {
  using C = Cfg;
  const int K = g.K, N = g.N, rows = g.rows;
  const int splits = (K + kchunk - 1) / kchunk;
  const int k_lo = grid_splits == 1 ? 0 : split * kchunk;
  const int k_hi = grid_splits == 1 ? K : min(K, k_lo + kchunk);
  const int iters = (k_hi - k_lo + C::BK - 1) / C::BK;

  // The running total: registers, or (SHARED_TOTAL) shared memory past the stages, element e of the
  // thread at shared_total[e THREADS + thread] (e = (mt NT + nt) 4 + c).
  float acc[C::MT][C::NT][4], total[C::SHARED_TOTAL ? 1 : C::MT][C::SHARED_TOTAL ? 1 : C::NT][4];
  float* shared_total = reinterpret_cast<float*>(g.sa) + C::STAGE_BYTES / 4;
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc[mt][nt][c] = 0.f;
        if constexpr (C::SHARED_TOTAL)
          shared_total[((mt * C::NT + nt) * 4 + c) * C::THREADS + threadIdx.x] = -0.f;
        else
          total[mt][nt][c] = -0.f;
      }

  float4 av[MmaGemm<T, Cfg, Gather, A16, SWIGLU, GATED>::A_HELD];
  typename Wt::Held held;
#pragma unroll
  for (int s = 0; s < C::STAGES - 1; ++s) {
    if (s < iters) {
      wt.fetch(g.sb + s * C::B_STAGE, k_lo + s * C::BK, g.n0, g.n1, held);
      g.start_a(s, k_lo + s * C::BK, av);
      g.finish_a(s, av);
      wt.place(g.sb + s * C::B_STAGE, held);
    }
    cp_async_commit();
  }
  // The CTA's chunks one by one (fold mode: every chunk of K; split mode: chunk `split`), each chunk's
  // tiles in the inner loop, the pipeline running on across the chunks, the fold after each chunk:
  // the inner loop is the main loop (profiling/sass.py: the innermost loop with the most MMAs).
  int it = 0;
  for (int chunk = k_lo / kchunk; it < iters; ++chunk) {
    const int chunk_end = min(k_hi, (chunk + 1) * kchunk);
    const int chunk_tiles = (chunk_end - k_lo + C::BK - 1) / C::BK;  // BK divides kchunk: one chunk per tile
    for (; it < chunk_tiles; ++it) {
      cp_async_wait<C::STAGES - 2>();
      __syncthreads();  // tile it is in shared memory; tile it - 1 is consumed everywhere
      const int next = it + C::STAGES - 1, k = k_lo + it * C::BK;
      if (next < iters) {
        wt.fetch(g.sb + (next % C::STAGES) * C::B_STAGE, k_lo + next * C::BK, g.n0, g.n1, held);
        g.start_a(next % C::STAGES, k_lo + next * C::BK, av);
      }
      cp_async_commit();
      const int steps = min(C::BK, chunk_end - k + 15) / 16;
      mma_tile_steps<T, C>(acc, g.sa + (it % C::STAGES) * C::A_STAGE, g.sb + (it % C::STAGES) * C::B_STAGE,
                           steps);
      if (next < iters) {
        g.finish_a(next % C::STAGES, av);
        wt.place(g.sb + (next % C::STAGES) * C::B_STAGE, held);
      }
    }
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)  // the chunk's partial folded; the next starts from +0
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if constexpr (C::SHARED_TOTAL) {
            float& t = shared_total[((mt * C::NT + nt) * 4 + c) * C::THREADS + threadIdx.x];
            t = t + acc[mt][nt][c];
          } else {
            total[mt][nt][c] = total[mt][nt][c] + acc[mt][nt][c];
          }
          acc[mt][nt][c] = 0.f;
        }
  }
  cp_async_wait<0>();  // nothing is in flight when the CTA leaves (the empty tail groups)

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = g.r0 + (warp / C::WARPS_N) * C::WM + (lane >> 2);
  const int col0 = g.n0 + (warp % C::WARPS_N) * C::WN + 2 * (lane & 3);
  const bool partial = grid_splits > 1 && splits > 1;
  float* dst = partial ? part + (int64_t)split * part_rows * N : out;
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int r = row0 + 16 * mt + 8 * (c >> 1), n = col0 + 8 * nt + (c & 1);
        float v;
        if constexpr (C::SHARED_TOTAL)
          v = shared_total[((mt * C::NT + nt) * 4 + c) * C::THREADS + threadIdx.x];
        else
          v = total[mt][nt][c];
        if (r < rows && n < g.n1) dst[(int64_t)(g.row0 + r) * N + n] = partial ? v : mma_epilogue(g.row0 + r, n, v);
      }
  if (!partial) return;
  mma_fold_partials(part, out, tickets + row_tile * col_tiles + tile, splits, part_rows, N, g.row0 + g.r0,
                    min(C::BM, rows - g.r0), g.n0, g.n1);
}

template <typename Cfg>
DSPARK_DEVICE void mma_check_launch() {
#if defined(DSPARK_SIMT)
  if ((size_t)Cfg::SMEM_BYTES > simt::dynamic_smem_size() || (int)blockDim.x != Cfg::THREADS)
    simt::fault("linear_mma: launch plan does not match the kernel (shared_mem " +
                std::to_string(simt::dynamic_smem_size()) + " < " + std::to_string(Cfg::SMEM_BYTES) +
                " or block != " + std::to_string(Cfg::THREADS) + ")");
#endif
}

// GATED's source: o, its gates (or none) and where head h's are.
template <typename T>
struct MmaGateSource {
  const T* o = nullptr;
  const float* gate = nullptr;
  long long stride = 0;
  int head = 0, dim = 1;
  bool vec = false;  // 8-byte loads of o and 16-byte loads of gates (uniform over the launch)
};

// The first column of column tile t of `col_tiles` over N: N's groups of 8 columns dealt out evenly
// (t groups / col_tiles of them before it). Any count from ceil(N / BN) up gives tiles of at most BN
// columns with every 16-byte weight chunk in one tile, so the plan (dspark.ops.linear.mma_plan) picks the
// count whose CTAs fill the SMs in whole waves. No column enters another's sum: the bits are the same
// for every count.
// (Opaque to ptxas: the 16-row shape takes 236 registers where it needs 156 when it can see the
// division, whose use it spreads into the K loop.)
DSPARK_DEVICE int mma_tile_column(int t, int col_tiles, int N) {
  const unsigned groups = ((unsigned)N + 7u) / 8u;  // t groups < 2^32: a 32-bit division
  return opaque_int(min(N, (int)(8u * ((unsigned)t * groups / (unsigned)col_tiles))));
}

// The whole product over weight source Wt: the CTA's tile and K chunk from its block index; the grid's
// column tiles (gridDim.x / grid_splits) split N as mma_tile_column deals it.
template <typename T, typename Cfg, typename Wt, bool A16 = false, bool SWIGLU = false, bool GATED = false>
DSPARK_DEVICE void mma_gemm(const float* __restrict__ x, const Wt& wt, int rows, int K, int N, int kchunk,
                            int grid_splits, float* __restrict__ out, float* __restrict__ part,
                            unsigned* __restrict__ tickets, const T* __restrict__ xh = nullptr,
                            const MmaGateSource<T>& gs = {}) {
  using C = Cfg;
  DSPARK_DYNAMIC_SMEM(T, smem);
  mma_check_launch<C>();
  const int col_tiles = gridDim.x / grid_splits;
  int tile = blockIdx.x / grid_splits, row_tile = blockIdx.y;
  const int split = blockIdx.x % grid_splits;
  if (grid_splits == 1) {  // fold: CTAs in groups of kMmaGroupRows row tiles, column tile by column tile
    const int id = blockIdx.y * gridDim.x + blockIdx.x, per_group = kMmaGroupRows * col_tiles;
    const int first = id / per_group * kMmaGroupRows, in_group = min(kMmaGroupRows, (int)gridDim.y - first);
    row_tile = first + id % per_group % in_group;
    tile = id % per_group / in_group;
  }
  const MmaGemm<T, C, false, A16, SWIGLU, GATED> g{x, nullptr, rows, K, N, 0, row_tile * C::BM,
                                                    mma_tile_column(tile, col_tiles, N),
                                                    mma_tile_column(tile + 1, col_tiles, N),
                                                    GATED ? gs.vec
                                                          : K % 4 == 0 && !(reinterpret_cast<unsigned long long>(x) & 15ull),
                                                    smem, smem + C::STAGES * C::A_STAGE, xh, gs.o, gs.gate, gs.stride,
                                                    gs.head, gs.dim};
  mma_tile<T, C, false>(g, wt, kchunk, grid_splits, split, out, part, rows, tickets, row_tile, tile, col_tiles);
}

template <typename T, typename Cfg>
DSPARK_DEVICE void linear_mma(const float* __restrict__ x, const T* __restrict__ w, int rows, int K, int N,
                              int kchunk, int grid_splits, float* __restrict__ out, float* __restrict__ part,
                              unsigned* __restrict__ tickets) {
  const MmaWeights16<T, Cfg> wt{w, K, N, N % 8 == 0 && !(reinterpret_cast<unsigned long long>(w) & 15ull)};
  mma_gemm<T, Cfg>(x, wt, rows, K, N, kchunk, grid_splits, out, part, tickets);
}

// The down product of an MLP over its gate|up product [rows, 2K] (SWIGLU above): bitwise linear_mma over
// swiglu_f32's output.
template <typename T, typename Cfg>
DSPARK_DEVICE void linear_mma_swiglu(const float* __restrict__ gate_up, const T* __restrict__ w, int rows, int K,
                                     int N, int kchunk, int grid_splits, float* __restrict__ out,
                                     float* __restrict__ part, unsigned* __restrict__ tickets) {
  const MmaWeights16<T, Cfg> wt{w, K, N, N % 8 == 0 && !(reinterpret_cast<unsigned long long>(w) & 15ull)};
  mma_gemm<T, Cfg, MmaWeights16<T, Cfg>, false, true>(gate_up, wt, rows, K, N, kchunk, grid_splits, out, part,
                                                      tickets);
}

// An attention's output projection over o [rows, K] as T and its gates (GATED above): bitwise linear_mma
// over attn_gate_<t>'s output.
template <typename T, typename Cfg>
DSPARK_DEVICE void linear_mma_gated(const T* __restrict__ o, const T* __restrict__ w, int rows, int K, int N,
                                    int kchunk, int grid_splits, float* __restrict__ out, float* __restrict__ part,
                                    unsigned* __restrict__ tickets, const float* __restrict__ gate,
                                    long long gate_stride, int gate_head, int head_dim) {
  const MmaWeights16<T, Cfg> wt{w, K, N, N % 8 == 0 && !(reinterpret_cast<unsigned long long>(w) & 15ull)};
  const bool vec = K % 4 == 0 && !(reinterpret_cast<unsigned long long>(o) & 7ull) &&
                   (!gate || (!(reinterpret_cast<unsigned long long>(gate) & 15ull) && gate_stride % 4 == 0 &&
                              gate_head % 4 == 0 && head_dim % 4 == 0));
  mma_gemm<T, Cfg, MmaWeights16<T, Cfg>, false, false, true>(nullptr, wt, rows, K, N, kchunk, grid_splits, out, part,
                                                             tickets, nullptr,
                                                             MmaGateSource<T>{o, gate, gate_stride, gate_head, head_dim,
                                                                              vec});
}

// The same product over activations already rounded to T (linear_mma.cuh's A16: the prompt shapes; the
// K order, and so every bit, of linear_mma over their f32 source).
template <typename T, typename Cfg>
DSPARK_DEVICE void linear_mma_a16(const T* __restrict__ xh, const T* __restrict__ w, int rows, int K, int N,
                                  int kchunk, int grid_splits, float* __restrict__ out, float* __restrict__ part,
                                  unsigned* __restrict__ tickets) {
#if defined(DSPARK_SIMT)
  if (K % 8 || (reinterpret_cast<unsigned long long>(xh) & 15ull))
    simt::fault("linear_mma a16: K % 8 != 0 or the activations off 16 bytes (the plan takes the f32 entry there)");
#endif
  const MmaWeights16<T, Cfg> wt{w, K, N, N % 8 == 0 && !(reinterpret_cast<unsigned long long>(w) & 15ull)};
  mma_gemm<T, Cfg, MmaWeights16<T, Cfg>, true>(nullptr, wt, rows, K, N, kchunk, grid_splits, out, part, tickets, xh);
}

// The instantiated tile shapes: dspark/ops/linear.py (MMA_CONFIGS) holds the same table.
using MmaGemmM16 = MmaGemmConfig<16, 256, 32, 1, 4, 4>;
using MmaGemmM32 = MmaGemmConfig<32, 256, 32, 1, 4, 4>;
using MmaGemmM64 = MmaGemmConfig<64, 128, 32, 2, 4, 4>;
using MmaGemmM128 = MmaGemmConfig<128, 128, 32, 2, 4, 4>;
using MmaGemmM128N256 = MmaGemmConfig<128, 256, 32, 2, 4, 3, true>;  // prompts: 64 x 64 a warp, the total shared
