"""argmax_rows, greedy_accept and the Markov chain: kernels (simt, cuda) against the NumPy
reference, exactly, with rows split across CTAs (ties and NaN across slices, odd and misaligned
rows), and their launch plans."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from dspark.errors import NonFiniteError, ShapeError
from dspark.ops import rowsplit
from dspark.ops.argmax import (MARKOV_SLICE, argmax_plan, argmax_rows, argmax_rows_ref, greedy_accept,
                               greedy_accept_plan, greedy_accept_ref, markov_chain, markov_chain_plan,
                               markov_chain_ref, markov_splits)
from dspark.ops.rowsplit import SLICE, splits
from tests.conftest import poison
from tests.kernels.asan import assert_clean, run_asan

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
ASAN_FAMILIES = ["argmax", "sampling"]  # one instrumented build shared with test_sampling
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


# ---- row split: every row across ceil(V / SLICE) CTAs, merged exactly ------------------------------
FULL_V = 248320  # Qwen3.5's vocabulary: 31 slices


def tied_across_slices(rng, rows, vocab, dtype):
    """Coarse logits whose row maximum also sits at other indices in other slices: beside a slice
    boundary (b - 1 | b), in the first and last slices, or anywhere; the lowest index must win
    whichever CTA holds it."""
    x = make_logits(rng, rows, vocab, np.float32, ties=True)
    top = np.float32(x.max() + 1)
    S = splits(vocab)
    for r in range(rows):
        kind = r % 4
        if kind == 0 and S > 1:
            b = SLICE * int(rng.integers(1, S))
            x[r, [b, b - 1]] = top
        elif kind == 1:
            x[r, [vocab - 1, int(rng.integers(0, min(vocab, SLICE)))]] = top
        elif kind == 2:
            x[r, rng.choice(vocab, 3, replace=False)] = top
    return x.astype(dtype)


def misaligned(x, shift: int):
    """A C-contiguous copy of x whose first element lies `shift` bytes past a 16-byte boundary."""
    buf = np.empty(x.nbytes + 32, np.uint8)
    start = (-buf.ctypes.data) % 16 + shift
    out = buf[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def test_split_count_depends_on_the_vocabulary_alone():
    assert [splits(v) for v in (1, SLICE, SLICE + 1, 151936, FULL_V)] == [1, 1, 2, 19, 31]
    assert [markov_splits(v) for v in (1, MARKOV_SLICE, MARKOV_SLICE + 1, FULL_V)] == [1, 1, 2, 243]
    for V in (33, MARKOV_SLICE + 1, SLICE + 1, 151937, FULL_V):
        for B in (1, 2, 32):
            for plan in (argmax_plan(B, V), greedy_accept_plan(B, 8 * B, V)):
                assert plan.splits == splits(V), (plan.op, B, V)
            assert argmax_plan(B, V).launches[0].ctas == B * splits(V)
            assert greedy_accept_plan(B, 8 * B, V).launches[0].ctas == 8 * B * splits(V)
            chain = markov_chain_plan(B, 7, V, 32)
            assert chain.splits == markov_splits(V)
            assert [r.ctas for r in chain.launches] == ([B] if markov_splits(V) == 1 else [B * markov_splits(V)] * 7)


def test_plans_count_bytes():
    p = argmax_plan(2, FULL_V, 2)
    assert p.min_bytes == 2 * FULL_V * 2 + 2 * 4 and p.passes == 1 and p.ctas == 62
    assert p.bytes_read >= p.min_bytes - 8 and p.bytes >= p.min_bytes
    m = markov_chain_plan(1, 7, FULL_V, 32)
    assert m.notes["flops"] == 2 * 7 * 32 * FULL_V and m.passes == 7


class Recording:
    """An executor that records each launch (name, grid, block, shared_mem, args) and runs it."""

    def __init__(self, kernels):
        self.kernels, self.calls = kernels, []

    def get_function(self, name):
        fn = self.kernels.get_function(name)

        def call(grid, block, args, shared_mem=0):
            self.calls.append((name, grid, block, shared_mem, args))
            fn(grid, block, args, shared_mem=shared_mem)
        return call


def recording(be):
    rec = Recording(be.kernels)
    return rec, dataclasses.replace(be, kernels=rec)


def test_ops_launch_their_plans(simt, rng):
    V = 2 * SLICE + 100
    rec, be = recording(simt)
    x = make_logits(rng, 5, V, np.float32)
    argmax_rows(be, x)
    (name, grid, block, smem, _), = rec.calls
    run = argmax_plan(5, V).launches[0]
    assert (name, grid, block, smem) == ("argmax_rows_f32", (run.ctas,), (run.threads,), 0)
    rec.calls.clear()
    w1, w2 = np.zeros((V, 3), np.float32), np.zeros((3, V), np.float32)
    markov_chain(be, x[:4], w1, w2, [0, 1], 2)
    plan = markov_chain_plan(2, 2, V, 3)
    assert [(c[1], c[2], c[3], c[4][-1]) for c in rec.calls] == [
        ((r.ctas,), (r.threads,), r.shared_mem, np.int32(k)) for k, r in enumerate(plan.launches)]


def test_scratch_is_zero_at_rest_and_launches_replay(simt, rng):
    """The last CTA of each row puts its ticket back, so the pool stays zero and a recorded launch
    run again merges again (a ticket left counted would make an early CTA the 'last')."""
    x = tied_across_slices(rng, 6, 3 * SLICE + 5, np.float32)
    rec, be = recording(simt)
    out = poison(np, 6, np.int32)
    argmax_rows(be, x, out=out)
    want = argmax_rows_ref(x)[0]
    np.testing.assert_array_equal(out, want)
    assert not rowsplit.scratch(simt, 6)[0].any()
    for _ in range(2):
        out[...] = -7
        name, grid, block, smem, args = rec.calls[0]
        simt.kernels.get_function(name)(grid, block, args, shared_mem=smem)
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 32])
def test_argmax_full_vocab_matches_reference(kernel_backend, rng, rows, dtype):
    x = tied_across_slices(rng, rows, FULL_V, dtype)
    if rows > 3:
        x[3] = -np.inf  # index 0
    np.testing.assert_array_equal(run_argmax(kernel_backend, x), argmax_rows_ref(x)[0])


def test_nan_in_any_slice_is_flagged_never_chosen(kernel_backend, rng):
    be = kernel_backend
    V = 5 * SLICE + 77  # 6 slices, the last one short
    x = tied_across_slices(rng, 9, V, np.float32)
    for r in range(6):  # one NaN in slice r of row r, at the maximum's place in row 0
        lo = SLICE * r
        x[r, x[r].argmax() if r == 0 else lo + int(rng.integers(0, min(SLICE, V - lo)))] = np.nan
    x[6] = np.nan  # nothing but NaN: -1
    x[7, [V - 1, 3]] = np.nan
    out = poison(be.xp, 9, np.int32)
    with pytest.raises(NonFiniteError, match=r"row 0 contains NaN \(8 rows in all\)"):
        argmax_rows(be, be.asarray(x), out=out)
    got, (want, flag) = be.to_host(out), argmax_rows_ref(x)
    np.testing.assert_array_equal(got, want)
    assert got[6] == -1 and flag.tolist() == [1] * 8 + [0]


def test_greedy_accept_full_vocab_batch_32(kernel_backend, rng):
    """32 sessions at V = 248320, some empty; where a column's maximum is tied across slices the
    candidate names the later index, which is a mismatch."""
    be = kernel_backend
    vts = rng.integers(1, 4, 32)
    vts[[5, 31]] = 0
    x, cand, indptr = make_verify_block(rng, list(vts), FULL_V, np.float32, accept_prob=0.8)
    top = x.max() + 1
    for b in range(0, 32, 3):
        c0, vt = indptr[b], vts[b]
        if vt >= 2:
            j = int(rng.integers(0, vt - 1))
            x[c0 + j, [SLICE * 7 + 2, SLICE * 20]] = top
            cand[c0 + j + 1] = SLICE * 20
    m, nxt = poison(be.xp, 32, np.int32), poison(be.xp, 32, np.int32)
    greedy_accept(be, be.asarray(x), be.asarray(cand), be.asarray(indptr), m_out=m, next_out=nxt)
    m_ref, next_ref, _ = greedy_accept_ref(x, cand, indptr)
    np.testing.assert_array_equal(be.to_host(m), m_ref)
    np.testing.assert_array_equal(be.to_host(nxt), next_ref)
    assert m_ref[5] == -1 and m_ref[31] == -1 and (next_ref == SLICE * 7 + 2).any()


def test_greedy_accept_reports_nan_only_in_examined_columns(kernel_backend, rng):
    be = kernel_backend
    V = 2 * SLICE + 9
    x, cand, indptr = make_verify_block(rng, [3, 2], V, np.float32, accept_prob=0.0)
    cand[1] = x[0].argmax() + 1  # session 0 stops at column 0
    x[2, 2 * SLICE + 3] = np.nan  # never examined
    m, nxt = greedy_accept(be, be.asarray(x), be.asarray(cand), be.asarray(indptr))
    assert be.to_host(m).tolist() == [0, 0]
    x[3, SLICE + 1] = np.nan  # examined: session 1's first column
    with pytest.raises(NonFiniteError, match="session 1 contains NaN"):
        greedy_accept(be, be.asarray(x), be.asarray(cand), be.asarray(indptr))


def coarse_markov_head(rng, vocab, rank):
    """w1, w2 on a 1/4 grid with many zeros: biases are exact small sums, so ties survive."""
    w1 = (rng.integers(-2, 3, (vocab, rank)) * (rng.random((vocab, rank)) < 0.5) / 4).astype(np.float32)
    w2 = (rng.integers(-2, 3, (rank, vocab)) * (rng.random((rank, vocab)) < 0.3) / 4).astype(np.float32)
    return w1, w2


@pytest.mark.parametrize("dtype", DTYPES)
def test_markov_chain_full_vocab_matches_reference(kernel_backend, rng, dtype):
    be = kernel_backend
    B, nd, rank = 2, 3, 4
    logits = tied_across_slices(rng, B * nd, FULL_V, dtype)
    w1, w2 = coarse_markov_head(rng, FULL_V, rank)
    anchors = rng.integers(0, FULL_V, B).astype(np.int32)
    out = poison(be.xp, (B, nd), np.int32)
    markov_chain(be, be.asarray(logits), be.asarray(w1), be.asarray(w2), anchors, nd, out=out)
    np.testing.assert_array_equal(be.to_host(out), markov_chain_ref(logits, w1, w2, anchors, nd)[0])


WHOLE_ELEMENT_SHIFTS = [(d, s) for d in DTYPES for s in (0, 2, 4, 8) if s % np.dtype(d).itemsize == 0]


@pytest.mark.parametrize("dtype, shift", WHOLE_ELEMENT_SHIFTS)
def test_odd_vocab_on_misaligned_rows(simt, rng, dtype, shift):
    """V = 151937 puts consecutive rows at every offset from a 16-byte boundary, and the array
    itself starts `shift` bytes past one (a whole number of elements): vector loads cover the
    aligned middle of each slice, the head and tail go entry by entry (simt faults on a
    misaligned vector load)."""
    V = 151937
    x = misaligned(tied_across_slices(rng, 5, V, dtype), shift)
    np.testing.assert_array_equal(run_argmax(simt, x), argmax_rows_ref(x)[0])
    cand = np.array([0, int(x[0].argmax()), 5, 0, 0], np.int32)
    indptr = np.array([0, 3, 5], np.int32)
    m, nxt = greedy_accept(simt, x, cand, indptr)
    want = greedy_accept_ref(x, cand, indptr)
    assert (m.tolist(), nxt.tolist()) == (want[0].tolist(), want[1].tolist())
    w1, w2 = coarse_markov_head(rng, V, 3)
    got = markov_chain(simt, x[:4], w1, misaligned(w2, 4), [1, 2], 2)
    np.testing.assert_array_equal(got, markov_chain_ref(x[:4], w1, w2, [1, 2], 2)[0])


def test_greedy_accept_blocks_longer_than_a_merge_chunk(kernel_backend, rng):
    """The last CTA merges 64 columns at a time: full accepts of 70 and 65 columns, a mismatch in
    the second chunk, one right at its start."""
    be = kernel_backend
    vts = [70, 65, 69, 66]
    x, cand, indptr = make_verify_block(rng, vts, SLICE + 5, ml_dtypes.bfloat16, accept_prob=1.0)
    best = argmax_rows_ref(x)[0]
    cand[indptr[2] + 67] = best[indptr[2] + 66] + 1  # column 66 mismatches
    cand[indptr[3] + 65] = best[indptr[3] + 64] + 1  # column 64, the first of the second chunk
    m, nxt = greedy_accept(be, be.asarray(x), be.asarray(cand), be.asarray(indptr))
    assert be.to_host(m).tolist() == [69, 64, 66, 64]
    np.testing.assert_array_equal(be.to_host(nxt), greedy_accept_ref(x, cand, indptr)[1])


def test_asan_clean():
    """Partials, tickets and the walk over merged columns stay in bounds, split or not."""
    r = run_asan("""
    from dspark.ops.argmax import *
    rng = np.random.default_rng(3)
    for V in (300, 2 * 8192 + 3):
        x = rng.standard_normal((7, V)).astype(np.float32)
        assert (argmax_rows(be, x) == argmax_rows_ref(x)[0]).all()
        cand, indptr = rng.integers(0, V, 7).astype(np.int32), np.array([0, 0, 3, 3, 7, 7], np.int32)
        got, want = greedy_accept(be, x, cand, indptr), greedy_accept_ref(x, cand, indptr)
        assert all((g == w).all() for g, w in zip(got, want))
        w1, w2 = rng.standard_normal((V, 3)).astype(np.float32), rng.standard_normal((3, V)).astype(np.float32)
        assert (markov_chain(be, x[:6], w1, w2, [1, 2], 3) == markov_chain_ref(x[:6], w1, w2, [1, 2], 3)[0]).all()
    print("ok")
    """, families=ASAN_FAMILIES)
    assert_clean(r)
    assert "ok" in r.stdout


# ---- ties among the entries one thread scans -------------------------------------------------------
# A thread scans its slice's scalar head and tail entries first, then its vectors (16 bytes each,
# blockDim.x vectors apart) in increasing order, so a per-thread scan that keeps the first (or the
# last) of equal values returns a higher index whenever the row maximum recurs inside one
# thread's entries. Each kind of row below puts it there at every V; row 0 of each batch starts on
# a 16-byte boundary, so its slices have tails (V % (16 / itemsize) != 0) that thread 0 scans first.
TIE_VOCABS = [3079, 2 * SLICE + 13, FULL_V]   # one slice; a 13-entry last slice; Qwen3.5's 31 slices
TIE_KINDS = ["all-equal", "last-slice-tied", "half-tied", "all-neg-inf"]
TIE_ROWS = 8                                  # every offset of a row from a 16-byte boundary (V odd)


def tied_within_threads(rng, kind, rows, vocab, dtype):
    """rows x vocab logits whose maximum recurs inside each thread's entries, and the lowest index
    of it per row (which the reference must agree with)."""
    top = np.float32(rng.integers(-4, 5) / 2)
    below = (top - 0.5 - np.abs(np.round(rng.standard_normal((rows, vocab)) * 2) / 2)).astype(np.float32)
    if kind == "all-equal":
        x, want = np.full((rows, vocab), top, np.float32), np.zeros(rows, np.int64)
    elif kind == "last-slice-tied":  # ties the whole (short) last slice; its first entry wins
        x = below
        x[:, SLICE * (splits(vocab) - 1):] = top
        want = np.full(rows, SLICE * (splits(vocab) - 1))
    elif kind == "half-tied":
        x = np.where(rng.random((rows, vocab)) < 0.5, top, below).astype(np.float32)
        want = (x == top).argmax(axis=1)
    else:
        x, want = np.full((rows, vocab), -np.inf, np.float32), np.zeros(rows, np.int64)
    x = x.astype(dtype)
    np.testing.assert_array_equal(argmax_rows_ref(x)[0], want)
    return x, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", TIE_VOCABS)
def test_argmax_ties_within_one_threads_entries(kernel_backend, rng, vocab, dtype):
    for kind in TIE_KINDS:
        x, want = tied_within_threads(rng, kind, TIE_ROWS, vocab, dtype)
        np.testing.assert_array_equal(run_argmax(kernel_backend, x), want, err_msg=kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", TIE_VOCABS)
def test_greedy_accept_ties_within_one_threads_entries(kernel_backend, rng, vocab, dtype):
    """Candidates that follow every column's lowest tied index: a full accept, so every column's
    argmax is examined; then a candidate naming a later tied index: a mismatch there."""
    be = kernel_backend
    indptr = np.array([0, 3, TIE_ROWS], np.int32)
    for kind in TIE_KINDS:
        x, want = tied_within_threads(rng, kind, TIE_ROWS, vocab, dtype)
        cand = np.zeros(TIE_ROWS, np.int32)
        for b in range(2):
            cand[indptr[b] + 1: indptr[b + 1]] = want[indptr[b]: indptr[b + 1] - 1]
        m, nxt = greedy_accept(be, be.asarray(x), be.asarray(cand), be.asarray(indptr))
        assert (be.to_host(m).tolist(), be.to_host(nxt).tolist()) == ([2, 4], [want[2], want[7]]), kind
        if kind != "all-neg-inf":
            later = np.flatnonzero(x[4].astype(np.float32) == x[4].astype(np.float32).max())[-1]
            cand[5] = later  # column 4's argmax is want[4] < later
            m, nxt = greedy_accept(be, be.asarray(x), be.asarray(cand), be.asarray(indptr))
            assert (be.to_host(m).tolist(), be.to_host(nxt).tolist()) == ([2, 1], [want[2], want[4]]), kind


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", TIE_VOCABS)
def test_markov_chain_ties_within_one_threads_entries(kernel_backend, rng, vocab, dtype):
    """A Markov head whose bias is exactly 0 keeps every tie of the slot logits."""
    be = kernel_backend
    B, nd = 2, TIE_ROWS // 2
    w1, w2 = rng.standard_normal((vocab, 1)).astype(np.float32), np.zeros((1, vocab), np.float32)
    anchors = rng.integers(0, vocab, B).astype(np.int32)
    for kind in TIE_KINDS:
        x, want = tied_within_threads(rng, kind, B * nd, vocab, dtype)
        out = poison(be.xp, (B, nd), np.int32)
        markov_chain(be, be.asarray(x), be.asarray(w1), be.asarray(w2), anchors, nd, out=out)
        np.testing.assert_array_equal(be.to_host(out).ravel(), want, err_msg=kind)
        np.testing.assert_array_equal(markov_chain_ref(x, w1, w2, anchors, nd)[0].ravel(), want, err_msg=kind)
