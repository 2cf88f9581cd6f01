// moe: a sparse mixture-of-experts block's kernels (the FFN of a MoE layer; dspark/ops/moe.py holds
// the launch plans and the NumPy twins). Per layer: one router launch, then each grouped product in
// one launch, then the combine, all sized on the host by the worst case and reading the routing's
// counts on the device, so a round captures into a CUDA graph with no host sync.
//
// moe_route_f32(logits [rows, ld] (first E columns), ld, rows, E, k, renorm, tile_rows,
//               ids [rows * k], weights [rows * k], pos [rows * k], src [rows * k],
//               counts [E], offsets [E], items [2 * max items], stats [2], tickets [1])
//   Router, one warp per row, kMoeWarps rows per CTA (grid ceil(rows / kMoeWarps), block 256). Lane l
//   holds experts e = l + 32 i (E <= kMoeMaxExperts):
//     m    = max_e logit_e                                     (exact in any order)
//     q_e  = exp(logit_e - m)
//     s    = lane sums q_{l + 32 i} in increasing i from 0, then a butterfly over lanes (xor 16, 8, 4,
//            2, 1; every lane ends with the same bits, adds being commutative)
//     p_e  = q_e / s                                           the softmax, in f32 as transformers takes it
//     top-k: k rounds of the warp's largest (p_e, then the LOWER e: rowsplit.cuh's arg_key) among the
//            experts not taken yet, in rank order j = 0 .. k-1
//     w_j  = p_j, or with renorm p_j / t, t = ((p_0 + p_1) + ...) + p_{k-1}   in rank order
//   ids[r k + i], weights[r k + i]: the row's chosen experts in increasing expert id (slot i: the i-th
//   smallest), with their weights. The hidden states are f32, so the cast of the weights to the hidden
//   dtype is the identity. No capacity limit: every row keeps its k.
//   Then the last CTA to arrive (rowsplit.cuh's ticket) groups the rows by expert:
//     counts[e]   rows routed to e;  offsets[e] = counts of the experts before e (the grouped rows of
//                 expert e are offsets[e] .. offsets[e] + counts[e] - 1, its rows in increasing row order)
//     pos[r k + i] the grouped row of the row's slot i; src[g] the token row of grouped row g
//     items       the CTA-to-expert map of both grouped products: for each expert with rows, in
//                 increasing e, ceil(counts[e] / tile_rows) tiles (items[2 i] = e, items[2 i + 1] = tile)
//     stats[0]    items; stats[1] the distinct experts routed to (what a verify's expert bytes scale with)
//   All of it integer: the same in any arrival order. dspark.ops.moe.route_ref / group_ref are the twins.
//
// moe_linear_<dt>(x, x_rows or null, w [E, K, N], counts, offsets, items, stats, tile_rows, K, N, kchunk,
//                 splits, out [P, N], part, part_rows, tickets)                    dt: f32 (CUDA cores)
// moe_linear_mma_bf16_m<BM>(x, x_rows or null, w, counts, offsets, items, stats, K, N, kchunk, grid_splits,
//                           out, part, part_rows, tickets)                         bf16 (tensor cores)
//   The grouped expert product: grouped row g of expert e is x[x_rows[g]] @ w[e] (x_rows null: x[g]).
//   grid.y = the worst case of items (the host's bound from rows, k and E); CTA y takes item y, or
//   leaves when y >= stats[0]. An item is one expert's tile of rows (tile_rows = BM for the tensor
//   cores; every row of the expert in one tile for f32, which walks its rows 16 at a time): each
//   distinct expert's weights are read once per tile for all its rows, so a verify reads the union of
//   its rows' experts. Inside an item the tile is dspark's GEMM itself (linear_f32.cuh, linear_mma.cuh),
//   the K order a function of (K, N) alone: a row's expert output has the same bits alone, sharing its
//   expert with any other rows, or in the product (linear) by that expert's weights.
//   grid.x = column tiles x K splits, as in linear; tickets: one per (item, column tile), zero at rest.
//
// moe_linear_fp8_bf16_m<BM>(x, x_rows or null, q [E, K, N] e4m3 bytes, scale [E, ceil(K / 128),
//                           ceil(N / 128)] f32, counts, offsets, items, stats, K, N, kchunk, grid_splits,
//                           out, part, part_rows, tickets)                          FP8 (tensor cores)
//   The same grouped product over FP8 experts (W8A16): item y's tile is linear_fp8's, its B tiles
//   linear_fp8.cuh's MmaWeightsFp8 over expert e's bytes and scales (q + e K N, scale + e of its grid),
//   so a row's expert output is bitwise linear_fp8 of that row by that expert's matrix, for the same
//   kchunk (a multiple of 128 from (K, N) alone: dspark.ops.moe.grouped_plan).
//
// moe_combine_f32(y [P, N], pos, weights, shared [rows, N] or null, gate or null, gate_ld, rows, k, N,
//                 out [rows, N])
//   out[r, n] = ((0 + w_0 y[pos_0, n]) + w_1 y[pos_1, n]) + ... + w_{k-1} y[pos_{k-1}, n], its slots in
//   increasing expert id (transformers' eager order), then + sigmoid(gate[r gate_ld]) * shared[r, n] (the
//   shared expert and its gate, Qwen3.5-MoE). The order is the row's own experts', never the order its
//   outputs were produced. One thread per output.
#include "linear_f32.cuh"
// The grouped 16-row FP8 tile sits at sm_90's 128-register cap, where nvcc spills 4 bytes around
// linear_mma.cuh's cvt pair rounding (pack2_finite): the integer rounding here, the same bits.
#define DSPARK_MMA_PACK_IN_INTEGERS 1
#include "linear_fp8.cuh"
#include "linear_mma.cuh"

constexpr int kMoeWarps = 8;  // router rows per CTA
constexpr int kMoeThreads = 32 * kMoeWarps;
constexpr int kMoeMaxExperts = 512;
constexpr int kMoePerLane = kMoeMaxExperts / 32;
constexpr int kMoeCombineThreads = 256;

// The float of an order key (rowsplit.cuh's order_key inverted).
DSPARK_DEVICE float order_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

DSPARK_DEVICE void route_row(const float* __restrict__ lr, int E, int k, int renorm, int* __restrict__ ids,
                             float* __restrict__ weights) {
  const int lane = threadIdx.x & 31;
  float p[kMoePerLane];
  float m = -dspark_inf();
#pragma unroll
  for (int i = 0; i < kMoePerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? lr[e] : -dspark_inf();
    m = fmaxf(m, p[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kMoePerLane; ++i) {
    p[i] = lane + 32 * i < E ? expf(p[i] - m) : 0.f;
    s = s + p[i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s = s + __shfl_xor_sync(0xffffffffu, s, o);
#pragma unroll
  for (int i = 0; i < kMoePerLane; ++i) p[i] = p[i] / s;

  unsigned taken = 0u;  // bit i: expert lane + 32 i is chosen
  int mine = 0;         // lane j: rank j's expert and probability
  float mine_p = 0.f;
  for (int j = 0; j < k; ++j) {
    unsigned long long best = 0ull;
#pragma unroll
    for (int i = 0; i < kMoePerLane; ++i) {
      const int e = lane + 32 * i;
      const unsigned long long key = e < E && !((taken >> i) & 1u) ? arg_key(p[i], e) : 0ull;
      best = key > best ? key : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
      best = other > best ? other : best;
    }
    const int e = arg_key_index(best);
    if ((e & 31) == lane) taken |= 1u << (e >> 5);
    if (lane == j) mine = e, mine_p = order_value((uint32_t)(best >> 32));
  }
  float w = mine_p;
  if (renorm) {
    float t = 0.f;
    for (int j = 0; j < k; ++j) t = t + __shfl_sync(0xffffffffu, mine_p, j);
    w = mine_p / t;
  }
  int slot = 0;  // the row's entries go in increasing expert id: the combine's order
  for (int j = 0; j < k; ++j) slot += __shfl_sync(0xffffffffu, mine, j) < mine;
  if (lane < k) {
    ids[slot] = mine;
    weights[slot] = w;
  }
}

// Exclusive prefix sum over the block of one int per thread; *total gets the sum. scratch: 33 ints.
DSPARK_DEVICE int block_exclusive_scan(int v, int* scratch, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += u;
  }
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int t = lane < warps ? scratch[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, t, o);
      if (lane >= o) t += u;
    }
    scratch[lane] = t;  // inclusive sums of the warps
    if (lane == 31) scratch[32] = t;
  }
  __syncthreads();
  const int before = (warp ? scratch[warp - 1] : 0) + incl - v;
  *total = scratch[32];
  __syncthreads();  // scratch is rewritten by the next scan
  return before;
}

DSPARK_DEVICE int load_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }

// The grouping (the last CTA, every row's ids written): counts, offsets, items, stats, pos, src.
DSPARK_DEVICE void group_rows(int rows, int E, int k, int tile_rows, const int* ids, int* __restrict__ pos,
                              int* __restrict__ src, int* __restrict__ counts, int* __restrict__ offsets,
                              int* __restrict__ items, int* __restrict__ stats) {
  __shared__ int cnt[kMoeMaxExperts], off[kMoeMaxExperts], cur[kMoeMaxExperts];
  __shared__ unsigned mask[kMoeWarps][kMoeMaxExperts];  // per warp: which of its 32 rows chose expert e
  __shared__ int scratch[33];
  const int P = rows * k, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0, cur[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < P; i += blockDim.x) atomicAdd(&cnt[load_volatile(ids + i)], 1);
  __syncthreads();

  // Thread t owns experts [t per, (t + 1) per): three block scans give each its first grouped row,
  // its rank among the experts with rows and its first item.
  const int per = (E + (int)blockDim.x - 1) / (int)blockDim.x, lo = threadIdx.x * per, hi = min(E, lo + per);
  int n_rows = 0, n_experts = 0, n_items = 0;
  for (int e = lo; e < hi; ++e) {
    n_rows += cnt[e];
    n_experts += cnt[e] > 0;
    n_items += (cnt[e] + tile_rows - 1) / tile_rows;
  }
  int total_experts, total_items, unused;
  int row = block_exclusive_scan(n_rows, scratch, &unused);
  block_exclusive_scan(n_experts, scratch, &total_experts);
  int item = block_exclusive_scan(n_items, scratch, &total_items);
  for (int e = lo; e < hi; ++e) {
    off[e] = row;
    counts[e] = cnt[e];
    offsets[e] = row;
    row += cnt[e];
    for (int t = 0; t * tile_rows < cnt[e]; ++t, ++item) {
      items[2 * item] = e;
      items[2 * item + 1] = t;
    }
  }
  if (threadIdx.x == 0) stats[0] = total_items, stats[1] = total_experts;
  __syncthreads();

  // Grouped rows in increasing row order: warp w takes rows base + 32 w + lane; a row's place in its
  // expert's group is the rows before it that chose the expert (earlier passes: cur; earlier warps and
  // lanes of this pass: their mask bits).
  for (int base = 0; base < rows; base += kMoeThreads) {
    for (int i = threadIdx.x; i < kMoeWarps * E; i += blockDim.x) mask[i / E][i % E] = 0u;
    __syncthreads();
    const int r = base + warp * 32 + lane;
    if (r < rows)
      for (int j = 0; j < k; ++j) atomicOr(&mask[warp][load_volatile(ids + r * k + j)], 1u << lane);
    __syncthreads();
    if (r < rows) {
      for (int j = 0; j < k; ++j) {
        const int e = load_volatile(ids + r * k + j);
        int g = off[e] + cur[e] + __popc(mask[warp][e] & ((1u << lane) - 1u));
        for (int v = 0; v < warp; ++v) g += __popc(mask[v][e]);
        pos[r * k + j] = g;
        src[g] = r;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      for (int v = 0; v < kMoeWarps; ++v) cur[e] += __popc(mask[v][e]);
    __syncthreads();
  }
}

// One CTA per SM is all the launch bounds promise (the router is a few CTAs at decode): without it,
// nvcc's ptxas holds the router and the grouping to 64 registers and spills.
extern "C" __global__ void __launch_bounds__(kMoeThreads, 1)
    moe_route_f32(const float* __restrict__ logits, long long ld, int rows, int E, int k, int renorm, int tile_rows,
                  int* __restrict__ ids, float* __restrict__ weights, int* __restrict__ pos, int* __restrict__ src,
                  int* __restrict__ counts, int* __restrict__ offsets, int* __restrict__ items,
                  int* __restrict__ stats, unsigned* __restrict__ tickets) {
  const int r = blockIdx.x * kMoeWarps + (threadIdx.x >> 5);
  if (r < rows) route_row(logits + r * ld, E, k, renorm, ids + r * k, weights + r * k);
  if (!split_arrive(tickets, gridDim.x, /*all_wrote=*/true)) return;
  group_rows(rows, E, k, tile_rows, ids, pos, src, counts, offsets, items, stats);
}

// ---- the grouped expert product ---------------------------------------------------------------------
// Item y's expert, and its rows: the block [row0, row0 + rows) of the grouped rows.
struct MoeItem {
  int e, row0, rows;
};

DSPARK_DEVICE MoeItem moe_item(const int* counts, const int* offsets, const int* items, int tile_rows) {
  const int e = items[2 * blockIdx.y], first = items[2 * blockIdx.y + 1] * tile_rows;
  return MoeItem{e, offsets[e] + first, min(tile_rows, counts[e] - first)};
}

extern "C" __global__ void __launch_bounds__(kLinearWarps * 32)
    moe_linear_f32(const float* __restrict__ x, const int* __restrict__ x_rows, const float* __restrict__ w,
                   const int* __restrict__ counts, const int* __restrict__ offsets, const int* __restrict__ items,
                   const int* __restrict__ stats, int tile_rows, int K, int N, int kchunk, int splits,
                   float* __restrict__ out, float* __restrict__ part, int part_rows, unsigned* __restrict__ tickets) {
  if ((int)blockIdx.y >= stats[0]) return;  // past the items this routing made
  const MoeItem it = moe_item(counts, offsets, items, tile_rows);
  const int tile = blockIdx.x / splits, col_tiles = gridDim.x / splits;
  linear_tile<float, true>(x, x_rows, w + (long long)it.e * K * N, it.row0, it.rows, K, N, kchunk, splits, tile,
                           blockIdx.x % splits, out, part, part_rows, tickets + blockIdx.y * col_tiles + tile);
}

// SWIGLU: x is the grouped rows' gate|up product [P, 2K] and the product runs over SiLU(gate) * up
// (linear_mma.cuh's SWIGLU stage): an expert's down product without swiglu_f32's launch.
template <typename T, typename Cfg, bool SWIGLU>
DSPARK_DEVICE void moe_linear_mma(const float* __restrict__ x, const int* __restrict__ x_rows, const T* __restrict__ w,
                                  const int* counts, const int* offsets, const int* items, const int* stats, int K,
                                  int N, int kchunk, int grid_splits, float* __restrict__ out, float* __restrict__ part,
                                  int part_rows, unsigned* __restrict__ tickets) {
  using C = Cfg;
  DSPARK_DYNAMIC_SMEM(T, smem);
  mma_check_launch<C>();
  if ((int)blockIdx.y >= stats[0]) return;
  const MoeItem it = moe_item(counts, offsets, items, C::BM);
  const int tile = blockIdx.x / grid_splits, col_tiles = (N + C::BN - 1) / C::BN;
  const T* we = w + (int64_t)it.e * K * N;
  const MmaGemm<T, C, true, false, SWIGLU> g{x, x_rows, it.rows, K, N, it.row0, 0, tile * C::BN,
                              min(N, (tile + 1) * C::BN),
                              K % 4 == 0 && !(reinterpret_cast<unsigned long long>(x) & 15ull), smem,
                              smem + C::STAGES * C::A_STAGE};
  const MmaWeights16<T, C> wt{we, K, N, N % 8 == 0 && !(reinterpret_cast<unsigned long long>(we) & 15ull)};
  mma_tile<T, C, true>(g, wt, kchunk, grid_splits, blockIdx.x % grid_splits, out, part, part_rows, tickets,
                       blockIdx.y, tile, col_tiles);
}

// The FP8 experts' product: moe_linear_mma's item and tile, linear_fp8's weights.
template <typename T, typename Cfg, bool SWIGLU>
DSPARK_DEVICE void moe_linear_fp8(const float* __restrict__ x, const int* __restrict__ x_rows,
                                  const uint8_t* __restrict__ q, const float* __restrict__ scale, const int* counts,
                                  const int* offsets, const int* items, const int* stats, int K, int N, int kchunk,
                                  int grid_splits, float* __restrict__ out, float* __restrict__ part, int part_rows,
                                  unsigned* __restrict__ tickets) {
  using C = Cfg;
  DSPARK_DYNAMIC_SMEM(T, smem);
  mma_check_launch<C>();
  if ((int)blockIdx.y >= stats[0]) return;
  const MoeItem it = moe_item(counts, offsets, items, C::BM);
  const int tile = blockIdx.x / grid_splits, col_tiles = (N + C::BN - 1) / C::BN;
  const int64_t grid = (int64_t)((K + kFp8Block - 1) / kFp8Block) * ((N + kFp8Block - 1) / kFp8Block);
  const uint8_t* qe = q + (int64_t)it.e * K * N;
  const MmaGemm<T, C, true, false, SWIGLU> g{x, x_rows, it.rows, K, N, it.row0, 0, tile * C::BN,
                              min(N, (tile + 1) * C::BN),
                              K % 4 == 0 && !(reinterpret_cast<unsigned long long>(x) & 15ull), smem,
                              smem + C::STAGES * C::A_STAGE};
  const MmaWeightsFp8<T, C> wt{qe, scale + it.e * grid, K, N,
                               N % 8 == 0 && !(reinterpret_cast<unsigned long long>(qe) & 7ull)};
  mma_tile<T, C, true>(g, wt, kchunk, grid_splits, blockIdx.x % grid_splits, out, part, part_rows, tickets,
                       blockIdx.y, tile, col_tiles);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define DSPARK_MOE_MMA_BODY(T, CFG, SWIGLU) __trap();
#define DSPARK_MOE_FP8_BODY(T, CFG, SWIGLU) __trap();
#else
#define DSPARK_MOE_MMA_BODY(T, CFG, SWIGLU) \
  moe_linear_mma<T, CFG, SWIGLU>(x, x_rows, w, counts, offsets, items, stats, K, N, kchunk, grid_splits, out, part, \
                                 part_rows, tickets);
#define DSPARK_MOE_FP8_BODY(T, CFG, SWIGLU) \
  moe_linear_fp8<T, CFG, SWIGLU>(x, x_rows, q, scale, counts, offsets, items, stats, K, N, kchunk, grid_splits, out, \
                                 part, part_rows, tickets);
#endif

// The tile shapes of the grouped product: 16 rows (decode, verify: an expert's rows of a few sessions)
// and 128 (prompts), dspark/ops/moe.py's MMA_TILES; bf16 weights only (the MoE checkpoints' dtype:
// every entry costs each compile of this family, and an f16 MoE is refused at load on the kernels);
// _swiglu_: the experts' down product over their gate|up rows (SWIGLU above), at 16 rows only: a
// prompt's 128-row tiles would read both f32 halves once per column tile, where swiglu_f32 writes half.
#define DSPARK_MOE_MMA_ENTRY(NAME, T, CFG, SWIGLU)                                                                \
  extern "C" __global__ void __launch_bounds__(CFG::THREADS) NAME(                                                \
      const float* __restrict__ x, const int* __restrict__ x_rows, const T* __restrict__ w,                      \
      const int* __restrict__ counts, const int* __restrict__ offsets, const int* __restrict__ items,             \
      const int* __restrict__ stats, int K, int N, int kchunk, int grid_splits, float* __restrict__ out,          \
      float* __restrict__ part, int part_rows, unsigned* __restrict__ tickets) {                                  \
    DSPARK_MOE_MMA_BODY(T, CFG, SWIGLU)                                                                           \
  }

DSPARK_MOE_MMA_ENTRY(moe_linear_mma_bf16_m16, bf16_t, MmaGemmM16, false)
DSPARK_MOE_MMA_ENTRY(moe_linear_mma_bf16_m128, bf16_t, MmaGemmM128, false)
DSPARK_MOE_MMA_ENTRY(moe_linear_mma_bf16_swiglu_m16, bf16_t, MmaGemmM16, true)

// FP8 experts: the same two tiles, bf16 activations only (an FP8 MoE computes in bf16 on the kernels).
#define DSPARK_MOE_FP8_ENTRY(NAME, T, CFG, SWIGLU)                                                                \
  extern "C" __global__ void __launch_bounds__(CFG::THREADS) NAME(                                                \
      const float* __restrict__ x, const int* __restrict__ x_rows, const uint8_t* __restrict__ q,                 \
      const float* __restrict__ scale, const int* __restrict__ counts, const int* __restrict__ offsets,           \
      const int* __restrict__ items, const int* __restrict__ stats, int K, int N, int kchunk, int grid_splits,    \
      float* __restrict__ out, float* __restrict__ part, int part_rows, unsigned* __restrict__ tickets) {         \
    DSPARK_MOE_FP8_BODY(T, CFG, SWIGLU)                                                                           \
  }

DSPARK_MOE_FP8_ENTRY(moe_linear_fp8_bf16_m16, bf16_t, MmaGemmM16, false)
DSPARK_MOE_FP8_ENTRY(moe_linear_fp8_bf16_m128, bf16_t, MmaGemmM128, false)
DSPARK_MOE_FP8_ENTRY(moe_linear_fp8_bf16_swiglu_m16, bf16_t, MmaGemmM16, true)

// ---- the combine ------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kMoeCombineThreads)
    moe_combine_f32(const float* __restrict__ y, const int* __restrict__ pos, const float* __restrict__ weights,
                    const float* __restrict__ shared, const float* __restrict__ gate, long long gate_ld, int rows,
                    int k, int N, float* __restrict__ out) {
  const int64_t i = (int64_t)blockIdx.x * kMoeCombineThreads + threadIdx.x;
  if (i >= (int64_t)rows * N) return;
  const int64_t r = i / N, n = i - r * N;
  float acc = 0.f;
  for (int j = 0; j < k; ++j) acc = acc + weights[r * k + j] * y[(int64_t)pos[r * k + j] * N + n];
  if (shared) acc = acc + (1.0f / (1.0f + expf(-gate[r * gate_ld]))) * shared[i];
  out[i] = acc;
}
