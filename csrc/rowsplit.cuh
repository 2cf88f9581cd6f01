// Row-split reductions over the vocabulary: the pieces argmax.cu and sampling.cu share.
//
// Split. A row of V entries is cut into slices of kSliceElems entries, one CTA each, so a row
// has S = ceil(V / kSliceElems) CTAs: a function of V alone, never of the batch. Launches are
// 1-D, CTA x = row * S + slice, so a row's CTAs are neighbours.
//
// Exact merges. Every partial is an integer: an argmax is the 64-bit key (order key of the
// value << 32 | ~index), so the larger value and then the lower index win under plain integer
// max; masses are 2^-32 fixed-point integers. Max, sum and or give the same result in any order,
// so the merge of S partials cannot depend on which CTA finished when.
//
// Last-CTA merge (the CUDA threadFenceReduction pattern). Each CTA writes its partial, fences,
// and thread 0 takes a ticket with atomicAdd; the CTA that draws the last ticket reads everyone's
// partials (volatile, so from L2) and finishes the row, then puts the ticket back to 0. Tickets,
// and the global histograms of sampling.cu, live in a scratch pool the host zeroes once: every
// launch leaves what it used at zero, so launches can be replayed. The simt runtime runs CTAs
// one after another, so there the last CTA in launch order merges, with every partial written.
//
// Loads. slice_for_each walks a slice with 16-byte vector loads over its aligned middle and
// scalar loads for the (at most 2 * (16 / sizeof(T) - 1)) entries of its head and tail, so any V
// and any row start work (V = 151937 leaves every other f32 row 4 bytes off 16). The simt build
// faults on a misaligned vector load, so a wrong head shows on the CPU.
#pragma once
#include "common.cuh"

constexpr int kSliceElems = 8192;   // a multiple of 8: 16-byte boundaries fall alike in every slice
constexpr int kSplitThreads = 256;  // the most threads a row-split CTA has

DSPARK_DEVICE int slice_lo(int s) { return s * kSliceElems; }
DSPARK_DEVICE int slice_hi(int s, int vocab) {
  const int lo = slice_lo(s);
  return lo + min(kSliceElems, vocab - lo);
}

// ---- 16-byte loads --------------------------------------------------------------------------------
struct Vec16 {
  uint32_t w[4];
};

DSPARK_DEVICE Vec16 load16(const void* p) {
#if defined(DSPARK_SIMT)
  if (reinterpret_cast<unsigned long long>(p) & 15ull) ::simt::fault("16-byte vector load from a misaligned address");
  Vec16 v;
  std::memcpy(&v, p, 16);
  return v;
#else
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  return Vec16{{u.x, u.y, u.z, u.w}};
#endif
}

template <typename T>
struct VecWidth {
  static constexpr int n = 16 / (int)sizeof(T);
};

DSPARK_DEVICE void unpack16(const Vec16& v, float* x, const float*) {
#pragma unroll
  for (int e = 0; e < 4; ++e) x[e] = __uint_as_float(v.w[e]);
}
template <typename H>
DSPARK_DEVICE void unpack16(const Vec16& v, float* x, const H*) {  // f16_t, bf16_t: little-endian halves
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = to_float(H{(uint16_t)(v.w[e >> 1] >> (16 * (e & 1)))});
}

// Entries of `row` before the first 16-byte boundary at or after `lo`, at most hi - lo.
template <typename T>
DSPARK_DEVICE int slice_head(const T* row, int lo, int hi) {
  const unsigned off = (unsigned)(reinterpret_cast<unsigned long long>(row + lo) & 15ull);
  return min(hi - lo, (int)(((16u - off) & 15u) / sizeof(T)));
}

// The aligned middle of a slice: `nvec` 16-byte vectors from entry `body`.
struct SliceBody {
  int body, nvec;
};

// Splits [lo, hi) into an unaligned head, the aligned middle and a tail, and calls f(i, x_i)
// for the head and tail entries (thread t takes entries t, t + blockDim.x, ...); the middle's
// vectors are the caller's.
template <typename T, class F>
DSPARK_DEVICE SliceBody slice_scalar_ends(const T* __restrict__ row, int lo, int hi, F& f) {
  const int head = slice_head(row, lo, hi);
  const int body = lo + head;
  const int nvec = (hi - body) / VecWidth<T>::n;
  const int tail = body + nvec * VecWidth<T>::n;
  for (int k = threadIdx.x; k < head + (hi - tail); k += blockDim.x) {
    const int i = k < head ? lo + k : tail + (k - head);
    f(i, to_float(row[i]));
  }
  return SliceBody{body, nvec};
}

// f(i, x_i) once for every i in [lo, hi), x_i as float, in no particular order: thread t takes
// vectors t, t + blockDim.x, ... of the aligned middle (U loads in flight before any use) and
// the scalar head and tail entries t, t + blockDim.x, ...
template <int U = 4, typename T, class F>
DSPARK_DEVICE void slice_for_each(const T* __restrict__ row, int lo, int hi, F&& f) {
  constexpr int E = VecWidth<T>::n;
  const SliceBody s = slice_scalar_ends(row, lo, hi, f);
  const int body = s.body, nvec = s.nvec;
  for (int v0 = threadIdx.x; v0 < nvec; v0 += U * blockDim.x) {
    Vec16 raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * (int)blockDim.x;
      if (v < nvec) raw[u] = load16(row + body + v * E);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * (int)blockDim.x;
      if (v < nvec) {
        float x[E];
        unpack16(raw[u], x, row);
#pragma unroll
        for (int e = 0; e < E; ++e) f(body + v * E + e, x[e]);
      }
    }
  }
}

// The same walk for a heavy f: U vectors in flight, but their entries go through one copy of f
// in a loop (they leave a queue of registers one entry at a time) instead of U * 16 / sizeof(T)
// inlined copies, which keeps the code small where f is long (exp, Philox, logs).
DSPARK_DEVICE float queue_front(const uint32_t* q, const float*) { return __uint_as_float(q[0]); }
template <typename H>
DSPARK_DEVICE float queue_front(const uint32_t* q, const H*) {  // f16_t, bf16_t
  return to_float(H{(uint16_t)q[0]});
}
template <typename T, int N>
DSPARK_DEVICE void queue_pop(uint32_t* q) {
#pragma unroll
  for (int w = 0; w < N; ++w)
    q[w] = sizeof(T) == 4 ? (w + 1 < N ? q[w + 1] : 0u) : (q[w] >> 16) | (w + 1 < N ? q[w + 1] << 16 : 0u);
}

template <int U = 4, typename T, class F>
DSPARK_DEVICE void slice_for_each_rolled(const T* __restrict__ row, int lo, int hi, F&& f) {
  constexpr int E = VecWidth<T>::n;
  const SliceBody s = slice_scalar_ends(row, lo, hi, f);
  const int body = s.body, nvec = s.nvec;
  for (int v0 = threadIdx.x; v0 < nvec; v0 += U * blockDim.x) {
    uint32_t q[4 * U];
    int n = 0;  // vectors loaded
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * (int)blockDim.x;
      const Vec16 raw = v < nvec ? load16(row + body + v * E) : Vec16{{0u, 0u, 0u, 0u}};
#pragma unroll
      for (int w = 0; w < 4; ++w) q[4 * u + w] = raw.w[w];
      n += v < nvec;
    }
#pragma unroll 1
    for (int k = 0; k < n * E; ++k) {
      f(body + (v0 + (k / E) * (int)blockDim.x) * E + k % E, queue_front(q, row));
      queue_pop<T, 4 * U>(q);
    }
  }
}

// ---- exact argmax keys ----------------------------------------------------------------------------
// Order-preserving key of a float (no NaN): larger float, larger key; -0 ties with +0. -inf has
// key 0x007fffff, so key 0 never names a value.
DSPARK_DEVICE uint32_t order_key(float x) {
  uint32_t u = __float_as_uint(x);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// (value, index) as one integer: the larger value wins, then the lower index. 0 = nothing.
DSPARK_DEVICE unsigned long long arg_key(float v, int i) {
  return (unsigned long long)order_key(v) << 32 | (unsigned long long)~(uint32_t)i;
}
DSPARK_DEVICE int arg_key_index(unsigned long long k) { return k ? (int)~(uint32_t)k : -1; }

// ---- block merge of (max key, sum masses, or flags) ----------------------------------------------
struct SplitPartial {
  unsigned long long key, mass, mass2;
  unsigned flags;
};
constexpr int kPartWords = 4;  // a partial in global memory: key, mass, mass2, flags

DSPARK_DEVICE void split_combine(SplitPartial& a, const SplitPartial& b) {
  a.key = b.key > a.key ? b.key : a.key;
  a.mass += b.mass;
  a.mass2 += b.mass2;
  a.flags |= b.flags;
}

// Every thread gets the block's merge. `scratch` holds blockDim.x + 1 entries: each thread parks
// its value, lane l of warp 0 folds entries l, l + 32, ..., warp 0 halves the 32 in shared memory
// and parks the result in the extra entry. Two barriers: the next merge's first barrier keeps its
// writes away from this one's reads.
DSPARK_DEVICE SplitPartial block_split_merge(SplitPartial p, SplitPartial* scratch) {
  scratch[threadIdx.x] = p;
  __syncthreads();
  const int lane = threadIdx.x;
  if (lane < 32) {
    SplitPartial a = scratch[lane];
    for (int t = lane + 32; t < (int)blockDim.x; t += 32) split_combine(a, scratch[t]);
    scratch[lane] = a;  // lanes read and write only their own entries so far
    __syncwarp();
    for (int o = 16; o > 0; o >>= 1) {
      if (lane < o) {  // reads [o, 2o), writes [0, o)
        split_combine(a, scratch[lane + o]);
        scratch[lane] = a;
      }
      __syncwarp();
    }
    if (lane == 0) scratch[blockDim.x] = a;
  }
  __syncthreads();
  return scratch[blockDim.x];
}

// ---- the last-CTA merge ---------------------------------------------------------------------------
// Reads of what other CTAs of this launch wrote: volatile, so they come from L2, not a stale L1.
DSPARK_DEVICE unsigned long long load_shared_u64(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}

// Whether this CTA is the last of `count` CTAs arriving at `ticket` (the same answer in every
// thread); count 1 needs no ticket. Called by every thread once the CTA's partial is written:
// by thread 0 alone (then after a barrier that every thread passed since), or, with
// `all_wrote`, by any thread (each fences its own writes, then a barrier).
DSPARK_DEVICE bool split_arrive(unsigned* ticket, unsigned count, bool all_wrote = false) {
  __shared__ int last;
  if (count == 1) return true;
  if (all_wrote) {
    __threadfence();  // this thread's writes reach L2 before the ticket is taken
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned before = atomicAdd(ticket, 1u);
    last = before + 1 == count;
    if (last) {
      atomicExch(ticket, 0u);  // every other CTA has arrived: the ticket is free for the next launch
      __threadfence();
    }
  }
  __syncthreads();
  return last != 0;
}

// Merge of the S partials at part[kPartWords * i], i in [0, S): by the last CTA.
DSPARK_DEVICE SplitPartial merge_split_partials(const unsigned long long* part, int S, SplitPartial* scratch) {
  SplitPartial a{0ull, 0ull, 0ull, 0u};
  for (int i = threadIdx.x; i < S; i += blockDim.x) {
    const unsigned long long* w = part + kPartWords * i;
    split_combine(a, SplitPartial{load_shared_u64(w), load_shared_u64(w + 1), load_shared_u64(w + 2),
                                  (unsigned)load_shared_u64(w + 3)});
  }
  return block_split_merge(a, scratch);
}

DSPARK_DEVICE void store_split_partial(unsigned long long* part, const SplitPartial& p) {
  if (threadIdx.x == 0) {
    part[0] = p.key;
    part[1] = p.mass;
    part[2] = p.mass2;
    part[3] = p.flags;
  }
}

// f(i, a_i, b_i) once for every i in [lo, hi) of two f32 rows read side by side (b may be null:
// b_i = 0). Vector loads for a; for b too when it shares a's offset from 16-byte boundaries.
template <class F>
DSPARK_DEVICE void slice_for_each2(const float* __restrict__ a, const float* __restrict__ b, int lo, int hi, F&& f) {
  const int head = slice_head(a, lo, hi);
  const int body = lo + head;
  const int nvec = (hi - body) / 4;
  const int tail = body + nvec * 4;
  const bool b_vec = b && !((reinterpret_cast<unsigned long long>(a + lo) ^ reinterpret_cast<unsigned long long>(b + lo)) & 15ull);
  for (int k = threadIdx.x; k < head + (hi - tail); k += blockDim.x) {
    const int i = k < head ? lo + k : tail + (k - head);
    f(i, a[i], b ? b[i] : 0.0f);
  }
  for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
    const int i0 = body + 4 * v;
    float x[4], y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    unpack16(load16(a + i0), x, a);
    if (b_vec) unpack16(load16(b + i0), y, b);
    else if (b)
      for (int e = 0; e < 4; ++e) y[e] = b[i0 + e];
#pragma unroll
    for (int e = 0; e < 4; ++e) f(i0 + e, x[e], y[e]);
  }
}
