// linear_fp8.cuh: the FP8 weights' B-tile loader of the tensor-core GEMM (linear_mma.cuh), shared by
// the dense product (linear_fp8.cu) and the grouped expert product (moe.cu), so that both dequantize
// with one arithmetic: W[k, n] = round_T(fl32(e4m3(q[k, n]) * scale[k / 128][n / 128])), the bytes
// decoded in registers on their way to shared memory (linear_fp8.cu's header states the tiling).
#pragma once
#include "common.cuh"
#include "fp8.cuh"
#include "linear_mma.cuh"

// An e4m3 byte (not a NaN pattern: the loader refuses them) to f32 in a few instructions: its sign and
// 7 magnitude bits placed at an f32's bits 31 and 26..20 are e4m3 * 2^-120 exactly, its subnormals
// (m 2^-9) included as f32 subnormals (-ftz=false), and the multiply by 2^120 is exact: fp8.cuh's
// e4m3_to_float for every other byte, without its branches.
DSPARK_DEVICE float e4m3_exact(uint32_t b) {
  return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * __uint_as_float(0x7b800000u);  // 2^120
}

// Two e4m3 bytes of `word` (at bit `shift` and shift + 8) dequantized, fl32(e4m3 * s), and rounded
// into one T pair.
template <typename T>
DSPARK_DEVICE uint32_t fp8_pair(uint32_t word, int shift, float s) {
  return pack2_finite<T>(e4m3_exact(word >> shift) * s, e4m3_exact(word >> (shift + 8)) * s);
}

template <typename T, typename Cfg>
struct MmaWeightsFp8 {
  using C = Cfg;
  // A thread's chunks of a tile share one column (THREADS is a multiple of a row's chunks) and the
  // tile's BK rows lie in one 128-row block (BK divides 128): one scale per thread per tile.
  static_assert(C::THREADS % (C::BN / 8) == 0 && kFp8Block % C::BK == 0, "one scale per thread and tile");
  const uint8_t* __restrict__ q;
  const float* __restrict__ scale;
  int K, N;
  bool vec;  // 8-byte loads of q
  struct Held {
    uint2 raw[C::B_VECS];
    float s;
  };

  __device__ __forceinline__ void fetch(T*, int k, int n0, int n1, Held& h) const {
    const int col = 8 * (threadIdx.x % (C::BN / 8)), n = n0 + col;
    h.s = n < n1 ? fp8_block_scale(scale, k, n, N) : 0.f;
#pragma unroll
    for (int i = 0; i < C::B_VECS; ++i) {
      const int kk = k + (threadIdx.x + i * C::THREADS) / (C::BN / 8);
      h.raw[i] = make_uint2(0u, 0u);
      if (kk < K && n < n1) {
        const uint8_t* p = q + (int64_t)kk * N + n;
        if (vec) {
          h.raw[i] = *reinterpret_cast<const uint2*>(p);
        } else {
          uint32_t lo = 0u, hi = 0u;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (n + j < n1) lo |= (uint32_t)p[j] << (8 * j);
            if (n + 4 + j < n1) hi |= (uint32_t)p[4 + j] << (8 * j);
          }
          h.raw[i] = make_uint2(lo, hi);
        }
      }
    }
  }

  __device__ __forceinline__ void place(T* stage, const Held& h) const {
    const int col = 8 * (threadIdx.x % (C::BN / 8));
#pragma unroll
    for (int i = 0; i < C::B_VECS; ++i) {
      const int kr = (threadIdx.x + i * C::THREADS) / (C::BN / 8);
      const uint2 r = h.raw[i];
      *reinterpret_cast<uint4*>(stage + kr * C::B_ROW + col) =
          make_uint4(fp8_pair<T>(r.x, 0, h.s), fp8_pair<T>(r.x, 16, h.s), fp8_pair<T>(r.y, 0, h.s),
                     fp8_pair<T>(r.y, 16, h.s));
    }
  }
};

// ---- The decode shapes (BM 16 and 32): the bytes straight into the MMA's B fragments ----------------
// With a few rows the weight bytes are the whole cost of the product, and a shared-memory stage (the
// 16-bit tile written, then read back by ldmatrix) issues and moves more than the bytes need. Here no
// weight touches shared memory. Warp w of the CTA owns columns [c, c + 8 NT), c = n0 + 8 NT w, NT n-tiles
// (NT = 8 at BM 16, 4 at BM 32: its accumulators fit beside the bytes in flight). For the k-step of 16 at
// k, lane (g = lane / 4, j = lane % 4) loads NT bytes from each of the rows k + 2j, k + 2j + 1,
// k + 2j + 8, k + 2j + 9 at columns [c + NT g, c + NT g + NT) (Fp8Columns), decodes them and pairs rows
// (2j, 2j + 1) and (2j + 8, 2j + 9) column by column: those pairs are exactly mma.m16n8k16's B
// fragment (b0, b1) of lane (g, j) for n-tile i, whose column g is c + NT g + i (fp8_fragments). Each
// column meets the k-steps, and within each the k order, of the stage path: the same bits. The
// accumulator's columns 2j and 2j + 1 of n-tile i are c + 2 NT j + i and c + 2 NT j + NT + i.
// The activations take linear_mma's A stage (two buffers of [BM][BK + 8], float4 loads one iteration
// ahead); the bytes are loaded one iteration (BK = 64: four k-steps, half a scale block) ahead, each
// k-step's into the registers its decode has just freed.
template <int BM_, int WARPS_N_, int NT_, int MIN_CTAS_ = 0>
struct Fp8StreamConfig {
  static constexpr int BM = BM_, BK = 64, WARPS_M = 1, WARPS_N = WARPS_N_, NT = NT_, STAGES = 2, MIN_CTAS = MIN_CTAS_;
  static constexpr int WARPS = WARPS_M * WARPS_N, THREADS = 32 * WARPS, WM = BM, WN = 8 * NT, BN = WARPS_N * WN;
  static constexpr int MT = BM / 16, STEPS = BK / 16, WORDS = NT / 4;  // a lane's bytes of a row, in words
  static constexpr int A_ROW = BK + 8, A_STAGE = BM * A_ROW;
  static constexpr int A_VECS = BM * BK / 4 / THREADS;  // float4s of x per thread per iteration
  static constexpr int SMEM_BYTES = 2 * STAGES * A_STAGE;
  static_assert((NT == 8 || NT == 4) && kFp8Block % WN == 0 && kFp8Block % BK == 0 &&
                A_VECS * THREADS * 4 == BM * BK, "tile shape");
};

// A word's four e4m3 bytes (byte b in bits 8b .. 8b + 7) to f32, exactly. sm_89 and later: a
// cvt.rn.f16x2.e4m3x2 per half word (every e4m3 is exact in f16; the halves picked by the operand,
// not by a shift) and a cvt.f32.f16 each. simt runs that instruction's definition (each byte's f16);
// sm_80 places the bits (e4m3_exact).
DSPARK_DEVICE void e4m3x4_to_float(uint32_t w, float (&f)[4]) {
#if defined(DSPARK_SIMT)
#pragma unroll
  for (int b = 0; b < 4; ++b) f[b] = to_float(from_float<f16_t>(e4m3_to_float((w >> (8 * b)) & 0xffu)));
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n"
      "  .reg .b16 q0, q1, h0, h1, h2, h3;\n"
      "  .reg .b32 lo, hi;\n"
      "  mov.b32 {q0, q1}, %4;\n"
      "  cvt.rn.f16x2.e4m3x2 lo, q0;\n"
      "  cvt.rn.f16x2.e4m3x2 hi, q1;\n"
      "  mov.b32 {h0, h1}, lo;\n"
      "  mov.b32 {h2, h3}, hi;\n"
      "  cvt.f32.f16 %0, h0;\n"
      "  cvt.f32.f16 %1, h1;\n"
      "  cvt.f32.f16 %2, h2;\n"
      "  cvt.f32.f16 %3, h3;\n"
      "}"
      : "=f"(f[0]), "=f"(f[1]), "=f"(f[2]), "=f"(f[3])
      : "r"(w));
#else
#pragma unroll
  for (int b = 0; b < 4; ++b) f[b] = e4m3_exact((w >> (8 * b)) & 0xffu);
#endif
}

// One lane's NT columns of FP8 weights, a k-step at a time: rows k + 2j, k + 2j + 1, k + 2j + 8 and
// k + 2j + 9 (raw[0..3]), NT bytes each; one NT-byte load per row where N % NT == 0 and q is NT-byte
// aligned (`vec`), else byte loads (zero past N). A row past K is read as row K - 1: the activations
// there are zero, and a finite weight times +0 adds a zero as the stage path's zero-filled weight
// does (a checkpoint's bytes are never NaN: the loader refuses them; a NaN byte in row K - 1 makes
// the column NaN anyway). A lane past N reads column 0 (its columns are never stored). The lane's
// columns lie in one 128-column scale block.
template <int NT>
struct Fp8Columns {
  static constexpr int WORDS = NT / 4;
  const uint8_t* __restrict__ q;
  const float* __restrict__ scale;
  int K, N;
  int col, j;  // the lane's first column, and lane % 4
  bool vec;

  // Whole: every row is below K and vec holds (the trip loop's loads): no clamp, no branch.
  template <bool Whole>
  __device__ __forceinline__ void load(int k, uint32_t (&raw)[4][WORDS]) const {
    const uint8_t* base = q + (col < N ? col : 0);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int kk = k + 2 * j + (r & 1) + 8 * (r >> 1);
      const uint8_t* p = row_address(base, Whole ? kk : min(kk, K - 1));
      if (Whole || vec) {
        if (WORDS == 2) {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
          raw[r][0] = v.x, raw[r][WORDS - 1] = v.y;
        } else {
          raw[r][0] = __ldg(reinterpret_cast<const uint32_t*>(p));
        }
      } else {
#pragma unroll
        for (int w = 0; w < WORDS; ++w) {
          uint32_t v = 0u;
#pragma unroll
          for (int b = 0; b < 4; ++b) v |= (col + 4 * w + b < N ? (uint32_t)p[4 * w + b] : 0u) << (8 * b);
          raw[r][w] = v;
        }
      }
    }
  }

  // The trip loop's loads: the lane's 4 rows of a k-step at rp (whole rows, vec), rp then advanced a k-step.
  __device__ __forceinline__ void load_next(const uint8_t* (&rp)[4], uint32_t (&raw)[4][WORDS]) const {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (WORDS == 2) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(rp[r]));
        raw[r][0] = v.x, raw[r][WORDS - 1] = v.y;
      } else {
        raw[r][0] = __ldg(reinterpret_cast<const uint32_t*>(rp[r]));
      }
      rp[r] += 16 * (int64_t)N;
    }
  }

  // The lane's row pointers for the k-step at k (rows below K).
  __device__ __forceinline__ void rows_at(int k, const uint8_t* (&rp)[4]) const {
    const uint8_t* base = q + (col < N ? col : 0);
#pragma unroll
    for (int r = 0; r < 4; ++r) rp[r] = row_address(base, k + 2 * j + (r & 1) + 8 * (r >> 1));
  }

  // base + row N in one instruction (mad.wide.u32: the product of two 32-bit values needs no wider type).
  __device__ __forceinline__ const uint8_t* row_address(const uint8_t* base, int row) const {
#if defined(DSPARK_SIMT)
    return base + (uint64_t)(uint32_t)row * (uint32_t)N;
#else
    uint64_t p;
    asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(p) : "r"(row), "r"(N), "l"(base));
    return reinterpret_cast<const uint8_t*>(p);
#endif
  }

  // The scale of the lane's columns in the block of rows holding k.
  __device__ __forceinline__ float block_scale(int k) const {
    return col < N ? fp8_block_scale(scale, k, col, N) : 0.f;
  }
};

// A k-step's bytes (Fp8Columns::load) to the B fragments of the lane's NT n-tiles: b[i] = (W[2j][i],
// W[2j + 1][i]), (W[2j + 8][i], W[2j + 9][i]), each W = round_T(fl32(e4m3 * s)), the lower row in the
// lower half.
template <typename T, int NT>
DSPARK_DEVICE void fp8_fragments(const uint32_t (&raw)[4][NT / 4], float s, uint32_t (&b)[NT][2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half)      // b0: rows 2j, 2j + 1; b1: rows 2j + 8, 2j + 9
#pragma unroll
    for (int w = 0; w < NT / 4; ++w) {       // bytes 4w .. 4w + 3 of each row: n-tiles 4w .. 4w + 3
      float lo[4], hi[4];
      e4m3x4_to_float(raw[2 * half][w], lo);
      e4m3x4_to_float(raw[2 * half + 1][w], hi);
#pragma unroll
      for (int i = 0; i < 4; ++i) b[4 * w + i][half] = pack2_finite<T>(lo[i] * s, hi[i] * s);
    }
}

// One iteration's four k-steps of a warp: the B fragments decoded from raw (and, with Prefetch, the
// registers refilled from the k-steps at k_next: Whole, from the row pointers rp), A from the stage sa,
// the MMAs; `steps` k-steps run (fewer in a chunk's last iteration only, where nothing is prefetched).
template <typename T, typename C, bool Prefetch, bool Whole>
DSPARK_DEVICE void fp8_stream_iteration(float (&acc)[C::MT][C::NT][4], uint32_t (&raw)[C::STEPS][4][C::WORDS],
                                        float s, const T* sa, const Fp8Columns<C::NT>& src, int k_next, int steps,
                                        const uint8_t* (&rp)[4]) {
#pragma unroll
  for (int st = 0; st < C::STEPS; ++st) {
    if (Prefetch || st < steps) {
      uint32_t b[C::NT][2], a[C::MT][4];
      fp8_fragments<T, C::NT>(raw[st], s, b);
      if (Prefetch && Whole)
        src.load_next(rp, raw[st]);  // read first: the load reuses the registers
      else if (Prefetch)
        src.template load<false>(k_next + 16 * st, raw[st]);
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) ldmatrix_x4(a[mt], sa + mt * 16 * C::A_ROW + 16 * st);
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt) mma_16816<T>(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
    }
  }
}

// A CTA's chunk [lo, hi) of the decode-shape product: the iterations in flight one ahead (Fp8Stream::step)
// and the last one. The common case (8-byte weight loads, float4 activations, the next iteration a whole
// one) runs in trips of two iterations (a scale block), branch-free; the rest (a chunk's last iterations,
// byte loads, unaligned activations) one by one with every bound checked. The trip loop is the one the
// performance model reads (profiling/sass.py: the loop with the most MMAs).
template <typename T, typename C, typename G = MmaGemm<T, C>>
struct Fp8Stream {
  const G& g;                 // MmaGemm<T, C>, or its SWIGLU mode (x an MLP's gate|up [rows, 2K])
  const Fp8Columns<C::NT>& src;
  const T* arow;              // the lane's ldmatrix row in stage 0
  const float* xs[C::A_VECS]; // the thread's x rows at the A tile's columns (null past `rows`)
  uint32_t raw[C::STEPS][4][C::WORDS];
  float4 av[G::A_HELD];       // SWIGLU: the gate halves, then the up halves (MmaGemm::load_a's layout)
  float s;                    // the scale of the iteration the bytes in raw belong to
  const uint8_t* rp[4];       // the trip loop's next k-step rows

  __device__ __forceinline__ Fp8Stream(const G& g_, const Fp8Columns<C::NT>& src_, const T* arow_)
      : g(g_), src(src_), arow(arow_) {
#pragma unroll
    for (int i = 0; i < C::A_VECS; ++i) {
      const int c = threadIdx.x + i * C::THREADS, r = g.r0 + c / (C::BK / 4);
      xs[i] = r < g.rows ? g.x + (int64_t)r * g.K * (G::SWIGLU ? 2 : 1) + 4 * (c % (C::BK / 4)) : nullptr;
    }
  }

  // Iteration `it` of the chunk at k, the next one's (at k + BK) bytes, scale and activations in flight.
  // Whole: the common case's loads (the next iteration whole and below K, vectors allowed).
  template <bool Whole>
  __device__ __forceinline__ void step(float (&acc)[C::MT][C::NT][4], int it, int k) {
    __syncthreads();  // the A stage of iteration it is written; the other one is read by no warp
    const int k_next = k + C::BK;
    if (Whole) {
#pragma unroll
      for (int i = 0; i < C::A_VECS; ++i) {
        av[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if constexpr (G::SWIGLU) av[C::A_VECS + i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (xs[i]) {
          av[i] = *reinterpret_cast<const float4*>(xs[i] + k_next);
          if constexpr (G::SWIGLU) av[C::A_VECS + i] = *reinterpret_cast<const float4*>(xs[i] + g.K + k_next);
        }
      }
    } else {
      g.load_a(k_next, av);  // a chunk's last iterations: every bound checked
    }
    const float s_it = s;
    s = src.block_scale(k_next);
    fp8_stream_iteration<T, C, true, Whole>(acc, raw, s_it, arow + (it & 1) * C::A_STAGE, src, k_next, C::STEPS,
                                            rp);
    g.store_a((it + 1) & 1, av);
  }

  __device__ __forceinline__ void chunk(float (&acc)[C::MT][C::NT][4], int lo, int hi) {
    const int iters = (hi - lo + C::BK - 1) / C::BK, whole = (hi - lo) / C::BK;
    if (iters == 0) return;
#pragma unroll
    for (int st = 0; st < C::STEPS; ++st) src.template load<false>(lo + 16 * st, raw[st]);
    s = src.block_scale(lo);
    g.load_a(lo, av);
    g.store_a(0, av);
    int it = 0;
    if (src.vec && g.x_vec && 2 < whole) {
      src.rows_at(lo + C::BK, rp);
      for (; it + 2 < whole; it += 2) {  // iterations it, it + 1 and the next trip's first are whole
        step<true>(acc, it, lo + it * C::BK);
        step<true>(acc, it + 1, lo + (it + 1) * C::BK);
      }
    }
    for (; it + 1 < iters; ++it) step<false>(acc, it, lo + it * C::BK);
    __syncthreads();
    fp8_stream_iteration<T, C, false, false>(acc, raw, s, arow + (it & 1) * C::A_STAGE, src, 0,
                                             (hi - lo - it * C::BK + 15) / 16, rp);
  }
};

// The decode-shape product: linear_fp8's order (linear_fp8.cu's header) in split mode only: the CTA
// of column tile `tile` and K chunk `split` (blockIdx.x = tile * grid_splits + split, grid_splits ==
// splits) runs its chunk (Fp8Stream::chunk); the partials are folded as linear_mma's split mode does.
template <typename T, typename Cfg, bool SWIGLU = false>
DSPARK_DEVICE void linear_fp8_stream(const float* __restrict__ x, const uint8_t* __restrict__ q,
                                     const float* __restrict__ scale, int rows, int K, int N, int kchunk,
                                     int grid_splits, float* __restrict__ out, float* __restrict__ part,
                                     unsigned* __restrict__ tickets) {
  using C = Cfg;
  DSPARK_DYNAMIC_SMEM(T, smem);
  mma_check_launch<C>();
  const int col_tiles = (N + C::BN - 1) / C::BN, tile = blockIdx.x / grid_splits, split = blockIdx.x % grid_splits;
  const int row_tile = blockIdx.y, splits = (K + kchunk - 1) / kchunk;
#if defined(DSPARK_SIMT)
  if (splits > 1 && grid_splits != splits)
    simt::fault("linear_fp8 m" + std::to_string(C::BM) + ": the decode shapes run split mode only (grid_splits " +
                std::to_string(grid_splits) + " for " + std::to_string(splits) + " chunks)");
#endif
  const MmaGemm<T, C, false, false, SWIGLU> g{x, nullptr, rows, K, N, 0, row_tile * C::BM, tile * C::BN,
                        min(N, (tile + 1) * C::BN),
                        K % 4 == 0 && !(reinterpret_cast<unsigned long long>(x) & 15ull), smem, nullptr};
  const int lane = threadIdx.x & 31, c = g.n0 + (threadIdx.x >> 5) * C::WN;
  const int lo = grid_splits == 1 ? 0 : split * kchunk, hi = min(K, lo + kchunk);
  float acc[C::MT][C::NT][4];
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
  const Fp8Columns<C::NT> src{q, scale, K, N, c + C::NT * (lane >> 2), lane & 3,
                              N % C::NT == 0 && !(reinterpret_cast<unsigned long long>(q) & (C::NT - 1))};
  Fp8Stream<T, C, decltype(g)>(g, src, smem + (lane & 15) * C::A_ROW + 8 * (lane >> 4)).chunk(acc, lo, hi);

  const bool partial = grid_splits > 1 && splits > 1;
  float* dst = partial ? part + (int64_t)split * rows * N : out;
  const int row = g.r0 + (lane >> 2), j = lane & 3;
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = row + 16 * mt + 8 * (e >> 1), n = c + 2 * C::NT * j + C::NT * (e & 1) + nt;
        const float v = -0.f + acc[mt][nt][e];  // the chunk's partial folded from -0, as the stage path does
        if (r < rows && n < N) dst[(int64_t)r * N + n] = partial ? v : mma_epilogue(r, n, v);
      }
  if (!partial) return;
  mma_fold_partials(part, out, tickets + row_tile * col_tiles + tile, splits, rows, N, g.r0, min(C::BM, rows - g.r0),
                    g.n0, g.n1);
}
