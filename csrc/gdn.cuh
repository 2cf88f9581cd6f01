// Gated delta-rule (gdn) mixer: the per-token pieces of the scan (csrc/gdn_scan.cu), each in the
// one floating-point order that the NumPy reference (dspark/ops/gdn.py) mirrors step by step.
//
// Per channel c, per value head h and token t (DESIGN section 6); value head h reads key head
// h / (value heads per key head), so consecutive value heads share a key head's q and k:
//   conv    y_c   = ((w_c0*x_c,t-3 + w_c1*x_c,t-2) + w_c2*x_c,t-1) + w_c3*x_c,t;  silu(y) = y / (1 + exp(-y))
//   norm    q    <- (q * 1/sqrt(sum q^2 + 1e-6)) * 1/sqrt(dk),   k <- k * 1/sqrt(sum k^2 + 1e-6)
//   gates   alpha = exp(-(exp(A_log) * softplus(a + dt_bias))), softplus(x) = x > 20 ? x : log1p(exp(x))
//           beta  = 1 / (1 + exp(-b))
//   update  S <- alpha * S;  u = S k;  S <- S + (beta * (v - u)) k^T;  o = S q
// The update is the delta rule S <- alpha S (I - beta k k^T) + beta v k^T, regrouped so that each
// state element costs one multiply and one multiply-add.
#pragma once
#include "common.cuh"
#include "reduce.cuh"

constexpr int kGdnTaps = 4;                // causal depthwise conv width
constexpr int kGdnWindow = kGdnTaps - 1;   // previous inputs kept per channel, oldest first
constexpr int kGdnMaxThreads = 512;        // the most state rows x lanes one head may have (dspark.ops.gdn)
constexpr int kGdnSliceThreads = 128;      // the most a scan block takes: a slice of a head's rows
constexpr float kGdnNormEps = 1e-6f;
constexpr float kGdnSoftplusThreshold = 20.f;  // as torch.nn.functional.softplus

// How one head's state S [dv, dk] is spread over a block. Thread t owns row t / kLanes and, as
// part p = t % kLanes of that row, the columns 4*(p + kLanes*g) + e for g < kGroups, e < 4:
// float4 groups interleaved across the row's lanes, so that the lanes of a row read distinct
// banks of q and k and a row's float4 stores are contiguous across its lanes.
template <int DK>
struct GdnTile {
  static_assert(DK == 16 || DK == 32 || DK == 64 || DK == 128, "dk must be 16, 32, 64 or 128");
  static constexpr int kCols = DK < 32 ? DK : 32;  // state elements per thread (registers)
  static constexpr int kLanes = DK / kCols;        // threads per row, adjacent lanes of one warp
  static constexpr int kGroups = kCols / 4;        // float4 groups per thread
};

// Sum over the kLanes adjacent lanes that share a row (xor butterfly); all of them get the sum.
template <int kLanes>
DSPARK_DEVICE float gdn_row_sum(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// One channel, one token: SiLU of the causal conv over [window, x], then shift x into the window
// (registers) and into its checkpoint, when there is one.
DSPARK_DEVICE float gdn_conv_silu(float (&win)[kGdnWindow], const float (&w)[kGdnTaps], float x,
                                  float* __restrict__ ckpt) {
  const float y = w[0] * win[0] + w[1] * win[1] + w[2] * win[2] + w[3] * x;
  win[0] = win[1];
  win[1] = win[2];
  win[2] = x;
  if (ckpt) {
    ckpt[0] = win[0];
    ckpt[1] = win[1];
    ckpt[2] = win[2];
  }
  return y / (1.0f + expf(-y));
}

// log(alpha) of one head at one token: -(A softplus(a + dt_bias)); A = exp(A_log). The chunked
// prompt pass (gdn_chunk.cu) sums these; the scan takes their exp.
DSPARK_DEVICE float gdn_log_decay(float a, float A, float dt_bias) {
  const float x = a + dt_bias;
  const float softplus = x > kGdnSoftplusThreshold ? x : log1pf(expf(x));
  return -(A * softplus);
}

// beta (write strength) of one head at one token.
DSPARK_DEVICE float gdn_beta(float b) { return 1.0f / (1.0f + expf(-b)); }

// alpha (decay) and beta of one head at one token.
DSPARK_DEVICE float2 gdn_gates(float a, float b, float A, float dt_bias) {
  return make_float2(expf(gdn_log_decay(a, A, dt_bias)), gdn_beta(b));
}

// x[0..n) <- (x * 1/sqrt(sum x^2 + eps)) * scale, by one whole warp. Lane l sums x[l], x[l+32],
// ... in order, then warp_sum's butterfly gives every lane the same total.
DSPARK_DEVICE void gdn_l2norm_warp(float* x, int n, float scale) {
  const int lane = threadIdx.x & 31;
  float ss = 0.f;
  for (int j = lane; j < n; j += 32) ss += x[j] * x[j];
  const float inv = 1.0f / sqrtf(warp_sum(ss) + kGdnNormEps);
  for (int j = lane; j < n; j += 32) x[j] = x[j] * inv * scale;
}
