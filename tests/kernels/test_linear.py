"""linear: the kernels (simt, and cuda on the CuPy contract stand-in) against their NumPy twins
bitwise at awkward sizes: the f32 kernel at every K split, the tensor-core GEMM for 16-bit weights
at every tile shape and mode; within TOLERANCE (f32) and MMA_TOLERANCE (16-bit, the activations'
rounding) of the numpy backend's BLAS chunks; row-invariant bitwise, a row alone equal to the same
row in launches of 1 to 300 rows; refusing bad input before it writes anything."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from dspark.backends import contract
from dspark.dtypes import BF16
from dspark.errors import DTypeError, ShapeError
from dspark.ops.linear import (MMA_CONFIGS, MMA_TOLERANCE, MMA_WIDE, SHARED_LIMIT, TOLERANCE, a16, chunking, launch_mma,
                               linear, linear_mma_ref, linear_numpy, linear_ref, mma_plan, mma_shared_mem,
                               mma_split_plan, shared_limit, split_plan, tiles, whole_wave_tiles)
from tests.conftest import poison

DTYPES = [np.float32, np.float16, BF16]
HALF = [np.float16, BF16]
# (rows, K, N): every rows in 1 2 3 7 8 9 17 33, K in 1 5 31 257 1000, N in 1 3 127 513 2050
SIZES = [(1, 1, 1), (2, 5, 3), (3, 31, 127), (7, 257, 513), (8, 1000, 2050), (9, 1000, 3), (17, 257, 127),
         (33, 31, 513), (1, 1000, 513), (3, 5, 2050), (9, 4099, 5)]


@pytest.fixture(params=["simt", "contract"])
def linear_backend(request, simt):
    return simt if request.param == "simt" else contract.backend()


def inputs(rng, rows, k, n, dtype):
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(max(k, 1))).astype(dtype)
    return x, w


def run(be, x, w, splits=None):
    out = poison(be.xp, (x.shape[0], w.shape[1]), np.float32)
    linear(be, be.asarray(x), be.asarray(w), out=out, splits=splits)
    return be.to_host(out)


def check_close_to_blas(got, x, w):
    """The numpy backend's BLAS chunks agree within TOLERANCE (f32) or MMA_TOLERANCE (16-bit) of
    |x| @ |w|."""
    wf = np.asarray(w).astype(np.float32)
    tol = TOLERANCE if np.dtype(w.dtype) == np.float32 else MMA_TOLERANCE[np.dtype(w.dtype)]
    bound = tol * (np.abs(x).astype(np.float64) @ np.abs(wf).astype(np.float64)) + 1e-30
    err = np.abs(got.astype(np.float64) - linear_numpy(x, w))
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"max excess {np.max(err - bound)} at {worst}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("size", SIZES, ids=[f"{r}x{k}x{n}" for r, k, n in SIZES])
def test_kernel_equals_its_twin_bitwise(linear_backend, rng, size, dtype):
    rows, k, n = size
    x, w = inputs(rng, rows, k, n, dtype)
    got = run(linear_backend, x, w)
    assert_bits(got, twin(x, w))
    check_close_to_blas(got, x, w)


def twin(x, w):
    """The kernel's NumPy twin: linear_ref for f32 weights, linear_mma_ref for 16-bit ones."""
    k, n = w.shape
    if np.dtype(w.dtype) == np.float32:
        return linear_ref(x, w, split_plan(k, n)[1])
    return linear_mma_ref(x, w, mma_split_plan(k, n)[1])


def assert_bits(got, want, what=""):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32), err_msg=what)


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_every_mma_tile_shape_and_mode_gives_the_same_bits(simt, rng, dtype):
    """The row tile (16, 32, 64, 128 rows) and whether a tile's K chunks share a CTA (fold) or take
    one each (split, partials merged by the last) change the launch, never the order: chunks of
    a K that is no multiple of the k-step, N neither a multiple of 8 (scalar weight loads) nor of
    the column tiles, rows crossing the 16-row m-tiles."""
    # K off 8: the tiles round the f32 x; K on 8: a prompt's tiles copy x rounded once (a16); K 1000: three chunks
    # (whose partials' order shows: two are added alike either way)
    for k in (700, 712, 1000):
        x, w = inputs(rng, 150, k, 77, dtype)  # 10 row tiles of 16: fold mode's CTA groups of 8, and a ragged one
        splits, kchunk = mma_split_plan(*w.shape)
        assert splits >= (3 if k == 1000 else 2) and kchunk % 16 == 0 and k % kchunk % 16
        want = linear_mma_ref(x, w, kchunk)
        for bm in MMA_CONFIGS:
            for split in (False, True):
                assert_bits(run_mma(simt, x, w, bm=bm, split=split), want, f"K={k} bm={bm} split={split}")
        assert a16(mma_plan(150, k, 77, bm=128, split=False), k) == (k % 8 == 0)


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_any_column_tile_count_gives_the_same_bits(simt, rng, dtype):
    """The kernel deals N's groups of 8 columns over the grid's column tiles (mma_tile_column), and a
    launch of one 16-row tile takes as many as fill the SMs' whole waves (whole_wave_tiles: up to twice
    ceil(N / BN)): every count gives the same bits, tiles of uneven width, N off 8 (scalar weight
    loads) and on it, a tile count past the groups (empty tiles), split mode and fold mode."""
    for rows, k, n in ((3, 1000, 513), (16, 330, 1000), (5, 64, 8), (17, 96, 264)):
        x, w = inputs(rng, rows, k, n, dtype)
        for split in (False, True):
            p = mma_plan(rows, k, n, split=split)
            base = -(-n // p.bn)
            assert base <= p.n_tiles <= 2 * base and p.m_tiles == 1
            want = linear_mma_ref(x, w, p.kchunk)
            for t in sorted({base, base + 1, 2 * base, p.n_tiles, 3 * base + 2}):
                out = poison(np, (rows, n), np.float32)
                launch_mma(simt, f"linear_mma_{'bf16' if dtype is BF16 else 'f16'}", dataclasses.replace(p, n_tiles=t),
                           x, (w,), out, None)
                assert_bits(out, want, f"{rows}x{k}x{n} split={split} tiles={t}")
    assert whole_wave_tiles(136, 1) == 264 and whole_wave_tiles(8, 16) == 8


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_the_wide_prompt_tile_gives_the_same_bits(simt, rng, dtype):
    """The prompt's wide tile (128 x 256, the K chunks' running total in shared memory: MMA_WIDE) is
    the plan's for a prompt, and gives the bits of every other shape: rows crossing its row tiles (a
    ragged last one), N crossing its 256 columns and off 8 (scalar weight loads), K off the k-step,
    one K chunk or several; a row alone gives the same bits. A split-mode launch of it is refused."""
    for k, n in ((430, 300), (1000, 300), (440, 301), (1344, 520)):
        x, w = inputs(rng, 150, k, n, dtype)
        p = mma_plan(150, k, n, split=False)  # a prompt's fold mode (these few tiles alone would take split mode)
        assert p.shape == "m128n256" and p.grid_splits == 1
        want = linear_mma_ref(x, w, p.kchunk)
        assert_bits(run_mma(simt, x, w, split=False), want, f"wide K={k} N={n}")
        assert_bits(run_mma(simt, x, w, split=False, wide=False), want, f"m128 K={k} N={n}")
        assert_bits(run_mma(simt, x[37:38], w), want[37:38], "row alone")
    assert {mma_split_plan(k, n)[0] > 1 for k, n in ((430, 300), (1344, 520))} == {False, True}
    with pytest.raises(ValueError, match="the wide tile is a prompt's"):
        mma_plan(150, 700, 77, split=True, wide=True)


def test_the_wide_tile_is_planned_where_the_device_holds_it(simt):
    """The wide tile's 207.5 KB of shared memory fit an H200's 227 KB a CTA, not an A100's 163 or an
    sm_89's 99: the plan for those devices keeps the 128-column tile (the same bits)."""
    assert mma_shared_mem(128, MMA_WIDE) > SHARED_LIMIT[80]
    for limit, shape in ((SHARED_LIMIT[90], "m128n256"), (SHARED_LIMIT[80], "m128"), (SHARED_LIMIT[89], "m128")):
        assert mma_plan(8192, 5120, 34816, limit=limit).shape == shape
    device = lambda arch: SimpleNamespace(kernels=SimpleNamespace(arch=arch))  # noqa: E731
    assert shared_limit(simt) == shared_limit(device("sm_90")) == SHARED_LIMIT[90]
    assert shared_limit(device("sm_80")) == SHARED_LIMIT[80] and shared_limit(device("sm_75")) == 49152


def run_mma(be, x, w, **plan):
    out = poison(be.xp, (x.shape[0], w.shape[1]), np.float32)
    linear(be, be.asarray(x), be.asarray(w), out=out, **plan)
    return be.to_host(out)


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_a_row_alone_equals_the_row_in_launches_of_any_rows(simt, rng, dtype):
    """Row invariance of the tensor-core GEMM: each row of launches of 1, 2, 7, 16, 17, 64 and 300
    rows is bitwise the row computed alone (the 16-row tile, one CTA per K chunk), in the tile
    shape the plan picks for the launch (16, 16, 16, 16, 32, 64, 128 rows) and in either mode
    (its chunks in one CTA each, or folded in one CTA: a prompt's)."""
    k, n = 600, 40
    assert mma_split_plan(k, n)[0] == 2
    x, w = inputs(rng, 300, k, n, dtype)
    alone = np.concatenate([run(simt, x[i : i + 1], w) for i in range(300)])
    assert_bits(alone, linear_mma_ref(x, w, mma_split_plan(k, n)[1]))
    shapes = []
    for rows in (1, 2, 7, 16, 17, 64, 300):
        start = int(rng.integers(0, 300 - rows + 1))
        shapes.append(mma_plan(rows, k, n).bm)
        for split in (True, False):
            got = run_mma(simt, x[start : start + rows], w, split=split)
            assert_bits(got, alone[start : start + rows], f"{rows} rows from {start}, split={split}")
    assert shapes == [16, 16, 16, 16, 32, 64, 128]


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_16_bit_weights_give_the_reference_of_their_rounding(simt, rng, dtype):
    """16-bit weights on the kernels: activations rounded to the weight's type, f32 MMA sums
    (linear_mma_ref, bitwise); the f32 copy of the same weights takes the f32 kernel and differs,
    within the activations' rounding (MMA_TOLERANCE). (The numpy backend widens: there a 16-bit
    weight gives bitwise the product of its f32 widening, tests/models/test_models.py.)"""
    for rows, k, n in ((3, 1000, 513), (9, 700, 2050)):
        x, w = inputs(rng, rows, k, n, dtype)
        got = run(simt, x, w)
        assert_bits(got, linear_mma_ref(x, w, mma_split_plan(k, n)[1]))
        widened = run(simt, x, w.astype(np.float32))
        assert not np.array_equal(got, widened)
        bound = MMA_TOLERANCE[np.dtype(dtype)] * (np.abs(x).astype(np.float64) @ np.abs(w.astype(np.float64)))
        assert np.all(np.abs(got - widened) <= bound)


def test_every_split_count(simt, rng):
    """Split counts from 1 up past what the plan can reach (TARGET_CTAS = 256): 65 splits of 4
    rows of w (one per warp), 257 of one row (three warps idle), merged in index order by the last
    CTA of each tile."""
    rows, k, n = 5, 257, 300
    x, w = inputs(rng, rows, k, n, np.float32)
    for splits in (*range(1, 10), 16, 33, 65, 257):
        s, kchunk = chunking(k, splits)
        got = run(simt, x, w, splits=splits)
        np.testing.assert_array_equal(got, linear_ref(x, w, kchunk), err_msg=f"splits={splits} (-> {s})")


def test_the_split_depends_on_the_weights_alone():
    """What the plan picks for the projections of Qwen3.5-27B (bf16) and the embedded pair: never
    a function of the rows, and enough CTAs at one row."""
    for k, n in ((5120, 5120), (17408, 5120), (5120, 34816), (5120, 16480), (5120, 248320), (64, 96), (1, 1)):
        s, kchunk = split_plan(k, n)
        assert 1 <= s <= max(1, k // 256) and (s - 1) * kchunk < k <= s * kchunk  # no split empty
        assert tiles(n, 2) * s >= 256 or s == max(1, k // 256)  # fills the GPU unless K is too short
    assert split_plan(5120, 5120) == (13, 394) and tiles(5120, 2) == 20


def test_a_row_is_the_same_alone_and_in_any_batch(simt, rng):
    """The f32 kernel (the tensor-core GEMM: test_a_row_alone_equals_the_row_in_launches_of_any_rows)."""
    k, n = 700, 300  # two K splits, ragged tiles
    assert split_plan(k, n)[0] == 2
    x, w = inputs(rng, 40, k, n, np.float32)
    full = run(simt, x, w)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 5), slice(5, 22), slice(30, 39), slice(39, 40)):
        np.testing.assert_array_equal(run(simt, x[rows], w), full[rows], err_msg=str(rows))


def test_unaligned_and_ragged_weights(simt, rng):
    """w not 16-byte aligned (scalar loads instead of cp.async chunks) gives the same bits as the
    aligned copy: the order is the plan's, whatever the loads."""
    x, w = inputs(rng, 3, 300, 64, BF16)
    buf = np.zeros(w.size + 1, BF16)
    shifted = buf[1:].reshape(w.shape)  # 2 bytes past a 16-byte boundary
    shifted[...] = w
    assert shifted.ctypes.data % 16
    np.testing.assert_array_equal(run(simt, x, shifted), run(simt, x, w))


def test_randomised_schedule(simt, rng):
    """Barriers guard the warps' shared sums (f32) and the pipeline's stages (16-bit: cp.async
    copies land at a random point up to their wait): a random thread order between barriers
    changes nothing. The CTAs run in a random order too: at K 1000 a column tile's three K chunks
    take a CTA each (split mode), and their partials are added in chunk order whichever CTA
    finishes first (three, since two partials add the same either way)."""
    for rows, k, dtype in ((11, 600, np.float32), (11, 600, BF16), (70, 600, BF16), (3, 1000, np.float32),
                           (3, 1000, BF16)):
        x, w = inputs(rng, rows, k, 300, dtype)
        expect = twin(x, w)
        for _ in range(2):
            with simt.kernels.schedule(seed=int(rng.integers(1, 2**31))):
                assert_bits(run(simt, x, w), expect, f"{rows} rows {np.dtype(dtype)}")


def test_bad_input_is_refused_and_out_untouched(simt, rng):
    x, w = inputs(rng, 3, 8, 5, np.float32)
    out = poison(np, (3, 5), np.float32)
    cases = [
        (ShapeError, r"w has shape \(7, 5\): expected \(8, N\)", dict(w=w[:7])),
        (DTypeError, "x has dtype float64: expected float32", dict(x=x.astype(np.float64))),
        (DTypeError, "w has dtype int32: expected float32, float16 or bfloat16", dict(w=w.astype(np.int32))),
        (ShapeError, r"x has shape \(8,\): expected 2 dims \[rows, K\]", dict(x=x[0])),
        (ShapeError, r"out has shape \(3, 5\): expected \(2, 5\)", dict(x=x[:2])),
    ]
    for err, msg, kw in cases:
        args = dict(x=x, w=w) | kw
        with pytest.raises(err, match=msg):
            linear(simt, args["x"], args["w"], out=out)
        assert np.isnan(out).all()
    with pytest.raises(DTypeError, match="out has dtype float16: expected float32"):
        linear(simt, x, w, out=np.zeros((3, 5), np.float16))


def test_empty_shapes(linear_backend, rng):
    be = linear_backend
    x, w = inputs(rng, 4, 0, 6, BF16)
    np.testing.assert_array_equal(run(be, x, w), np.zeros((4, 6), np.float32))  # K = 0: sums of nothing
    assert run(be, *inputs(rng, 0, 7, 6, BF16)).shape == (0, 6)
    assert run(be, *inputs(rng, 3, 7, 0, BF16)).shape == (3, 0)
