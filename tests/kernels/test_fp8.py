"""FP8 products (csrc/linear_fp8.cu on simt and the CuPy contract stand-in, csrc/cpu's product_fp8 on
the numpy backend) against their NumPy twins bitwise: the e4m3 decode at all 256 byte patterns
against ml_dtypes; edge blocks, every tile shape and mode; one arithmetic at every row count (a
row alone equals the row in launches of 1 to 300 rows); the plan's K chunk a multiple of the scale
block, chosen by (K, N) alone; refusals."""

import ml_dtypes
import numpy as np
import pytest

from dspark.backends import contract
from dspark.dtypes import BF16
from dspark.errors import DTypeError, ShapeError
from dspark.ops import fp8
from dspark.ops import product as prod
from dspark.ops.fp8 import Fp8Matrix
from dspark.ops.linear import (FP8_ALIGN, FP8_CONFIGS, FP8_STREAM, fp8_linear_plan, fp8_plan, linear, linear_fp8_ref,
                               linear_plan, mma_linear_plan)
from dspark.ops.rowsplit import launch
from tests.conftest import poison
from tests.peers import peer

ALL_BYTES = np.arange(256, dtype=np.uint8)
REFERENCE = ALL_BYTES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
# (rows, K, N): K and N off the 128 grid (edge blocks), N off 8 (byte loads), one K chunk or several
SIZES = [(1, 1, 1), (3, 130, 77), (9, 300, 200), (17, 640, 136), (2, 128, 256)]


@pytest.fixture(scope="module", params=["simt", "contract", "cuda"])
def fp8_backend(request, simt):
    """simt, the CuPy contract stand-in, and a GPU where one works (the decode shapes' sm_89+
    e4m3 conversion instruction runs there alone)."""
    if request.param == "cuda":
        return request.getfixturevalue("cuda")
    return simt if request.param == "simt" else contract.backend()


def assert_same_values(got, what, want=REFERENCE):
    nan = np.isnan(want)
    assert list(np.flatnonzero(nan)) == [0x7F, 0xFF] and np.isnan(got[nan]).all(), what
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32), err_msg=what)


def test_all_256_e4m3_bytes_decode_as_ml_dtypes(simt):
    """The kernel's decode (fp8_decode_e4m3 on simt), its NumPy twin and the numpy backend's native
    product (a row of ones times a row of all bytes at scale 1) give ml_dtypes' float8_e4m3fn
    values: subnormals, both zeros, 448, NaN."""
    out = poison(simt.xp, (256,), np.float32)
    launch(simt, "fp8_decode_e4m3", 2, 128, (simt.asarray(ALL_BYTES), np.int32(256), out))
    assert_same_values(simt.to_host(out), "kernel")
    assert_same_values(fp8.e4m3_decode(ALL_BYTES), "twin")
    native = prod.product_fp8(np.ones((1, 1), np.float32), ALL_BYTES[None], np.ones((1, 2), np.float32))
    assert_same_values(native[0], "native product", REFERENCE + np.float32(0))  # a sum from +0: -0 becomes +0


@pytest.mark.parametrize("compute", [BF16, np.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rows", [16, 32], ids=["m16", "m32"])
def test_every_byte_through_the_decode_shapes(fp8_backend, compute, rows):
    """The decode shapes' own decode (the bytes straight into the MMA's fragments: the e4m3 conversion
    instruction on sm_89+, its definition on simt) at all 254 finite byte patterns: one-hot rows of x
    pick single weights, so out[r] is row r of round_T(e4m3(q) * 1) exactly, as ml_dtypes has it."""
    k, n = rows, 256
    q = (ALL_BYTES[None, :] + 17 * np.arange(k, dtype=np.uint8)[:, None]).astype(np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38
    assert set(np.unique(q)) == set(ALL_BYTES) - {0x7F, 0xFF}
    x = np.eye(rows, k, dtype=np.float32)
    assert fp8_plan(rows, k, n).bm == rows
    got = run(fp8_backend, x, q, np.ones(fp8.scale_grid(k, n), np.float32), compute)
    want = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32).astype(compute).astype(np.float32) + np.float32(0)
    np.testing.assert_array_equal(bits(got), bits(want))


# The decode shapes' paths (csrc/linear_fp8.cuh, Fp8Stream): (rows, K, N, q offset, x offset). The trip loop
# (8- or 4-byte loads, float4 activations, several scale blocks); a chunk's short last iteration (K off 64);
# byte loads (N off the lane's bytes; q off its alignment); scalar activations (K off 4; x off 16 bytes);
# columns past N in the last tile; several K chunks (split mode) of one and of many iterations.
STREAM_CASES = [(1, 1000, 256, 0, 0), (16, 770, 520, 0, 0), (5, 640, 100, 0, 0), (9, 384, 264, 1, 0),
                (3, 390, 256, 0, 1), (7, 130, 77, 0, 0), (30, 900, 132, 0, 0), (32, 512, 90, 0, 0),
                (17, 3000, 256, 0, 0), (2, 2304, 512, 4, 2)]


def shifted(a, offset):
    """A contiguous copy of `a` starting `offset` elements into a fresh buffer (off its alignment)."""
    buf = np.empty(a.size + offset, a.dtype)
    out = buf[offset:].reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("case", STREAM_CASES, ids=[f"{r}x{k}x{n}+{o}+{xo}" for r, k, n, o, xo in STREAM_CASES])
def test_decode_shapes_equal_their_twin_on_every_path(simt, rng, case):
    rows, k, n, q_offset, x_offset = case
    q, s = random_fp8(rng, k, n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    p = fp8_plan(rows, k, n)
    assert p.bm in FP8_STREAM and (p.grid_splits == p.splits)
    want = linear_fp8_ref(x, q, s, BF16, p.kchunk)
    got = run(simt, shifted(x, x_offset), shifted(q, q_offset), s)
    np.testing.assert_array_equal(bits(got), bits(want))


def test_the_decode_shapes_cover_their_paths():
    """STREAM_CASES reach each path: whole trips, several chunks, byte loads, scalar activations."""
    plans = [(fp8_plan(r, k, n), r, k, n, o, xo) for r, k, n, o, xo in STREAM_CASES]
    assert any(p.splits > 1 for p, *_ in plans) and any(p.bm == 32 for p, *_ in plans)
    assert any(min(p.kchunk, k) >= 4 * 64 for p, r, k, *_ in plans)                     # trips in the loop
    assert any(n % 8 for p, r, k, n, o, xo in plans if p.bm == 16) and any(o for *_, o, xo in plans)  # bytes
    assert any(k % 4 for p, r, k, *_ in plans) and any(xo for *_, xo in plans)          # scalar x
    assert any(k % 64 for p, r, k, *_ in plans)                                         # a short last iteration


def random_fp8(rng, k, n):
    q = rng.integers(0, 256, (k, n)).astype(np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38  # no NaN bytes (refused at load)
    s = np.exp(rng.uniform(-8, -2, fp8.scale_grid(k, n))).astype(np.float32)
    return q, s


def run(be, x, q, s, compute=BF16, **plan):
    out = poison(be.xp, (x.shape[0], q.shape[1]), np.float32)
    linear(be, be.asarray(x), Fp8Matrix(be.asarray(q), be.asarray(s), np.dtype(compute)), out=out, **plan)
    return be.to_host(out)


def bits(a):
    return np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("compute", [BF16, np.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("size", SIZES, ids=[f"{r}x{k}x{n}" for r, k, n in SIZES])
def test_kernel_equals_its_twin_bitwise(fp8_backend, rng, size, compute):
    rows, k, n = size
    q, s = random_fp8(rng, k, n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    want = linear_fp8_ref(x, q, s, compute, fp8_plan(rows, k, n).kchunk)
    np.testing.assert_array_equal(bits(run(fp8_backend, x, q, s, compute)), bits(want))


def test_scales_of_every_range_give_the_twins_bits(simt, rng):
    """The kernel's decode takes a short path for scales below 2^8 (each byte's bits placed as an
    f32's, one multiply by scale x 2^120) and the general one above: both give the twin's bits, for
    subnormal scales, scales around 2^8 and far above it, in one launch (blocks of each)."""
    k, n = 384, 260
    q, _ = random_fp8(rng, k, n)
    grid = fp8.scale_grid(k, n)
    s = np.exp2(rng.uniform(-140.0, 14.0, grid)).astype(np.float32)
    s.flat[:4] = [255.99998, 256.0, 2.0**-149, 1.0]
    assert (s >= 256).any() and (s < 256).any() and (s < 2.0**-126).any()
    x = rng.standard_normal((5, k)).astype(np.float32)
    want = linear_fp8_ref(x, q, s, BF16, fp8_plan(5, k, n).kchunk)
    np.testing.assert_array_equal(bits(run(simt, x, q, s)), bits(want))


def test_every_tile_shape_and_mode_gives_the_same_bits(simt, rng):
    x = rng.standard_normal((70, 600)).astype(np.float32)
    q, s = random_fp8(rng, 600, 136)
    splits, kchunk = fp8_plan(70, 600, 136).splits, fp8_plan(70, 600, 136).kchunk
    assert splits >= 2 and kchunk % FP8_ALIGN == 0
    want = bits(linear_fp8_ref(x, q, s, BF16, kchunk))
    for bm in FP8_CONFIGS:
        for split in (True,) if bm in FP8_STREAM else (False, True):
            np.testing.assert_array_equal(bits(run(simt, x, q, s, bm=bm, split=split)), want, err_msg=f"{bm} {split}")


ROWS = (1, 2, 7, 16, 17, 64, 300)
FP8_STREAM_ROWS = range(1, max(FP8_STREAM) + 1)   # the decode shapes' rows: split mode only


def test_a_row_alone_equals_the_row_in_launches_of_any_rows(simt, numpy_backend, rng):
    """One arithmetic at every M, bitwise, on simt (the plan's tile shape for each count, both modes)
    and on the numpy backend's native product: launches of 1, 2, 7, 16, 17, 64 and 300 rows give
    the twin's bits for every row (whose arithmetic is the same for every row), and a sample of
    rows computed alone are the same bits. K = 600 takes two K chunks; N = 136 an edge block."""
    k, n = 600, 136
    q, s = random_fp8(rng, k, n)
    x = rng.standard_normal((300, k)).astype(np.float32)
    assert fp8_plan(1, k, n).splits == 2
    sample = sorted({0, 1, 15, 16, 17, 63, 64, 150, 299, *rng.integers(0, 300, 6).tolist()})
    for be, twin in ((simt, linear_fp8_ref(x, q, s, BF16, fp8_plan(1, k, n).kchunk)),
                     (numpy_backend, prod.product_ref(x, fp8.dequantize(q, s)))):
        alone = {i: run(be, x[i : i + 1], q, s)[0] for i in sample}
        for i, row in alone.items():
            np.testing.assert_array_equal(bits(row), bits(twin[i]), err_msg=f"{be.name} row {i} alone")
        shapes = set()
        for rows in ROWS:
            start = int(rng.integers(0, 300 - rows + 1)) if rows < 300 else 0
            shapes.add(fp8_plan(rows, k, n).bm)
            for split in (None, True) + (() if rows in FP8_STREAM_ROWS else (False,)) \
                    if be is simt and rows in (17, 300) else (None,):
                got = run(be, x[start : start + rows], q, s, split=split)
                np.testing.assert_array_equal(bits(got), bits(twin[start : start + rows]),
                                              err_msg=f"{be.name} {rows} rows from {start}, split={split}")
        assert shapes == set(FP8_CONFIGS)


def test_native_product_equals_its_twin_at_every_isa_and_thread_count(rng):
    _cpu = peer("dspark._cpu")
    for rows, k, n in ((1, 130, 77), (3, 257, 1100), (9, 64, 300)):
        q, s = random_fp8(rng, k, n)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        want = prod.product_ref(x, fp8.dequantize(q, s))
        for isa in _cpu.isas:
            for threads in (1, 3):
                np.testing.assert_array_equal(prod.product_fp8(x, q, s, threads=threads, isa=isa), want,
                                              err_msg=f"{rows}x{k}x{n} {isa} {threads}")


def test_the_plan_depends_on_the_weights_alone():
    """The K split and chunk of every row count are those of one row, the chunk a multiple of the
    128-row scale block; a pass over the weights reads 1 byte a weight plus 4 per block."""
    for k, n in ((5120, 5120), (17408, 5120), (5120, 34816), (600, 136), (130, 77)):
        one = fp8_plan(1, k, n)
        assert one.kchunk % FP8_ALIGN == 0
        for rows in ROWS + (1000,):
            assert (fp8_plan(rows, k, n).splits, fp8_plan(rows, k, n).kchunk) == (one.splits, one.kchunk)
    p = fp8_linear_plan(1, 5120, 5120)
    assert p.notes["w_bytes"] == 5120 * 5120 + 4 * 40 * 40 and linear_plan(1, 5120, 5120, 1) == p
    assert p.min_bytes < 0.51 * mma_linear_plan(1, 5120, 5120).min_bytes
    assert p.notes["bytes_per_cta"] > 0 and p.launches[0].kernel == f"linear_fp8_m{fp8_plan(1, 5120, 5120).bm}"


def test_bad_input_is_refused_and_out_untouched(simt, rng):
    q, s = random_fp8(rng, 130, 20)
    x = rng.standard_normal((2, 130)).astype(np.float32)
    out = poison(np, (2, 20), np.float32)
    cases = [(ShapeError, r"w.scale has shape \(1, 1\): expected \(2, 1\)", Fp8Matrix(q, s[:1], BF16)),
             (DTypeError, "w.q has dtype int8", Fp8Matrix(q.view(np.int8), s, BF16)),
             (DTypeError, "w.compute is float32: FP8 weights multiply on tensor cores", Fp8Matrix(q, s, np.float32)),
             (ShapeError, r"w has shape \(129, 20\): expected \(130, N\)", Fp8Matrix(q[:129], s, BF16))]
    for err, msg, w in cases:
        with pytest.raises(err, match=msg):
            linear(simt, x, w, out=out)
        assert np.isnan(out).all()
