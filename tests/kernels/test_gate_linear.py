"""attn_gate_linear: an attention's output projection over its output o and gates, the gate (and o's
widening) in the tensor-core GEMM's activation stage, one launch: bitwise the two launches it replaces
(`attn_gate`, then `linear`) at awkward sizes in every tile shape and mode, gated or not; row-invariant;
refusing bad input before anything is written."""

import numpy as np
import pytest

from dspark import profile
from dspark.backends import contract, get_backend
from dspark.dtypes import BF16, to_f32
from dspark.errors import DTypeError, ShapeError
from dspark.ops.activation import attn_gate
from dspark.ops.gate_linear import attn_gate_linear, fused
from dspark.ops.linear import MMA_CONFIGS, linear, mma_plan
from tests.conftest import poison

HALF = [np.float16, BF16]


def inputs(rng, rows, heads, D, n, dtype, width_pad=3):
    """o [rows, heads, D] of dtype; q|gate [rows, heads * 2D + pad] f32 with each head's gate after its
    query (Qwen3.5's layout: first column D, every 2D); w [heads * D, N] of dtype."""
    o = (rng.standard_normal((rows, heads, D)) * 2).astype(dtype)
    qg = (rng.standard_normal((rows, heads * 2 * D + width_pad)) * 3).astype(np.float32)
    w = (rng.standard_normal((heads * D, n)) / np.sqrt(heads * D)).astype(dtype)
    return o, qg, w


def assert_bits(got, want, what=""):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32), err_msg=what)


def fused_run(be, o, qg, w, gated=True, **plan):
    out = poison(be.xp, (o.shape[0], w.shape[1]), np.float32)
    D = o.shape[2]
    attn_gate_linear(be, be.asarray(o), be.asarray(w), (be.asarray(qg), D, 2 * D) if gated else None, out=out, **plan)
    return be.to_host(out)


def two_launches(be, o, qg, w, gated=True, **plan):
    out = poison(be.xp, (o.shape[0], w.shape[1]), np.float32)
    D = o.shape[2]
    o32 = attn_gate(be, be.asarray(o), (be.asarray(qg), D, 2 * D) if gated else None)
    linear(be, o32, be.asarray(w), out=out, **plan)
    return be.to_host(out)


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_every_tile_shape_and_mode_gives_the_bits_of_the_gate_then_the_product(simt, rng, dtype):
    """Gated and not (o widened alone); heads of D off 4 and on 8; gates whose rows are 16-byte aligned
    (vector loads of o and gates) or not (scalar loads); rows crossing the m-tiles; N off 8; one K chunk
    or several; a prompt's a16 tiles through round_gate (D % 4 == 0) or the two launches (D off 4)."""
    for rows, heads, D, n, pad in ((150, 3, 13, 77, 3), (150, 3, 24, 77, 3), (9, 4, 64, 300, 0), (40, 2, 40, 130, 3),
                                   (40, 2, 40, 130, 0)):
        o, qg, w = inputs(rng, rows, heads, D, n, dtype, pad)
        k = heads * D
        for gated in (True, False):
            want = two_launches(simt, o, qg, w, gated)
            ways = set()
            for bm in MMA_CONFIGS:
                for split in (False, True):
                    ways.add(fused(simt, o.dtype, w, rows, k, n, D, bm=bm, split=split))
                    got = fused_run(simt, o, qg, w, gated, bm=bm, split=split)
                    assert_bits(got, want, f"rows={rows} heads={heads} D={D} gated={gated} bm={bm} split={split}")
            assert "stage" in ways and ("round" in ways) == (rows == 150 and D % 4 == 0), (rows, k, ways)


def test_gates_of_0_half_and_1_give_the_product_of_the_gated_rows(simt, rng):
    """Within csrc/linear.cu alone (what a private build of the family holds): gates of -inf, 0 and +inf
    make the sigmoid exactly 0, 1/2 and 1 on any backend, so the gated stage, and a prompt's rounding,
    must give the plain product of o times them, computed on the host, bitwise, each head with its own
    gates."""
    rows, heads, D, n = 9, 3, 24, 70
    for pad in (3, 0):   # gates' rows off 16 bytes (scalar loads) and on (vector loads)
        o, qg, w = inputs(rng, rows, heads, D, n, BF16, pad)
        qg[...] = rng.choice(np.array([-np.inf, 0.0, np.inf], np.float32), qg.shape)
        gates = np.stack([qg[:, D + h * 2 * D : D + h * 2 * D + D] for h in range(heads)], axis=1)
        scale = np.where(gates == np.inf, 1.0, np.where(gates == 0, 0.5, 0.0)).astype(np.float32)
        want = two_launches_of(simt, (to_f32(o) * scale).reshape(rows, -1), w)
        for bm in (16, 32):
            assert fused(simt, o.dtype, w, rows, heads * D, n, D, bm=bm) == "stage"
            assert_bits(fused_run(simt, o, qg, w, bm=bm), want, f"bm={bm} pad={pad}")
    rows = 200   # a prompt's rows: round_gate, then the a16 tiles
    o, qg, w = inputs(rng, rows, heads, D, n, BF16)
    qg[...] = rng.choice(np.array([-np.inf, 0.0, np.inf], np.float32), qg.shape)
    gates = np.stack([qg[:, D + h * 2 * D : D + h * 2 * D + D] for h in range(heads)], axis=1)
    scale = np.where(gates == np.inf, 1.0, np.where(gates == 0, 0.5, 0.0)).astype(np.float32)
    assert fused(simt, o.dtype, w, rows, heads * D, n, D) == "round"
    assert_bits(fused_run(simt, o, qg, w), two_launches_of(simt, (to_f32(o) * scale).reshape(rows, -1), w), "prompt")


def two_launches_of(be, o32, w):
    out = poison(be.xp, (o32.shape[0], w.shape[1]), np.float32)
    linear(be, be.asarray(o32), be.asarray(w), out=out)
    return be.to_host(out)


def test_the_fused_plans_take_one_launch(rng):
    """Counted on the cuda path (the contract stand-in): a decode's and a verify's output projection is
    one launch and no attn_gate; a prompt's is round_gate and the a16 tiles (attn_gate, the rounding and
    the tiles where D is off 4); f32 o without gates is the product alone. Each gives the two launches'
    bits."""
    be = contract.backend()
    cases = ((1, BF16, True, 2, 32, ["linear_mma_bf16_gated_m16"]),
             (18, np.float16, False, 2, 32, ["linear_mma_f16_gated_m32"]),
             (300, BF16, True, 2, 32, ["linear_mma_bf16_a16_m128n256", "round_gate_bf16"]),
             (300, np.float16, False, 2, 32, ["linear_mma_f16_a16_m128n256", "round_gate_f16"]),
             (300, BF16, True, 4, 30, ["attn_gate_bf16", "linear_mma_bf16_a16_m128n256", "round_activations_bf16"]),
             (3, np.float32, False, 2, 32, ["linear_f32"]))
    for rows, dtype, gated, heads, D, entries in cases:
        o, qg, w = inputs(rng, rows, heads, D, 40, dtype)
        want = two_launches(be, o, qg, w, gated)
        with profile.counting() as c:
            got = fused_run(be, o, qg, w, gated)
        assert sorted(c.by_name.elements()) == entries, (rows, dtype, D, dict(c.by_name))
        assert_bits(got, want, f"{rows} rows {np.dtype(dtype)} D={D}")


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_a_row_alone_equals_the_row_in_launches_of_any_rows(simt, rng, dtype):
    """Row invariance: each row of launches of 1, 2, 7, 16, 17, 64 and 300 rows (the 16-, 32- and 64-row
    stages, and a prompt's rounding) is bitwise the row computed alone."""
    heads, D, n = 3, 40, 40
    o, qg, w = inputs(rng, 300, heads, D, n, dtype)
    alone = np.concatenate([fused_run(simt, o[i : i + 1], qg[i : i + 1], w) for i in range(300)])
    assert_bits(alone, two_launches(simt, o, qg, w))
    shapes = set()
    for rows in (1, 2, 7, 16, 17, 64, 300):
        start = int(rng.integers(0, 300 - rows + 1))
        for split in (True, False):
            shapes.add((mma_plan(rows, heads * D, n).bm, fused(simt, o.dtype, w, rows, heads * D, n, D, split=split)))
            got = fused_run(simt, o[start : start + rows], qg[start : start + rows], w, split=split)
            assert_bits(got, alone[start : start + rows], f"{rows} rows from {start}, split={split}")
    assert {bm for bm, how in shapes if how == "stage"} == {16, 32, 64} and (128, "round") in shapes  # 300: a prompt's


def test_the_numpy_backend_is_the_gate_then_its_product(rng):
    be = get_backend("numpy")
    o, qg, w = inputs(rng, 5, 2, 8, 9, BF16)
    for gated in (True, False):
        assert_bits(fused_run(be, o, qg, w, gated), two_launches(be, o, qg, w, gated))


def test_bad_input_is_refused_and_out_untouched(simt, rng):
    o, qg, w = inputs(rng, 3, 2, 4, 5, BF16)
    out = poison(np, (3, 5), np.float32)
    cases = [
        (ShapeError, r"w has shape \(7, 5\): expected \(8, N\) for o of shape \(3, 2, 4\)", dict(w=w[:7])),
        (ShapeError, r"o has shape \(3, 8\): expected 3 dims \[rows, heads, D\]", dict(o=o.reshape(3, 8))),
        (DTypeError, "o has dtype int32", dict(o=o.astype(np.int32))),
        (ShapeError, r"gates has shape \(3, 10\): expected 3 rows holding 2 heads of 4", dict(qg=qg[:, :10])),
        (ShapeError, r"out has shape \(3, 5\): expected \(2, 5\)", dict(o=o[:2], qg=qg[:2])),
    ]
    for err, msg, kw in cases:
        args = dict(o=o, qg=qg, w=w) | kw
        with pytest.raises(err, match=msg):
            attn_gate_linear(simt, args["o"], args["w"], (args["qg"], 4, 8), out=out)
        assert np.isnan(out).all()
