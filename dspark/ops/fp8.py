"""FP8 weights: block-scaled e4m3 as the Qwen3 / Qwen3.5 FP8 releases store them (csrc/fp8.cuh,
csrc/linear_fp8.cu, csrc/cpu/product.h), and the NumPy twins of their products.

A quantized linear keeps its bytes and scales as stored: `q` uint8 [K, N], e4m3fn bit patterns
(1 sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 holds the subnormals m 2^-9; 0x7F
and 0xFF are NaN, refused at load), and `scale` f32 [ceil(K / 128), ceil(N / 128)], one per
128 x 128 block (the checkpoint's `weight_scale_inv`, transposed to our [in, out] layout; bf16
scales widened, exactly). The weight is e4m3(q) * scale of its block. Every e4m3 value is exact
in f32, bf16 and f16; the scale product is not, so it is rounded once to f32 and then, on the
tensor-core path, to the path's 16-bit type:

    W = round_T(fl32(e4m3(q[k, n]) * scale[k // 128, n // 128]))     round to nearest even

T is f32 on the numpy backend (where W is bitwise transformers' own f32 dequantization, so its
products are the f32 products of that matrix) and the trunk's 16-bit type (bf16, f16) on simt and
cuda (W8A16: the bytes dequantized in registers, then the tensor-core GEMM of
dspark.ops.linear on bf16 / f16 operands). Each product therefore is, bit for bit, its dtype's
16-bit or f32 product of W: `dequantize` is the one definition of W both twins use.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

F32 = np.float32
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BLOCK = 128                # the scale block, [128, 128]: the only one the kernels take
NAN_BYTES = (0x7F, 0xFF)   # e4m3fn has no infinities; these two patterns are its NaNs


def e4m3_decode(q) -> np.ndarray:
    """f32 values of e4m3fn bit patterns (uint8, any shape), from the bits alone: normal numbers
    (1 + m / 8) 2^(e - 7), subnormals m 2^-9, NaN for 0x7F / 0xFF. The twin of csrc/fp8.cuh's
    e4m3_to_float."""
    b = np.asarray(q, np.uint8).astype(np.int32)
    e, m = (b >> 3) & 15, b & 7
    mag = np.where(e == 0, np.ldexp(m.astype(np.float64), -9), np.ldexp((8 + m).astype(np.float64), e - 10))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(b & 0x80, -mag, mag).astype(F32)


def scale_grid(k: int, n: int) -> tuple[int, int]:
    """The scale grid of w [K, N] in our layout: ceil(K / 128) x ceil(N / 128)."""
    return -(-k // BLOCK), -(-n // BLOCK)


def expand(scale, k: int, n: int) -> np.ndarray:
    """Each block's scale at each of its weights: [K, N] f32 (the edge blocks cut to K and N)."""
    s = np.asarray(scale, F32)
    return np.repeat(np.repeat(s, BLOCK, axis=0), BLOCK, axis=1)[:k, :n]


def dequantize(q, scale, dtype=F32) -> np.ndarray:
    """W = round_dtype(fl32(e4m3(q) * scale)) [K, N] (module doc): the matrix the products multiply by."""
    q = np.asarray(q)
    w = e4m3_decode(q) * expand(scale, *q.shape)  # f32 by f32: one rounding to f32
    return w if np.dtype(dtype) == F32 else w.astype(dtype)


class Fp8Shape:
    """What a quantized linear shows NumPy-side: 2 dims, q's [K, N], the e4m3 dtype; `__array__`
    gives W in f32 on the host (a copy: tests and tools; the products never make it)."""
    ndim = 2

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def dtype(self) -> np.dtype:
        return E4M3

    def __array__(self, dtype=None, copy=None):
        w = dequantize(_host(self.q).view(np.uint8), _host(self.scale))
        return w if dtype is None else w.astype(dtype)


@dataclass
class Fp8Matrix(Fp8Shape):
    """A quantized linear on a backend: q uint8 [K, N] and scale f32 [ceil(K / 128), ceil(N / 128)]
    (module doc), and `compute`, the type its product rounds W and the activations to on the kernel
    backends (bf16 or f16; the numpy backend computes in f32 whatever it says). Fused projections
    are one Fp8Matrix when every part but the last spans whole column blocks (the scale grid then
    lines up); `columns` views a part that starts on a block."""
    q: object
    scale: object
    compute: np.dtype

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes) + int(self.scale.nbytes)

    def columns(self, at: int, width: int) -> "Fp8Matrix":
        if at % BLOCK:
            raise ValueError(f"columns at {at}: an FP8 part must start on a {BLOCK}-column block")
        return Fp8Matrix(self.q[:, at : at + width], self.scale[:, at // BLOCK : -(-(at + width) // BLOCK)],
                         self.compute)


def _host(a) -> np.ndarray:
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) and not isinstance(a, np.ndarray) else a)


@dataclass(frozen=True)
class Fp8Host(Fp8Shape):
    """A quantized linear on the host, as the loader reads it (memory-mapped views in our [K, N]
    layout): q as e4m3fn [K, N], scale [ceil(K / 128), ceil(N / 128)] f32 or bf16; `name` is the
    checkpoint tensor, for errors."""
    q: np.ndarray
    scale: np.ndarray
    name: str = ""


def nan_bytes(q) -> int:
    """How many of q's bytes are e4m3 NaN patterns (0x7F, 0xFF); q is read in slices of rows."""
    b = np.asarray(q).view(np.uint8)
    rows = max(1, (1 << 24) // max(1, b.shape[-1]))
    return int(sum(np.count_nonzero((b[i : i + rows] & 0x7F) == 0x7F) for i in range(0, b.shape[0], rows)))


@dataclass
class Fp8Stack:
    """A MoE layer's quantized experts stacked on a backend, as the 16-bit ones are stacked
    (dspark.models.moe): q uint8 [E, K, N] and scale f32 [E, ceil(K / 128), ceil(N / 128)], expert
    e's matrix the Fp8Matrix (q[e], scale[e]) (module doc); `compute` as Fp8Matrix's. The grouped
    expert product (dspark.ops.moe) reads the bytes; no dequantized copy exists."""
    q: object
    scale: object
    compute: np.dtype

    ndim = 3

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.q.shape)

    @property
    def dtype(self) -> np.dtype:
        return E4M3

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes) + int(self.scale.nbytes)

    def __getitem__(self, e: int) -> Fp8Matrix:
        return Fp8Matrix(self.q[e], self.scale[e], self.compute)
