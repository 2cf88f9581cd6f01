"""linear: the kernel (simt, and cuda on the CuPy contract stand-in) against its NumPy twin bitwise
at awkward sizes, every weight dtype and every K split; within TOLERANCE of the numpy backend's
BLAS chunks; row-invariant bitwise; refusing bad input before it writes anything."""

import numpy as np
import pytest

from dspark.backends import contract
from dspark.dtypes import BF16
from dspark.errors import DTypeError, ShapeError
from dspark.ops.linear import TOLERANCE, chunking, linear, linear_numpy, linear_ref, split_plan, tiles
from tests.conftest import poison

DTYPES = [np.float32, np.float16, BF16]
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
    """The numpy backend's BLAS chunks agree within TOLERANCE of |x| @ |w|."""
    wf = np.asarray(w).astype(np.float32)
    bound = TOLERANCE * (np.abs(x).astype(np.float64) @ np.abs(wf).astype(np.float64)) + 1e-30
    err = np.abs(got.astype(np.float64) - linear_numpy(x, w))
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"max excess {np.max(err - bound)} at {worst}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("size", SIZES, ids=[f"{r}x{k}x{n}" for r, k, n in SIZES])
def test_kernel_equals_its_twin_bitwise(linear_backend, rng, size, dtype):
    rows, k, n = size
    x, w = inputs(rng, rows, k, n, dtype)
    got = run(linear_backend, x, w)
    _, kchunk = split_plan(k, n)
    np.testing.assert_array_equal(got, linear_ref(x, w, kchunk))
    check_close_to_blas(got, x, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_every_split_count(simt, rng, dtype):
    """Split counts from 1 up past what the plan can reach (TARGET_CTAS = 256): 65 splits of 4
    rows of w (one per warp), 257 of one row (three warps idle), merged in index order by the last
    CTA of each tile."""
    rows, k, n = 5, 257, 300
    x, w = inputs(rng, rows, k, n, dtype)
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


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_a_row_is_the_same_alone_and_in_any_batch(simt, rng, dtype):
    k, n = 700, 300  # two K splits, ragged tiles
    assert split_plan(k, n)[0] == 2
    x, w = inputs(rng, 40, k, n, dtype)
    full = run(simt, x, w)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 5), slice(5, 22), slice(30, 39), slice(39, 40)):
        np.testing.assert_array_equal(run(simt, x[rows], w), full[rows], err_msg=str(rows))


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
def test_16_bit_weights_give_the_product_of_their_widening(simt, rng, dtype):
    """The plan and the order do not depend on the storage dtype: bitwise the f32 product."""
    for rows, k, n in ((3, 1000, 513), (9, 700, 2050)):
        x, w = inputs(rng, rows, k, n, dtype)
        np.testing.assert_array_equal(run(simt, x, w), run(simt, x, w.astype(np.float32)))


def test_unaligned_and_ragged_weights(simt, rng):
    """w not 16-byte aligned (scalar loads for every vector) gives the same bits as the aligned
    copy: the order is the plan's, whatever the loads."""
    x, w = inputs(rng, 3, 300, 64, BF16)
    buf = np.zeros(w.size + 1, BF16)
    shifted = buf[1:].reshape(w.shape)  # 2 bytes past a 16-byte boundary
    shifted[...] = w
    assert shifted.ctypes.data % 16
    np.testing.assert_array_equal(run(simt, x, shifted), run(simt, x, w))


def test_randomised_schedule(simt, rng):
    """Barriers guard the warps' shared sums: a random thread order between barriers changes
    nothing."""
    x, w = inputs(rng, 11, 600, 300, BF16)
    expect = linear_ref(x, w, split_plan(600, 300)[1])
    for _ in range(3):
        with simt.kernels.schedule(seed=int(rng.integers(1, 2**31))):
            np.testing.assert_array_equal(run(simt, x, w), expect)


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
