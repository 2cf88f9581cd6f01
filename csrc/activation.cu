// activation: the gates of the model's layers, elementwise, one thread per output (each of these
// was two to four array operations of glue, a launch and an allocation each).
//
// swiglu_f32(gate_up [rows, 2F], rows, F, out [rows, F])
//   out[r, j] = (g * (1 / (1 + exp(-g)))) * u with g = gate_up[r, j], u = gate_up[r, F + j]: the MLP's
//   SiLU(gate) * up (dspark.ops.dense.swiglu), in that order.
//
// attn_gate_<dt>(o [rows, heads * D] of dt, gate f32 or null, rows, heads, D, gate_stride, gate_head,
//                out f32 [rows, heads * D])
//   out = widen(o) * (1 / (1 + exp(-g))), g = gate[r * gate_stride + h * gate_head + d] (Qwen3.5's
//   output gate, read where q_proj put it: after each head's query); without a gate, out = widen(o).
//
// sigmoid_bias_f32(x [n], bias [1], n, out [n])
//   out = 1 / (1 + exp(-(x + bias[0]))): the confidence head's c_k.
//
// Grid ceil(elements / 256), block 256. No reductions: exact functions of each input.
#include "activation.cuh"

constexpr int kActThreads = 256;

extern "C" __global__ void __launch_bounds__(kActThreads)
    swiglu_f32(const float* __restrict__ gate_up, int rows, int F, float* __restrict__ out) {
  const int64_t i = (int64_t)blockIdx.x * kActThreads + threadIdx.x;
  if (i >= (int64_t)rows * F) return;
  const int64_t r = i / F, j = i - r * F;
  out[i] = swiglu_value(gate_up[r * 2 * F + j], gate_up[r * 2 * F + F + j]);
}

template <typename T>
DSPARK_DEVICE void attn_gate(const T* __restrict__ o, const float* __restrict__ gate, int rows, int heads, int D,
                             long long gate_stride, int gate_head, float* __restrict__ out) {
  const int64_t i = (int64_t)blockIdx.x * kActThreads + threadIdx.x;
  const int64_t width = (int64_t)heads * D;
  if (i >= rows * width) return;
  const float v = to_float(o[i]);
  if (!gate) {
    out[i] = v;
    return;
  }
  const int64_t r = i / width, c = i - r * width, h = c / D, d = c - h * D;
  out[i] = v * act_sigmoid(gate[r * gate_stride + h * gate_head + d]);
}

#define DSPARK_ATTN_GATE(SUF, T)                                                                                \
  extern "C" __global__ void __launch_bounds__(kActThreads) attn_gate_##SUF(                                    \
      const T* __restrict__ o, const float* __restrict__ gate, int rows, int heads, int D, long long gate_stride, \
      int gate_head, float* __restrict__ out) {                                                                  \
    attn_gate<T>(o, gate, rows, heads, D, gate_stride, gate_head, out);                                          \
  }

DSPARK_ATTN_GATE(f32, float)
DSPARK_ATTN_GATE(f16, f16_t)
DSPARK_ATTN_GATE(bf16, bf16_t)

extern "C" __global__ void __launch_bounds__(kActThreads)
    sigmoid_bias_f32(const float* __restrict__ x, const float* __restrict__ bias, int n, float* __restrict__ out) {
  const int i = blockIdx.x * kActThreads + threadIdx.x;
  if (i < n) out[i] = act_sigmoid(x[i] + bias[0]);
}
