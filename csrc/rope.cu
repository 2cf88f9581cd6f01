// rope: one attention layer's projections made ready for the attention kernel, in one launch: each
// query and key head RMS-normed (when the model norms them), rotated (RoPE, rotate-half, over the
// first `rot` dims; the rest pass through), and every head of q, k and v rounded to the K/V storage
// dtype and scattered to its own [rows, heads, D] array (the glue took a norm launch per q and k,
// a RoPE of several array operations each, and three casts).
//
// qk_prepare_<dt>(src [rows, width] f32, width, rows, hq, hkv, D, q_off, q_head, k_off, v_off,
//                 q_norm [D] or null, k_norm [D] or null, eps, inv_freq [rot / 2] f32, rot, attn_factor,
//                 pos [B], row_indptr [B+1], B, q [rows, hq, D] or null, k [rows, hkv, D], v [rows, hkv, D]
//                 or null)
//   Query head h of row r is src[r, q_off + h * q_head ..][0 .. D), key head h src[r, k_off + h D ..],
//   value head h src[r, v_off + h D ..]. Row r of session b (row_indptr[b] <= r < row_indptr[b+1])
//   sits at position p = pos[b] + r - row_indptr[b]: positions are read from device memory, so a
//   captured pass runs at the positions of the round it replays.
//   Grid (rows, ceil((hq + 2 hkv) / 8)), block 256: warp w of block (r, y) takes head slot 8 y + w
//   of row r (q heads, then k heads, then v heads; a null q or v skips its slots).
//   Norm: lane l sums x[l]^2, x[l + 32]^2, ... then warp_sum's butterfly: rmsnorm_f32's order, so
//   y = (x / sqrt(s / D + eps)) * w is bitwise the norm kernel's. RoPE of y with
//   cos_i = (float)cos((double)p * (double)inv_freq[i]) * attn_factor (sin likewise; the angles in f64,
//   rounded once, as dspark.ops.dense.rope_table computes them): out_i = y_i cos_i - y_{i+h} sin_i,
//   out_{i+h} = y_{i+h} cos_i + y_i sin_i for i < h = rot / 2 (no contraction: -fmad=false).
#include "common.cuh"
#include "reduce.cuh"

constexpr int kRopeWarps = 8;
constexpr int kRopeMaxDim = 256;

template <typename T>
DSPARK_DEVICE void qk_prepare(const float* __restrict__ src, long long width, int rows, int hq, int hkv, int D,
                              int q_off, int q_head, int k_off, int v_off, const float* __restrict__ q_norm,
                              const float* __restrict__ k_norm, float eps, const float* __restrict__ inv_freq,
                              int rot, float attn_factor, const int* __restrict__ pos,
                              const int* __restrict__ row_indptr, int sessions, T* __restrict__ q,
                              T* __restrict__ k, T* __restrict__ v) {
  __shared__ float buf[kRopeWarps][kRopeMaxDim];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x, slot = blockIdx.y * kRopeWarps + warp;
  if (row >= rows || slot >= hq + 2 * hkv) return;  // whole warps leave together
  const float* weight;
  const float* x;
  T* dst;
  bool rotate;
  if (slot < hq) {
    if (!q) return;
    x = src + row * width + q_off + (int64_t)slot * q_head;
    dst = q + ((int64_t)row * hq + slot) * D;
    weight = q_norm, rotate = true;
  } else if (slot < hq + hkv) {
    x = src + row * width + k_off + (int64_t)(slot - hq) * D;
    dst = k + ((int64_t)row * hkv + slot - hq) * D;
    weight = k_norm, rotate = true;
  } else {
    if (!v) return;
    x = src + row * width + v_off + (int64_t)(slot - hq - hkv) * D;
    dst = v + ((int64_t)row * hkv + slot - hq - hkv) * D;
    weight = nullptr, rotate = false;
  }
  float* y = buf[warp];
  if (weight) {
    float ss = 0.f;
    for (int j = lane; j < D; j += 32) {
      const float e = x[j];
      ss += e * e;
    }
    const float r = sqrtf(warp_sum(ss) / (float)D + eps);
    for (int j = lane; j < D; j += 32) y[j] = (x[j] / r) * weight[j];
  } else {
    for (int j = lane; j < D; j += 32) y[j] = x[j];
  }
  __syncwarp();
  if (!rotate) {
    for (int j = lane; j < D; j += 32) dst[j] = from_float<T>(y[j]);
    return;
  }
  int b = 0;
  while (b + 1 < sessions && row_indptr[b + 1] <= row) ++b;
  const double p = (double)(pos[b] + row - row_indptr[b]);
  const int half = rot / 2;
  for (int j = lane; j < D; j += 32) {
    float o = y[j];
    if (j < rot) {
      const int i = j < half ? j : j - half;
      const double angle = p * (double)inv_freq[i];
      const float c = (float)cos(angle) * attn_factor, s = (float)sin(angle) * attn_factor;
      o = j < half ? y[j] * c - y[j + half] * s : y[j] * c + y[j - half] * s;
    }
    dst[j] = from_float<T>(o);
  }
}

#define DSPARK_QK_PREPARE(SUF, T)                                                                                  \
  extern "C" __global__ void __launch_bounds__(kRopeWarps * 32) qk_prepare_##SUF(                                  \
      const float* __restrict__ src, long long width, int rows, int hq, int hkv, int D, int q_off, int q_head,     \
      int k_off, int v_off, const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,          \
      const float* __restrict__ inv_freq, int rot, float attn_factor, const int* __restrict__ pos,                  \
      const int* __restrict__ row_indptr, int sessions, T* __restrict__ q, T* __restrict__ k, T* __restrict__ v) {  \
    qk_prepare<T>(src, width, rows, hq, hkv, D, q_off, q_head, k_off, v_off, q_norm, k_norm, eps, inv_freq, rot,  \
                  attn_factor, pos, row_indptr, sessions, q, k, v);                                                 \
  }

DSPARK_QK_PREPARE(f32, float)
DSPARK_QK_PREPARE(f16, f16_t)
DSPARK_QK_PREPARE(bf16, bf16_t)
