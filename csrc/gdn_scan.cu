// gdn_scan: the gated delta-rule recurrence over t tokens (columns) per session, for decode
// (t = 1), verify (t = vt, with per-column checkpoints), replay (t = keep) and prefill. Two
// launches per layer, both read by session through col_indptr [B+1] (session s owns the columns
// col_indptr[s] .. col_indptr[s+1]):
//
// gdn_conv_f32(mixed [cols, C], conv_weight [C, 4], conv_windows [B] -> [C, 3], col_indptr, C,
//              x [cols, C], conv_ckpt [cols, C, 3] or null, commit)
//   The causal depthwise conv + SiLU of every channel. Grid (ceil(C / 128), B), one thread per
//   (channel, session): it walks the session's columns in order with the window in registers,
//   so every window has exactly one owner, then writes it back once (commit = 1). A key head's
//   channels are read by several value heads, so the conv cannot live in the scan's per-head
//   blocks.
//
// gdn_scan_dk<DK>_f32(x [cols, C], a [cols, H], b [cols, H], A_log [H], dt_bias [H],
//                     states [B] -> [H, dv, DK], col_indptr [B+1], heads, k_heads, dv,
//                     out [cols, H, dv], state_ckpt [cols, H, dv, DK] or null, commit)
//   C = k_heads * 2*DK + H * dv channels laid out [q (k_heads*DK) | k (k_heads*DK) | v (H*dv)].
//   Value head h reads key head h / (H / k_heads): consecutive value heads share a key head, as
//   transformers' repeat_interleave does. Grid (H, B): one block per (value head, session), so a
//   state has exactly one owner and the scan needs no inter-block ordering. Block:
//   GdnTile<DK>::kLanes threads per state row, rounded up to whole warps (at most 512). The state
//   lives in registers for the whole scan, 32 (or DK) floats per thread; it is read once and
//   written once per launch, or not at all with commit = 0. Per column:
//   A. the head's q, k (of its key head) and v to shared memory, gates by thread 0;
//   B. L2 norm of q by warp 0 and of k by warp 1 (warp 0 when there is only one);
//   C. the delta rule on each thread's row slice; u and o are summed over the thread's columns
//      in order g, e (see GdnTile), then over the row's lanes by xor butterfly.
//
// commit = 0 (a speculative verify): the live state and window are read, never written; the
// round's rollback then moves them exactly `keep` columns on (checkpoint select or replay), and a
// round that fails before it leaves them as they were, with no snapshot.
//
// Nothing depends on how many columns or sessions share a launch, so a verify column is bitwise
// equal to the decode step at the same position, and replay equals checkpoint select.
#include "common.cuh"
#include "gdn.cuh"

constexpr int kGdnConvThreads = 128;

extern "C" __global__ void __launch_bounds__(kGdnConvThreads) gdn_conv_f32(
    const float* __restrict__ mixed, const float* __restrict__ conv_weight, float* const* __restrict__ conv_windows,
    const int* __restrict__ col_indptr, int C, float* __restrict__ x, float* __restrict__ conv_ckpt, int commit) {
  const int c = blockIdx.x * kGdnConvThreads + threadIdx.x, s = blockIdx.y;
  const int c0 = col_indptr[s], c1 = col_indptr[s + 1];
  if (c >= C || c0 >= c1) return;  // no barriers here: threads may leave on their own
  float* __restrict__ window = conv_windows[s] + (int64_t)c * kGdnWindow;
  float win[kGdnWindow], w[kGdnTaps];
#pragma unroll
  for (int j = 0; j < kGdnWindow; ++j) win[j] = window[j];
#pragma unroll
  for (int j = 0; j < kGdnTaps; ++j) w[j] = conv_weight[(int64_t)c * kGdnTaps + j];
  for (int col = c0; col < c1; ++col) {
    const int64_t i = (int64_t)col * C + c;
    x[i] = gdn_conv_silu(win, w, mixed[i], conv_ckpt ? conv_ckpt + i * kGdnWindow : nullptr);
  }
  if (!commit) return;
#pragma unroll
  for (int j = 0; j < kGdnWindow; ++j) window[j] = win[j];
}

template <int DK>
DSPARK_DEVICE void gdn_scan(const float* __restrict__ x, const float* __restrict__ a, const float* __restrict__ b,
                            const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                            float* const* __restrict__ states, const int* __restrict__ col_indptr, int heads,
                            int k_heads, int dv, float* __restrict__ out, float* __restrict__ state_ckpt,
                            int commit) {
  using Tile = GdnTile<DK>;
  DSPARK_DYNAMIC_SMEM(float, xs);  // this token's [q DK | k DK | v dv] for this head
  __shared__ float2 gate;          // (alpha, beta) of this token

  const int h = blockIdx.x, s = blockIdx.y;
  const int c0 = col_indptr[s], c1 = col_indptr[s + 1];
  if (c0 >= c1) return;  // the whole block leaves together
  const int C = 2 * k_heads * DK + heads * dv;
  const int kh = h / (heads / k_heads);  // the key head this value head reads
  const float* q_src = x + kh * DK;
  const float* k_src = x + (k_heads + kh) * DK;
  const float* v_src = x + 2 * k_heads * DK + h * dv;
  const int row = threadIdx.x / Tile::kLanes, part = threadIdx.x % Tile::kLanes;
  const bool owner = row < dv;  // padding threads still join every shuffle and barrier
  const int64_t row_off = ((int64_t)h * dv + row) * DK;

  float S[Tile::kCols];
#pragma unroll
  for (int g = 0; g < Tile::kGroups; ++g) {
    const float4 v = owner ? reinterpret_cast<const float4*>(states[s] + row_off)[part + Tile::kLanes * g]
                           : make_float4(0.f, 0.f, 0.f, 0.f);
    S[4 * g] = v.x, S[4 * g + 1] = v.y, S[4 * g + 2] = v.z, S[4 * g + 3] = v.w;
  }
  const float A = expf(A_log[h]), bias = dt_bias[h];
  const float q_scale = 1.0f / sqrtf((float)DK);
  const int warp = threadIdx.x >> 5, k_warp = blockDim.x > 32 ? 1 : 0;
  const float4* q4 = reinterpret_cast<const float4*>(xs);
  const float4* k4 = reinterpret_cast<const float4*>(xs + DK);

  for (int col = c0; col < c1; ++col) {
    // A. q and k of the key head, v of this head; gates.
    const int64_t at = (int64_t)col * C;
    for (int c = threadIdx.x; c < DK; c += blockDim.x) xs[c] = q_src[at + c], xs[DK + c] = k_src[at + c];
    for (int c = threadIdx.x; c < dv; c += blockDim.x) xs[2 * DK + c] = v_src[at + c];
    if (threadIdx.x == 0) gate = gdn_gates(a[(int64_t)col * heads + h], b[(int64_t)col * heads + h], A, bias);
    __syncthreads();

    // B. L2 norms, in place.
    if (warp == 0) gdn_l2norm_warp(xs, DK, q_scale);
    if (warp == k_warp) gdn_l2norm_warp(xs + DK, DK, 1.0f);
    __syncthreads();

    // C. S <- alpha S; u = S k; S <- S + beta (v - u) k^T; o = S q.
    const float alpha = gate.x, beta = gate.y;
    float u = 0.f;
#pragma unroll
    for (int g = 0; g < Tile::kGroups; ++g) {
      const float4 k = k4[part + Tile::kLanes * g];
      float* sg = S + 4 * g;
      sg[0] *= alpha, sg[1] *= alpha, sg[2] *= alpha, sg[3] *= alpha;
      u += sg[0] * k.x;
      u += sg[1] * k.y;
      u += sg[2] * k.z;
      u += sg[3] * k.w;
    }
    u = gdn_row_sum<Tile::kLanes>(u);
    const float delta = owner ? beta * (xs[2 * DK + row] - u) : 0.f;
    float o = 0.f;
#pragma unroll
    for (int g = 0; g < Tile::kGroups; ++g) {
      const float4 k = k4[part + Tile::kLanes * g], q = q4[part + Tile::kLanes * g];
      float* sg = S + 4 * g;
      sg[0] += delta * k.x, sg[1] += delta * k.y, sg[2] += delta * k.z, sg[3] += delta * k.w;
      o += sg[0] * q.x;
      o += sg[1] * q.y;
      o += sg[2] * q.z;
      o += sg[3] * q.w;
    }
    o = gdn_row_sum<Tile::kLanes>(o);
    if (owner) {
      const int64_t head_row = (int64_t)col * heads * dv + (int64_t)h * dv + row;
      if (part == 0) out[head_row] = o;
      if (state_ckpt) {
        float4* dst = reinterpret_cast<float4*>(state_ckpt + head_row * DK);
#pragma unroll
        for (int g = 0; g < Tile::kGroups; ++g)
          dst[part + Tile::kLanes * g] = make_float4(S[4 * g], S[4 * g + 1], S[4 * g + 2], S[4 * g + 3]);
      }
    }
    __syncthreads();  // xs and gate are rewritten by the next column
  }

  if (owner && commit) {
    float4* dst = reinterpret_cast<float4*>(states[s] + row_off);
#pragma unroll
    for (int g = 0; g < Tile::kGroups; ++g)
      dst[part + Tile::kLanes * g] = make_float4(S[4 * g], S[4 * g + 1], S[4 * g + 2], S[4 * g + 3]);
  }
}

#define DSPARK_GDN_SCAN_ENTRY(DK)                                                                          \
  extern "C" __global__ void __launch_bounds__(kGdnMaxThreads) gdn_scan_dk##DK##_f32(                      \
      const float* __restrict__ x, const float* __restrict__ a, const float* __restrict__ b,               \
      const float* __restrict__ A_log, const float* __restrict__ dt_bias, float* const* __restrict__ states, \
      const int* __restrict__ col_indptr, int heads, int k_heads, int dv, float* __restrict__ out,         \
      float* __restrict__ state_ckpt, int commit) {                                                        \
    gdn_scan<DK>(x, a, b, A_log, dt_bias, states, col_indptr, heads, k_heads, dv, out, state_ckpt, commit);\
  }

DSPARK_GDN_SCAN_ENTRY(16)
DSPARK_GDN_SCAN_ENTRY(32)
DSPARK_GDN_SCAN_ENTRY(64)
DSPARK_GDN_SCAN_ENTRY(128)
