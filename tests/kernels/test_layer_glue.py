"""The layers' glue as kernels (csrc/norm.cu's residual and embedding norms, csrc/activation.cu,
csrc/rope.cu, csrc/heads.cu) against their NumPy twins, on simt and on the cuda path over the CuPy
stand-in, at awkward sizes, outputs poisoned.

Bitwise where the arithmetic is the twin's own (the norms' sums in the kernel's lane order,
copies, products, the rotation's products of cos and sin); within an f32 ulp or two of |ref| where
a transcendental (exp, tanh, the f64 cos and sin of RoPE's angles before their one rounding) may
differ in its last bit between the host's libm and NumPy's. Every op is row-invariant: a row's
result alone equals it among others, bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark.backends import contract
from dspark.dtypes import BF16
from dspark.errors import ShapeError
from dspark.ops import dense
from dspark.ops.activation import attn_gate, attn_gate_ref, sigmoid_bias, swiglu, swiglu_ref
from dspark.errors import TokenRangeError
from dspark.ops.argmax import argmax_rows_ref, markov_chain_ref
from dspark.ops.heads import markov_logits, markov_logits_ref
from dspark.ops.heads import (confidence_features, confidence_features_ref, gather_rows, logit_scale,
                              logit_scale_ref)
from dspark.ops import norm
from dspark.ops.norm import add_rmsnorm, add_rmsnorm_ref, embed_rmsnorm, rmsnorm_ref
from dspark.ops.workspace import Workspace
from dspark.ops.rope import Heads, Rotary, qk_prepare, qk_prepare_ref, row_positions
from tests.conftest import poison

F32 = np.float32


@pytest.fixture(params=["simt", "contract"])
def kbe(request, simt):
    return simt if request.param == "simt" else contract.backend()


def close(got, ref, ulps=4):
    """Within a few f32 ulps of |ref| (transcendentals may differ in their last bit)."""
    got, ref = np.asarray(got, F32), np.asarray(ref, F32)
    np.testing.assert_allclose(got, ref, rtol=ulps * 2.0**-23, atol=ulps * 2.0**-23 * float(np.abs(ref).max(initial=1)))


# ---- norms at the layer boundary ----------------------------------------------------------------------------
@pytest.mark.parametrize("rows, n", [(1, 64), (7, 33), (9, 5120), (3, 1000)])
def test_add_rmsnorm_is_the_add_then_the_norm_bitwise(kbe, rng, rows, n):
    be = kbe
    x, y = (rng.standard_normal((rows, n)) * rng.uniform(0.1, 20)).astype(F32), rng.standard_normal((rows, n)).astype(F32)
    w = rng.standard_normal(n).astype(F32)
    taps = poison(be.xp, (rows, 3 * n), F32)
    xd, out = be.asarray(x.copy()), poison(be.xp, (rows, n), F32)
    add_rmsnorm(be, xd, be.asarray(y), be.asarray(w), 1e-6, out=out, tap=(taps, n))
    want_x, want = add_rmsnorm_ref(x, y, w, 1e-6)
    np.testing.assert_array_equal(be.to_host(xd), want_x)
    np.testing.assert_array_equal(be.to_host(out), want)
    t = be.to_host(taps)
    np.testing.assert_array_equal(t[:, n : 2 * n], want_x)
    assert np.isnan(t[:, :n]).all() and np.isnan(t[:, 2 * n :]).all()  # only its column block written
    alone = be.asarray(x[-1:].copy())
    out1 = add_rmsnorm(be, alone, be.asarray(y[-1:]), be.asarray(w), 1e-6)
    np.testing.assert_array_equal(be.to_host(out1)[0], want[-1])      # a row alone: the same bits


@pytest.mark.parametrize("rows, n", [(2, 1025), (5, 2048), (1, 4097 + 1024)])
def test_add_rmsnorm_across_chunks_is_the_norm_of_the_whole_new_row(kbe, rng, rows, n):
    """A row over several CTAs (ROW_CHUNK columns each; a last chunk of one column; past a staged piece): the row's last
    CTA norms every chunk's new x (a norm taken before the other chunks wrote would see their old x,
    which y moves far), in place over x as the drafter's fc norm runs it, and the tickets are put back."""
    be = kbe
    assert norm.row_chunks(n) > 1
    x = rng.standard_normal((rows, n)).astype(F32)
    y = (rng.standard_normal((rows, n)) * 50).astype(F32)
    w = rng.standard_normal(n).astype(F32)
    ws = Workspace(be, rows)
    xd = be.asarray(x.copy())
    got = add_rmsnorm(be, xd, be.asarray(y), be.asarray(w), 1e-6, out=xd, ws=ws)  # out is x
    want_x, want = add_rmsnorm_ref(x, y, w, 1e-6)
    np.testing.assert_array_equal(be.to_host(got), want)
    assert not be.to_host(ws.take("norm.tickets", rows, (), np.uint32)).any()  # zero at rest for the next launch
    xd, out = be.asarray(x.copy()), poison(be.xp, (rows, n), F32)
    add_rmsnorm(be, xd, None, be.asarray(w), 1e-6, out=out, ws=ws)      # no residual: the norm of x as it is
    np.testing.assert_array_equal(be.to_host(out), add_rmsnorm_ref(x, None, w, 1e-6)[1])
    np.testing.assert_array_equal(be.to_host(xd), x)


def test_add_rmsnorm_refuses_bad_input_and_leaves_x_untouched(simt, rng):
    be = simt
    x, w = be.asarray(rng.standard_normal((3, 600)).astype(F32)), be.asarray(rng.standard_normal(600).astype(F32))
    before, out = be.to_host(x).copy(), poison(be.xp, (3, 600), F32)
    with pytest.raises(ShapeError, match=r"y has shape \(3, 599\): expected \(3, 600\)"):
        add_rmsnorm(be, x, be.asarray(np.ones((3, 599), F32)), w, 1e-6, out=out)
    with pytest.raises(ShapeError, match=r"out has shape \(2, 600\): expected \(3, 600\)"):
        add_rmsnorm(be, x, be.asarray(np.ones((3, 600), F32)), w, 1e-6, out=poison(be.xp, (2, 600), F32))
    np.testing.assert_array_equal(be.to_host(x), before)
    assert np.isnan(be.to_host(out)).all()


@pytest.mark.parametrize("dtype, n", [(np.float32, 96), (np.float16, 96), (BF16, 96), (BF16, 1100)])
def test_embed_rmsnorm_gathers_widens_and_norms_bitwise(kbe, rng, dtype, n):
    be = kbe
    V, rows = 77, 11
    table = rng.standard_normal((V, n)).astype(F32).astype(dtype)
    ids = rng.integers(0, V, rows).astype(np.int32)
    w = rng.standard_normal(n).astype(F32)
    x, out = poison(be.xp, (rows, n), F32), poison(be.xp, (rows, n), F32)
    embed_rmsnorm(be, be.asarray(table), ids, be.asarray(w), 1e-5, x=x, out=out, scale=0.5)
    want_x = dense.widen(table[ids]) * F32(0.5)
    np.testing.assert_array_equal(be.to_host(x), want_x)
    np.testing.assert_array_equal(be.to_host(out), rmsnorm_ref(want_x, w, 1e-5))
    with pytest.raises(ShapeError, match="ids: expected token ids in"):
        embed_rmsnorm(be, be.asarray(table), np.array([V], np.int32), be.asarray(w), 1e-5)


# ---- gates ---------------------------------------------------------------------------------------------------
def test_swiglu_attention_gate_and_sigmoid(kbe, rng):
    be = kbe
    g = (3 * rng.standard_normal((5, 2 * 37))).astype(F32)
    out = poison(be.xp, (5, 37), F32)
    swiglu(be, be.asarray(g), out=out)
    close(be.to_host(out), swiglu_ref(g))
    rows, H, D = 6, 3, 64
    for dtype in (np.float32, BF16):
        o = rng.standard_normal((rows, H, D)).astype(F32).astype(dtype)
        q = rng.standard_normal((rows, H * 2 * D + 3)).astype(F32)
        for gated in (True, False):  # Qwen3.5: the gate after each head's query
            out = poison(be.xp, (rows, H * D), F32)
            attn_gate(be, be.asarray(o), (be.asarray(q), D, 2 * D) if gated else None, out=out)
            ref = attn_gate_ref(o, q[:, : 2 * H * D].reshape(rows, H, 2 * D)[..., D:] if gated else None)
            close(be.to_host(out), ref.reshape(rows, H * D))
    x, b = rng.standard_normal(13).astype(F32), rng.standard_normal(1).astype(F32)
    close(be.to_host(sigmoid_bias(be, be.asarray(x), be.asarray(b))), dense.sigmoid(x + b[0]))


# ---- q/k norm + RoPE -------------------------------------------------------------------------------------------
ROPE_CASES = [  # (hq, hkv, D, gated, rot fraction, scaling, dtype)
    (4, 2, 64, False, 1.0, (), np.float32),
    (6, 1, 128, True, 0.25, (("factor", 4.0), ("original_max_position_embeddings", 32), ("rope_type", "yarn")), BF16),
    (0, 3, 32, False, 1.0, (("factor", 2.0), ("rope_type", "linear")), np.float32),   # the ingest's K|V: no q
]


@pytest.mark.parametrize("hq, hkv, D, gated, frac, scaling, dtype", ROPE_CASES)
def test_qk_prepare_is_norm_then_rope_then_cast(kbe, rng, hq, hkv, D, gated, frac, scaling, dtype):
    be = kbe
    heads = Heads.packed(hq, hkv, D, gated)
    rotary = Rotary.of(int(D * frac), 1e4, scaling)
    lens, pos = [3, 0, 5], np.array([0, 9, 300], np.int32)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    rows = int(indptr[-1])
    src = rng.standard_normal((rows, heads.width + 5)).astype(F32)
    qn, kn = rng.standard_normal(D).astype(F32), rng.standard_normal(D).astype(F32)
    q, k, v = (poison(be.xp, (rows, n, D), dtype) for n in (hq, hkv, hkv))
    qk_prepare(be, be.asarray(src), heads, rotary, pos, indptr, q_norm=be.asarray(qn) if hq else None,
               k_norm=be.asarray(kn), eps=1e-6, q=q, k=k, v=v, dtype=dtype, with_q=hq > 0)
    want = qk_prepare_ref(src, heads, rotary, row_positions(pos, indptr), qn if hq else None, kn, 1e-6, dtype)
    for got, ref in zip((q, k, v), want):
        close(np.asarray(be.to_host(got), F32), np.asarray(ref, F32), ulps=2 if dtype == np.float32 else 2**16)
    np.testing.assert_array_equal(be.to_host(v), want[2])           # v: a cast copy, exact
    # a row alone, at its own position: the same bits as among the others
    one = qk_prepare(be, be.asarray(src[-1:]), heads, rotary, np.array([pos[2] + 4], np.int32),
                     np.array([0, 1], np.int32), q_norm=be.asarray(qn) if hq else None, k_norm=be.asarray(kn),
                     eps=1e-6, dtype=dtype, with_q=hq > 0)
    for a, b in zip(one, (q, k, v)):
        if a is not None:
            assert be.to_host(a)[0].tobytes() == be.to_host(b)[-1].tobytes()


# ---- the drafter's heads' glue ---------------------------------------------------------------------------------
def test_draft_rows_features_and_logit_cap(kbe, rng):
    be = kbe
    src = rng.standard_normal((12, 40)).astype(F32)
    rows = np.array([1, 2, 3, 5, 6, 7], np.int32)
    np.testing.assert_array_equal(be.to_host(gather_rows(be, be.asarray(src), rows)), src[rows])
    B, nd, d, r, V = 2, 3, 24, 5, 30
    h = rng.standard_normal((B * nd, d)).astype(F32)
    w1 = rng.standard_normal((V, r)).astype(F32)
    anchors, drafts = rng.integers(0, V, B).astype(np.int32), rng.integers(0, V, (B, nd)).astype(np.int32)
    out = poison(be.xp, (B * nd, d + r), F32)
    confidence_features(be, be.asarray(h), be.asarray(w1), anchors, be.asarray(drafts), out=out)
    np.testing.assert_array_equal(be.to_host(out), confidence_features_ref(h, w1, anchors, drafts))
    x = (40 * rng.standard_normal((4, 33))).astype(F32)
    close(be.to_host(logit_scale(be, be.asarray(x), 0.75, 30.0)), logit_scale_ref(x, 0.75, 30.0))
    np.testing.assert_array_equal(be.to_host(logit_scale(be, be.asarray(x), 0.75, 0.0)), x * F32(0.75))


def test_markov_logits_is_the_greedy_chains_bias_bitwise(kbe, rng):
    """One slot of the sampled chain: the slot's rows plus the greedy chain's bias, bit for bit
    (its argmax walk is markov_chain's drafts), x_{k-1} read from the device picks, which also land
    in drafts[:, k - 1]; a -1 pick reads row 0; without w1 the rows alone; bad slots and anchors
    raise."""
    be = kbe
    B, nd, V, r = 3, 4, 300, 7   # two column CTAs per row
    logits = rng.standard_normal((B * nd, V)).astype(F32)
    w1, w2 = rng.standard_normal((V, r)).astype(F32), rng.standard_normal((r, V)).astype(F32)
    anchors = rng.integers(0, V, B).astype(np.int32)
    dl, dw1, dw2 = be.asarray(logits), be.asarray(w1), be.asarray(w2)
    drafts = poison(be.xp, (B, nd), np.int32)
    picks, walk = None, []
    for k in range(nd + 1):
        out = poison(be.xp, (B, V), F32)
        markov_logits(be, dl, dw1, dw2, anchors, picks, k, nd, drafts, out=out)
        if k:
            np.testing.assert_array_equal(be.to_host(drafts)[:, k - 1], be.to_host(picks))
        if k == nd:
            break
        got = be.to_host(out)
        np.testing.assert_array_equal(got, markov_logits_ref(logits, w1, w2, anchors, None if k == 0 else
                                                             be.to_host(picks), k, nd))
        idx, _ = argmax_rows_ref(got)
        walk.append(idx)
        picks = be.asarray(idx)
    np.testing.assert_array_equal(np.stack(walk, 1), markov_chain_ref(logits, w1, w2, anchors, nd)[0])
    bad = be.asarray(np.array([-1, 5, 2], np.int32))
    out = poison(be.xp, (B, V), F32)
    markov_logits(be, dl, dw1, dw2, anchors, bad, 1, nd, drafts, out=out)
    np.testing.assert_array_equal(be.to_host(out)[0], markov_logits_ref(logits, w1, w2, anchors, [0, 5, 2], 1, nd)[0])
    plain = markov_logits(be, dl, None, None, anchors, bad, 2, nd, drafts)
    np.testing.assert_array_equal(be.to_host(plain), logits.reshape(B, nd, V)[:, 2])
    with pytest.raises(ShapeError, match="slot=5"):
        markov_logits(be, dl, dw1, dw2, anchors, bad, 5, nd, drafts)
    with pytest.raises(TokenRangeError, match="anchors"):
        markov_logits(be, dl, dw1, dw2, np.array([0, V, 1], np.int32), None, 0, nd, drafts)
