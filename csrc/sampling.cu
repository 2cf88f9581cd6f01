// sampling: Philox draws, filtered sampling over logit rows, and the lossless speculative accept.
// NumPy twins (and the semantics in prose): dspark/philox.py, dspark/ops/sampling.py.
// Alone: nvcc -cubin -arch=sm_90 -I csrc csrc/sampling.cu; on the CPU:
//        python -m dspark.backends.simt_build --families sampling
//
// philox_blocks(ctr [n,4], key [n,2], n, bits, uniform, uniform_open, gumbel [n,4] or null)
//   Philox4x32-10 of explicit counters and keys, and the float transforms of each word.
//   Grid-stride loop, one counter per thread per step.
//
// sample_filtered_<dt>(logits [rows,V], rows, V, temperature, top_k, top_p, min_p [rows],
//                      seed, counter, stream [rows], method, token, prob [rows],
//                      dist [rows,V] or null, status [rows])
//   grid.x = rows, one block per row (32..512 threads). At temperature T > 0, in f32:
//     d_i = (x_i - max x) * (1/T),  w_i = exp(d_i) in [0, 1],  W_i = floor(w_i * 2^32)
//     top-k (0 < k < V): keep x_i >= the k-th largest x (ties at the boundary all kept);
//     top-p (p < 1):     of the top-k survivors by w descending, keep the smallest prefix with
//                        sum(W) >= ceil(p * the survivors' sum(W)) (renormalised after top-k;
//                        ties at the boundary all kept);
//     min-p (m > 0):     keep w_i >= m, i.e. p_i >= m * p_max;
//     always W_i > 0:    an implicit floor at 2^-32 of the max;
//   pi_i = W_i / S over the kept set, S = sum of the kept W. T = 0 is greedy: the argmax
//   (lowest index on ties) with probability 1.
//   Exactness: masses are 64-bit integers, so every sum is the same in any order; thresholds
//   come from radix selects (8-bit digits over the bit patterns of x and w, block-wide integer
//   histograms) instead of a sort, and equal the reference's sort-based ones bit for bit.
//   Passes over the row (w is recomputed, nothing V-sized is stored): 1 max/argmax, 4 top-k,
//   4 top-p (only when on), 1 draw (+1 walk for inverse CDF), 1 dist (only when asked).
//   Draws use the row's (seed, counter, stream) (csrc/philox.cuh):
//     method 0, Gumbel-max:  argmax over kept i of d_i + gumbel(word i), lowest index on ties;
//     method 1, inverse CDF: the first kept i whose running sum of W exceeds
//                            floor(word 0 * S / 2^32);
//     other:                 the distribution only (token -1).
//   prob = pi_token, dist = pi (0 outside the kept set). status: 0 ok, 1 NaN or +inf in the
//   row, 2 no finite logit (token -1, dist untouched).
//
// spec_accept_f32(drafts [nd_total], draft_indptr [B+1], q [nd_total,V], p [nd_total+B,V], V,
//                 seed, counter [B], m, next, source, status [B])
//   grid.x = B sessions, one block each. Session b has nd = indptr[b+1] - indptr[b] drafts and
//   nd + 1 target columns from p row indptr[b] + b on (column j: the distribution after
//   cand[j]). Draft j is accepted while u_j * q_j(d_j) < p_j(d_j), u_j the [0,1) uniform of
//   (ACCEPT, slot j); every warp runs the tests 32 at a time and m = the first reject (or nd).
//   next is drawn by inverse CDF: after a reject from max(0, p_m - q_m) (RESIDUAL, source 1),
//   or from p_m when that has no mass (source 2); after a full accept from p_nd (BONUS,
//   source 0). status 1: a value outside [0, 1] (or NaN) among the q_j(d_j), p_j(d_j) or in the
//   rows the draw reads, or a p row without mass (next = -1).
#include "common.cuh"
#include "philox.cuh"
#include "reduce.cuh"

constexpr int kSampleGumbel = 0, kSampleInverseCdf = 1;  // any other method: distribution only
constexpr int kRowOk = 0, kRowNonFinite = 1, kRowNoFinite = 2;
constexpr int kSourceBonus = 0, kSourceResidual = 1, kSourceFallback = 2;

// ---- integer masses ---------------------------------------------------------------------------
// A weight or probability in [0, 1] as a 2^-32 fixed-point integer (truncated). V <= 2^21 keeps
// every sum below 2^53, so the sums also convert to double exactly.
// Clamped to [0, 1] first (NaN -> 0) so that bad input (flagged by the caller) cannot overflow
// a sum.
DSPARK_DEVICE unsigned long long sampling_fixed(float w) {
  w = w > 0.0f ? (w < 1.0f ? w : 1.0f) : 0.0f;
  return (unsigned long long)__fmul_rn(w, 4294967296.0f);
}

DSPARK_DEVICE float sampling_ratio(unsigned long long w, unsigned long long total) {
  return philox_fdiv((float)w, (float)total);
}

// Order-preserving key of a float (no NaN): larger float, larger key; -0 ties with +0.
DSPARK_DEVICE uint32_t sampling_order_key(float x) {
  uint32_t u = __float_as_uint(x);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// ---- block-wide exclusive scan of u64 (exact, so the order is free) --------------------------
struct SamplingScan {
  unsigned long long before, total;
};

DSPARK_DEVICE unsigned long long sampling_warp_inclusive(unsigned long long v, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    unsigned long long up = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += up;
  }
  return v;
}

// `scratch` holds 32 entries; every thread gets its exclusive prefix and the block total.
DSPARK_DEVICE SamplingScan sampling_block_scan(unsigned long long v, unsigned long long* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const unsigned long long incl = sampling_warp_inclusive(v, lane);
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    // each lane reads and writes only its own entry
    scratch[lane] = sampling_warp_inclusive(lane < nwarps ? scratch[lane] : 0ull, lane);
  }
  __syncthreads();
  SamplingScan r{(warp ? scratch[warp - 1] : 0ull) + incl - v, scratch[nwarps - 1]};
  __syncthreads();  // scratch is reused by the caller's next scan
  return r;
}

// ---- radix select -----------------------------------------------------------------------------
struct SamplingRadix {
  unsigned long long bin[256];
  uint32_t digit;
};

// What warp 0 carries from one digit to the next: the weight of the valid items above the
// current prefix, and the goal.
struct SamplingCarry {
  unsigned long long above, goal;
};

// Warp 0 picks the digit; lane l owns bins 8l .. 8l+7. On the first digit the goal is
// ceil(frac * total weight) when frac > 0 (top-p), else `count` (top-k).
DSPARK_DEVICE void sampling_radix_pick(SamplingRadix* s, bool first, float frac, unsigned long long count,
                                       SamplingCarry& c) {
  const int lane = threadIdx.x;
  unsigned long long own = 0;
  for (int b = 0; b < 8; ++b) own += s->bin[lane * 8 + b];
  unsigned long long suffix = own;  // weight of bins >= 8 * lane
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long down = __shfl_down_sync(kFullMask, suffix, o);
    if (lane + o < 32) suffix += down;
  }
  if (first) {
    const unsigned long long total = __shfl_sync(kFullMask, suffix, 0);
    c.above = 0;
    c.goal = frac > 0.0f ? (unsigned long long)ceil(philox_dmul((double)frac, (double)total)) : count;
    if (c.goal == 0) c.goal = 1;
  }
  // Suffix weights fall with the lane, so the lanes that reach the goal are 0 .. hit. The goal
  // never exceeds the weight left, so hit >= 0.
  const unsigned reach = __ballot_sync(kFullMask, c.above + suffix >= c.goal);
  const int hit = 31 - __clz((int)reach);
  unsigned long long acc = c.above + suffix - own;
  int b = lane * 8 + 7;
  for (; b > lane * 8 && acc + s->bin[b] < c.goal; --b) acc += s->bin[b];
  c.above = __shfl_sync(kFullMask, acc, hit);
  b = __shfl_sync(kFullMask, b, hit);
  if (lane == 0) s->digit = (uint32_t)b;
}

// Finds the largest key t such that the valid items with key >= t weigh at least the goal,
// digit by digit (8 bits, from the top): histogram the weights of the items that match the
// digits chosen so far, then take the highest bin where the weight above plus the bins down to
// it reach the goal. Weights are integers, so the shared-memory atomics add up the same in any
// order. item(i, key, weight) -> whether item i takes part.
template <class Item>
DSPARK_DEVICE uint32_t sampling_radix_select(const Item& item, int n, unsigned long long count, float frac,
                                             SamplingRadix* s) {
  SamplingCarry carry{0, 0};
  uint32_t prefix = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) s->bin[b] = 0;
    __syncthreads();
    const uint32_t high = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      uint32_t key;
      unsigned long long w;
      if (item(i, key, w) && w && (key & high) == prefix) atomicAdd(&s->bin[(key >> shift) & 255u], w);
    }
    __syncthreads();
    if (threadIdx.x < 32) sampling_radix_pick(s, shift == 24, frac, count, carry);
    __syncthreads();
    prefix |= s->digit << shift;
  }
  return prefix;
}

// ---- inverse-CDF draw -------------------------------------------------------------------------
struct SamplingDraw {
  unsigned long long scan[32];
  int token;
};

// The first i in [0, n) whose running sum of weight(i) exceeds floor(x * S / 2^32), S the total
// (returned through *total); -1 when S = 0. Each thread owns a contiguous chunk of the row; one
// block scan of the chunk sums places the target, and the owning thread walks its chunk.
template <class Weight>
DSPARK_DEVICE int sampling_inverse_cdf(const Weight& weight, int n, uint32_t x, unsigned long long* total,
                                       SamplingDraw* s) {
  const int chunk = (n + blockDim.x - 1) / blockDim.x;
  const int lo = min(n, (int)threadIdx.x * chunk), hi = min(n, lo + chunk);
  unsigned long long own = 0;
  for (int i = lo; i < hi; ++i) own += weight(i);
  if (threadIdx.x == 0) s->token = -1;
  const SamplingScan sc = sampling_block_scan(own, s->scan);  // its barriers order the write above
  const unsigned long long target = __umul64hi(sc.total, (unsigned long long)x << 32);
  if (sc.before <= target && target < sc.before + own) {
    unsigned long long acc = sc.before;
    for (int i = lo; i < hi; ++i) {
      acc += weight(i);
      if (acc > target) {
        s->token = i;
        break;
      }
    }
  }
  __syncthreads();
  const int token = s->token;
  __syncthreads();  // s is reused by the caller's next draw
  *total = sc.total;
  return token;
}

DSPARK_DEVICE unsigned long long sampling_block_sum(unsigned long long v, unsigned long long* scratch) {
  return sampling_block_scan(v, scratch).total;
}

// ---- filtered sampling ------------------------------------------------------------------------
// One row's filtered weights, recomputed from the logits on every pass (no V-sized scratch).
template <typename T>
struct SamplingRow {
  const T* row;
  float xmax, inv_t, min_p;
  uint32_t k_key, p_key;  // keep order_key(x) >= k_key and bits(w) >= p_key

  __device__ __forceinline__ float logit(int i) const { return to_float(row[i]); }
  __device__ __forceinline__ float shifted(float x) const { return __fmul_rn(__fadd_rn(x, -xmax), inv_t); }
  // d_i, and W_i when i is kept (else 0).
  __device__ __forceinline__ unsigned long long kept(int i, float* d) const {
    const float x = logit(i);
    *d = shifted(x);
    const float w = philox_exp(*d);
    const unsigned long long W = sampling_fixed(w);
    const bool keep = sampling_order_key(x) >= k_key && __float_as_uint(w) >= p_key && w >= min_p;
    return keep ? W : 0ull;
  }
};

struct SamplingSmem {
  SamplingRadix radix;
  SamplingDraw draw;
  ArgBest best[32];
};

template <typename T>
DSPARK_DEVICE void sample_filtered(const T* __restrict__ logits, int rows, int vocab,
                                   const float* __restrict__ temperature, const int* __restrict__ top_k,
                                   const float* __restrict__ top_p, const float* __restrict__ min_p,
                                   const unsigned long long* __restrict__ seed,
                                   const unsigned long long* __restrict__ counter, const unsigned* __restrict__ stream,
                                   int method, int* __restrict__ token_out, float* __restrict__ prob_out,
                                   float* __restrict__ dist_out, int* __restrict__ status_out) {
  __shared__ SamplingSmem sm;
  const int r = blockIdx.x;
  if (r >= rows) return;
  const T* row = logits + (int64_t)r * vocab;
  float* dist = dist_out ? dist_out + (int64_t)r * vocab : nullptr;

  // Pass 1: the max (and greedy's argmax), and the row's health.
  ArgBest top{-dspark_inf(), 0x7fffffff};
  bool bad = false;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = to_float(row[i]);
    if (dspark_isnan(v) || v == dspark_inf()) bad = true;
    else if (arg_better(v, i, top)) top = ArgBest{v, i};
  }
  bad = block_any(bad);
  top = block_argmax(top, sm.best);
  const int status = bad ? kRowNonFinite : top.v == -dspark_inf() ? kRowNoFinite : kRowOk;
  const float t = temperature[r];
  if (status != kRowOk || !(t > 0.0f)) {  // a bad row, or greedy: a point mass on the argmax
    const int token = status == kRowOk ? top.i : -1;
    if (threadIdx.x == 0) {
      token_out[r] = token;
      prob_out[r] = status == kRowOk ? 1.0f : 0.0f;
      status_out[r] = status;
    }
    if (dist && status == kRowOk)
      for (int i = threadIdx.x; i < vocab; i += blockDim.x) dist[i] = i == token ? 1.0f : 0.0f;
    return;
  }

  SamplingRow<T> f{row, top.v, philox_fdiv(1.0f, t), min_p[r], 0u, 0u};
  const int k = top_k[r];
  if (k > 0 && k < vocab) {
    f.k_key = sampling_radix_select(
        [&](int i, uint32_t& key, unsigned long long& w) {
          key = sampling_order_key(f.logit(i));
          w = 1;
          return true;
        },
        vocab, (unsigned long long)k, 0.0f, &sm.radix);
  }
  const float p = top_p[r];
  if (p < 1.0f) {
    f.p_key = sampling_radix_select(
        [&](int i, uint32_t& key, unsigned long long& w) {
          const float x = f.logit(i);
          const float wf = philox_exp(f.shifted(x));
          key = __float_as_uint(wf);
          w = sampling_fixed(wf);
          return sampling_order_key(x) >= f.k_key;
        },
        vocab, 0ull, p, &sm.radix);
  }

  const uint64_t sd = seed[r], n = counter[r];
  const uint32_t st = stream[r];
  unsigned long long total = 0;
  int token = -1;
  if (method == kSampleGumbel) {
    ArgBest best{-dspark_inf(), 0x7fffffff};
    unsigned long long own = 0;
    for (int q = threadIdx.x; q < (vocab + 3) / 4; q += blockDim.x) {
      float d[4];
      unsigned long long W[4];
      bool any = false;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        W[e] = 4 * q + e < vocab ? f.kept(4 * q + e, &d[e]) : 0ull;
        any = any || W[e];
      }
      if (!any) continue;  // no noise needed for a quad with nothing kept
      const Philox4 blk = philox_draw_block(sd, n, st, 4u * (uint32_t)q);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (!W[e]) continue;
        own += W[e];
        const float score = __fadd_rn(d[e], philox_gumbel(philox_word(blk, e)));
        if (arg_better(score, 4 * q + e, best)) best = ArgBest{score, 4 * q + e};
      }
    }
    best = block_argmax(best, sm.best);
    total = sampling_block_sum(own, sm.draw.scan);
    token = best.i == 0x7fffffff ? -1 : best.i;  // nothing kept: cannot happen (the max is)
  } else if (method == kSampleInverseCdf) {
    const uint32_t x = philox_draw_block(sd, n, st, 0u).x;
    token = sampling_inverse_cdf([&](int i) { float d; return f.kept(i, &d); }, vocab, x, &total, &sm.draw);
  } else {
    unsigned long long own = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      float d;
      own += f.kept(i, &d);
    }
    total = sampling_block_sum(own, sm.draw.scan);
  }

  if (threadIdx.x == 0) {
    float d;
    token_out[r] = token;
    prob_out[r] = token >= 0 ? sampling_ratio(f.kept(token, &d), total) : 0.0f;
    status_out[r] = kRowOk;
  }
  if (dist)
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      float d;
      dist[i] = sampling_ratio(f.kept(i, &d), total);
    }
}

// ---- speculative accept -----------------------------------------------------------------------
DSPARK_DEVICE bool sampling_is_prob(float v) { return v >= 0.0f && v <= 1.0f; }

DSPARK_DEVICE void spec_accept(const int* __restrict__ drafts, const int* __restrict__ draft_indptr,
                               const float* __restrict__ q, const float* __restrict__ p, int vocab,
                               const unsigned long long* __restrict__ seed,
                               const unsigned long long* __restrict__ counter, int* __restrict__ m_out,
                               int* __restrict__ next_out, int* __restrict__ source_out, int* __restrict__ status_out) {
  __shared__ SamplingDraw draw;
  const int b = blockIdx.x;
  const int c0 = draft_indptr[b], nd = draft_indptr[b + 1] - c0, pc0 = c0 + b;
  const uint64_t sd = seed[b], n = counter[b];

  // Every warp runs the accept tests, lane j on draft j (32 at a time): m, the first reject (or
  // nd), comes out of the ballots in every warp with no barrier. All drafts' q_j(d_j) and
  // p_j(d_j) are checked, whatever m turns out to be.
  const int lane = threadIdx.x & 31;
  bool bad = false;
  int m = nd;
  for (int j0 = 0; j0 < nd; j0 += 32) {
    const int j = j0 + lane;
    bool reject = false;
    if (j < nd) {
      const int d = drafts[c0 + j];
      const float qd = q[(int64_t)(c0 + j) * vocab + d], pd = p[(int64_t)(pc0 + j) * vocab + d];
      const uint32_t word = philox_draw_block(sd, n, kTagAccept << kPhiloxSlotBits | (uint32_t)j, 0u).x;
      bad = bad || !sampling_is_prob(qd) || !sampling_is_prob(pd);
      reject = !(__fmul_rn(philox_uniform(word), qd) < pd);
    }
    const unsigned rejects = __ballot_sync(kFullMask, reject);
    if (rejects && m == nd) m = j0 + __ffs((int)rejects) - 1;
  }
  const bool residual = m < nd;
  const float* prow = p + (int64_t)(pc0 + m) * vocab;  // column m: p_m, or the bonus column
  const float* qrow = residual ? q + (int64_t)(c0 + m) * vocab : nullptr;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x)
    bad = bad || !sampling_is_prob(prow[i]) || (qrow && !sampling_is_prob(qrow[i]));
  bad = block_any(bad);

  const uint32_t x = philox_draw_block(sd, n, (residual ? kTagResidual : kTagBonus) << kPhiloxSlotBits, 0u).x;
  const auto from_p = [&](int i) { return sampling_fixed(prow[i]); };
  unsigned long long total;
  int token, source = kSourceBonus;
  if (residual) {
    source = kSourceResidual;
    // max(0, p - q): sampling_fixed clamps at 0
    token = sampling_inverse_cdf([&](int i) { return sampling_fixed(__fadd_rn(prow[i], -qrow[i])); }, vocab, x,
                                 &total, &draw);
    if (total == 0) {  // p <= q everywhere (p == q up to rounding): the residual is undefined
      source = kSourceFallback;
      token = sampling_inverse_cdf(from_p, vocab, x, &total, &draw);
    }
  } else {
    token = sampling_inverse_cdf(from_p, vocab, x, &total, &draw);
  }
  if (threadIdx.x == 0) {
    m_out[b] = m;
    next_out[b] = token;
    source_out[b] = source;
    status_out[b] = bad || token < 0 ? 1 : 0;
  }
}

// ---- entry points -----------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
    philox_blocks(const unsigned* __restrict__ ctr, const unsigned* __restrict__ key, long long n,
                  unsigned* __restrict__ bits, float* __restrict__ uniform, float* __restrict__ uniform_open,
                  float* __restrict__ gumbel) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const Philox4 out = philox4x32_10(Philox4{ctr[4 * i], ctr[4 * i + 1], ctr[4 * i + 2], ctr[4 * i + 3]},
                                      key[2 * i], key[2 * i + 1]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t w = philox_word(out, e);
      if (bits) bits[4 * i + e] = w;
      if (uniform) uniform[4 * i + e] = philox_uniform(w);
      if (uniform_open) uniform_open[4 * i + e] = philox_uniform_open(w);
      if (gumbel) gumbel[4 * i + e] = philox_gumbel(w);
    }
  }
}

#define DSPARK_SAMPLE_ENTRY(SUF, T)                                                                       \
  extern "C" __global__ void __launch_bounds__(512) sample_filtered_##SUF(                                \
      const T* __restrict__ logits, int rows, int vocab, const float* __restrict__ temperature,            \
      const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,     \
      const unsigned long long* __restrict__ seed, const unsigned long long* __restrict__ counter,          \
      const unsigned* __restrict__ stream, int method, int* __restrict__ token, float* __restrict__ prob,   \
      float* __restrict__ dist, int* __restrict__ status) {                                                 \
    sample_filtered<T>(logits, rows, vocab, temperature, top_k, top_p, min_p, seed, counter, stream, method, \
                       token, prob, dist, status);                                                          \
  }

DSPARK_SAMPLE_ENTRY(f32, float)
DSPARK_SAMPLE_ENTRY(f16, f16_t)
DSPARK_SAMPLE_ENTRY(bf16, bf16_t)

extern "C" __global__ void __launch_bounds__(512)
    spec_accept_f32(const int* __restrict__ drafts, const int* __restrict__ draft_indptr, const float* __restrict__ q,
                    const float* __restrict__ p, int vocab, const unsigned long long* __restrict__ seed,
                    const unsigned long long* __restrict__ counter, int* __restrict__ m, int* __restrict__ next,
                    int* __restrict__ source, int* __restrict__ status) {
  spec_accept(drafts, draft_indptr, q, p, vocab, seed, counter, m, next, source, status);
}
