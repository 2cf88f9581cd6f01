// gdn_chunk: the gated delta rule of a prompt pass in chunks of 64 tokens (the WY / UT form, as
// flash-linear-attention's chunk_gated_delta_rule and transformers' torch_chunk_gated_delta_rule),
// on tensor cores for 16-bit operands. Verify and decode keep the sequential scan (gdn_scan.cu).
//
// Chunks sit on a fixed absolute grid: chunk c holds positions [64 c, 64 c + 64). A pass that starts
// inside a chunk recomputes that chunk from its start: the cache keeps the state at the chunk's start
// (chunk_states) and the chunk's earlier inputs (tails: conv outputs x [C], a [H], b [H] per row), so
// a prompt split anywhere gives the state and outputs of one pass, bitwise. A session's rows are its
// tail (tail_len rows) then its new columns: n = tail_len + columns rows, ceil(n / 64) chunks; rows past
// n are padding (q = k = v = 0, beta = 0, log decay 0), which adds exact zeros only.
//
// Per chunk and value head h (rows i, j in [0, 64); key head h / (H / Hk); S [dv, dk] per head):
//   q_i, k_i  L2-normalised as the scan does (gdn_l2norm_warp), q scaled by 1 / sqrt(dk)
//   G_i       = g_0 + .. + g_i,  g = gdn_log_decay (log alpha), summed in order; gam_i = exp(G_i),
//               del_i = exp(G_63 - G_i), Gam_ij = exp(G_i - G_j), gl = exp(G_63)
//   A         = strictly lower part of (beta_i k_i . k_j) Gam_ij;  T = (I + A)^-1 in f32 by blocks of 16
//               rows (chunk_solve: diagonal blocks by forward substitution, then the blocks below)
//   U = T (beta v),  W = T ((beta_i gam_i) k),  P_ij = (q_i . k_j) Gam_ij for j <= i (else 0),
//   Qt_i = gam_i q_i,  Kt_j = del_j k_j                                        (gdn_chunk_prep)
// then, chunk after chunk from the state S at the first chunk's start   (gdn_chunk_state):
//   Vn = U - W S^T;   o = Qt S^T + P Vn;   S <- gl S + Vn^T Kt
// Every product is a warp MMA tile (warp_mma16): operands in E, the trunk's 16-bit weight type
// (rounded to it, f32 accumulation on tensor cores), or f32 (fmaf chains in the same fragment
// layout, for f32 models). U, o and S stay f32. A row's outputs depend on the rows before it alone
// (masks are selects, T is lower triangular), so a chunk cut short by the end of a pass gives its
// rows the same bits as the whole chunk; only the state after it (the live state, for decode) is
// the partial chunk's.
//
// gdn_chunk_prep_<e>_dk<DK>: grid (chunks of the launch, H), 128 threads. Writes the chunk's U (f32
//   [64, dv]), W, Qt, Kt ([64, DK]) and P ([64, 64]) in E, and gl, to scratch (dspark.ops.gdn_chunk).
// gdn_chunk_state_<e>_dk<DK>: grid (ceil(dv / 32), H, B), 128 threads: 32 state rows of one head of
//   one session (in registers), walking its chunks in order; writes o for the pass's columns, the live
//   state after the last row, the state at the last chunk's start (chunk_states, when that chunk is
//   partial), and (CTA (0, 0, s)) the session's new tail rows and conv window.
// gdn_conv_rows_f32 (first): the conv of the pass's columns, in parallel (below).
#include "common.cuh"
#include "gdn.cuh"
#include "tensor_core.cuh"

constexpr int kChunk = 64;
constexpr int kChunkThreads = 128;
constexpr int kChunkSlice = 32;  // state rows per CTA of the state walk

// acc (a 16 x 16 tile: two n-tiles of the mma.sync C layout) += A (16 x 16 ksteps) B (16 ksteps x 16),
// k in increasing steps of 16. A's element (m, k) is a[m lda + k], or a[k lda + m] with kAKM; B's
// (k, n) is b[n ldb + k], or b[k ldb + n] with kBKN. 16-bit E: ldmatrix (.trans where the stored
// layout is the transpose of the fragment's) and mma.sync; f32: one fmaf chain per element in
// increasing k, in the same fragment layout.
template <typename E, bool kAKM, bool kBKN>
DSPARK_DEVICE void warp_mma16(float (&acc)[2][4], const E* a, int lda, const E* b, int ldb, int ksteps) {
  const int lane = threadIdx.x & 31;
  if constexpr (sizeof(E) == 2 && DSPARK_TENSOR_CORES) {
    for (int s = 0; s < ksteps; ++s) {
      uint32_t af[4], bf[4];
      if (kAKM) ldmatrix_x4_trans(af, a + (16 * s + (lane & 7) + 8 * (lane >> 4)) * lda + 8 * ((lane >> 3) & 1));
      else ldmatrix_x4(af, a + (lane & 15) * lda + 16 * s + 8 * (lane >> 4));
      if (kBKN) ldmatrix_x4_trans(bf, b + (16 * s + (lane & 7) + 8 * ((lane >> 3) & 1)) * ldb + 8 * (lane >> 4));
      else ldmatrix_x4(bf, b + ((lane & 7) + 8 * (lane >> 4)) * ldb + 16 * s + 8 * ((lane >> 3) & 1));
      mma_16816<E>(acc[0], af, bf[0], bf[1]);
      mma_16816<E>(acc[1], af, bf[2], bf[3]);
    }
  } else {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll 1
    for (int k = 0; k < 16 * ksteps; ++k) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int nt = e >> 2, c = e & 3, m = g + 8 * (c >> 1), n = 8 * nt + 2 * t + (c & 1);
        acc[nt][c] = fmaf(to_float(kAKM ? a[k * lda + m] : a[m * lda + k]),
                          to_float(kBKN ? b[k * ldb + n] : b[n * ldb + k]), acc[nt][c]);
      }
    }
  }
}

// Where a session's rows are: row r < tail_len is row r of its tail, row r >= tail_len column
// col0 + r - tail_len of the pass. rows = tail_len + columns.
struct ChunkRows {
  int session, tail_len, rows, col0, chunk0, chunks;
};

DSPARK_DEVICE ChunkRows chunk_rows(const int* col_indptr, const int* tail_lens, const int* chunk_indptr, int s) {
  ChunkRows c;
  c.session = s;
  c.tail_len = tail_lens[s];
  c.col0 = col_indptr[s];
  c.rows = c.tail_len + col_indptr[s + 1] - c.col0;
  c.chunk0 = chunk_indptr[s];
  c.chunks = chunk_indptr[s + 1] - c.chunk0;
  return c;
}

// Shared-memory strides (elements): 16-bit rows padded by 16 bytes (ldmatrix off one bank).
template <typename E>
struct ChunkPad {
  static constexpr int kE = 16 / (int)sizeof(E);
};

// T = (I + A)^-1 for a strictly lower triangular A [64][64] (f32, row stride ld), by blocks of 16
// rows: (1) each diagonal block's inverse by forward substitution, a thread per column (row i of
// column c: -sum_{j=c}^{i-1} A_ij T_jc in increasing j); (2) for block distance d = 1, 2, 3 the
// blocks (I, I - d): M = sum_{K=J}^{I-1} A_IK T_KJ (K, then k, increasing), T_IJ = -T_II M (p
// increasing). Row i of T reads rows <= i of A alone, zeros stay exact zeros. `m` is 768 floats
// of scratch. All threads of the block call it; it ends with T complete after a barrier.
DSPARK_DEVICE void chunk_solve(const float* A, float* T, float* m, int ld) {
  const int tid = threadIdx.x;
  if (tid < kChunk) {
    const int c = tid, blk0 = c / 16 * 16;
    for (int i = 0; i < blk0; ++i) T[i * ld + c] = 0.f;
    for (int i = blk0; i < blk0 + 16; ++i) {
      float v = i < c ? 0.f : 1.f;
      if (i > c) {
        float acc = 0.f;
        for (int j = c; j < i; ++j) acc = fmaf(A[i * ld + j], T[j * ld + c], acc);
        v = -acc;
      }
      T[i * ld + c] = v;
    }
  }
  __syncthreads();
  for (int d = 1; d < 4; ++d) {
    const int blocks = 4 - d;  // (I, J) = (d + b, b)
    for (int e = tid; e < blocks * 256; e += blockDim.x) {
      const int b = e / 256, r = e % 256 / 16, n = e % 16, I = d + b, J = b;
      float acc = 0.f;
      for (int K = J; K < I; ++K)
        for (int k = 0; k < 16; ++k) acc = fmaf(A[(16 * I + r) * ld + 16 * K + k], T[(16 * K + k) * ld + 16 * J + n], acc);
      m[e] = acc;
    }
    __syncthreads();
    for (int e = tid; e < blocks * 256; e += blockDim.x) {
      const int b = e / 256, r = e % 256 / 16, n = e % 16, I = d + b, J = b;
      float acc = 0.f;
      for (int q = 0; q <= r; ++q) acc = fmaf(T[(16 * I + r) * ld + 16 * I + q], m[b * 256 + q * 16 + n], acc);
      T[(16 * I + r) * ld + 16 * J + n] = -acc;
    }
    __syncthreads();
  }
}

// ---- gdn_chunk_prep ---------------------------------------------------------------------------------
// Shared memory (dspark.ops.gdn_chunk.prep_shared_mem computes the same):
//   gates  [4][64] f32          G (cumulative log decay), beta, gam, del
//   X      16-bit E: q, k f32 [64][DK + 4] (raw, then normalised); then A, T f32 [64][65] and the
//          solve's scratch (768 f32); then T in E [64][64 + pad] and beta v in E [64][dvp + pad].
//          f32: A, T [64][65] and T [64][64 + 4] (the solve's scratch until then)
//   Y      q, k in E [64][DK + pad] (f32: also their raw copies); then v f32 [64][dvp + 4] as copied
//          (f32: beta v, in place)
//   BK     (beta gam) k in E [64][DK + pad]
// The inputs arrive by asynchronous copies, 16 bytes each where a row is 16-byte aligned (a tail's
// rows are not when H is odd): q and k while the gates and their running sum are computed, v while
// T is solved.
template <typename E, int DK>
struct ChunkPrepLayout {
  static constexpr bool kAlias = sizeof(E) == 4;
  static constexpr int PE = ChunkPad<E>::kE;
  static constexpr int LDE = DK + PE, LDF = kAlias ? LDE : DK + 4, LDA = kChunk + 1, LDT = kChunk + PE;
  static constexpr size_t kGates = 4 * kChunk * sizeof(float);
  static constexpr size_t kAT = 2 * kChunk * LDA * sizeof(float);
  static constexpr size_t kSolveScratch = 768 * sizeof(float);
  static constexpr size_t kTE = kChunk * LDT * sizeof(E);
  static constexpr size_t kQKf = kAlias ? 0 : 2 * kChunk * LDF * sizeof(float);
  static constexpr size_t kQKE = 2 * kChunk * LDE * sizeof(E);
  __device__ __forceinline__ static size_t larger(size_t a, size_t b) { return a > b ? a : b; }
  __device__ __forceinline__ static size_t v_bytes(int dvp) { return (size_t)kChunk * (dvp + PE) * sizeof(E); }
  __device__ __forceinline__ static size_t stage_bytes(int dvp) { return (size_t)kChunk * (dvp + 4) * sizeof(float); }
  __device__ __forceinline__ static size_t x_bytes(int dvp) {
    return kAlias ? kAT + kTE : larger(larger(kQKf, kAT + kSolveScratch), kTE + v_bytes(dvp));
  }
  __device__ __forceinline__ static size_t y_bytes(int dvp) { return larger(kQKE, stage_bytes(dvp)); }
  __device__ __forceinline__ static size_t bytes(int dvp) {
    return kGates + x_bytes(dvp) + y_bytes(dvp) + kChunk * LDE * sizeof(E);
  }
};

template <typename E, int DK>
DSPARK_DEVICE void gdn_chunk_prep(const float* __restrict__ x, const float* __restrict__ a_in, const float* __restrict__ b_in,
                                  const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                                  const float* const* __restrict__ tails, const int* __restrict__ col_indptr,
                                  const int* __restrict__ tail_lens, const int* __restrict__ chunk_indptr, int sessions,
                                  int heads, int k_heads, int dv, float* __restrict__ u_s, E* __restrict__ w_s,
                                  E* __restrict__ q_s, E* __restrict__ k_s, E* __restrict__ p_s, float* __restrict__ gl_s) {
  using L = ChunkPrepLayout<E, DK>;
  constexpr int LDF = L::LDF, LDE = L::LDE, LDA = L::LDA, LDT = L::LDT;
  const int dvp = (dv + 15) / 16 * 16, LDV = dvp + L::PE;
  const int cid = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int s = 0, top = sessions;  // the session of chunk cid: chunk_indptr[s] <= cid < chunk_indptr[s + 1]
  while (top - s > 1) {
    const int mid = (s + top) / 2;
    if (chunk_indptr[mid] <= cid) s = mid;
    else top = mid;
  }
  const ChunkRows cr = chunk_rows(col_indptr, tail_lens, chunk_indptr, s);
  const int r0 = kChunk * (cid - cr.chunk0);
  const int C = 2 * k_heads * DK + heads * dv, TW = C + 2 * heads, kh = h / (heads / k_heads);

  DSPARK_DYNAMIC_SMEM(unsigned char, smem);
  float* G = reinterpret_cast<float*>(smem);
  float* beta = G + kChunk;
  float* gam = beta + kChunk;
  float* del = gam + kChunk;
  unsigned char* X = smem + L::kGates;
  unsigned char* Y = X + L::x_bytes(dvp);
  float* Af = reinterpret_cast<float*>(X);
  float* Tf = Af + kChunk * LDA;
  float* solve_scratch = Tf + kChunk * LDA;
  E* TE = L::kAlias ? reinterpret_cast<E*>(solve_scratch) : reinterpret_cast<E*>(X);  // 16-bit: over A, once solved
  E* qE = reinterpret_cast<E*>(Y);
  E* kE = qE + kChunk * LDE;
  float* v_copy = reinterpret_cast<float*>(Y);
  const int LDS = dvp + 4;
  E* vE = L::kAlias ? reinterpret_cast<E*>(Y) : reinterpret_cast<E*>(X + L::kTE);  // f32: v_copy itself
  E* bkE = reinterpret_cast<E*>(Y + L::y_bytes(dvp));
  float* qf = L::kAlias ? reinterpret_cast<float*>(qE) : reinterpret_cast<float*>(X);
  float* kf = qf + kChunk * LDF;
#if defined(DSPARK_SIMT)
  if (L::bytes(dvp) > simt::dynamic_smem_size() || (int)blockDim.x != kChunkThreads)
    simt::fault("gdn_chunk_prep: launch plan does not match the kernel (shared_mem " +
                std::to_string(simt::dynamic_smem_size()) + " < " + std::to_string(L::bytes(dvp)) + " or block != 128)");
#endif

  // Row i of the chunk: its conv outputs, a and b (null past the session's rows).
  auto row_x = [&](int i) -> const float* {
    const int r = r0 + i;
    if (r >= cr.rows) return nullptr;
    return r < cr.tail_len ? tails[s] + (int64_t)r * TW : x + (int64_t)(cr.col0 + r - cr.tail_len) * C;
  };
  auto row_gate = [&](int i, bool is_b) -> float {
    const int r = r0 + i;
    if (r < cr.tail_len) return tails[s][(int64_t)r * TW + C + (is_b ? heads : 0) + h];
    return (is_b ? b_in : a_in)[(int64_t)(cr.col0 + r - cr.tail_len) * heads + h];
  };

  // 1. raw q, k of the key head (zeros past the session's rows), copied while the gates and the
  // cumulative log decay (in order) are computed.
  for (int e = tid; e < kChunk * DK / 4; e += blockDim.x) {
    const int i = e / (DK / 4), d = 4 * (e % (DK / 4));
    const float* xr = row_x(i);
    cp_async_f32x4(qf + i * LDF + d, xr ? xr + kh * DK + d : x, xr != nullptr);
    cp_async_f32x4(kf + i * LDF + d, xr ? xr + (k_heads + kh) * DK + d : x, xr != nullptr);
  }
  cp_async_commit();
  if (tid < kChunk) {
    const bool valid = r0 + tid < cr.rows;
    G[tid] = valid ? gdn_log_decay(row_gate(tid, false), expf(A_log[h]), dt_bias[h]) : 0.f;
    beta[tid] = valid ? gdn_beta(row_gate(tid, true)) : 0.f;
  }
  __syncthreads();
  if (tid == 0)
    for (int i = 1; i < kChunk; ++i) G[i] = G[i - 1] + G[i];
  cp_async_wait<0>();
  __syncthreads();

  // 2. L2 norms (a warp per row, as the scan); the decays.
  const float q_scale = 1.0f / sqrtf((float)DK);
  for (int i = warp; i < kChunk; i += kChunkThreads / 32) {
    gdn_l2norm_warp(qf + i * LDF, DK, q_scale);
    gdn_l2norm_warp(kf + i * LDF, DK, 1.0f);
  }
  if (tid < kChunk) {
    gam[tid] = expf(G[tid]);
    del[tid] = expf(G[kChunk - 1] - G[tid]);
  }
  if (tid == 0) gl_s[(int64_t)cid * heads + h] = expf(G[kChunk - 1]);
  __syncthreads();

  // 3. the operands in E; Qt and Kt to scratch.
  const int64_t slot = (int64_t)cid * heads + h;
  for (int e = tid; e < kChunk * DK; e += blockDim.x) {
    const int i = e / DK, d = e % DK;
    const float q = qf[i * LDF + d], k = kf[i * LDF + d];
    qE[i * LDE + d] = from_float<E>(q);
    kE[i * LDE + d] = from_float<E>(k);
    bkE[i * LDE + d] = from_float<E>((beta[i] * gam[i]) * k);
    q_s[(slot * kChunk + i) * DK + d] = from_float<E>(gam[i] * q);
    k_s[(slot * kChunk + i) * DK + d] = from_float<E>(del[i] * k);
  }
  __syncthreads();  // qf, kf are dead (or, f32, are qE, kE): X is A and T from here on

  // 4. A = strictly lower (beta_i k_i . k_j) Gam_ij (f32) and P = lower (q_i . k_j) Gam_ij (E, to scratch).
  {
    const int g = lane >> 2, t = lane & 3, m0 = 16 * warp;
    for (int cg = 0; cg < kChunk / 16; ++cg) {
      float kk[2][4] = {}, qk[2][4] = {};
      warp_mma16<E, false, false>(kk, kE + m0 * LDE, LDE, kE + 16 * cg * LDE, LDE, DK / 16);
      warp_mma16<E, false, false>(qk, qE + m0 * LDE, LDE, kE + 16 * cg * LDE, LDE, DK / 16);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int i = m0 + g + 8 * (c >> 1), j = 16 * cg + 8 * nt + 2 * t + (c & 1);
          const float gm = j <= i ? expf(G[i] - G[j]) : 0.f;
          Af[i * LDA + j] = j < i ? (beta[i] * kk[nt][c]) * gm : 0.f;
          p_s[(slot * kChunk + i) * kChunk + j] = from_float<E>(j <= i ? qk[nt][c] * gm : 0.f);
        }
    }
  }
  __syncthreads();

  // 5. v of the head (zeros past the rows and dv), copied while T = (I + A)^-1 is solved in f32 by
  // 16-row blocks (chunk_solve); T in E for the products.
  for (int e = tid; e < kChunk * dvp / 4; e += blockDim.x) {
    const int i = e / (dvp / 4), v = 4 * (e % (dvp / 4));
    const float* xr = row_x(i);
    const bool valid = xr != nullptr && v < dv;
    cp_async_f32x4(v_copy + i * LDS + v, valid ? xr + 2 * k_heads * DK + h * dv + v : x, valid);
  }
  cp_async_commit();
  chunk_solve(Af, Tf, solve_scratch, LDA);
  for (int e = tid; e < kChunk * kChunk; e += blockDim.x)
    TE[(e / kChunk) * LDT + e % kChunk] = from_float<E>(Tf[(e / kChunk) * LDA + e % kChunk]);
  cp_async_wait<0>();
  __syncthreads();  // T in E and v are in place; A and T in f32 are dead
  // 6. beta v in E (f32: in place, each element by the thread that reads it).
  for (int e = tid; e < kChunk * dvp; e += blockDim.x) {
    const int i = e / dvp, v = e % dvp;
    vE[i * LDV + v] = from_float<E>(r0 + i < cr.rows && v < dv ? beta[i] * v_copy[i * LDS + v] : 0.f);
  }
  __syncthreads();

  // 7. U = T (beta v) (f32) and W = T ((beta gam) k) (E), to scratch: 16 columns at a time. Element
  // (nt, c) of a product is row m0 + g + 8 (c / 2), column 16 cg + 8 nt + 2 t + c % 2.
  const int g = lane >> 2, t = lane & 3, m0 = 16 * warp;
  auto product = [&](const E* b, int ldb, int cg, float (&acc)[2][4]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e >> 2][e & 3] = 0.f;
    warp_mma16<E, false, true>(acc, TE + m0 * LDT, LDT, b + 16 * cg, ldb, kChunk / 16);
  };
  for (int cg = 0; cg < dvp / 16; ++cg) {
    float u[2][4];
    product(vE, LDV, cg, u);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int i = m0 + g + 8 * ((e & 3) >> 1), v = 16 * cg + 8 * (e >> 2) + 2 * t + (e & 1);
      if (v < dv) u_s[(slot * kChunk + i) * dv + v] = u[e >> 2][e & 3];
    }
  }
  for (int cg = 0; cg < DK / 16; ++cg) {
    float w[2][4];
    product(bkE, LDE, cg, w);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int i = m0 + g + 8 * ((e & 3) >> 1), d = 16 * cg + 8 * (e >> 2) + 2 * t + (e & 1);
      w_s[(slot * kChunk + i) * DK + d] = from_float<E>(w[e >> 2][e & 3]);
    }
  }
}

// ---- gdn_chunk_state ---------------------------------------------------------------------------------
// The 32 state rows live in registers, as the C fragments of the state update: warp w owns the
// (m-tile, 16-column group) pairs w, w + 4, ... of the slice (kPairs of them). Shared memory
// (dspark.ops.gdn_chunk.state_shared_mem computes the same): S in E [32][DK + pad] (the products'
// operand), and STAGES buffers (2 for 16-bit E: the next chunk's operands land while this one
// runs) of W, Qt, Kt in E [64][DK + pad], P in E [64][64 + pad], U f32 [64][32]; Vn in E [64][32 + pad].
// f(i, nt, q) for each of a lane's kPairs x 2 x 4 state elements (in registers, unrolled).
template <int kPairs, typename F>
DSPARK_DEVICE void each_state(F&& f) {
#pragma unroll
  for (int e = 0; e < kPairs * 8; ++e) f(e >> 3, (e >> 2) & 1, e & 3);
}

template <typename E, int DK>
struct ChunkStateLayout {
  static constexpr int PE = ChunkPad<E>::kE;
  static constexpr int STAGES = sizeof(E) == 2 ? 2 : 1;
  static constexpr int LDE = DK + PE, LDP = kChunk + PE, LDV = kChunkSlice + PE;
  static constexpr int kPairs = (2 * (DK / 16) + 3) / 4;            // state pairs per warp
  static constexpr int kOperands = 3 * kChunk * LDE + kChunk * LDP;  // E elements of W, Qt, Kt, P
  static constexpr size_t kStage = kOperands * sizeof(E) + kChunk * kChunkSlice * sizeof(float);
  static constexpr size_t kBytes = kChunkSlice * LDE * sizeof(E) + STAGES * kStage + kChunk * LDV * sizeof(E);
};

template <typename E, int DK>
DSPARK_DEVICE void gdn_chunk_state(const float* __restrict__ mixed, const float* __restrict__ x,
                                   const float* __restrict__ a_in, const float* __restrict__ b_in,
                                   float* const* __restrict__ conv_windows, float* const* __restrict__ states,
                                   float* const* __restrict__ chunk_states,
                                   float* const* __restrict__ tails, const int* __restrict__ col_indptr,
                                   const int* __restrict__ tail_lens, const int* __restrict__ chunk_indptr, int heads,
                                   int k_heads, int dv, const float* __restrict__ u_s, const E* __restrict__ w_s,
                                   const E* __restrict__ q_s, const E* __restrict__ k_s, const E* __restrict__ p_s,
                                   const float* __restrict__ gl_s, float* __restrict__ out) {
  using L = ChunkStateLayout<E, DK>;
  constexpr int LDE = L::LDE, LDP = L::LDP, LDV = L::LDV, VEC = 16 / (int)sizeof(E);
  const int v0 = blockIdx.x * kChunkSlice, h = blockIdx.y, s = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const ChunkRows cr = chunk_rows(col_indptr, tail_lens, chunk_indptr, s);
  if (cr.chunks == 0) return;  // the whole CTA leaves together
  const int C = 2 * k_heads * DK + heads * dv, TW = C + 2 * heads;

  DSPARK_DYNAMIC_SMEM(unsigned char, smem);
#if defined(DSPARK_SIMT)
  if (L::kBytes > simt::dynamic_smem_size() || (int)blockDim.x != kChunkThreads)
    simt::fault("gdn_chunk_state: launch plan does not match the kernel (shared_mem " +
                std::to_string(simt::dynamic_smem_size()) + " < " + std::to_string(L::kBytes) + " or block != 128)");
#endif
  E* SE = reinterpret_cast<E*>(smem);
  unsigned char* stage0 = reinterpret_cast<unsigned char*>(SE + kChunkSlice * LDE);
  E* Vn = reinterpret_cast<E*>(stage0 + L::STAGES * L::kStage);
  auto W_of = [&](int st) { return reinterpret_cast<E*>(stage0 + st * L::kStage); };
  auto Q_of = [&](int st) { return W_of(st) + kChunk * LDE; };
  auto K_of = [&](int st) { return W_of(st) + 2 * kChunk * LDE; };
  auto P_of = [&](int st) { return W_of(st) + 3 * kChunk * LDE; };
  auto U_of = [&](int st) { return reinterpret_cast<float*>(W_of(st) + L::kOperands); };

  if (blockIdx.x == 0 && blockIdx.y == 0) {
    // The session's new tail, when its last chunk is partial: rows [64 (chunks - 1), rows) (those
    // already in the tail stay).
    const int last0 = kChunk * (cr.chunks - 1);
    for (int e = tid; cr.rows % kChunk && e < (cr.rows - last0) * TW; e += blockDim.x) {
      const int r = last0 + e / TW, f = e % TW, col = cr.col0 + r - cr.tail_len;
      if (r < cr.tail_len) continue;
      tails[s][(int64_t)(r - last0) * TW + f] = f < C ? x[(int64_t)col * C + f]
                                                : f < C + heads ? a_in[(int64_t)col * heads + f - C]
                                                                : b_in[(int64_t)col * heads + f - C - heads];
    }
    // The conv window: the session's last 3 inputs (gdn_conv_rows left the old window to be read).
    const int cols = cr.rows - cr.tail_len;
    for (int c = tid; c < C; c += blockDim.x) {
      float* win = conv_windows[s] + (int64_t)c * kGdnWindow;
      float w[kGdnWindow];
#pragma unroll
      for (int j = 0; j < kGdnWindow; ++j) {
        const int back = cols - kGdnWindow + j;  // the input `back` columns into the pass (< 0: the old window)
        w[j] = back >= 0 ? mixed[(int64_t)(cr.col0 + back) * C + c] : win[kGdnWindow + back];
      }
#pragma unroll
      for (int j = 0; j < kGdnWindow; ++j) win[j] = w[j];
    }
  }

  // This lane's state elements: pair p = warp + 4 i is (m-tile p / (DK / 16), column group p % (DK / 16)).
  auto state_at = [&](int i, int nt, int q, int& v, int& d) {
    const int pr = warp + 4 * i, mt = pr / (DK / 16), cg = pr % (DK / 16);
    v = v0 + 16 * mt + g + 8 * (q >> 1);
    d = 16 * cg + 8 * nt + 2 * t + (q & 1);
    return pr < 2 * (DK / 16);
  };
  // The state at the first chunk's start: the chunk state when the pass resumes inside a chunk.
  float S[L::kPairs][2][4];
  const float* base = (cr.tail_len ? chunk_states[s] : states[s]) + (int64_t)h * dv * DK;
  each_state<L::kPairs>([&](int i, int nt, int q) {
    int v, d;
    S[i][nt][q] = state_at(i, nt, q, v, d) && v < dv ? base[(int64_t)v * DK + d] : 0.f;
  });

  auto issue = [&](int c, int st) {  // chunk c's operands into stage st
    const int64_t slot = (int64_t)(cr.chunk0 + c) * heads + h;
    for (int e = tid; e < kChunk * DK / VEC; e += blockDim.x) {
      const int i = e / (DK / VEC), d = (e % (DK / VEC)) * VEC;
      const int64_t at = (slot * kChunk + i) * DK + d;
      E* dst = W_of(st) + i * LDE + d;
      cp_async16(dst, w_s + at, true);
      cp_async16(dst + kChunk * LDE, q_s + at, true);
      cp_async16(dst + 2 * kChunk * LDE, k_s + at, true);
    }
    for (int e = tid; e < kChunk * kChunk / VEC; e += blockDim.x) {
      const int i = e / (kChunk / VEC), j = (e % (kChunk / VEC)) * VEC;
      cp_async16(P_of(st) + i * LDP + j, p_s + (slot * kChunk + i) * kChunk + j, true);
    }
    for (int e = tid; e < kChunk * kChunkSlice / 4; e += blockDim.x) {
      const int i = e / (kChunkSlice / 4), vv = (e % (kChunkSlice / 4)) * 4;
      const bool valid = v0 + vv < dv;  // dv % 4 == 0: a chunk is wholly in or out
      cp_async16(U_of(st) + i * kChunkSlice + vv, valid ? u_s + (slot * kChunk + i) * dv + v0 + vv : u_s, valid);
    }
    cp_async_commit();
  };

  issue(0, 0);
  for (int c = 0; c < cr.chunks; ++c) {
    const int st = L::STAGES == 2 ? c & 1 : 0;
    if (L::STAGES == 2) {
      if (c + 1 < cr.chunks) issue(c + 1, st ^ 1);
      else cp_async_commit();
    }
    // S in E, and (the last chunk cut short) the chunk state: the state at the chunk's start.
    const bool last_partial = c == cr.chunks - 1 && cr.rows % kChunk != 0;
    each_state<L::kPairs>([&](int i, int nt, int q) {
      int v, d;
      if (!state_at(i, nt, q, v, d)) return;
      SE[(v - v0) * LDE + d] = from_float<E>(S[i][nt][q]);
      if (last_partial && v < dv) chunk_states[s][((int64_t)h * dv + v) * DK + d] = S[i][nt][q];
    });
    if (L::STAGES == 2) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();  // [A] chunk c's operands and S in E are in shared memory
    const E* Wt = W_of(st);
    const E* Qt = Q_of(st);
    const E* Kt = K_of(st);
    const E* Pt = P_of(st);
    const float* Ut = U_of(st);
    const float gl = gl_s[(int64_t)(cr.chunk0 + c) * heads + h];

    // Vn = U - W S^T: warp w owns rows 16 w .. 16 w + 15.
    const int m0 = 16 * warp;
#pragma unroll
    for (int cg = 0; cg < kChunkSlice / 16; ++cg) {
      float p[2][4] = {};
      warp_mma16<E, false, false>(p, Wt + m0 * LDE, LDE, SE + 16 * cg * LDE, LDE, DK / 16);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int i = m0 + g + 8 * (q >> 1), vv = 16 * cg + 8 * nt + 2 * t + (q & 1);
          Vn[i * LDV + vv] = from_float<E>(Ut[i * kChunkSlice + vv] - p[nt][q]);
        }
    }
    __syncthreads();  // [B]

    // o = Qt S^T + P Vn, for the pass's own rows.
#pragma unroll
    for (int cg = 0; cg < kChunkSlice / 16; ++cg) {
      float o[2][4] = {};
      warp_mma16<E, false, false>(o, Qt + m0 * LDE, LDE, SE + 16 * cg * LDE, LDE, DK / 16);
      warp_mma16<E, false, true>(o, Pt + m0 * LDP, LDP, Vn + 16 * cg, LDV, kChunk / 16);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int r = kChunk * c + m0 + g + 8 * (q >> 1), v = v0 + 16 * cg + 8 * nt + 2 * t + (q & 1);
          if (r >= cr.tail_len && r < cr.rows && v < dv)
            out[((int64_t)(cr.col0 + r - cr.tail_len) * heads + h) * dv + v] = o[nt][q];
        }
    }

    // S <- gl S + Vn^T Kt, each warp its pairs (m-tile of the slice, 16 state columns).
#pragma unroll
    for (int i = 0; i < L::kPairs; ++i) {
      const int pr = warp + 4 * i, mt = pr / (DK / 16), cg = pr % (DK / 16);
      if (pr < 2 * (DK / 16)) {
#pragma unroll
        for (int e = 0; e < 8; ++e) S[i][e >> 2][e & 3] = gl * S[i][e >> 2][e & 3];
        warp_mma16<E, true, true>(S[i], Vn + 16 * mt, LDV, Kt + 16 * cg, LDE, kChunk / 16);
      }
    }
    __syncthreads();  // [C] this stage, S in E and Vn are consumed
    if (L::STAGES == 1 && c + 1 < cr.chunks) issue(c + 1, 0);
  }
  cp_async_wait<0>();

  float* live = states[s] + (int64_t)h * dv * DK;
  each_state<L::kPairs>([&](int i, int nt, int q) {
    int v, d;
    if (state_at(i, nt, q, v, d) && v < dv) live[(int64_t)v * DK + d] = S[i][nt][q];
  });
}

// gdn_conv_rows_f32(mixed [cols, C], conv_weight [C, 4], conv_windows [B] -> [C, 3], col_indptr, C, x)
//   The causal conv + SiLU of a prompt pass's columns, a thread per (channel, 64 columns of a
//   session): each output reads the 4 inputs it needs (the window for a session's first three),
//   in gdn_conv_silu's order, so it gives the scan's conv (gdn_conv_f32) bit for bit with a pass's
//   columns in parallel. Grid (ceil(C / 128), ceil(most columns / 64), B). The windows are read
//   here and moved on by gdn_chunk_state, after every read.
constexpr int kConvCols = 64;

extern "C" __global__ void __launch_bounds__(kChunkThreads) gdn_conv_rows_f32(
    const float* __restrict__ mixed, const float* __restrict__ conv_weight, float* const* __restrict__ conv_windows,
    const int* __restrict__ col_indptr, int C, float* __restrict__ x) {
  const int c = blockIdx.x * kChunkThreads + threadIdx.x, s = blockIdx.z;
  const int c0 = col_indptr[s], c1 = col_indptr[s + 1], t0 = c0 + (int)blockIdx.y * kConvCols;
  if (c >= C || t0 >= c1) return;  // no barriers here: threads may leave on their own
  const float* window = conv_windows[s] + (int64_t)c * kGdnWindow;
  float win[kGdnWindow], w[kGdnTaps];
#pragma unroll
  for (int j = 0; j < kGdnTaps; ++j) w[j] = conv_weight[(int64_t)c * kGdnTaps + j];
#pragma unroll
  for (int j = 0; j < kGdnWindow; ++j) {
    const int col = t0 - kGdnWindow + j;
    win[j] = col >= c0 ? mixed[(int64_t)col * C + c] : window[col - c0 + kGdnWindow];
  }
  for (int t = t0; t < min(c1, t0 + kConvCols); ++t) {
    const int64_t i = (int64_t)t * C + c;
    x[i] = gdn_conv_silu(win, w, mixed[i], nullptr);
  }
}

#define DSPARK_GDN_CHUNK_ENTRIES(SUF, E, DK)                                                                  \
  extern "C" __global__ void __launch_bounds__(kChunkThreads) gdn_chunk_prep_##SUF##_dk##DK(                 \
      const float* __restrict__ x, const float* __restrict__ a, const float* __restrict__ b,                  \
      const float* __restrict__ A_log, const float* __restrict__ dt_bias, const float* const* __restrict__ tails, \
      const int* __restrict__ col_indptr, const int* __restrict__ tail_lens, const int* __restrict__ chunk_indptr, \
      int sessions, int heads, int k_heads, int dv, float* __restrict__ u_s, E* __restrict__ w_s,             \
      E* __restrict__ q_s, E* __restrict__ k_s, E* __restrict__ p_s, float* __restrict__ gl_s) {              \
    gdn_chunk_prep<E, DK>(x, a, b, A_log, dt_bias, tails, col_indptr, tail_lens, chunk_indptr, sessions, heads, \
                          k_heads, dv, u_s, w_s, q_s, k_s, p_s, gl_s);                                         \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(kChunkThreads, 1) gdn_chunk_state_##SUF##_dk##DK(             \
      const float* __restrict__ mixed, const float* __restrict__ x, const float* __restrict__ a,               \
      const float* __restrict__ b, float* const* __restrict__ conv_windows, float* const* __restrict__ states,  \
      float* const* __restrict__ chunk_states, float* const* __restrict__ tails,                               \
      const int* __restrict__ col_indptr, const int* __restrict__ tail_lens, const int* __restrict__ chunk_indptr, \
      int heads, int k_heads, int dv, const float* __restrict__ u_s, const E* __restrict__ w_s,               \
      const E* __restrict__ q_s, const E* __restrict__ k_s, const E* __restrict__ p_s,                        \
      const float* __restrict__ gl_s, float* __restrict__ out) {                                               \
    gdn_chunk_state<E, DK>(mixed, x, a, b, conv_windows, states, chunk_states, tails, col_indptr, tail_lens,   \
                           chunk_indptr, heads,                                                                  \
                           k_heads, dv, u_s, w_s, q_s, k_s, p_s, gl_s, out);                                   \
  }

#define DSPARK_GDN_CHUNK_DTYPE(SUF, E) \
  DSPARK_GDN_CHUNK_ENTRIES(SUF, E, 16) \
  DSPARK_GDN_CHUNK_ENTRIES(SUF, E, 32) \
  DSPARK_GDN_CHUNK_ENTRIES(SUF, E, 64) \
  DSPARK_GDN_CHUNK_ENTRIES(SUF, E, 128)

DSPARK_GDN_CHUNK_DTYPE(f32, float)
DSPARK_GDN_CHUNK_DTYPE(f16, f16_t)
DSPARK_GDN_CHUNK_DTYPE(bf16, bf16_t)
