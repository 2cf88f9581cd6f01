"""argmax_rows and greedy_accept: kernels (simt, cuda) against the NumPy reference, exactly."""

import ml_dtypes
import numpy as np
import pytest

from dspark.errors import NonFiniteError, ShapeError
from dspark.ops.argmax import (argmax_rows, argmax_rows_ref, greedy_accept, greedy_accept_ref, markov_chain,
                               markov_chain_ref)
from tests.conftest import poison

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
SHAPES = [(1, 1), (1, 151936), (3, 258), (7, 1000), (19, 31), (4, 33), (2, 4097)]


def make_logits(rng, rows, vocab, dtype, ties=False, neg_inf_rows=()):
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    if ties:  # coarse values: many exact ties per row, including at the maximum
        x = np.round(x * 2) / 2
    for r in neg_inf_rows:
        x[r] = -np.inf
    return x.astype(dtype)


def run_argmax(be, logits):
    out = poison(be.xp, logits.shape[0], np.int32)
    return be.to_host(argmax_rows(be, be.asarray(logits), out=out))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_argmax_rows_matches_reference(kernel_backend, rng, rows, vocab, dtype):
    x = make_logits(rng, rows, vocab, dtype, ties=True, neg_inf_rows=[rows - 1] if rows > 2 else [])
    np.testing.assert_array_equal(run_argmax(kernel_backend, x), argmax_rows_ref(x)[0])


def test_argmax_ties_go_to_the_lowest_index(kernel_backend):
    x = np.zeros((3, 1000), np.float32)
    x[0, [999, 5, 700]] = 2.0
    x[2, :] = -np.inf
    np.testing.assert_array_equal(run_argmax(kernel_backend, x), [5, 0, 0])


def test_argmax_reference_is_numpy_argmax(numpy_backend, rng):
    x = make_logits(rng, 9, 517, np.float32, ties=True)
    np.testing.assert_array_equal(run_argmax(numpy_backend, x), x.argmax(axis=1))


def test_nan_is_reported_never_chosen(any_backend):
    be = any_backend
    x = np.zeros((4, 100), np.float32)
    x[2, 50] = np.nan
    x[2, 60] = np.inf
    with pytest.raises(NonFiniteError, match="row 2 contains NaN"):
        argmax_rows(be, be.asarray(x))
    idx, flag = argmax_rows_ref(x)
    assert idx[2] == 60 and flag.tolist() == [0, 0, 1, 0]


def test_empty_batch(kernel_backend):
    assert run_argmax(kernel_backend, np.zeros((0, 10), np.float32)).shape == (0,)


def test_argmax_rejects_bad_shapes_and_dtypes(kernel_backend):
    with pytest.raises(ShapeError, match=r"logits has shape \(10,\): expected 2 dims"):
        argmax_rows(kernel_backend, kernel_backend.asarray(np.zeros(10, np.float32)))
    with pytest.raises(TypeError, match="logits has dtype float64"):
        argmax_rows(kernel_backend, kernel_backend.asarray(np.zeros((2, 10))))


def make_verify_block(rng, vts, vocab, dtype, accept_prob=0.7):
    """Ragged verify columns whose candidates agree with the column argmax with some probability."""
    cols = sum(vts)
    x = make_logits(rng, cols, vocab, dtype, ties=True)
    best = argmax_rows_ref(x)[0]
    cand = rng.integers(0, vocab, cols).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(vts)]).astype(np.int32)
    for b, vt in enumerate(vts):
        c0 = indptr[b]
        for j in range(vt - 1):
            if rng.random() < accept_prob:
                cand[c0 + j + 1] = best[c0 + j]
    return x, cand, indptr


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vts,vocab", [([1], 258), ([8], 151936), ([3, 1, 8, 2, 5, 7, 4], 1000),
                                       ([2] * 5, 33), ([8, 8, 8], 4097), ([0, 3, 0], 100)])
def test_greedy_accept_matches_reference(kernel_backend, rng, vts, vocab, dtype):
    x, cand, indptr = make_verify_block(rng, vts, vocab, dtype)
    be = kernel_backend
    B = len(vts)
    m, nxt = poison(be.xp, B, np.int32), poison(be.xp, B, np.int32)
    greedy_accept(be, be.asarray(x), be.asarray(cand), be.asarray(indptr), m_out=m, next_out=nxt)
    m_ref, next_ref, _ = greedy_accept_ref(x, cand, indptr)
    np.testing.assert_array_equal(be.to_host(m), m_ref)
    np.testing.assert_array_equal(be.to_host(nxt), next_ref)


def test_greedy_accept_semantics(numpy_backend):
    """m counts accepted drafts; next is the argmax of column m (the bonus on a full accept)."""
    V = 10
    x = np.full((4, V), -1.0, np.float32)
    for j, t in enumerate([4, 7, 2, 9]):
        x[j, t] = 1.0
    for cand, m, nxt in [([0, 4, 7, 2], 3, 9), ([0, 4, 1, 2], 1, 7), ([0, 5, 7, 2], 0, 4)]:
        got = greedy_accept(numpy_backend, x, np.array(cand, np.int32), np.array([0, 4], np.int32))
        assert (int(got[0][0]), int(got[1][0])) == (m, nxt)


def test_greedy_accept_rejects_a_bad_indptr(kernel_backend):
    x = np.zeros((4, 10), np.float32)
    cand = np.zeros(4, np.int32)
    with pytest.raises(ShapeError, match="col_indptr must start at 0 and end at 4"):
        greedy_accept(kernel_backend, x, cand, np.array([0, 3], np.int32))
    with pytest.raises(ShapeError, match="non-decreasing"):
        greedy_accept(kernel_backend, x, cand, np.array([0, 3, 2, 4], np.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,nd,vocab,rank", [(1, 1, 258, 8), (3, 8, 1000, 32), (7, 4, 33, 5), (2, 7, 4097, 16)])
def test_markov_chain_matches_reference_exactly(kernel_backend, rng, B, nd, vocab, rank, dtype):
    be = kernel_backend
    logits = make_logits(rng, B * nd, vocab, dtype)
    w1 = rng.standard_normal((vocab, rank)).astype(np.float32)
    w2 = rng.standard_normal((rank, vocab)).astype(np.float32)
    anchors = rng.integers(0, vocab, B).astype(np.int32)
    out = poison(be.xp, (B, nd), np.int32)
    markov_chain(be, be.asarray(logits), be.asarray(w1), be.asarray(w2), anchors, nd, out=out)
    want, _ = markov_chain_ref(logits, w1, w2, anchors, nd)
    np.testing.assert_array_equal(be.to_host(out), want)


def test_markov_chain_follows_the_chain(numpy_backend):
    """Slot k's bias comes from the token chosen at slot k-1 (the anchor for slot 0)."""
    V, r = 6, 2
    w1 = np.zeros((V, r), np.float32)
    w2 = np.zeros((r, V), np.float32)
    for t in range(V):  # token t pushes toward t+1 (mod V) with a strong bias
        w1[t, t % r] = 1.0
    w2[0, [1, 3, 5]] = 10.0
    w2[1, [2, 4, 0]] = 10.0
    w2[0] *= np.array([0, 1, 0, 1.01, 0, 1.02], np.float32)
    w2[1] *= np.array([1.02, 0, 1.01, 0, 1.0, 0], np.float32)
    logits = np.zeros((3, V), np.float32)
    drafts = markov_chain(numpy_backend, logits, w1, w2, [0], 3)
    assert drafts.tolist() == [[5, 0, 5]]


def test_markov_chain_reports_nan(any_backend):
    logits = np.zeros((4, 10), np.float32)
    logits[2, 3] = np.nan
    w1, w2 = np.zeros((10, 2), np.float32), np.zeros((2, 10), np.float32)
    with pytest.raises(NonFiniteError, match="session 1 contains NaN"):
        markov_chain(any_backend, any_backend.asarray(logits), any_backend.asarray(w1), any_backend.asarray(w2),
                     [0, 0], 2)
