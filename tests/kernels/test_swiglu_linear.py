"""swiglu_linear: an MLP's down product over its gate|up product, the SwiGLU in the tensor-core GEMM's
activation stage (one launch) or in the prompt's rounding (round_swiglu, then the a16 tiles), bitwise
the two launches it replaces (`swiglu`, then `linear`) and their NumPy twins at awkward sizes, in
every tile shape and mode; row-invariant; refusing bad input before anything is written."""

import numpy as np
import pytest

from dspark import profile
from dspark.backends import contract, get_backend
from dspark.dtypes import BF16
from dspark.errors import DTypeError, ShapeError
from dspark.ops.activation import swiglu, swiglu_ref
from dspark.ops.fp8 import Fp8Matrix, scale_grid
from dspark.ops.linear import FP8_CONFIGS, FP8_STREAM, MMA_CONFIGS, linear, linear_mma_ref, mma_plan, mma_split_plan
from dspark.ops.swiglu_linear import fused, swiglu_linear
from tests.conftest import poison

HALF = [np.float16, BF16]
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the twins' SiLU at g = -100


def inputs(rng, rows, k, n, dtype):
    """gate|up [rows, 2K] with gates far into SiLU's tails (exp overflows to inf: SiLU -> -0) and ups
    of either sign; w [K, N] of dtype."""
    gate_up = (rng.standard_normal((rows, 2 * k)) * rng.uniform(0.5, 4)).astype(np.float32)
    gate_up[:, :k][rng.random((rows, k)) < 0.02] = -100.0
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    return gate_up, w


def assert_bits(got, want, what=""):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32), err_msg=what)


def activations(be, gate_up):
    """swiglu_f32's output (its exp is the device's expf: the host twin's libm may differ in the last bit)."""
    act = be.to_host(swiglu(be, be.asarray(gate_up)))
    np.testing.assert_allclose(act, swiglu_ref(gate_up), rtol=1e-6, atol=1e-30)
    return act


def weights(be, w):
    """w on the backend's device (an FP8 matrix: its bytes and scales)."""
    return Fp8Matrix(be.asarray(w.q), be.asarray(w.scale), w.compute) if isinstance(w, Fp8Matrix) else be.asarray(w)


def fused_run(be, gate_up, w, **plan):
    out = poison(be.xp, (gate_up.shape[0], w.shape[1]), np.float32)
    swiglu_linear(be, be.asarray(gate_up), weights(be, w), out=out, **plan)
    return be.to_host(out)


def two_launches(be, gate_up, w, **plan):
    out = poison(be.xp, (gate_up.shape[0], w.shape[1]), np.float32)
    linear(be, swiglu(be, be.asarray(gate_up)), weights(be, w), out=out, **plan)
    return be.to_host(out)


def fp8_weights(rng, k, n, compute):
    q = rng.integers(0, 256, (k, n)).astype(np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38  # no NaN bytes (refused at load)
    return Fp8Matrix(q, np.exp(rng.uniform(-8, -2, scale_grid(k, n))).astype(np.float32), np.dtype(compute))


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_every_tile_shape_and_mode_gives_the_bits_of_swiglu_then_the_product(simt, rng, dtype):
    """K off 4 (scalar loads of both halves), off 8 (the prompt's tiles stage f32: SwiGLU in the stage)
    and on 8 (the prompt's tiles copy round_swiglu's output); rows crossing the 16-row m-tiles and
    fold mode's groups; N off 8 and the column tiles; K in one chunk or several."""
    for rows, k, n in ((150, 31, 77), (150, 700, 77), (150, 712, 130), (9, 1000, 300)):
        gate_up, w = inputs(rng, rows, k, n, dtype)
        want = linear_mma_ref(activations(simt, gate_up), w, mma_split_plan(k, n)[1])
        ways = set()
        for bm in MMA_CONFIGS:
            for split in (False, True):
                ways.add(fused(simt, w, rows, k, n, bm=bm, split=split))
                got = fused_run(simt, gate_up, w, bm=bm, split=split)
                assert_bits(got, want, f"rows={rows} K={k} N={n} bm={bm} split={split}")
        assert_bits(two_launches(simt, gate_up, w), want, f"unfused rows={rows} K={k}")
        prompt = rows > 128  # fold mode's 128-row tiles: the wide tile where K % 8 != 0 has no fused entry
        assert ways == {"stage"} | ({"round" if k % 8 == 0 else None} if prompt else set()), (k, ways)


@pytest.mark.parametrize("compute", HALF, ids=["f16", "bf16"])
def test_fp8_weights_take_the_swiglu_in_the_stream_and_the_128_row_tiles(simt, rng, compute):
    """FP8 weights: the decode shapes' stream (16 and 32 rows: whole trips, a short last iteration, K off
    4 for scalar loads of both halves) and the 128-row tiles (fold and split) take SwiGLU in the stage;
    64 rows keeps swiglu then the product (the held halves would cost it its second CTA per SM). Every
    one gives the bits of the two launches."""
    ways = set()
    for rows, k, n in ((5, 700, 300), (20, 1030, 130), (150, 258, 77)):
        gate_up = inputs(rng, rows, k, 1, BF16)[0]
        w = fp8_weights(rng, k, n, compute)
        want = two_launches(simt, gate_up, w)
        for bm in FP8_CONFIGS:
            for split in (True,) if bm in FP8_STREAM else (True, False):
                ways.add((bm, fused(simt, w, rows, k, n, bm=bm, split=split)))
                assert_bits(fused_run(simt, gate_up, w, bm=bm, split=split), want, f"rows={rows} K={k} bm={bm}")
    assert ways == {(16, "stage"), (32, "stage"), (64, None), (128, "stage")}


def test_the_stage_equals_the_prompts_rounding_bitwise(simt, rng):
    """Within csrc/linear.cu alone (no swiglu_f32: what a private build of the family holds): every tile
    shape that takes SwiGLU in its stage gives the bits of the prompt's path, round_swiglu then the a16
    tiles, which computes it elsewhere (rows alike by row invariance)."""
    rows, k, n = 150, 440, 130   # one K chunk: a prompt's fold mode
    gate_up, w = inputs(rng, rows, k, n, BF16)
    assert fused(simt, w, rows, k, n) == "round"
    want = fused_run(simt, gate_up, w)
    staged = set()
    for bm in MMA_CONFIGS:
        r = rows if bm < 64 else bm - 3   # one row tile: 64 and 128 rows stage f32 activations there
        for split in (False, True):
            if fused(simt, w, r, k, n, bm=bm, split=split) == "stage":
                staged.add(bm)
                assert_bits(fused_run(simt, gate_up[:r], w, bm=bm, split=split), want[:r], f"bm={bm} split={split}")
    assert staged == set(MMA_CONFIGS)


def test_the_fp8_stream_equals_the_fp8_tiles_bitwise(simt, rng):
    """Within csrc/linear_fp8.cu alone: the decode shapes' stream (its whole trips: K on 4, chunks of
    several iterations) gives the bits of the 128-row tiles' stage (linear_mma's loads) at 16 and 32 rows."""
    rows, k, n = 20, 700, 300
    gate_up = inputs(rng, rows, k, 1, BF16)[0]
    w = fp8_weights(rng, k, n, BF16)
    want = fused_run(simt, gate_up, w, bm=128, split=True)
    for bm in FP8_STREAM:
        assert fused(simt, w, rows, k, n, bm=bm) == "stage"
        assert_bits(fused_run(simt, gate_up, w, bm=bm), want, f"stream bm={bm}")


def test_the_fused_plans_take_one_launch_and_the_prompts_two(rng):
    """Where the SwiGLU goes, counted on the cuda path (the contract stand-in): a decode's and a
    verify's down product is one launch and no swiglu_f32, over 16-bit or FP8 weights; a prompt's is
    round_swiglu and the a16 tiles; f32 weights keep swiglu_f32 and linear_f32. Each gives the two
    launches' bits."""
    be = contract.backend()
    cases = ((1, 64, 40, BF16, ["linear_mma_bf16_swiglu_m16"]),
             (18, 64, 40, np.float16, ["linear_mma_f16_swiglu_m32"]),
             (300, 64, 40, BF16, ["linear_mma_bf16_a16_m128n256", "round_swiglu_bf16"]),
             (3, 64, 40, np.float32, ["linear_f32", "swiglu_f32"]),
             (2, 256, 40, "fp8", ["linear_fp8_bf16_swiglu_m16"]))
    for rows, k, n, dtype, entries in cases:
        gate_up, w = inputs(rng, rows, k, n, BF16 if dtype == "fp8" else dtype)
        w = fp8_weights(rng, k, n, BF16) if dtype == "fp8" else w
        want = two_launches(be, gate_up, w)
        with profile.counting() as c:
            got = fused_run(be, gate_up, w)
        assert sorted(c.by_name.elements()) == entries, (rows, dtype, dict(c.by_name))
        assert_bits(got, want, f"{rows} rows {dtype}")


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_a_row_alone_equals_the_row_in_launches_of_any_rows(simt, rng, dtype):
    """Row invariance: each row of launches of 1, 2, 7, 16, 17, 64 and 300 rows (the 16-, 32-, 64- and
    128-row stages and the prompt's rounding) is bitwise the row computed alone."""
    k, n = 600, 40
    gate_up, w = inputs(rng, 300, k, n, dtype)
    alone = np.concatenate([fused_run(simt, gate_up[i : i + 1], w) for i in range(300)])
    assert_bits(alone, linear_mma_ref(activations(simt, gate_up), w, mma_split_plan(k, n)[1]))
    ways = set()
    for rows in (1, 2, 7, 16, 17, 64, 300):
        start = int(rng.integers(0, 300 - rows + 1))
        for split in (True, False):
            ways.add((mma_plan(rows, k, n).bm, fused(simt, w, rows, k, n, split=split)))
            got = fused_run(simt, gate_up[start : start + rows], w, split=split)
            assert_bits(got, alone[start : start + rows], f"{rows} rows from {start}, split={split}")
    assert ways == {(16, "stage"), (32, "stage"), (64, "stage"), (128, "stage"), (128, "round")}


def test_the_numpy_backend_is_swiglu_then_its_product(rng):
    be = get_backend("numpy")
    gate_up, w = inputs(rng, 5, 40, 9, BF16)
    assert_bits(fused_run(be, gate_up, w), two_launches(be, gate_up, w))


def test_bad_input_is_refused_and_out_untouched(simt, rng):
    gate_up, w = inputs(rng, 3, 8, 5, BF16)
    out = poison(np, (3, 5), np.float32)
    cases = [
        (ShapeError, "gate_up has 15 columns: expected an even number", dict(gate_up=gate_up[:, :15])),
        (ShapeError, r"w has shape \(7, 5\): expected \(8, N\) for gate_up of shape \(3, 16\)", dict(w=w[:7])),
        (DTypeError, "gate_up has dtype float64: expected float32", dict(gate_up=gate_up.astype(np.float64))),
        (ShapeError, r"gate_up has shape \(16,\): expected 2 dims \[rows, 2F\]", dict(gate_up=gate_up[0])),
        (ShapeError, r"out has shape \(3, 5\): expected \(2, 5\)", dict(gate_up=gate_up[:2])),
    ]
    w8 = fp8_weights(rng, 8, 5, BF16)
    cases += [
        (ShapeError, r"w.scale has shape \(1, 2\): expected \(1, 1\)",
         dict(w=Fp8Matrix(w8.q, np.ones((1, 2), np.float32), BF16))),
        (DTypeError, "w.q has dtype int8", dict(w=Fp8Matrix(w8.q.view(np.int8), w8.scale, BF16))),
    ]
    for err, msg, kw in cases:
        args = dict(gate_up=gate_up, w=w) | kw
        with pytest.raises(err, match=msg):
            swiglu_linear(simt, args["gate_up"], args["w"], out=out)
        assert np.isnan(out).all()
