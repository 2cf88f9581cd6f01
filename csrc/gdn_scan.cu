// gdn_scan: one gdn layer's recurrence over t tokens (columns) per session, for decode (t = 1),
// verify (t = vt, with per-column checkpoints), replay (t = keep) and prefill, in ONE launch: the
// causal conv, the scan and the gated output norm (three launches and six array operations before).
//
// gdn_scan_dk<DK>_f32(proj [cols, ld], ld, mixed_off, a_off, b_off, z_off, conv_weight [C, 4],
//                     A_log [H], dt_bias [H], o_norm [dv] or null, eps, states [B] -> [H, dv, DK],
//                     conv_windows [B] -> [C, 3], col_indptr [B+1], col_count [B] or null, heads, k_heads,
//                     dv, slice_rows, out [cols, H, dv] or null, state_ckpt [cols, H, dv, DK] or null,
//                     conv_ckpt [cols, C, 3] or null, tickets [B * (k_heads + H)] or null, commit)
//   Row `col` of proj holds the layer's input projection: mixed [C] at mixed_off (C = k_heads*2*DK +
//   H*dv channels [q (k_heads*DK) | k (k_heads*DK) | v (H*dv)]), a [H] at a_off, b [H] at b_off and
//   z [H*dv] at z_off. Session s owns columns col_indptr[s] .. col_indptr[s+1] (or the first
//   col_count[s] of them: replay's kept columns). Value head h reads key head h / (H / k_heads):
//   consecutive value heads share a key head, as transformers' repeat_interleave does.
//   Grid (H * slices, B): block (h * slices + i, s) holds state rows [i slice_rows, +slice_rows) of
//   value head h of session s (slices = ceil(dv / slice_rows): a head's state spread over several SMs,
//   their loads and stores in flight together), so each state row has exactly one owner; a state row
//   is independent of the others in the delta rule, so the scan needs no inter-block ordering. Block:
//   GdnTile<DK>::kLanes threads per state row, rounded up to whole warps (at most kGdnSliceThreads).
//   The state lives in registers for the whole scan, 32 (or DK) floats per thread; it is read once
//   and written once per launch, or not at all with commit = 0.
//   Per column:
//   A. conv + SiLU of the block's channels (its key head's q and k, its rows' v; each channel a
//      thread with its window in shared memory, in gdn_conv_silu's order), into shared memory; the
//      window after the column to conv_ckpt; gates by thread 0;
//   B. L2 norm of q by warp 0 and of k by warp 1 (warp 0 when there is only one);
//   C. the delta rule on each thread's row slice; u and o are summed over the thread's columns
//      in order g, e (see GdnTile), then over the row's lanes by xor butterfly; o to `out`.
//   D. with o_norm, once every slice of the head has written its o (the last to take the head's
//      ticket, tickets[B k_heads + s H + h]), for each column: out = (o / sqrt(sum o^2 / dv + eps)) *
//      o_norm * (z * (1 / (1 + exp(-z)))), the sum by warp 0 in rmsnorm_f32's lane order over o read
//      back; without: out = o.
//   A key head's q and k checkpoints are written by its first value head's first slice only, each
//   slice its rows' v. With commit, a key head's q and k windows are written back once every block
//   reading them has read them: the last to take the session's ticket of that key head (zero at
//   rest, put back to 0) writes them; each slice writes its rows' v windows.
//
// commit = 0 (a speculative verify): the live state and window are read, never written; the
// round's rollback then moves them exactly `keep` columns on (checkpoint select or replay), and a
// round that fails before it leaves them as they were, with no snapshot.
//
// Nothing depends on how many columns or sessions share a launch, so a verify column is bitwise
// equal to the decode step at the same position, and replay equals checkpoint select.
#include "activation.cuh"
#include "common.cuh"
#include "gdn.cuh"

template <int DK>
DSPARK_DEVICE void gdn_scan(const float* __restrict__ proj, long long ld, int mixed_off, int a_off, int b_off, int z_off,
                            const float* __restrict__ conv_weight, const float* __restrict__ A_log,
                            const float* __restrict__ dt_bias, const float* __restrict__ o_norm, float eps,
                            float* const* __restrict__ states, float* const* __restrict__ conv_windows,
                            const int* __restrict__ col_indptr, const int* __restrict__ col_count, int heads,
                            int k_heads, int dv, int slice_rows, float* __restrict__ out,
                            float* __restrict__ state_ckpt, float* __restrict__ conv_ckpt,
                            unsigned* __restrict__ tickets, int commit) {
  using Tile = GdnTile<DK>;
  DSPARK_DYNAMIC_SMEM(float, xs);  // [q DK | k DK | v of the slice's rows] of this column, then windows, conv weights
  __shared__ float2 gate;          // (alpha, beta) of this token
  __shared__ bool last;
  __shared__ float r_norm;        // a column's sqrt(mean o^2 + eps)

  const int slices = (dv + slice_rows - 1) / slice_rows;
  const int h = blockIdx.x / slices, slice = blockIdx.x % slices, s = blockIdx.y;
  const int c0 = col_indptr[s], c1 = col_count ? c0 + col_count[s] : col_indptr[s + 1];
  if (c0 >= c1) return;  // the whole block leaves together
  const int C = 2 * k_heads * DK + heads * dv, group = heads / k_heads;
  const int kh = h / group;  // the key head this value head reads
  const bool lead = h % group == 0 && slice == 0;  // writes its key head's q and k checkpoints
  const int row0 = slice * slice_rows, rs = min(slice_rows, dv - row0);  // the slice's state rows
  const int nch = 2 * DK + rs;
  float* win = xs + nch;           // [nch][3]: each channel's last 3 inputs, oldest first
  float* cw = win + 3 * nch;       // [nch][4]: the conv weights
  // Local channel c -> the layer's channel: q and k of key head kh, then v of the slice's rows of head h.
  auto channel = [&](int c) {
    return c < DK ? kh * DK + c
                  : c < 2 * DK ? (k_heads + kh) * DK + c - DK : 2 * k_heads * DK + h * dv + row0 + c - 2 * DK;
  };
  for (int c = threadIdx.x; c < nch; c += blockDim.x) {
    const int g = channel(c);
#pragma unroll
    for (int j = 0; j < kGdnWindow; ++j) win[c * kGdnWindow + j] = conv_windows[s][(int64_t)g * kGdnWindow + j];
#pragma unroll
    for (int j = 0; j < kGdnTaps; ++j) cw[c * kGdnTaps + j] = conv_weight[(int64_t)g * kGdnTaps + j];
  }
  const int row = threadIdx.x / Tile::kLanes, part = threadIdx.x % Tile::kLanes;
  const bool owner = row < rs;  // padding threads still join every shuffle and barrier
  const int state_row = h * dv + row0 + row;  // the head's state row this thread holds part of

  float S[Tile::kCols];
#pragma unroll
  for (int g = 0; g < Tile::kGroups; ++g) {
    const float4 v = owner ? reinterpret_cast<const float4*>(states[s] + (int64_t)state_row * DK)[part + Tile::kLanes * g]
                           : make_float4(0.f, 0.f, 0.f, 0.f);
    S[4 * g] = v.x, S[4 * g + 1] = v.y, S[4 * g + 2] = v.z, S[4 * g + 3] = v.w;
  }
  const float A = expf(A_log[h]), bias = dt_bias[h];
  const float q_scale = 1.0f / sqrtf((float)DK);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, k_warp = blockDim.x > 32 ? 1 : 0;
  const float4* q4 = reinterpret_cast<const float4*>(xs);
  const float4* k4 = reinterpret_cast<const float4*>(xs + DK);
  const bool gated = o_norm && out;
  __syncthreads();  // windows and weights are in shared memory

  for (int col = c0; col < c1; ++col) {
    // A. conv + SiLU of the slice's channels; gates.
    const float* in = proj + col * ld;
    for (int c = threadIdx.x; c < nch; c += blockDim.x) {
      float w[kGdnTaps], wn[kGdnWindow];
#pragma unroll
      for (int j = 0; j < kGdnTaps; ++j) w[j] = cw[c * kGdnTaps + j];
#pragma unroll
      for (int j = 0; j < kGdnWindow; ++j) wn[j] = win[c * kGdnWindow + j];
      const int g = channel(c);
      float* ckpt = conv_ckpt && (c >= 2 * DK || lead) ? conv_ckpt + ((int64_t)col * C + g) * kGdnWindow : nullptr;
      xs[c] = gdn_conv_silu(wn, w, in[mixed_off + g], ckpt);
#pragma unroll
      for (int j = 0; j < kGdnWindow; ++j) win[c * kGdnWindow + j] = wn[j];
    }
    if (threadIdx.x == 0) gate = gdn_gates(in[a_off + h], in[b_off + h], A, bias);
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
    const int64_t head_row = (int64_t)col * heads * dv + (int64_t)h * dv + row0;
    if (owner) {
      if (part == 0 && out) out[head_row + row] = o;  // gated: o itself until the norm below
      if (state_ckpt) {
        float4* dst = reinterpret_cast<float4*>(state_ckpt + (head_row + row) * DK);
#pragma unroll
        for (int g = 0; g < Tile::kGroups; ++g)
          dst[part + Tile::kLanes * g] = make_float4(S[4 * g], S[4 * g + 1], S[4 * g + 2], S[4 * g + 3]);
      }
    }
    __syncthreads();  // xs and gate are rewritten by the next column
  }

  if (commit && owner) {
    float4* dst = reinterpret_cast<float4*>(states[s] + (int64_t)state_row * DK);
#pragma unroll
    for (int g = 0; g < Tile::kGroups; ++g)
      dst[part + Tile::kLanes * g] = make_float4(S[4 * g], S[4 * g + 1], S[4 * g + 2], S[4 * g + 3]);
  }
  if (commit) {  // The key head's window goes back once every block reading it has read it (module doc).
    if (threadIdx.x == 0) {
      bool lr = true;
      if (group * slices > 1) {
        __threadfence();
        unsigned* t = tickets + s * k_heads + kh;
        lr = atomicAdd(t, 1u) == (unsigned)(group * slices - 1);
        if (lr) atomicExch(t, 0u);
      }
      last = lr;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < nch; c += blockDim.x) {
      if (c < 2 * DK && !last) continue;
      const int g = channel(c);
#pragma unroll
      for (int j = 0; j < kGdnWindow; ++j) conv_windows[s][(int64_t)g * kGdnWindow + j] = win[c * kGdnWindow + j];
    }
  }
  if (!gated) return;

  // D. The gated norm of each column's o, by the last of the head's slices to finish (all of o is in
  // `out` then): out = (o / sqrt(sum o^2 / dv + eps)) * o_norm * (z * (1 / (1 + exp(-z)))), the sum by
  // warp 0 in rmsnorm_f32's lane order.
  if (slices > 1) {
    __threadfence();  // this block's o reach L2 before its ticket
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned* t = tickets + (int64_t)gridDim.y * k_heads + s * heads + h;
      const bool lr = atomicAdd(t, 1u) == (unsigned)(slices - 1);
      if (lr) {
        atomicExch(t, 0u);
        __threadfence();
      }
      last = lr;
    }
    __syncthreads();
    if (!last) return;
  }
  for (int col = c0; col < c1; ++col) {
    const float* in = proj + col * ld;
    volatile float* oc = out + (int64_t)col * heads * dv + (int64_t)h * dv;  // the other slices' o: from L2
    if (warp == 0) {
      float ss = 0.f;
      for (int j = lane; j < dv; j += 32) ss += oc[j] * oc[j];
      const float r = sqrtf(warp_sum(ss) / (float)dv + eps);
      if (lane == 0) r_norm = r;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < dv; j += blockDim.x) {
      const float z = in[z_off + h * dv + j];
      oc[j] = silu_gate((oc[j] / r_norm) * o_norm[j], z);
    }
    __syncthreads();  // r_norm is rewritten by the next column
  }
}

#define DSPARK_GDN_SCAN_ENTRY(DK)                                                                                 \
  extern "C" __global__ void __launch_bounds__(kGdnSliceThreads) gdn_scan_dk##DK##_f32(                           \
      const float* __restrict__ proj, long long ld, int mixed_off, int a_off, int b_off, int z_off,                \
      const float* __restrict__ conv_weight, const float* __restrict__ A_log, const float* __restrict__ dt_bias,   \
      const float* __restrict__ o_norm, float eps, float* const* __restrict__ states,                              \
      float* const* __restrict__ conv_windows, const int* __restrict__ col_indptr, const int* __restrict__ col_count,\
      int heads, int k_heads, int dv, int slice_rows, float* __restrict__ out, float* __restrict__ state_ckpt,      \
      float* __restrict__ conv_ckpt, unsigned* __restrict__ tickets, int commit) {                                 \
    gdn_scan<DK>(proj, ld, mixed_off, a_off, b_off, z_off, conv_weight, A_log, dt_bias, o_norm, eps, states,       \
                 conv_windows, col_indptr, col_count, heads, k_heads, dv, slice_rows, out, state_ckpt, conv_ckpt,  \
                 tickets, commit);                                                                                 \
  }

DSPARK_GDN_SCAN_ENTRY(16)
DSPARK_GDN_SCAN_ENTRY(32)
DSPARK_GDN_SCAN_ENTRY(64)
DSPARK_GDN_SCAN_ENTRY(128)
