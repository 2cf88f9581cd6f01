// The gates' arithmetic, shared by the elementwise kernels (activation.cu) and the products that take
// SwiGLU into their activation stage (linear_mma.cuh's SwiGLU mode): one definition, so a fused
// product's activations are bitwise the ones swiglu_f32 writes (-fmad=false: nothing contracted).
#pragma once
#include "common.cuh"

DSPARK_DEVICE float act_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// SiLU(g) * u, in that order: the MLP's activation of gate g and up u.
DSPARK_DEVICE float swiglu_value(float g, float u) { return (g * act_sigmoid(g)) * u; }

// v * SiLU(z), in that order: the gdn's gated output norm (v the normed o, z its gate), as the decode
// scan (gdn_scan.cu) and a prompt's norm (norm.cu's rmsnorm_gated_f32) both write it.
DSPARK_DEVICE float silu_gate(float v, float z) { return v * (z * act_sigmoid(z)); }
