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
//                      dist [rows,V] or null, status [rows], state, part, tickets, hist, phase)
//   At temperature T > 0, in f32:
//     d_i = (x_i - max x) * (1/T),  w_i = exp(d_i) in [0, 1],  W_i = floor(w_i * 2^32)
//     top-k (0 < k < V): keep x_i >= the k-th largest x (ties at the boundary all kept);
//     top-p (p < 1):     of the top-k survivors by w descending, keep the smallest prefix with
//                        sum(W) >= ceil(p * the survivors' sum(W)) (renormalised after top-k;
//                        ties at the boundary all kept);
//     min-p (m > 0):     keep w_i >= m, i.e. p_i >= m * p_max;
//     always W_i > 0:    an implicit floor at 2^-32 of the max;
//   pi_i = W_i / S over the kept set, S = sum of the kept W. T = 0 is greedy: the argmax
//   (lowest index on ties) with probability 1.
//   Row split (csrc/rowsplit.cuh): grid.x = rows * S CTAs, one per slice, and one launch per
//   phase; `phase` names it (kPhase*). Between launches a row's state (max, status, thresholds,
//   radix carry, S) lives in `state` (kStateWords words per row), written by the phase's last
//   CTA. When S = 1 a single launch with phase -1 runs every phase in one CTA per row.
//   Phases, each one pass over the row (nothing V-sized is stored):
//     0 scan:    max and argmax (exact keys), health; top-k's first digit histogram.
//     1, 2:      top-k's other digits (only rows with top-k on).
//     3, 4, 5:   top-p's digits over the bits of w (only rows with top-p on).
//     6 draw:    per-slice kept mass S_s (and the Gumbel argmax); the last CTA adds them up,
//                and for inverse CDF finds the slice holding the target and walks that slice.
//     7 dist:    pi (only when dist is asked for).
//   Exactness: masses are 64-bit integers and argmaxes integer keys, so every sum and merge is
//   the same in any order; thresholds come from radix selects (digits of 11, 11 and 10 bits over
//   the order key of x; 11, 9 and 9 over bits(w) - bits(2^-32)) with integer histograms (two
//   32-bit shared atomics per entry for a mass, added into a per-row global histogram of 64-bit
//   words), so they equal the reference's sort-based thresholds bit for bit.
//   Draws use the row's (seed, counter, stream) (csrc/philox.cuh):
//     method 0, Gumbel-max:  argmax over kept i of d_i + gumbel(word i), lowest index on ties;
//     method 1, inverse CDF: the first kept i whose running sum of W exceeds
//                            floor(word 0 * S / 2^32);
//     other:                 the distribution only (token -1).
//   prob = pi_token, dist = pi (0 outside the kept set). status: 0 ok, 1 NaN or +inf in the
//   row, 2 no finite logit (token -1, dist untouched).
//
// spec_accept_f32(drafts [nd_total], draft_indptr [B+1], q [nd_total,V], p [nd_total+B,V], V,
//                 seed, counter [B], m, next, source, status [B], part, tickets)
//   grid.x = B * S: session b's target row is split like a logit row. Session b has
//   nd = indptr[b+1] - indptr[b] drafts and nd + 1 target columns from p row indptr[b] + b on
//   (column j: the distribution after cand[j]). Draft j is accepted while u_j * q_j(d_j) <
//   p_j(d_j), u_j the [0,1) uniform of (ACCEPT, slot j); every warp of every CTA runs the tests
//   32 at a time and m = the first reject (or nd). Each CTA sums its slice of max(0, p_m - q_m)
//   and of p_m in one pass; the last CTA draws next by inverse CDF: after a reject from the
//   residual (RESIDUAL, source 1), or from p_m when that has no mass (source 2); after a full
//   accept from p_nd (BONUS, source 0). status 1: a value outside [0, 1] (or NaN) among the
//   q_j(d_j), p_j(d_j) or in the rows the draw reads, or a p row without mass (next = -1).
//
// pick_accept(picks [cols], cand [cols], col_indptr [B+1], B, m [B], next [B])
//   The coupled accept's walk (dspark/ops/coupled.py). Session b owns the verify columns
//   col_indptr[b] .. [b+1]: cand = [anchor, d_1 .. d_{vt-1}], and picks[j] is the target's
//   Gumbel-max pick after cand[j] (sample_filtered with the noise of that token's position, the
//   noise the drafter proposed d_{j+1} with). Draft d_{j+1} is accepted while it equals picks[j]:
//   m = the first column j < vt - 1 whose pick differs from cand[j+1] (or vt - 1), next =
//   picks[m]. A warp per session, lane l on columns l, l + 32, ..., the first difference from a
//   ballot; block.x = a multiple of 32, grid.x = ceil(B / warps per CTA). A session without
//   columns gets m = next = -1.
#include "common.cuh"
#include "philox.cuh"
#include "reduce.cuh"
#include "rowsplit.cuh"

constexpr int kSampleGumbel = 0, kSampleInverseCdf = 1;  // any other method: distribution only
constexpr int kRowOk = 0, kRowNonFinite = 1, kRowNoFinite = 2;
constexpr int kSourceBonus = 0, kSourceResidual = 1, kSourceFallback = 2;
constexpr int kPhaseScan = 0, kPhaseTopK = 1, kPhaseTopP = 3, kPhaseDraw = 6, kPhaseDist = 7, kPhases = 8;
constexpr int kPhaseAll = -1;

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

// ---- shared memory ----------------------------------------------------------------------------
constexpr int kRadixBins = 2048;
constexpr uint32_t kMassFloorBits = 0x2f800000u;  // bits(2^-32): w >= 2^-32 <=> W > 0

// What every row-split sampling CTA needs: merges, scans, and what the last CTA broadcasts.
struct SamplingCore {
  SplitPartial scratch[kSplitThreads + 1];
  unsigned long long scan[32];
  unsigned long long above, base;
  unsigned digit;
  int token, slice;
};

// Filtered sampling adds the radix histograms.
struct SamplingSmem : SamplingCore {
  unsigned hist_lo[kRadixBins], hist_hi[kRadixBins];  // this CTA's digit histogram (mass bits 0-15, 16-32)
  unsigned long long bins[kRadixBins];                // the row's histogram, for the pick
};

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
// Digit d of top-k's key (the order key of x: 11, 11, 10 bits) or top-p's (bits(w) - bits(2^-32),
// in [0, 2^28]: 11, 9, 9 bits).
DSPARK_DEVICE int radix_shift(bool topp, int d) { return topp ? (d == 0 ? 18 : d == 1 ? 9 : 0) : (d == 0 ? 21 : d == 1 ? 10 : 0); }
DSPARK_DEVICE int radix_width(bool topp, int d) { return topp ? (d == 0 ? 11 : 9) : (d == 2 ? 10 : 11); }

// Picks the digit: the highest bin b of sm.bins [0, nbins) where `above` plus the weight of the
// bins >= b reaches the goal; sets sm.digit and sm.above (the weight above the chosen bin). Thread
// t owns a run of bins; one block scan of the run sums places the bin. On the first digit the
// goal is ceil(frac * total weight) when frac > 0 (top-p), else `count` (top-k); it is returned.
DSPARK_DEVICE unsigned long long radix_pick(SamplingSmem& sm, int nbins, unsigned long long above,
                                            unsigned long long goal, bool first, float frac,
                                            unsigned long long count) {
  const int per = (nbins + blockDim.x - 1) / blockDim.x;
  const int b0 = min(nbins, (int)threadIdx.x * per), b1 = min(nbins, b0 + per);
  unsigned long long own = 0;
  for (int b = b0; b < b1; ++b) own += sm.bins[b];
  const SamplingScan sc = sampling_block_scan(own, sm.scan);
  if (first) {
    goal = frac > 0.0f ? (unsigned long long)ceil(philox_dmul((double)frac, (double)sc.total)) : count;
    if (goal == 0) goal = 1;
  }
  // The weight above this thread's run falls with the thread, so exactly one run holds the bin
  // (the goal never exceeds the weight left).
  unsigned long long acc = above + (sc.total - sc.before - own);
  if (acc < goal && goal <= acc + own) {
    for (int b = b1 - 1; b >= b0; --b) {
      if (acc + sm.bins[b] >= goal) {
        sm.digit = (unsigned)b;
        sm.above = acc;
        break;
      }
      acc += sm.bins[b];
    }
  }
  __syncthreads();
  return goal;
}

// ---- the row state between phases ---------------------------------------------------------------
struct SampleState {
  float xmax, inv_t;
  int argmax, status, live;  // live: status ok and T > 0
  uint32_t k_key, p_key;     // keep order_key(x) >= k_key and bits(w) >= p_key
  uint32_t prefix;           // radix digits chosen so far
  unsigned long long above, goal, total;
};
constexpr int kStateWords = 7;
static_assert(sizeof(SampleState) == 8 * kStateWords, "SampleState is kStateWords words");

// One row's filtered weights, recomputed from the logits on every pass (no V-sized scratch).
struct SamplingRow {
  float xmax, inv_t, min_p;
  uint32_t k_key, p_key;

  __device__ __forceinline__ float shifted(float x) const { return __fmul_rn(__fadd_rn(x, -xmax), inv_t); }
  // d_i, and W_i when i is kept (else 0).
  __device__ __forceinline__ unsigned long long kept(float x, float* d) const {
    *d = shifted(x);
    const float w = philox_exp(*d);
    const unsigned long long W = sampling_fixed(w);
    const bool keep = order_key(x) >= k_key && __float_as_uint(w) >= p_key && w >= min_p;
    return keep ? W : 0ull;
  }
};

template <typename T>
struct SampleArgs {
  const T* logits;
  int rows, vocab;
  const float *temperature, *top_p, *min_p;
  const int* top_k;
  const unsigned long long *seed, *counter;
  const unsigned* stream;
  int method;
  int* token;
  float* prob;
  float* dist;
  int* status;
  unsigned long long *state, *part;
  unsigned* tickets;
  unsigned long long* hist;
};

// ---- inverse-CDF walk -------------------------------------------------------------------------
// The first i in [lo, hi) where base + the running sum of weight(i) from lo exceeds target; -1
// when there is none. Each thread owns a contiguous run; one block scan of the run sums places
// the target, and the owning thread walks its run.
template <class Weight>
DSPARK_DEVICE int sampling_walk(const Weight& weight, int lo, int hi, unsigned long long base,
                                unsigned long long target, SamplingCore& sm) {
  const int n = hi - lo, run = (n + blockDim.x - 1) / blockDim.x;
  const int a = lo + min(n, (int)threadIdx.x * run), b = min(hi, a + run);
  unsigned long long own = 0;
  for (int i = a; i < b; ++i) own += weight(i);
  if (threadIdx.x == 0) sm.token = -1;
  const SamplingScan sc = sampling_block_scan(own, sm.scan);  // its barriers order the write above
  unsigned long long acc = base + sc.before;
  if (acc <= target && target < acc + own) {
    for (int i = a; i < b; ++i) {
      acc += weight(i);
      if (acc > target) {
        sm.token = i;
        break;
      }
    }
  }
  __syncthreads();
  const int token = sm.token;
  __syncthreads();  // sm is reused by the caller
  return token;
}

// The slice s whose partial mass (word `word` of each partial) holds the target, and the mass of
// the slices before it (sm.slice, sm.base); slice -1 when the total is 0. By the last CTA.
DSPARK_DEVICE void sampling_find_slice(const unsigned long long* part, int S, int word, unsigned long long target,
                                       SamplingCore& sm) {
  const int run = (S + blockDim.x - 1) / blockDim.x;
  const int a = min(S, (int)threadIdx.x * run), b = min(S, a + run);
  unsigned long long own = 0;
  for (int i = a; i < b; ++i) own += load_shared_u64(part + kPartWords * i + word);
  if (threadIdx.x == 0) sm.slice = -1;
  const SamplingScan sc = sampling_block_scan(own, sm.scan);
  unsigned long long acc = sc.before;
  if (acc <= target && target < acc + own) {
    for (int i = a; i < b; ++i) {
      const unsigned long long m = load_shared_u64(part + kPartWords * i + word);
      if (target < acc + m) {
        sm.slice = i;
        sm.base = acc;
        break;
      }
      acc += m;
    }
  }
  __syncthreads();
}

// ---- filtered sampling, phase by phase --------------------------------------------------------
template <typename T>
DSPARK_DEVICE SamplingRow row_filter(const SampleArgs<T>& a, const SampleState* st, int r) {
  return SamplingRow{st->xmax, st->inv_t, a.min_p[r], st->k_key, st->p_key};
}

DSPARK_DEVICE void clear_histogram(SamplingSmem& sm) {
  for (int b = threadIdx.x; b < kRadixBins; b += blockDim.x) sm.hist_lo[b] = sm.hist_hi[b] = 0;
  __syncthreads();
}

DSPARK_DEVICE void histogram_add(SamplingSmem& sm, int bin, unsigned long long w) {
  atomicAdd(&sm.hist_lo[bin], (unsigned)(w & 0xffffu));  // w <= 2^32: both halves stay below 2^17
  if (w >> 16) atomicAdd(&sm.hist_hi[bin], (unsigned)(w >> 16));
}

// Brings this CTA's histogram (bins [0, nbins)) into sm.bins for the pick: directly when S = 1,
// else through the row's global histogram (added with 64-bit global atomics; the last CTA reads
// it and zeroes it again). Returns false in every CTA but the last. `p` is this CTA's partial
// (stored first when S > 1); the row's merged partial comes back through it.
DSPARK_DEVICE bool gather_histogram(SamplingSmem& sm, int nbins, unsigned long long* ghist, unsigned long long* part,
                                    int S, int s, unsigned* ticket, SplitPartial* p) {
  if (S == 1) {
    for (int b = threadIdx.x; b < nbins; b += blockDim.x)
      sm.bins[b] = sm.hist_lo[b] + ((unsigned long long)sm.hist_hi[b] << 16);
    if (nbins) __syncthreads();
    return true;
  }
  if (p) store_split_partial(part + kPartWords * s, *p);
  if (ghist)
    for (int b = threadIdx.x; b < nbins; b += blockDim.x) {
      const unsigned long long v = sm.hist_lo[b] + ((unsigned long long)sm.hist_hi[b] << 16);
      if (v) atomicAdd(ghist + b, v);
    }
  if (!split_arrive(ticket, (unsigned)S, ghist != nullptr)) return false;
  if (p) *p = merge_split_partials(part, S, sm.scratch);
  if (ghist) {
    for (int b = threadIdx.x; b < nbins; b += blockDim.x) {
      sm.bins[b] = load_shared_u64(ghist + b);
      ghist[b] = 0;  // zero at rest, for the next launch
    }
    __syncthreads();
  }
  return true;
}

template <typename T>
DSPARK_DEVICE void phase_scan(const SampleArgs<T>& a, SampleState* st, int r, int s, int S, SamplingSmem& sm) {
  const T* row = a.logits + (int64_t)r * a.vocab;
  const int k = a.top_k[r];
  const bool topk = k > 0 && k < a.vocab;
  if (topk) clear_histogram(sm);
  unsigned long long best = 0;
  unsigned bad = 0;
  slice_for_each(row, slice_lo(s), slice_hi(s, a.vocab), [&](int i, float v) {
    if (dspark_isnan(v) || v == dspark_inf()) {
      bad = 1;
      return;
    }
    const unsigned long long key = arg_key(v, i);
    best = key > best ? key : best;
    if (topk) atomicAdd(&sm.hist_lo[order_key(v) >> 21], 1u);
  });
  SplitPartial p = block_split_merge(SplitPartial{best, 0ull, 0ull, bad}, sm.scratch);
  unsigned long long* ghist = topk && S > 1 ? a.hist + (int64_t)r * kRadixBins : nullptr;
  if (!gather_histogram(sm, topk ? kRadixBins : 0, ghist, a.part + kPartWords * ((int64_t)r * S), S, s, a.tickets + r, &p))
    return;
  const int argmax = arg_key_index(p.key);
  const float xmax = argmax >= 0 ? to_float(row[argmax]) : -dspark_inf();
  const int status = p.flags ? kRowNonFinite : xmax == -dspark_inf() ? kRowNoFinite : kRowOk;
  const float t = a.temperature[r];
  const bool live = status == kRowOk && t > 0.0f;
  if (threadIdx.x == 0) {
    *st = SampleState{xmax, live ? philox_fdiv(1.0f, t) : 0.0f, argmax, status, live ? 1 : 0, 0u, 0u, 0u, 0ull,
                      0ull, 0ull};
    a.status[r] = status;
    if (!live) {  // a bad row, or greedy: a point mass on the argmax
      a.token[r] = status == kRowOk ? argmax : -1;
      a.prob[r] = status == kRowOk ? 1.0f : 0.0f;
    }
  }
  if (topk && live) {
    const unsigned long long goal = radix_pick(sm, kRadixBins, 0ull, 0ull, true, 0.0f, (unsigned long long)k);
    if (threadIdx.x == 0) {
      st->prefix = sm.digit << radix_shift(false, 0);
      st->above = sm.above;
      st->goal = goal;
    }
  }
}

// Digit d of top-k (topp false) or top-p.
template <typename T>
DSPARK_DEVICE void phase_radix(const SampleArgs<T>& a, SampleState* st, bool topp, int d, int r, int s, int S,
                               SamplingSmem& sm) {
  const T* row = a.logits + (int64_t)r * a.vocab;
  const int shift = radix_shift(topp, d), width = radix_width(topp, d), nbins = 1 << width;
  const uint32_t prefix = d ? st->prefix : 0u;
  const int high = shift + width;  // the key's bits from `high` up must equal the prefix's
  const SamplingRow f = row_filter(a, st, r);
  clear_histogram(sm);
  slice_for_each_rolled(row, slice_lo(s), slice_hi(s, a.vocab), [&](int, float x) {
    uint32_t key;
    unsigned long long w = 1;
    if (topp) {
      if (order_key(x) < f.k_key) return;
      const float wf = philox_exp(f.shifted(x));
      if (__float_as_uint(wf) < kMassFloorBits) return;  // W = 0: no mass, no say
      key = __float_as_uint(wf) - kMassFloorBits;
      w = sampling_fixed(wf);
    } else {
      key = order_key(x);
    }
    if (high < 32 && (key >> high) != (prefix >> high)) return;
    histogram_add(sm, (int)((key >> shift) & (uint32_t)(nbins - 1)), w);
  });
  __syncthreads();
  if (!gather_histogram(sm, nbins, S > 1 ? a.hist + (int64_t)r * kRadixBins : nullptr, a.part + kPartWords * ((int64_t)r * S), S, s,
                        a.tickets + r, nullptr))
    return;
  const unsigned long long goal = radix_pick(sm, nbins, d ? st->above : 0ull, d ? st->goal : 0ull, d == 0,
                                             topp ? a.top_p[r] : 0.0f, (unsigned long long)a.top_k[r]);
  if (threadIdx.x == 0) {
    const uint32_t chosen = prefix | sm.digit << shift;
    st->prefix = chosen;
    st->above = sm.above;
    st->goal = goal;
    if (d == 2) {
      if (topp) st->p_key = chosen + kMassFloorBits;
      else st->k_key = chosen;
    }
  }
}

template <typename T>
DSPARK_DEVICE void phase_draw(const SampleArgs<T>& a, SampleState* st, int r, int s, int S, SamplingSmem& sm) {
  const T* row = a.logits + (int64_t)r * a.vocab;
  const SamplingRow f = row_filter(a, st, r);
  const uint64_t sd = a.seed[r], n = a.counter[r];
  const uint32_t stream = a.stream[r];
  const bool gumbel = a.method == kSampleGumbel;
  unsigned long long best = 0, own = 0;
  int quad = -1;  // the Philox block of the last quad drawn (4 words: entries 4q .. 4q+3)
  Philox4 blk{0u, 0u, 0u, 0u};
  slice_for_each_rolled(row, slice_lo(s), slice_hi(s, a.vocab), [&](int i, float x) {
    float d;
    const unsigned long long W = f.kept(x, &d);
    if (!W) return;  // no noise needed where nothing is kept
    own += W;
    if (gumbel) {
      if (i >> 2 != quad) {
        quad = i >> 2;
        blk = philox_draw_block(sd, n, stream, 4u * (uint32_t)quad);
      }
      const unsigned long long key = arg_key(__fadd_rn(d, philox_gumbel(philox_word(blk, i & 3))), i);
      best = key > best ? key : best;
    }
  });
  SplitPartial p = block_split_merge(SplitPartial{best, own, 0ull, 0u}, sm.scratch);
  unsigned long long* part = a.part + kPartWords * ((int64_t)r * S);
  if (!gather_histogram(sm, 0, nullptr, part, S, s, a.tickets + r, &p)) return;
  const unsigned long long total = p.mass;
  int token = -1;
  if (gumbel) {
    token = arg_key_index(p.key);  // nothing kept: cannot happen (the max is)
  } else if (a.method == kSampleInverseCdf) {
    const uint32_t x = philox_draw_block(sd, n, stream, 0u).x;
    const unsigned long long target = __umul64hi(total, (unsigned long long)x << 32);
    int slice = 0;
    unsigned long long base = 0;
    if (S > 1) {
      sampling_find_slice(part, S, 1, target, sm);
      slice = sm.slice;
      base = sm.base;
    }
    if (slice >= 0)
      token = sampling_walk([&](int i) { float d; return f.kept(to_float(row[i]), &d); }, slice_lo(slice),
                            slice_hi(slice, a.vocab), base, target, sm);
  }
  if (threadIdx.x == 0) {
    float d;
    a.token[r] = token;
    a.prob[r] = token >= 0 ? sampling_ratio(f.kept(to_float(row[token]), &d), total) : 0.0f;
    st->total = total;
  }
}

template <typename T>
DSPARK_DEVICE void phase_dist(const SampleArgs<T>& a, const SampleState* st, int r, int s) {
  float* dist = a.dist + (int64_t)r * a.vocab;
  const int lo = slice_lo(s), hi = slice_hi(s, a.vocab);
  if (!st->live) {  // greedy
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) dist[i] = i == st->argmax ? 1.0f : 0.0f;
    return;
  }
  const SamplingRow f = row_filter(a, st, r);
  const unsigned long long total = st->total;
  slice_for_each_rolled(a.logits + (int64_t)r * a.vocab, lo, hi, [&](int i, float x) {
    float d;
    dist[i] = sampling_ratio(f.kept(x, &d), total);
  });
}

// Phase `phase` of slice s of row r. Whether a row takes part is decided from its state and
// settings alone, so all S CTAs of a row agree (and take their tickets, or none does).
template <typename T>
DSPARK_DEVICE void sample_phase(const SampleArgs<T>& a, int phase, int r, int s, int S, SamplingSmem& sm) {
  SampleState* st = reinterpret_cast<SampleState*>(a.state + (int64_t)r * kStateWords);
  if (phase == kPhaseScan) {
    phase_scan(a, st, r, s, S, sm);
    return;
  }
  if (phase == kPhaseDist) {
    if (a.dist && st->status == kRowOk) phase_dist(a, st, r, s);
    return;
  }
  if (!st->live) return;
  if (phase < kPhaseTopP) {
    const int k = a.top_k[r];
    if (k > 0 && k < a.vocab) phase_radix(a, st, false, phase - kPhaseTopK + 1, r, s, S, sm);
  } else if (phase < kPhaseDraw) {
    if (a.top_p[r] < 1.0f) phase_radix(a, st, true, phase - kPhaseTopP, r, s, S, sm);
  } else {
    phase_draw(a, st, r, s, S, sm);
  }
}

template <typename T>
DSPARK_DEVICE void sample_filtered(const SampleArgs<T>& a, int phase) {
  __shared__ SamplingSmem sm;
  const int S = (a.vocab + kSliceElems - 1) / kSliceElems;
  const int r = blockIdx.x / S, s = blockIdx.x % S;
  if (r >= a.rows) return;
  // phase -1 (S = 1): every phase in turn, in this CTA; one inlined copy either way
  const int first = phase == kPhaseAll ? 0 : phase, last = phase == kPhaseAll ? kPhases - 1 : phase;
#pragma unroll 1
  for (int p = first; p <= last; ++p) {
    sample_phase(a, p, r, s, S, sm);
    __syncthreads();
  }
}

// ---- speculative accept -----------------------------------------------------------------------
DSPARK_DEVICE bool sampling_is_prob(float v) { return v >= 0.0f && v <= 1.0f; }

DSPARK_DEVICE void spec_accept(const int* __restrict__ drafts, const int* __restrict__ draft_indptr,
                               const float* __restrict__ q, const float* __restrict__ p, int vocab,
                               const unsigned long long* __restrict__ seed,
                               const unsigned long long* __restrict__ counter, int* __restrict__ m_out,
                               int* __restrict__ next_out, int* __restrict__ source_out, int* __restrict__ status_out,
                               unsigned long long* __restrict__ part, unsigned* __restrict__ tickets) {
  __shared__ SamplingCore sm;
  const int S = (vocab + kSliceElems - 1) / kSliceElems;
  const int b = blockIdx.x / S, s = blockIdx.x % S;
  const int c0 = draft_indptr[b], nd = draft_indptr[b + 1] - c0, pc0 = c0 + b;
  const uint64_t sd = seed[b], n = counter[b];

  // Every warp runs the accept tests, lane j on draft j (32 at a time): m, the first reject (or
  // nd), comes out of the ballots in every warp with no barrier. All drafts' q_j(d_j) and
  // p_j(d_j) are checked, whatever m turns out to be.
  const int lane = threadIdx.x & 31;
  unsigned bad = 0;
  int m = nd;
  for (int j0 = 0; j0 < nd; j0 += 32) {
    const int j = j0 + lane;
    bool reject = false;
    if (j < nd) {
      const int d = drafts[c0 + j];
      const float qd = q[(int64_t)(c0 + j) * vocab + d], pd = p[(int64_t)(pc0 + j) * vocab + d];
      const uint32_t word = philox_draw_block(sd, n, kTagAccept << kPhiloxSlotBits | (uint32_t)j, 0u).x;
      bad |= !sampling_is_prob(qd) || !sampling_is_prob(pd);
      reject = !(__fmul_rn(philox_uniform(word), qd) < pd);
    }
    const unsigned rejects = __ballot_sync(kFullMask, reject);
    if (rejects && m == nd) m = j0 + __ffs((int)rejects) - 1;
  }
  const bool residual = m < nd;
  const float* prow = p + (int64_t)(pc0 + m) * vocab;  // column m: p_m, or the bonus column
  const float* qrow = residual ? q + (int64_t)(c0 + m) * vocab : nullptr;

  // One pass over the slice: health, the residual's mass max(0, p - q) (sampling_fixed clamps at
  // 0) and p's mass (the bonus, or the fallback when the residual has none).
  unsigned long long res = 0, full = 0;
  slice_for_each2(prow, qrow, slice_lo(s), slice_hi(s, vocab), [&](int, float pv, float qv) {
    bad |= !sampling_is_prob(pv) || (qrow && !sampling_is_prob(qv));
    full += sampling_fixed(pv);
    if (qrow) res += sampling_fixed(__fadd_rn(pv, -qv));
  });
  SplitPartial sums = block_split_merge(SplitPartial{0ull, res, full, bad}, sm.scratch);
  unsigned long long* mine = part + kPartWords * ((int64_t)b * S);  // per slice: -, residual mass, p's mass, bad
  if (S > 1) {
    store_split_partial(mine + kPartWords * s, sums);
    if (!split_arrive(tickets + b, (unsigned)S)) return;
    sums = merge_split_partials(mine, S, sm.scratch);
  }
  const unsigned long long res_total = sums.mass, full_total = sums.mass2;
  const unsigned any_bad = sums.flags;

  // p <= q everywhere (p == q up to rounding) leaves the residual undefined: draw from p instead,
  // with the same word.
  const bool from_residual = residual && res_total > 0;
  const int source = residual ? (res_total > 0 ? kSourceResidual : kSourceFallback) : kSourceBonus;
  const unsigned long long total = from_residual ? res_total : full_total;
  const uint32_t x = philox_draw_block(sd, n, (residual ? kTagResidual : kTagBonus) << kPhiloxSlotBits, 0u).x;
  const unsigned long long target = __umul64hi(total, (unsigned long long)x << 32);
  int slice = 0;
  unsigned long long base = 0;
  if (S > 1) {
    sampling_find_slice(mine, S, from_residual ? 1 : 2, target, sm);
    slice = sm.slice;
    base = sm.base;
  }
  int token = -1;
  if (total > 0 && slice >= 0) {
    const int lo = slice_lo(slice), hi = slice_hi(slice, vocab);
    if (from_residual)
      token = sampling_walk([&](int i) { return sampling_fixed(__fadd_rn(prow[i], -qrow[i])); }, lo, hi, base,
                           target, sm);
    else
      token = sampling_walk([&](int i) { return sampling_fixed(prow[i]); }, lo, hi, base, target, sm);
  }
  if (threadIdx.x == 0) {
    m_out[b] = m;
    next_out[b] = token;
    source_out[b] = source;
    status_out[b] = any_bad || token < 0 ? 1 : 0;
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

extern "C" __global__ void __launch_bounds__(kSplitThreads)
    pick_accept(const int* __restrict__ picks, const int* __restrict__ cand, const int* __restrict__ col_indptr, int B,
                int* __restrict__ m_out, int* __restrict__ next_out) {
  const int lane = threadIdx.x & 31;
  const int b = blockIdx.x * (int)(blockDim.x >> 5) + (int)(threadIdx.x >> 5);
  if (b >= B) return;  // a whole warp: its lanes share b
  const int c0 = col_indptr[b], vt = col_indptr[b + 1] - c0;
  int m = vt - 1;
  for (int j0 = 0; j0 < vt - 1; j0 += 32) {
    const int j = j0 + lane;
    const unsigned differs = __ballot_sync(kFullMask, j < vt - 1 && picks[c0 + j] != cand[c0 + j + 1]);
    if (differs) {  // the same in every lane
      m = j0 + __ffs((int)differs) - 1;
      break;
    }
  }
  if (lane == 0) {
    m_out[b] = vt > 0 ? m : -1;
    next_out[b] = vt > 0 ? picks[c0 + m] : -1;
  }
}

#define DSPARK_SAMPLE_ENTRY(SUF, T)                                                                        \
  extern "C" __global__ void __launch_bounds__(kSplitThreads, 1) sample_filtered_##SUF(                       \
      const T* __restrict__ logits, int rows, int vocab, const float* __restrict__ temperature,             \
      const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,      \
      const unsigned long long* __restrict__ seed, const unsigned long long* __restrict__ counter,           \
      const unsigned* __restrict__ stream, int method, int* __restrict__ token, float* __restrict__ prob,    \
      float* __restrict__ dist, int* __restrict__ status, unsigned long long* __restrict__ state,            \
      unsigned long long* __restrict__ part, unsigned* __restrict__ tickets, unsigned long long* __restrict__ hist, \
      int phase) {                                                                                           \
    const SampleArgs<T> a{logits, rows,  vocab, temperature, top_p, min_p, top_k, seed, counter, stream,     \
                          method, token, prob,  dist,        status, state, part,  tickets, hist};          \
    sample_filtered<T>(a, phase);                                                                            \
  }

DSPARK_SAMPLE_ENTRY(f32, float)
DSPARK_SAMPLE_ENTRY(f16, f16_t)
DSPARK_SAMPLE_ENTRY(bf16, bf16_t)

extern "C" __global__ void __launch_bounds__(kSplitThreads)
    spec_accept_f32(const int* __restrict__ drafts, const int* __restrict__ draft_indptr, const float* __restrict__ q,
                    const float* __restrict__ p, int vocab, const unsigned long long* __restrict__ seed,
                    const unsigned long long* __restrict__ counter, int* __restrict__ m, int* __restrict__ next,
                    int* __restrict__ source, int* __restrict__ status, unsigned long long* __restrict__ part,
                    unsigned* __restrict__ tickets) {
  spec_accept(drafts, draft_indptr, q, p, vocab, seed, counter, m, next, source, status, part, tickets);
}
