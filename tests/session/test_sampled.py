"""Sampled speculative sessions: lossless (the first two tokens follow plain sampling from the
trunk, chi-square), seeded streams independent of the batch, and a broken accept caught."""

import numpy as np
import pytest
from scipy import stats as scistats

from dspark.decode import plain_generate
from dspark.models.presets import tiny_pair
from dspark.ops.sampling import filtered_probs
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams, spec_burst, spec_round
from dspark.spec_sampling import filters_for

SAMPLING = SamplingParams(temperature=1.3, top_k=6)  # few tokens carry mass: big expected counts
N = 2500


@pytest.fixture(scope="module")
def setup():
    import dspark
    be = dspark.get_backend("numpy")
    trunk, drafter = tiny_pair(be, 31)
    prompt = np.random.default_rng(5).integers(0, 256, 12).astype(np.int32)
    return be, trunk, drafter, prompt


def exact_two_token_marginals(be, trunk, prompt, sampling):
    """P(t1) and P(t2) = sum_t1 P(t1) P(t2 | t1) under plain filtered sampling from the trunk."""
    cache = trunk.new_cache()
    tp = trunk.prefill(cache, prompt)
    p1 = be.to_host(filtered_probs(be, tp.logits[-1:], filters_for([sampling])))[0].astype(np.float64)
    p2 = np.zeros_like(p1)
    for t1 in np.flatnonzero(p1):
        c = cache.copy()
        step = trunk.decode([c], [int(t1)])
        p2 += p1[t1] * be.to_host(filtered_probs(be, step.logits, filters_for([sampling])))[0]
        c.free()
    cache.free()
    return p1, p2


def spec_first_two_tokens(be, trunk, drafter, prompt, sampling, n):
    """n sessions restored from one capture with seeds 0..n-1, one batched round each."""
    s0 = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(sampling=sampling))
    cap = s0.take_prefix_capture()
    s0.close()
    sessions = [DsparkSpecSession.restore(trunk, drafter, cap, SpecParams(sampling=SamplingParams(
        **{**sampling.__dict__, "seed": i}))) for i in range(n)]
    spec_round(sessions)
    first = np.array([s.emitted[0] for s in sessions])
    second = np.array([s.emitted[1] if len(s.emitted) > 1 else s.last for s in sessions])
    drafted = sum(s.stats.drafted for s in sessions)
    for s in sessions:
        s.close()
    cap.free()
    return first, second, drafted


def chi2_p(samples, probs):
    support = np.flatnonzero(probs > 0)
    assert np.isin(samples, support).all(), "a token outside the filtered support was emitted"
    counts = np.array([(samples == t).sum() for t in support])
    return scistats.chisquare(counts, probs[support] / probs[support].sum() * len(samples)).pvalue


def test_sampled_spec_is_lossless(setup):
    be, trunk, drafter, prompt = setup
    p1, p2 = exact_two_token_marginals(be, trunk, prompt, SAMPLING)
    first, second, drafted = spec_first_two_tokens(be, trunk, drafter, prompt, SAMPLING, N)
    assert drafted > 0
    assert chi2_p(first, p1) > 1e-3
    assert chi2_p(second, p2) > 1e-3


def test_a_broken_accept_fails_the_same_check(setup, monkeypatch):
    """Mutation: accept every draft (no rejection test) -> the second token follows q, not p."""
    import dspark.spec_sampling as ss
    be, trunk, drafter, prompt = setup
    real = ss.speculative_accept

    def accept_all(be_, drafts, indptr, q, p, seed, counter, **kw):
        m, nxt, src = real(be_, drafts, indptr, q, p, seed, counter, **kw)
        m[...] = np.diff(be_.to_host(indptr))
        nxt[...] = 0
        return m, nxt, src

    monkeypatch.setattr(ss, "speculative_accept", accept_all)
    _, p2 = exact_two_token_marginals(be, trunk, prompt, SAMPLING)
    _, second, _ = spec_first_two_tokens(be, trunk, drafter, prompt, SAMPLING, 800)  # far off: fewer draws do
    support = p2 > 0
    assert not np.isin(second, np.flatnonzero(support)).all() or chi2_p(second, p2) < 1e-3


def test_same_seed_same_stream_alone_and_batched(setup):
    be, trunk, drafter, prompt = setup
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=1234)
    alone = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=30, sampling=sp))
    while not alone.finished():
        spec_burst([alone])
    rng = np.random.default_rng(2)
    others = [DsparkSpecSession.prime(trunk, drafter, rng.integers(0, 256, int(n)),
                                      SpecParams(max_new_tokens=30, sampling=SamplingParams(temperature=1.0, seed=i)))
              for i, n in enumerate((3, 20, 41))]
    again = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=30, sampling=sp))
    batch = [others[0], again, *others[1:]]
    while not all(s.finished() for s in batch):
        spec_burst(batch)
    assert again.emitted == alone.emitted
    different = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=30, sampling=SamplingParams(
        temperature=0.9, top_p=0.9, seed=1235)))
    while not different.finished():
        spec_burst([different])
    assert different.emitted != alone.emitted
    for s in [alone, again, different, *others]:
        s.close()


def test_greedy_sampling_params_are_plain_greedy(setup):
    be, trunk, drafter, prompt = setup
    s = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=20,
                                                                   sampling=SamplingParams(temperature=0.0, seed=9)))
    while not s.finished():
        s.burst()
    assert s.emitted == plain_generate(trunk, prompt, 20)
    s.close()
