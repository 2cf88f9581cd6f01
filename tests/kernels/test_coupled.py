"""The coupled accept (dspark.ops.coupled): the target's position-keyed Gumbel-max picks of the
verify columns (sample_filtered) and the walk (pick_accept), on the kernels against the NumPy
reference bit for bit, at awkward sizes and at Qwen3.5's full vocabulary (31 CTAs a row), with
outputs poisoned before every launch."""

import ml_dtypes
import numpy as np
import pytest

from dspark.errors import DTypeError, NonFiniteError, ShapeError, TokenRangeError
from dspark.ops.coupled import (coupled_accept, coupled_accept_plan, coupled_accept_ref, pick_accept,
                                pick_accept_ref)
from dspark.ops.rowsplit import SLICE
from dspark.ops.sampling import Filters, Streams, sample_plan
from dspark.philox import Tag
from tests.conftest import poison
from tests.kernels.test_sampling import FULL_V, make_logits, mixed_filters

f32 = np.float32


def indptr_of(vts) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(vts)]).astype(np.int32)


def agreeing(rng, picks, vts) -> np.ndarray:
    """Candidates [anchor, d_1 ..] per session whose drafts equal the picks before them for a
    random prefix (every length from none to all), then differ: partial and full accepts."""
    cand = rng.integers(0, 1000, len(picks)).astype(np.int32)
    c0 = 0
    for vt in vts:
        agree = int(rng.integers(0, vt)) if vt else 0
        for j in range(vt - 1):
            cand[c0 + j + 1] = picks[c0 + j] if j < agree else (picks[c0 + j] + 1) % 1000
        c0 += vt
    return cand


# ---- the walk -------------------------------------------------------------------------------------
@pytest.mark.parametrize("vts", [[1], [2], [9], [33], [70, 1, 0, 3], [1] * 40, [0, 0], [5, 32, 31, 64, 2, 8, 17]])
def test_pick_accept_matches_reference(kernel_backend, rng, vts):
    be = kernel_backend
    picks = rng.integers(0, 1000, sum(vts)).astype(np.int32)
    cand = agreeing(rng, picks, vts)
    m, nxt = poison(be.xp, len(vts), np.int32), poison(be.xp, len(vts), np.int32)
    pick_accept(be, be.asarray(picks), be.asarray(cand), indptr_of(vts), m, nxt)
    want_m, want_next = pick_accept_ref(picks, cand, indptr_of(vts))
    np.testing.assert_array_equal(be.to_host(m), want_m)
    np.testing.assert_array_equal(be.to_host(nxt), want_next)
    vt = np.array(vts)
    assert ((want_m == -1) == (vt == 0)).all() and (want_m <= vt - 1).all()


def test_pick_accept_walks_to_the_first_disagreement():
    """Columns after the first disagreement do not count, even where they agree again; a
    session's last column is never compared (its pick is the bonus)."""
    picks = np.array([5, 6, 7, 8, 1, 2, 3], np.int32)
    cand = np.array([0, 5, 9, 7, 0, 1, 2], np.int32)   # session 0: 4 columns; session 1: 3
    m, nxt = pick_accept_ref(picks, cand, np.array([0, 4, 7], np.int32))
    assert m.tolist() == [1, 2] and nxt.tolist() == [6, 3]


def test_pick_accept_under_a_random_schedule(simt, rng):
    vts = [33, 1, 64, 7]
    picks = rng.integers(0, 1000, sum(vts)).astype(np.int32)
    cand = agreeing(rng, picks, vts)
    want = pick_accept_ref(picks, cand, indptr_of(vts))
    for seed in (1, 2):
        with simt.kernels.schedule(seed):
            got = pick_accept(simt, picks, cand, indptr_of(vts))
        np.testing.assert_array_equal(np.stack(got), np.stack(want))


# ---- picks and walk -------------------------------------------------------------------------------
def coupled_batch(rng, vts, vocab, dtype=np.float32):
    """Verify columns of sessions with their own filters, seeds and positions (each column the
    PICK stream of the position it predicts), and candidates that agree with the reference picks
    for random prefixes."""
    cols, B = sum(vts), len(vts)
    x = make_logits(rng, cols, vocab, dtype)
    per = mixed_filters(rng, B, vocab)
    f = Filters(*(np.repeat(a, vts) for a in (per.temperature, per.top_k, per.top_p, per.min_p)))
    seeds = rng.integers(0, 2**64, B, dtype=np.uint64)
    starts = rng.integers(0, 2**40, B)
    positions = np.concatenate([s + 1 + np.arange(vt) for s, vt in zip(starts, vts)]).astype(np.uint64)
    s = Streams.full(cols, np.repeat(seeds, vts), positions, Tag.PICK)
    picks = coupled_accept_ref(x, np.zeros(cols, np.int32), indptr_of(vts), f, s)["picks"]
    cand = agreeing(rng, np.where(picks >= 0, picks, 0), vts)
    cand = np.where(cand < vocab, cand, cand % vocab).astype(np.int32)
    return x, cand, f, s


def run_coupled(be, x, cand, vts, f, s):
    cols, B = len(cand), len(vts)
    m, nxt = poison(be.xp, B, np.int32), poison(be.xp, B, np.int32)
    picks, status = poison(be.xp, cols, np.int32), poison(be.xp, cols, np.int32)
    coupled_accept(be, be.asarray(x), cand, indptr_of(vts), f, s, m, nxt, status, picks)
    return {k: be.to_host(v) for k, v in (("m", m), ("next", nxt), ("picks", picks), ("status", status))}


def assert_coupled_matches(be, x, cand, vts, f, s):
    got = run_coupled(be, x, cand, vts, f, s)
    want = coupled_accept_ref(x, cand, indptr_of(vts), f, s)
    for k in ("picks", "status", "m", "next"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    return got


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("vts,vocab", [([1], 258), ([9], 31), ([3, 1, 8, 2], 1000), ([5, 0, 2], 4097),
                                       ([2, 33], 2 * SLICE + 3)])
def test_coupled_accept_matches_reference(kernel_backend, rng, vts, vocab, dtype):
    x, cand, f, s = coupled_batch(rng, vts, vocab, dtype)
    got = assert_coupled_matches(kernel_backend, x, cand, vts, f, s)
    assert (got["status"] == 0).all()
    greedy = np.asarray(f.temperature) == 0
    np.testing.assert_array_equal(got["picks"][greedy], make_argmax(x)[greedy])


def make_argmax(x):
    return np.asarray(x, f32).argmax(axis=1)


@pytest.mark.parametrize("vts", [[8], [3, 1, 5, 8]])
def test_coupled_accept_full_vocab_matches_reference(kernel_backend, rng, vts):
    """V = 248320: each column's pick across 31 CTAs and every filter phase, merged exactly."""
    x, cand, f, s = coupled_batch(rng, vts, FULL_V, ml_dtypes.bfloat16)
    got = assert_coupled_matches(kernel_backend, x, cand, vts, f, s)
    assert (got["picks"] >= 0).all()


def test_coupled_accept_is_batch_invariant(kernel_backend, rng):
    """A session's (m, next) and picks alone equal its part of a batch of five."""
    vts = [4, 1, 9, 2, 6]
    x, cand, f, s = coupled_batch(rng, vts, 1000)
    batch = run_coupled(kernel_backend, x, cand, vts, f, s)
    c = indptr_of(vts)
    for b, vt in enumerate(vts):
        rows = slice(int(c[b]), int(c[b + 1]))
        sub_f = Filters(*(np.ascontiguousarray(np.asarray(a)[rows]) for a in (f.temperature, f.top_k, f.top_p,
                                                                                f.min_p)))
        sub_s = Streams(*(np.ascontiguousarray(np.asarray(a)[rows]) for a in (s.seed, s.counter, s.stream)))
        alone = run_coupled(kernel_backend, x[rows], cand[rows], [vt], sub_f, sub_s)
        assert (alone["m"][0], alone["next"][0]) == (batch["m"][b], batch["next"][b])
        np.testing.assert_array_equal(alone["picks"], batch["picks"][rows])


def test_a_padded_column_is_never_accepted_where_the_pick_is_token_0(any_backend, rng):
    """dspark.graphs verifies a batch at its widest session's width, a shorter session's candidates
    padded with PAD past its own columns. Its (m, next) equal its unpadded accept's, also where
    the pick of its last own column, and of every padded column, is token 0: a real id, so a PAD
    equal to it would be taken for an agreeing draft and the walk would run into the padding."""
    from dspark.ops.coupled import PAD
    be, W, vocab = any_backend, 4, 258
    x, cand, f, s = coupled_batch(rng, [W, W], vocab)
    own = 2                                   # session 0's own width; session 1 verifies all W
    x[: W, 0] = np.asarray(x[: W], f32).max(axis=1) + 64   # every column of session 0 picks token 0
    f = Filters(*(np.asarray(a).copy() for a in (f.temperature, f.top_k, f.top_p, f.min_p)))
    f.temperature[:W], f.top_k[:W], f.top_p[:W], f.min_p[:W] = 0.8, 0, 0.95, 0.0
    cand[1] = 0                               # its one draft agrees with column 0's pick
    padded = cand.copy()
    padded[own:W] = PAD
    got = run_coupled(be, x, padded, [W, W], f, s)
    assert got["picks"][:W].tolist() == [0] * W
    rows = slice(0, own)
    alone = run_coupled(be, x[rows], cand[rows], [own],
                        Filters(*(np.asarray(a)[rows] for a in (f.temperature, f.top_k, f.top_p, f.min_p))),
                        Streams(*(np.asarray(a)[rows] for a in (s.seed, s.counter, s.stream))))
    assert (got["m"][0], got["next"][0]) == (alone["m"][0], alone["next"][0]) == (own - 1, 0)
    whole = run_coupled(be, x, cand, [W, W], f, s)
    assert (got["m"][1], got["next"][1]) == (whole["m"][1], whole["next"][1])


def test_equal_rows_and_noise_agree_everywhere(any_backend, rng):
    """A drafter whose filtered row equals the target's, drawing with the same position's noise,
    proposes the target's pick: every draft is accepted, the bonus is the last column's pick."""
    be = any_backend
    vts = [6, 3]
    x, _, f, s = coupled_batch(rng, vts, 500)
    picks = coupled_accept_ref(x, np.zeros(9, np.int32), indptr_of(vts), f, s)["picks"]
    cand = np.concatenate([[0], picks[:5], [0], picks[6:8]]).astype(np.int32)
    got = run_coupled(be, x, cand, vts, f, s)
    assert got["m"].tolist() == [5, 2] and got["next"].tolist() == [picks[5], picks[8]]


def test_coupled_accept_rejects_bad_inputs(any_backend, rng):
    be = any_backend
    vts = [2, 3]
    x, cand, f, s = coupled_batch(rng, vts, 16)
    call = lambda **kw: coupled_accept(be, be.asarray(kw.get("x", x)), kw.get("cand", cand),  # noqa: E731
                                       kw.get("indptr", indptr_of(vts)), f, s)
    with pytest.raises(TokenRangeError, match=r"cand\[1\]=16 is outside the vocabulary \[0, 16\)"):
        call(cand=np.array([0, 16, 1, 2, 3], np.int32))
    with pytest.raises(ShapeError, match="col_indptr must start at 0 and end at 5"):
        call(indptr=np.array([0, 2, 4], np.int32))
    with pytest.raises(DTypeError, match="cand has dtype int64: expected int32"):
        call(cand=cand.astype(np.int64))
    with pytest.raises(ShapeError, match=r"cand has shape \(4,\): expected \(5,\)"):
        call(cand=cand[:4])
    bad = x.copy()
    bad[3, 7] = np.nan
    with pytest.raises(NonFiniteError, match=r"row 3 contains NaN or \+inf"):
        call(x=bad)
    with pytest.raises(ShapeError, match=r"m_out has shape \(3,\): expected \(2,\)"):
        coupled_accept(be, be.asarray(x), cand, indptr_of(vts), f, s, m_out=be.xp.zeros(3, np.int32))


def test_plan():
    p = coupled_accept_plan(2, 16, FULL_V, 2, top_k=True, top_p=True)
    picks = sample_plan(16, FULL_V, 2, top_k=True, top_p=True)
    assert p.launches[:-1] == picks.launches and p.launches[-1].kernel == "pick_accept"
    assert p.launches[-1].ctas == 1 and coupled_accept_plan(9, 9, 100).launches[-1].ctas == 3
    assert p.bytes > picks.bytes and p.min_bytes > picks.min_bytes
