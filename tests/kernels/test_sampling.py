"""Filtered sampling and the speculative accept: kernels (simt, cuda) against the NumPy reference
bit for bit, the documented filter semantics, and chi-square checks (each paired with a broken
sampler that fails them) that the draws follow the filtered softmax and that speculative accept
is lossless."""

import zlib

import ml_dtypes
import numpy as np
import pytest
from scipy import stats

import dspark
from dspark import philox
from dspark.errors import CapacityError, DTypeError, NonFiniteError, ShapeError, TokenRangeError
from dspark.ops import rowsplit, sampling
from dspark.ops.rowsplit import SLICE, splits
from dspark.ops.sampling import (Filters, SamplingParamError, Source, Streams, accept_plan, filtered_probs,
                                 sample_filtered, sample_filtered_ref, sample_plan, speculative_accept,
                                 speculative_accept_ref)
from dspark.philox import Tag
from tests.conftest import poison
from tests.kernels.asan import assert_clean, run_asan
from tests.kernels.test_argmax import ASAN_FAMILIES, misaligned

f32, u32 = np.float32, np.uint32
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
SHAPES = [(1, 1), (1, 151936), (3, 258), (7, 1000), (19, 31), (4, 33), (2, 4097)]
METHODS = ["gumbel", "inverse_cdf"]
P_MIN = 1e-3    # chi-square acceptance threshold
DRAWS = 20_000
NUMPY = dspark.get_backend("numpy")


# ---- inputs -------------------------------------------------------------------------------------
def make_logits(rng, rows, vocab, dtype=np.float32, ties=True):
    """Coarse logits (many exact ties, at the max too), some -inf entries, and (rows > 2) an
    all-equal row."""
    x = rng.standard_normal((rows, vocab)) * 3
    if ties:
        x = np.round(x * 4) / 4
    x[rng.random((rows, vocab)) < 0.05] = -np.inf
    x[np.arange(rows), rng.integers(0, vocab, rows)] = 1.0  # at least one finite logit per row
    if rows > 2:
        x[1] = 0.5
    return x.astype(dtype)


def mixed_filters(rng, rows, vocab):
    """Every row its own settings: greedy, tiny temperatures, top-k at and around its limits,
    top-p near 0 and 1, min-p up to 1."""
    pick = lambda opts: np.asarray(opts)[rng.integers(0, len(opts), rows)]  # noqa: E731
    return Filters.full(rows,
                        temperature=pick([0.0, 0.05, 0.7, 1.0, 2.5]),
                        top_k=pick([0, 1, 2, max(1, vocab // 3), vocab - 1, vocab, vocab + 5]),
                        top_p=pick([1.0, 1.0, 0.95, 0.5, 1e-7]),
                        min_p=pick([0.0, 0.0, 0.02, 0.5, 1.0]))


def random_streams(rng, rows, tag=Tag.DRAFT):
    return Streams.full(rows, seed=rng.integers(0, 2**64, rows, dtype=np.uint64),
                        counter=rng.integers(0, 2**64, rows, dtype=np.uint64), tag=tag,
                        slot=rng.integers(0, 16, rows))


def filters_on(be, f: Filters) -> Filters:
    return Filters(*(be.asarray(a) for a in (f.temperature, f.top_k, f.top_p, f.min_p)))


def streams_on(be, s: Streams) -> Streams:
    return Streams(be.asarray(s.seed), be.asarray(s.counter), be.asarray(s.stream))


def draw(be, x, filters, streams, method="gumbel", dist=True):
    """(token, prob, dist) on host, outputs poisoned before the launch."""
    rows, vocab = x.shape
    token, prob = poison(be.xp, rows, np.int32), poison(be.xp, rows, f32)
    d = poison(be.xp, (rows, vocab), f32) if dist else None
    sample_filtered(be, be.asarray(x), filters_on(be, filters), streams_on(be, streams), method, token, prob, d)
    return be.to_host(token), be.to_host(prob), be.to_host(d) if dist else None


def assert_bitwise(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype.kind == "f":
        got, want = got.view(u32), want.view(u32)
    np.testing.assert_array_equal(got, want, err_msg=what)


# ---- kernels against the reference --------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_sample_filtered_matches_reference(kernel_backend, rng, rows, vocab, dtype, method):
    x = make_logits(rng, rows, vocab, dtype)
    f, s = mixed_filters(rng, rows, vocab), random_streams(rng, rows)
    token, prob, dist = draw(kernel_backend, x, f, s, method)
    ref = sample_filtered_ref(x, f, s, method, with_dist=True)
    assert_bitwise(token, ref["token"], "token")
    assert_bitwise(prob, ref["prob"], "prob")
    assert_bitwise(dist, ref["dist"], "dist")
    assert (token >= 0).all() and (token < vocab).all()
    assert_bitwise(prob, dist[np.arange(rows), token], "prob is dist[token]")


@pytest.mark.parametrize("rows,vocab", [(5, 151936), (6, 517)])
def test_heavy_filters_on_wide_rows_match_reference(kernel_backend, rng, rows, vocab):
    """All radix passes over long rows: top-k in the thousands, top-p near 1, no ties."""
    x = (rng.standard_normal((rows, vocab)) * 2).astype(f32)
    f = Filters.full(rows, temperature=rng.uniform(0.5, 1.5, rows), top_k=rng.integers(vocab // 4, vocab, rows),
                     top_p=rng.uniform(0.8, 0.999, rows), min_p=[0, 1e-5, 0, 1e-3, 0, 0][:rows])
    s = random_streams(rng, rows)
    for method in METHODS:
        token, prob, dist = draw(kernel_backend, x, f, s, method)
        ref = sample_filtered_ref(x, f, s, method, with_dist=True)
        assert_bitwise(token, ref["token"], method)
        assert_bitwise(dist, ref["dist"], method)


def test_filtered_probs_matches_sample_dist(any_backend, rng):
    be = any_backend
    x = make_logits(rng, 6, 300)
    f = mixed_filters(rng, 6, 300)
    out = poison(be.xp, (6, 300), f32)
    got = be.to_host(filtered_probs(be, be.asarray(x), filters_on(be, f), out=out))
    assert_bitwise(got, sample_filtered_ref(x, f, random_streams(rng, 6), with_dist=True)["dist"], "dist")
    np.testing.assert_allclose(got.astype(np.float64).sum(axis=1), 1.0, atol=1e-5)


def test_empty_batch(any_backend):
    token, prob, dist = draw(any_backend, np.zeros((0, 10), f32), Filters.full(0), random_streams(
        np.random.default_rng(0), 0))
    assert token.shape == (0,) and dist.shape == (0, 10)


def test_random_schedule_still_matches(simt, rng):
    """Threads run in a random order between barriers: a missing barrier would show. One CTA per
    row (V = 1000) and three (V = 2 * SLICE + 3)."""
    x = make_logits(rng, 5, 1000)
    f = Filters.full(5, temperature=1.0, top_k=[0, 3, 400, 999, 1], top_p=[0.9, 1, 0.5, 0.99, 1], min_p=0.01)
    s = random_streams(rng, 5)
    wide = make_logits(rng, 2, 2 * SLICE + 3)
    fw, sw = Filters.full(2, temperature=[0.9, 0.0], top_k=[300, 0], top_p=[0.8, 1.0]), random_streams(rng, 2)
    b = accept_batch(rng, [3, 0, 8, 1], 600)
    bw = accept_batch(rng, [2, 1], 2 * SLICE + 3)
    for seed in (1, 2, 3):
        with simt.kernels.schedule(seed):
            for method in METHODS:
                for xs, fs, ss in ((x, f, s), (wide, fw, sw)):
                    token, _, dist = draw(simt, xs, fs, ss, method)
                    ref = sample_filtered_ref(xs, fs, ss, method, with_dist=True)
                    assert_bitwise(token, ref["token"], method)
                    assert_bitwise(dist, ref["dist"], method)
            assert_accept_matches(simt, b)
            assert_accept_matches(simt, bw)


def test_asan_clean():
    script = """
    from dspark.ops.sampling import *
    from dspark.philox import Tag
    import ml_dtypes
    nb = dspark.get_backend("numpy")
    rng = np.random.default_rng(5)
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
        for rows, V in ((3, 37), (2, 1000), (2, 2 * 8192 + 3)):  # the last: 3 CTAs per row
            x = (rng.standard_normal((rows, V)) * 3).astype(dt)
            f = Filters.full(rows, temperature=[0.0, 1.0, 0.5][:rows], top_k=[0, 5, 900][:rows],
                             top_p=[1, 0.8, 0.9][:rows], min_p=[0, 0.01, 0][:rows])
            s = Streams.full(rows, 7, np.arange(rows), Tag.DRAFT, 1)
            for m in ("gumbel", "inverse_cdf"):
                d = np.empty((rows, V), np.float32)
                got = sample_filtered(be, x, f, s, m, dist_out=d)
                want = sample_filtered(nb, x, f, s, m)
                assert all(np.array_equal(a, b) for a, b in zip(got, want)), m
            filtered_probs(be, x, f)
    V = 50
    q = filtered_probs(nb, rng.standard_normal((9, V)).astype(np.float32), Filters.full(9, top_k=10))
    p = filtered_probs(nb, rng.standard_normal((13, V)).astype(np.float32), Filters.full(13))
    p[4] = q[2]   # session 2 accepts its first draft for sure
    indptr = np.array([0, 2, 2, 8, 9], np.int32)
    drafts = np.array([np.argmax(r) for r in q], np.int32)
    got = speculative_accept(be, drafts, indptr, q, p, np.arange(4, dtype=np.uint64), np.ones(4, np.uint64))
    want = speculative_accept(nb, drafts, indptr, q, p, np.arange(4, dtype=np.uint64), np.ones(4, np.uint64))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    V = 8192 + 9
    q = filtered_probs(nb, rng.standard_normal((3, V)).astype(np.float32), Filters.full(3, top_k=50))
    p = filtered_probs(nb, rng.standard_normal((5, V)).astype(np.float32), Filters.full(5))
    indptr, drafts = np.array([0, 2, 3], np.int32), np.array([np.argmax(r) for r in q], np.int32)
    got = speculative_accept(be, drafts, indptr, q, p, np.arange(2, dtype=np.uint64), np.ones(2, np.uint64))
    want = speculative_accept(nb, drafts, indptr, q, p, np.arange(2, dtype=np.uint64), np.ones(2, np.uint64))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    philox_random(be, np.zeros((300, 4), np.uint32), np.ones((300, 2), np.uint32))
    from dspark.ops.coupled import coupled_accept
    vts, V = [33, 1, 0, 5], 8192 + 9   # a warp's worth of columns and more; an empty session
    cols = sum(vts)
    x = rng.standard_normal((cols, V)).astype(np.float32)
    f, s = Filters.full(cols, temperature=0.9, top_k=40), Streams.full(cols, 3, np.arange(cols) + 10, Tag.PICK)
    cand, indptr = rng.integers(0, V, cols).astype(np.int32), np.array([0, 33, 34, 34, 39], np.int32)
    got = coupled_accept(be, x, cand, indptr, f, s)
    want = coupled_accept(nb, x, cand, indptr, f, s)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    print("ok")
    """
    r = run_asan(script, families=ASAN_FAMILIES)
    assert_clean(r)
    assert "ok" in r.stdout


# ---- semantics ----------------------------------------------------------------------------------
def kept_set(be, x, **settings):
    dist = filtered_probs(be, be.asarray(np.asarray([x], f32)), filters_on(be, Filters.full(1, **settings)))
    return set(np.flatnonzero(be.to_host(dist)[0]).tolist())


def test_filter_semantics(any_backend):
    be = any_backend
    lp = np.log([0.4, 0.3, 0.2, 0.1])
    # top-k keeps every tie at its boundary
    assert kept_set(be, [3, 2, 2, 2, 1], top_k=2) == {0, 1, 2, 3}
    assert kept_set(be, [3, 2, 2, 2, 1], top_k=1) == {0}
    # top-p: the smallest prefix reaching p of the mass, ties at the boundary together
    assert kept_set(be, lp, top_p=0.65) == {0, 1}
    assert kept_set(be, lp, top_p=0.75) == {0, 1, 2}
    assert kept_set(be, [1, 1, 1, 0], top_p=0.3) == {0, 1, 2}
    # top-p renormalises after top-k: of [4/7, 3/7], 0.55 needs one token (0.55 of all would need two)
    assert kept_set(be, lp, top_k=2, top_p=0.55) == {0}
    # min-p: p_i >= m * p_max
    assert kept_set(be, lp, min_p=0.6) == {0, 1}
    assert kept_set(be, lp, min_p=0.3) == {0, 1, 2}
    # temperature sharpens before min-p: (0.2/0.4)^(1/0.5) = 0.25
    assert kept_set(be, lp, temperature=0.5, min_p=0.26) == {0, 1}
    # the implicit 2^-32 floor
    assert kept_set(be, [0, -22.0, -23.0]) == {0, 1}


def filtered_softmax64(x, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """An independent float64 reading of the documented semantics (for logits without ties),
    and the smallest distance of any threshold decision from its boundary."""
    x = np.asarray(x, np.float64)
    w = np.exp((x - x.max()) / temperature)
    keep = np.ones(len(x), bool)
    margin = np.inf
    if 0 < top_k < len(x):
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1:
        order = np.argsort(-np.where(keep, w, -1))[: keep.sum()]
        frac = np.cumsum(w[order]) / w[order].sum()
        n = int(np.searchsorted(frac, top_p)) + 1
        margin = np.abs(frac - top_p).min()
        keep[order[n:]] = False
    if min_p > 0:
        margin = min(margin, np.abs(w - min_p).min())
        keep &= w >= min_p
    prob = np.where(keep, w, 0)
    return prob / prob.sum(), margin


SETTINGS = [  # (V, temperature, top_k, top_p, min_p)
    (8, 1.0, 0, 1.0, 0.0),
    (20, 0.7, 5, 1.0, 0.0),
    (30, 1.3, 0, 0.8, 0.0),
    (50, 1.0, 0, 1.0, 0.1),
    (40, 0.9, 10, 0.7, 0.05),
]


def stats_case(rng, vocab, temperature, top_k, top_p, min_p, draws=DRAWS):
    """A logit row whose filtered distribution keeps >= 3 tokens with every threshold decision
    clear of its boundary, repeated over `draws` rows with distinct counters."""
    while True:
        x = (rng.standard_normal(vocab) * 1.5).astype(f32)
        prob, margin = filtered_softmax64(x, temperature, top_k, top_p, min_p)
        if margin > 1e-3 and (prob > 0).sum() >= 3:
            break
    f = Filters.full(draws, temperature, top_k, top_p, min_p)
    s = Streams.full(draws, rng.integers(0, 2**64, dtype=np.uint64), np.arange(draws) * 7919, Tag.PICK)
    return np.broadcast_to(x, (draws, vocab)), f, s, prob


@pytest.fixture
def stats_rng(request):
    """Statistical checks run on pinned seeds (one per test id): at p > 0.001 a correct sampler
    would otherwise fail about once in a thousand runs by chance. The paired mutation tests show
    that the same checks do fail a broken sampler."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def chi2_pvalue(tokens, prob):
    """Chi-square p-value of the draws against `prob`; 0 if any draw falls outside its support."""
    counts = np.bincount(tokens, minlength=len(prob))
    if counts[prob == 0].any():
        return 0.0
    live = prob > 0
    return stats.chisquare(counts[live], prob[live] / prob[live].sum() * len(tokens)).pvalue


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("setting", SETTINGS, ids=[f"V{s[0]}-t{s[1]}-k{s[2]}-p{s[3]}-m{s[4]}" for s in SETTINGS])
def test_draws_follow_the_filtered_softmax(numpy_backend, simt, stats_rng, setting, method):
    """20k draws (one per row, distinct counters) against the float64 filtered softmax; the
    kernel reproduces the reference's draws bit for bit on a slice of them."""
    x, f, s, prob = stats_case(stats_rng, *setting)
    token, _ = sample_filtered(numpy_backend, x, f, s, method)
    assert chi2_pvalue(token, prob) > P_MIN
    n = 128
    head = Filters(*(a[:n] for a in (f.temperature, f.top_k, f.top_p, f.min_p)))
    got = draw(simt, np.ascontiguousarray(x[:n]), head, Streams(s.seed[:n], s.counter[:n], s.stream[:n]), method,
               dist=False)[0]
    np.testing.assert_array_equal(got, token[:n])


def without_renormalisation(orig):
    """Broken top-p: the mass is taken over every token instead of the top-k survivors."""
    return lambda w, in_k, p: orig(w, np.ones_like(in_k), p)


def exponential_noise(x):
    """Broken Gumbel-max: Exp(1) noise -log(u) instead of -log(-log(u))."""
    return -philox.log_f32(philox.uniform_open(x))


@pytest.mark.parametrize("method,setting,mutation", [
    ("gumbel", SETTINGS[4], "renorm"), ("inverse_cdf", SETTINGS[4], "renorm"), ("gumbel", SETTINGS[0], "noise")])
def test_broken_sampler_fails_the_same_check(numpy_backend, stats_rng, monkeypatch, method, setting, mutation):
    """Pinned seeds, as the checks they pair with: on some logit rows the broken top-p keeps the
    same tokens as the right one (top-k or min-p decide), and a random row would pass by chance."""
    x, f, s, prob = stats_case(stats_rng, *setting)
    if mutation == "renorm":
        monkeypatch.setattr(sampling, "_top_p_threshold", without_renormalisation(sampling._top_p_threshold))
    else:
        monkeypatch.setattr(philox, "gumbel", exponential_noise)
    token, _ = sample_filtered(numpy_backend, x, f, s, method)
    assert chi2_pvalue(token, prob) < P_MIN


@pytest.mark.parametrize("method", METHODS)
def test_argmax_edge_cases(kernel_backend, rng, method):
    """top-k = 1, top-p near 0, min-p = 1, the smallest temperature and a row with all mass on
    one token give the argmax (and probability 1) whatever the counter; temperature 0 is greedy
    with lowest-index ties."""
    rows, vocab = 64, 77
    x = (rng.standard_normal((rows, vocab)) * 2).astype(f32)
    best = x.argmax(axis=1)
    s = random_streams(rng, rows)
    tiny = float(np.finfo(f32).tiny)  # the smallest temperature allowed: 1/T is still finite
    for settings in (dict(top_k=1), dict(top_p=1e-7), dict(min_p=1.0), dict(temperature=0.0),
                     dict(temperature=tiny)):
        token, prob, dist = draw(kernel_backend, x, Filters.full(rows, **{"temperature": 1.3, **settings}), s, method)
        np.testing.assert_array_equal(token, best, err_msg=str(settings))
        assert (prob == 1).all() and (dist.sum(axis=1) == 1).all()
    lone = np.full((rows, vocab), -np.inf, f32)
    lone[np.arange(rows), best] = 0.0
    lone[:8, :] = -200.0   # the others far below the 2^-32 floor
    lone[np.arange(8), best[:8]] = 0.0
    token, prob, _ = draw(kernel_backend, lone, Filters.full(rows, temperature=2.0, top_p=0.9), s, method)
    np.testing.assert_array_equal(token, best)
    assert (prob == 1).all()
    tied = np.zeros((3, vocab), f32)
    tied[:, [40, 7, 70]] = 5.0
    token, prob, dist = draw(kernel_backend, tied, Filters.full(3, temperature=0.0), random_streams(rng, 3), method)
    assert token.tolist() == [7, 7, 7] and (dist[:, 7] == 1).all()


def test_same_seed_and_counter_same_token_in_any_batch(kernel_backend, rng):
    """A row's draw depends only on its own logits, settings, seed, counter and stream."""
    be = kernel_backend
    rows, vocab = 7, 500
    x = make_logits(rng, rows, vocab, ties=False)
    f = Filters.full(rows, temperature=1.1, top_k=[0, 50, 0, 400, 2, 0, 100], top_p=[1, 0.9, 0.7, 1, 1, 0.95, 0.99])
    s = random_streams(rng, rows)
    sel = lambda a, i: np.ascontiguousarray(np.asarray(a)[i])  # noqa: E731
    for method in METHODS:
        full = draw(be, x, f, s, method)
        again = draw(be, x, f, s, method)
        assert_bitwise(again[0], full[0], "repeat")
        for idx in ([3], [6, 3, 0], list(range(rows))[::-1]):
            part = draw(be, sel(x, idx), Filters(*(sel(a, idx) for a in (f.temperature, f.top_k, f.top_p, f.min_p))),
                        Streams(*(sel(a, idx) for a in (s.seed, s.counter, s.stream))), method)
            assert_bitwise(part[0], full[0][idx], f"rows {idx}")
            assert_bitwise(part[2], full[2][idx], f"rows {idx}")
    # another counter (or tag) is another draw
    moved = Streams(s.seed, s.counter + np.uint64(1), s.stream)
    many = Filters.full(rows, temperature=50.0)
    assert not np.array_equal(draw(be, x, many, s)[0], draw(be, x, many, moved)[0])


# ---- speculative accept -------------------------------------------------------------------------
def normalised(rng, rows, vocab, top_k=0, scale=1.0):
    """Filtered distributions of random logits (float32 rows summing to 1)."""
    return filtered_probs(NUMPY, (rng.standard_normal((rows, vocab)) * scale).astype(f32),
                          Filters.full(rows, top_k=top_k))


def pick_rows(rng, prob_rows):
    """One token from each float32 row (as float64, renormalised) by inverse CDF."""
    cdf = np.cumsum(prob_rows.astype(np.float64), axis=1)
    cdf /= cdf[:, -1:]
    return (cdf < rng.random((len(cdf), 1))).sum(axis=1).astype(np.int32)


def rough_dists(rng, rows, vocab, keep=1.0):
    """Random float32 distributions without the filter pipeline (quick at any V): a fraction
    `keep` of each row nonzero."""
    w = rng.random((rows, vocab)) ** 8 * (rng.random((rows, vocab)) < keep)
    w[np.arange(rows), rng.integers(0, vocab, rows)] += 1e-3
    return (w / w.sum(axis=1, keepdims=True)).astype(f32)


def accept_batch(rng, nds, vocab, rough=False):
    """A ragged batch: drafts drawn from q, target rows p (each session's own), seeds, counters.
    q and p are filtered distributions, or `rough_dists` (for wide rows)."""
    B = len(nds)
    indptr = np.concatenate([[0], np.cumsum(nds)]).astype(np.int32)
    if rough:
        q, p = rough_dists(rng, int(indptr[-1]), vocab, keep=0.25), rough_dists(rng, int(indptr[-1]) + B, vocab)
    else:
        q = normalised(rng, int(indptr[-1]), vocab, top_k=max(2, vocab // 4))
        p = normalised(rng, int(indptr[-1]) + B, vocab)
    drafts = pick_rows(rng, q) if len(q) else np.zeros(0, np.int32)
    return dict(drafts=drafts, draft_indptr=indptr, q=q, p=p,
                seed=rng.integers(0, 2**64, B, dtype=np.uint64), counter=rng.integers(0, 2**64, B, dtype=np.uint64))


def accept(be, b):
    B = len(b["draft_indptr"]) - 1
    outs = [poison(be.xp, B, np.int32) for _ in range(3)]
    args = [be.asarray(b[k]) for k in ("drafts", "draft_indptr", "q", "p", "seed", "counter")]
    speculative_accept(be, *args, *outs)
    return [be.to_host(o) for o in outs]


def assert_accept_matches(be, b):
    got = accept(be, b)
    want = speculative_accept_ref(**b)
    for name, g in zip(("m", "next", "source"), got):
        np.testing.assert_array_equal(g, want[name], err_msg=name)
    assert not want["status"].any()
    return got


@pytest.mark.parametrize("nds,vocab", [([2], 8), ([3, 0, 8, 1, 5, 2, 7], 1000), ([0, 0], 33), ([4, 33], 151936),
                                       ([1] * 40, 31), ([40, 1], 258)])
def test_accept_matches_reference(kernel_backend, rng, nds, vocab):
    b = accept_batch(rng, nds, vocab)
    m, nxt, source = assert_accept_matches(kernel_backend, b)
    nd = np.array(nds)
    assert ((m >= 0) & (m <= nd)).all() and ((nxt >= 0) & (nxt < vocab)).all()
    np.testing.assert_array_equal(source == Source.BONUS, m == nd)


def test_accept_empty_batch(kernel_backend):
    b = accept_batch(np.random.default_rng(0), [], 10)
    assert [a.shape for a in accept(kernel_backend, b)] == [(0,)] * 3


def test_accept_edge_cases(any_backend, rng):
    be = any_backend
    vocab, nd = 40, 5
    b = accept_batch(rng, [nd] * 6, vocab)
    # q == p: everything is accepted, the bonus comes from the last column
    same = dict(b, p=b["p"].copy())
    for s in range(6):
        same["p"][s * (nd + 1): s * (nd + 1) + nd] = b["q"][s * nd:(s + 1) * nd]
    m, _, source = accept(be, same)
    assert (m == nd).all() and (source == Source.BONUS).all()
    # q with support disjoint from p: the first draft is rejected, next comes from p_0
    disjoint = dict(b, q=np.zeros_like(b["q"]), p=np.zeros_like(b["p"]))
    disjoint["q"][:, :20] = 1 / 20
    disjoint["p"][:, 20:] = 1 / 20
    disjoint["drafts"] = pick_rows(rng, disjoint["q"])
    m, nxt, source = accept(be, disjoint)
    assert (m == 0).all() and (nxt >= 20).all() and (source == Source.RESIDUAL).all()
    # p <= q everywhere with p(d) < q(d): a reject leaves no residual mass -> drawn from p
    flat = dict(b, q=np.full_like(b["q"], 1 / vocab), p=np.full_like(b["p"], 1 / vocab))
    flat["p"][:, ::2] = 0.25 / vocab  # p sums to 5/8: not a distribution, but p <= q
    flat["drafts"] = np.zeros(len(flat["drafts"]), np.int32)
    m, nxt, source = accept(be, flat)
    assert (source == Source.FALLBACK).any()
    fb = source == Source.FALLBACK
    assert (m[fb] < nd).all() and ((nxt[fb] >= 0) & (nxt[fb] < vocab)).all()
    np.testing.assert_array_equal(nxt, speculative_accept_ref(**flat)["next"])
    # a session without drafts draws its bonus from its single column
    none = accept_batch(rng, [0, 0, 0], vocab)
    m, nxt, source = accept(be, none)
    assert (m == 0).all() and (source == Source.BONUS).all()
    np.testing.assert_array_equal(nxt, speculative_accept_ref(**none)["next"])


def test_accept_is_batch_invariant(kernel_backend, rng):
    be = kernel_backend
    nds = [3, 1, 4, 0, 2]
    b = accept_batch(rng, nds, 300)
    full = accept(be, b)
    indptr = b["draft_indptr"]
    for order in ([2], [4, 2, 0], [1, 3]):
        sub_nds = [nds[i] for i in order]
        sub = dict(drafts=np.concatenate([b["drafts"][indptr[i]:indptr[i + 1]] for i in order]).astype(np.int32),
                   draft_indptr=np.concatenate([[0], np.cumsum(sub_nds)]).astype(np.int32),
                   q=np.concatenate([b["q"][indptr[i]:indptr[i + 1]] for i in order]),
                   p=np.concatenate([b["p"][indptr[i] + i:indptr[i + 1] + i + 1] for i in order]),
                   seed=b["seed"][order], counter=b["counter"][order])
        for g, f in zip(accept(be, sub), full):
            np.testing.assert_array_equal(g, f[order])


def lossless_world(rng, vocab=8):
    """A target with P1 (first token) and P2[t] (the token after t), and a deliberately different
    drafter Q1, Q2[t] (sharper, top-k = 5: zero where p is not)."""
    P1, P3 = normalised(rng, 1, vocab, scale=0.7)[0], normalised(rng, 1, vocab, scale=0.7)[0]
    P2 = normalised(rng, vocab, vocab, scale=0.7)
    Q1, Q2 = normalised(rng, 1, vocab, top_k=5, scale=2.0)[0], normalised(rng, vocab, vocab, top_k=5, scale=2.0)
    return P1, P2, P3, Q1, Q2


def speculate_two_tokens(be, rng, world, sessions=DRAWS):
    """Emit two tokens per session by speculation: a 2-draft round, then (when its first draft
    was rejected) a 1-draft round for the second token, as the session would."""
    P1, P2, P3, Q1, Q2 = world
    B = sessions
    seed = rng.integers(0, 2**64, B, dtype=np.uint64)
    d1 = pick_rows(rng, np.broadcast_to(Q1, (B, len(Q1))))
    d2 = pick_rows(rng, Q2[d1])
    q = np.stack([np.broadcast_to(Q1, (B, len(Q1))), Q2[d1]], axis=1).reshape(2 * B, -1)
    p = np.stack([np.broadcast_to(P1, (B, len(P1))), P2[d1], np.broadcast_to(P3, (B, len(P3)))],
                 axis=1).reshape(3 * B, -1)
    rnd = dict(drafts=np.stack([d1, d2], axis=1).reshape(-1), draft_indptr=np.arange(0, 2 * B + 1, 2, dtype=np.int32),
               q=q, p=p, seed=seed, counter=np.full(B, 11, np.uint64))
    m, nxt, _ = accept(be, rnd)
    t1 = np.where(m >= 1, d1, nxt)
    t2 = np.where(m >= 2, d2, nxt)
    again = np.flatnonzero(m == 0)
    if again.size:
        n = again.size
        e1 = pick_rows(rng, Q2[t1[again]])
        rnd2 = dict(drafts=e1, draft_indptr=np.arange(n + 1, dtype=np.int32), q=Q2[t1[again]],
                    p=np.stack([P2[t1[again]], np.broadcast_to(P3, (n, len(P3)))], axis=1).reshape(2 * n, -1),
                    seed=seed[again], counter=np.full(n, 12, np.uint64))
        m2, nxt2, _ = accept(be, rnd2)
        t2[again] = np.where(m2 >= 1, e1, nxt2)
    return t1, t2


def lossless_pvalues(t1, t2, world):
    P1, P2 = (a.astype(np.float64) for a in world[:2])
    P1 /= P1.sum()
    P2 /= P2.sum(axis=1, keepdims=True)
    return chi2_pvalue(t1, P1), chi2_pvalue(t2, P1 @ P2)


@pytest.mark.parametrize("backend", ["numpy", "simt"])
def test_speculative_accept_is_lossless(request, stats_rng, backend):
    """With q far from p, the first and the second emitted tokens still follow the target."""
    be = request.getfixturevalue({"numpy": "numpy_backend"}.get(backend, backend))
    world = lossless_world(stats_rng)
    t1, t2 = speculate_two_tokens(be, stats_rng, world)
    first, second = lossless_pvalues(t1, t2, world)
    assert first > P_MIN and second > P_MIN


def test_broken_accept_fails_the_same_check(numpy_backend, stats_rng, monkeypatch):
    """Accepting while u * q < 1.2 p over-accepts the drafter's favourites: the first token's
    marginal fails the check (by tens of orders of magnitude; the second's often does too).
    Pinned seeds, as the check it pairs with."""
    monkeypatch.setattr(sampling, "_accepts", lambda u, q_d, p_d: u * q_d < f32(1.2) * p_d)
    world = lossless_world(stats_rng)
    t1, t2 = speculate_two_tokens(numpy_backend, stats_rng, world)
    first, _ = lossless_pvalues(t1, t2, world)
    assert first < P_MIN


# ---- bad input ----------------------------------------------------------------------------------
def test_sample_rejects_bad_logits(any_backend, rng):
    be = any_backend
    x = make_logits(rng, 4, 20, ties=False)
    f, s = Filters.full(4), random_streams(rng, 4)
    for row, value, says in ((2, np.nan, "row 2 contains NaN or \\+inf"), (1, np.inf, "row 1 contains NaN")):
        bad = x.copy()
        bad[row, 3] = value
        with pytest.raises(NonFiniteError, match=says):
            sample_filtered(be, be.asarray(bad), filters_on(be, f), streams_on(be, s))
    bad = x.copy()
    bad[3] = -np.inf
    with pytest.raises(NonFiniteError, match="row 3 has no finite logit"):
        sample_filtered(be, be.asarray(bad), filters_on(be, f), streams_on(be, s))
    with pytest.raises(NonFiniteError, match="row 3 has no finite logit"):
        filtered_probs(be, be.asarray(bad), filters_on(be, Filters.full(4, temperature=0.0)))


def test_sample_rejects_bad_settings(any_backend, rng):
    be = any_backend
    x = be.asarray(make_logits(rng, 3, 20))
    s = streams_on(be, random_streams(rng, 3))
    for settings, says in ((dict(temperature=[1, -1, 1]), r"temperature\[1\]=-1.0 is outside 0 \(greedy\)"),
                           (dict(temperature=[1e-40, 1, 1]), r"temperature\[0\]=.* or \[2\^-126, inf\)"),
                           (dict(temperature=[1, 1, np.nan]), r"temperature\[2\]=nan"),
                           (dict(top_k=[0, 0, -3]), r"top_k\[2\]=-3 is outside"),
                           (dict(top_p=[0, 1, 1]), r"top_p\[0\]=0.0 is outside \(0, 1\]"),
                           (dict(min_p=[0, 1.5, 0]), r"min_p\[1\]=1.5 is outside \[0, 1\]")):
        with pytest.raises(SamplingParamError, match=says):
            sample_filtered(be, x, filters_on(be, Filters.full(3, **settings)), s)
    f = filters_on(be, Filters.full(3))
    with pytest.raises(SamplingParamError, match="method='top': expected one of gumbel, inverse_cdf"):
        sample_filtered(be, x, f, s, "top")
    with pytest.raises(DTypeError, match="top_k has dtype float32: expected int32"):
        sample_filtered(be, x, Filters(f.temperature, f.top_p, f.top_p, f.min_p), s)
    with pytest.raises(ShapeError, match=r"seed has shape \(2,\): expected \(3,\)"):
        sample_filtered(be, x, f, Streams(s.seed[:2], s.counter, s.stream))
    with pytest.raises(SamplingParamError, match="stream tag"):
        sample_filtered(be, x, f, Streams(s.seed, s.counter, be.asarray(np.full(3, 9 << 24, u32))))
    with pytest.raises(DTypeError, match="logits has dtype int32"):
        sample_filtered(be, be.asarray(np.zeros((3, 20), np.int32)), f, s)
    with pytest.raises(ShapeError, match=r"token_out has shape \(4,\): expected \(3,\)"):
        sample_filtered(be, x, f, s, token_out=be.xp.zeros(4, np.int32))
    with pytest.raises(CapacityError, match="expected a vocabulary in"):
        sample_filtered(be, be.asarray(np.zeros((0, sampling.MAX_VOCAB + 1), f32)), filters_on(be, Filters.full(0)),
                        streams_on(be, random_streams(rng, 0)))


def test_accept_rejects_bad_inputs(any_backend, rng):
    be = any_backend
    b = accept_batch(rng, [2, 3], 16)
    call = lambda **kw: speculative_accept(be, *[be.asarray(dict(b, **kw)[k]) for k in (  # noqa: E731
        "drafts", "draft_indptr", "q", "p", "seed", "counter")])
    with pytest.raises(TokenRangeError, match=r"drafts\[1\]=16 is outside the vocabulary \[0, 16\)"):
        call(drafts=np.array([0, 16, 1, 2, 3], np.int32))
    with pytest.raises(ShapeError, match="draft_indptr must start at 0 and end at 5"):
        call(draft_indptr=np.array([0, 2, 4], np.int32))
    with pytest.raises(ShapeError, match=r"p has shape \(6, 16\): expected \(7, 16\)"):
        call(p=b["p"][:6])
    with pytest.raises(DTypeError, match="q has dtype float16: expected float32"):
        call(q=b["q"].astype(np.float16))
    with pytest.raises(DTypeError, match="counter has dtype int64: expected uint64"):
        call(counter=np.zeros(2, np.int64))
    p = b["p"].copy()
    p[3:, :] = np.nan  # session 1's columns: its first test already reads one
    with pytest.raises(NonFiniteError, match="session 1 reads a probability outside"):
        call(p=p)
    q = b["q"].copy()
    q[0, b["drafts"][0]] = -0.5  # read by the first accept test of session 0
    with pytest.raises(NonFiniteError, match="session 0 reads a probability outside"):
        call(q=q)


# ---- row split: every row across ceil(V / SLICE) CTAs, merged exactly ------------------------------
FULL_V = 248320  # Qwen3.5's vocabulary: 31 slices


def assert_draw_matches(be, x, f, s, method, dist=True):
    token, prob, d = draw(be, x, f, s, method, dist=dist)
    ref = sample_filtered_ref(x, f, s, method, with_dist=dist)
    assert_bitwise(token, ref["token"], f"{method} token")
    assert_bitwise(prob, ref["prob"], f"{method} prob")
    if dist:
        assert_bitwise(d, ref["dist"], f"{method} dist")
    return token


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_vocab_one_row_matches_reference(kernel_backend, rng, dtype, method):
    """B = 1 at V = 248320 with every filter on: 31 CTAs, eight phases."""
    x = make_logits(rng, 1, FULL_V, dtype)
    f = Filters.full(1, temperature=0.8, top_k=int(rng.integers(20, 5000)), top_p=0.9, min_p=0.001)
    assert_draw_matches(kernel_backend, x, f, random_streams(rng, 1), method)


@pytest.mark.parametrize("method", METHODS)
def test_full_vocab_mixed_rows_match_reference(kernel_backend, rng, method):
    """Four rows, each its own filters: greedy with the maximum tied across slices, top-k at V - 1
    with top-p near 1 (every radix digit over nearly the whole row), a top-p cut inside a run of
    ties, min-p alone."""
    x = make_logits(rng, 4, FULL_V, ml_dtypes.bfloat16).astype(f32)
    x[0, [SLICE * 30 + 1, SLICE * 3, SLICE * 3 - 1]] = 64.0  # greedy: the lowest of these wins
    x = x.astype(ml_dtypes.bfloat16)
    f = Filters.full(4, temperature=[0.0, 1.0, 0.6, 2.0], top_k=[0, FULL_V - 1, 0, 0],
                     top_p=[1.0, 0.999, 0.3, 1.0], min_p=[0.0, 0.0, 0.0, 0.05])
    token = assert_draw_matches(kernel_backend, x, f, random_streams(rng, 4), method)
    assert token[0] == SLICE * 3 - 1


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_full_vocab_batch_32_matches_reference(kernel_backend, rng, dtype):
    """B = 32 at V = 248320 (992 CTAs a launch): greedy rows among sampled ones, min-p on some,
    the inverse-CDF target in any slice, and the distributions."""
    x = make_logits(rng, 32, FULL_V, dtype)
    f = Filters.full(32, temperature=rng.choice([0.0, 0.5, 1.0, 1.5], 32), min_p=rng.choice([0.0, 0.0, 1e-4], 32))
    assert_draw_matches(kernel_backend, x, f, random_streams(rng, 32), "inverse_cdf")


def test_bad_rows_found_in_any_slice(kernel_backend, rng):
    be = kernel_backend
    V = 3 * SLICE + 40
    x = make_logits(rng, 4, V, ties=False)
    x[1, 2 * SLICE + 5] = np.nan
    x[2, 3 * SLICE + 39] = np.inf
    x[3] = -np.inf
    f, s = Filters.full(4, temperature=1.0, top_k=7), random_streams(rng, 4)
    token, prob = poison(be.xp, 4, np.int32), poison(be.xp, 4, f32)
    with pytest.raises(NonFiniteError, match=r"row 1 contains NaN or \+inf \(2 rows in all\)"):
        sample_filtered(be, be.asarray(x), filters_on(be, f), streams_on(be, s), "gumbel", token, prob)
    ref = sample_filtered_ref(x, f, s)
    assert_bitwise(be.to_host(token), ref["token"], "token")
    assert be.to_host(token)[1:].tolist() == [-1, -1, -1] and ref["status"].tolist() == [0, 1, 1, 2]


def test_scratch_is_zero_at_rest(simt, rng):
    """Every launch puts back to zero the tickets and histograms it counted in."""
    x = make_logits(rng, 3, 2 * SLICE + 1)
    f = Filters.full(3, temperature=1.0, top_k=[5, 0, 900], top_p=[0.5, 0.9, 1.0])
    draw(simt, x, f, random_streams(rng, 3), "inverse_cdf")
    assert_accept_matches(simt, accept_batch(rng, [1, 3], 2 * SLICE + 1))
    tickets, hist = rowsplit.scratch(simt, 3, 3)
    assert not tickets.any() and not hist.any()


@pytest.mark.parametrize("B", [1, 32])
def test_accept_full_vocab_matches_reference(kernel_backend, rng, B):
    nds = [int(n) for n in rng.integers(0, 5, B)]
    assert_accept_matches(kernel_backend, accept_batch(rng, nds, FULL_V, rough=True))


def test_accept_fallback_and_disjoint_support_on_split_rows(kernel_backend, rng):
    """The residual's mass, p's mass and the walk cross slices: p <= q everywhere (fallback to p),
    and support disjoint from q's in the last slice only."""
    vocab, nd = 3 * SLICE + 5, 2
    b = accept_batch(rng, [nd] * 3, vocab)
    flat = dict(b, q=np.full_like(b["q"], 1 / vocab), p=np.full_like(b["p"], 1 / vocab))
    flat["p"][:, ::2] = 0.25 / vocab
    flat["drafts"] = np.zeros(len(flat["drafts"]), np.int32)
    m, nxt, source = accept(kernel_backend, flat)
    want = speculative_accept_ref(**flat)
    assert (source == Source.FALLBACK).any()
    np.testing.assert_array_equal(nxt, want["next"])
    np.testing.assert_array_equal(source, want["source"])
    disjoint = dict(b, q=np.zeros_like(b["q"]), p=np.zeros_like(b["p"]))
    disjoint["q"][:, :20] = 1 / 20
    disjoint["p"][:, 3 * SLICE:] = 1 / 5
    disjoint["drafts"] = pick_rows(rng, disjoint["q"])
    m, nxt, source = accept(kernel_backend, disjoint)
    assert (m == 0).all() and (nxt >= 3 * SLICE).all() and (source == Source.RESIDUAL).all()


def test_plans():
    """Split counts follow V alone; phases and passes follow the filters asked for."""
    for B in (1, 2, 32):
        p = sample_plan(B, FULL_V, 2, top_k=True, top_p=True, method="inverse_cdf", dist=True)
        assert p.splits == 31 and p.notes["phases"] == [0, 1, 2, 3, 4, 5, 6, 7]
        assert [launch.ctas for launch in p.launches] == [31 * B] * 8
        assert p.passes == pytest.approx(8 + 1 / 31) and p.min_bytes < p.bytes
        assert accept_plan(B, 7, FULL_V).launches[0].ctas == 31 * B
    plain = sample_plan(1, FULL_V)
    assert plain.notes["phases"] == [0, 6] and plain.passes == 2
    small = sample_plan(7, 1000, top_k=True, dist=True)
    assert small.splits == 1 and len(small.launches) == 1 and small.launches[0].ctas == 7
    assert small.passes == 5 and splits(SLICE + 1) == 2


@pytest.mark.parametrize("dtype,shift", [(np.float32, 4), (ml_dtypes.bfloat16, 2), (np.float16, 10)])
def test_odd_vocab_on_misaligned_rows(simt, rng, dtype, shift):
    """V = 151937 rows at every offset from a 16-byte boundary, the array `shift` bytes past one:
    every phase's vector loads stay aligned (simt faults otherwise) and the draws match."""
    V = 151937
    x = misaligned(make_logits(rng, 3, V, dtype), shift)
    f = Filters.full(3, temperature=[1.0, 0.7, 0.0], top_k=[200, 0, 0], top_p=[0.9, 0.95, 1.0], min_p=[0, 0.01, 0])
    s = random_streams(rng, 3)
    for method in METHODS:
        assert_draw_matches(simt, x, f, s, method)
    b = accept_batch(rng, [2, 1], V, rough=True)
    b["p"], b["q"] = misaligned(b["p"], 4), misaligned(b["q"], 8)
    assert_accept_matches(simt, b)
