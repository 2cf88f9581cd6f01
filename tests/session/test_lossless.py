"""Sampled speculation is lossless, checked at the session level with drafters that accept.

The drafter is the trunk's own filtered distribution, perturbed (dspark.models.oracle.TrunkDrafter),
so most rounds accept several drafts and the accept's every path matters: for the rejection
sampler accepted drafts, rejections, the residual norm(max(0, p - q)) and the bonus; for the
coupled sampler drafts that equal the target's pick and drafts that do not. Every check runs over
many rounds and bursts, on pinned seeds: the p-values are fixed numbers, far above P_FLOOR with the
correct code (rejection 0.17, 0.21, 0.38; coupled 0.27, when written) and far below it under the
mutants that profiling/mutants.toml pairs with each check (named in its docstring; the mutation run
in CI shows they fail).

The coupled sampler's stream equals plain sampled decode's by construction (test_coupled.py), so
its chi-square check is what shows that the shared stream is the trunk's law and not merely
self-consistent: noise shared across positions, say, would keep the coupled stream and plain
decode equal and both wrong.
"""

import numpy as np
import pytest
from scipy import stats as scistats

from dspark.models.oracle import TrunkDrafter
from dspark.models.presets import tiny_pair
from dspark.ops.sampling import filtered_probs
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams, spec_burst
from dspark.spec_sampling import filters_for
from dspark.stats import SpecStats

SAMPLING = SamplingParams(temperature=1.0, top_k=4)  # few tokens carry mass: big expected counts
TILT = 0.6      # q = p tilted by exp(+-0.6) per token inside p's support: ~0.83 accepted per slot
ESCAPE = 0.25   # q = p with a quarter of its mass moved to the least likely token
P_FLOOR = 1e-3


@pytest.fixture(scope="module")
def setup():
    import dspark
    be = dspark.get_backend("numpy")
    trunk, base = tiny_pair(be, 31, max_ctx=64)
    prompt = np.random.default_rng(5).integers(0, 256, 12).astype(np.int32)
    return be, trunk, base, prompt


def with_seed(sampling: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(**{**sampling.__dict__, "seed": seed})


def sample(trunk, drafter, prompt, n, params, tokens: int, group: int = 250):
    """n sessions restored from one prompt capture with seeds 0..n-1, run in batches of `group`
    (bursts of params.burst_target) until each emitted `tokens` tokens or finished. Returns
    [(emitted, stats, alphas)] per session."""
    s0 = DsparkSpecSession.prime(trunk, drafter, prompt, params)
    cap = s0.take_prefix_capture()
    s0.close()
    out = []
    for lo in range(0, n, group):
        batch = []
        for seed in range(lo, min(n, lo + group)):
            s = DsparkSpecSession.restore(trunk, drafter, cap, SpecParams(**{
                **params.__dict__, "sampling": with_seed(params.sampling, seed)}))
            drafter.follow(s)
            batch.append(s)
        while True:
            todo = [s for s in batch if not s.finished() and len(s.emitted) < tokens]
            if not todo:
                break
            spec_burst(todo)
        for s in batch:
            out.append((list(s.emitted), s.stats, s.kv.alphas))
            s.close()
    cap.free()
    return out


def filtered(be, logits, sampling):
    return be.to_host(filtered_probs(be, logits, filters_for([sampling] * logits.shape[0]))).astype(np.float64)


def first_three_law(be, trunk, prompt, sampling) -> dict:
    """P(t1, t2, t3) under plain filtered sampling from the trunk, by enumeration."""
    cache = trunk.new_cache()
    p1 = filtered(be, trunk.prefill(cache, prompt).logits[-1:], sampling)[0]
    law = {}
    t1s = np.flatnonzero(p1)
    c1 = [cache.copy() for _ in t1s]
    for t1, c, p2 in zip(t1s, c1, filtered(be, trunk.decode(c1, t1s).logits, sampling)):
        t2s = np.flatnonzero(p2)
        c2 = [c.copy() for _ in t2s]
        for t2, p3 in zip(t2s, filtered(be, trunk.decode(c2, t2s).logits, sampling)):
            for t3 in np.flatnonzero(p3):
                law[(int(t1), int(t2), int(t3))] = p1[t1] * p2[t2] * p3[t3]
        for x in c2:
            x.free()
    for x in [cache, *c1]:
        x.free()
    return law


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square; cells expecting fewer than 5 are pooled into one."""
    expected = expected * observed.sum() / expected.sum()
    small = expected < 5
    o, e = observed[~small], expected[~small]
    if small.any():
        o, e = np.append(o, observed[small].sum()), np.append(e, expected[small].sum())
    return float(scistats.chisquare(o, e).pvalue)


def merged(runs) -> SpecStats:
    total = SpecStats()
    for _, stats, _ in runs:
        total = total.merge(stats)
    return total


@pytest.mark.parametrize("sampler", ["rejection", "coupled"])
def test_first_three_tokens_follow_the_trunk(setup, sampler):
    """1500 sessions, one round per burst, until each emitted three tokens: the joint law of
    (t1, t2, t3) against exact enumeration. t2 and t3 come from accepted drafts and from the
    token after them (a residual or bonus, or the target's pick) of the first rounds, and from a
    second round when the first accepted little. Mutants that fail it: rejection,
    all-zero-drafter-distribution and round-counter-never-advances; coupled,
    pick-noise-keyed-by-the-seed-alone and coupled-accept-any-draft-with-mass."""
    be, trunk, base, prompt = setup
    drafter = TrunkDrafter(base, tilt=TILT, seed=3)
    law = first_three_law(be, trunk, prompt, SAMPLING)
    assert 256 not in {t for key in law for t in key}, "EOS would end some streams early"
    runs = sample(trunk, drafter, prompt, 1500, SpecParams(sampling=SAMPLING, tau=0.0, burst_target=1,
                                                           sampler=sampler), tokens=3)
    stats = merged(runs)
    assert stats.mean_accepted_length >= (3.0 if sampler == "rejection" else 2.5), stats.summary()  # drafts accepted
    assert stats.rounds > len(runs)  # some sessions needed a second round (and burst)
    keys = list(law)
    index = {k: i for i, k in enumerate(keys)}
    observed = np.zeros(len(keys))
    for emitted, _, _ in runs:
        key = tuple(emitted[:3])
        assert key in index, f"{key} is outside the filtered support"
        observed[index[key]] += 1
    pvalue = chi2_pvalue(observed, np.array([law[k] for k in keys]))
    print(f"{stats.summary()}; chi-square p = {pvalue:.3g}")
    assert pvalue > P_FLOOR


def test_every_token_follows_the_trunk_across_bursts(setup):
    """Rejection: 160 sessions of 40 tokens in bursts of 5 (several rounds each). Each emitted token's law
    given its prefix is the trunk's filtered p (one prefill over the stream gives them all): the
    count of tokens that the tilt favours is a sum of independent Bernoullis with those
    probabilities, so (observed - expected)^2 / variance is chi-square with one degree of freedom.
    Mutant that fails it: residual-drawn-from-p."""
    be, trunk, base, prompt = setup
    drafter = TrunkDrafter(base, tilt=TILT, seed=4)
    runs = sample(trunk, drafter, prompt, 160, SpecParams(sampling=SAMPLING, tau=0.0, max_new_tokens=40,
                                                          burst_target=5, sampler="rejection"), tokens=40)
    stats = merged(runs)
    assert stats.mean_accepted_length >= 3.0, stats.summary()
    favoured = drafter.pattern > 0
    observed = expected = variance = 0.0
    for emitted, _, _ in runs:
        cache = trunk.new_cache()
        stream = np.concatenate([prompt, emitted[:-1]]).astype(np.int32)
        p = filtered(be, trunk.prefill(cache, stream).logits[len(prompt) - 1:], SAMPLING)
        cache.free()
        assert (p[np.arange(len(emitted)), emitted] > 0).all(), "a token outside the filtered support"
        pa = p[:, favoured].sum(axis=1)
        observed += favoured[emitted].sum()
        expected += pa.sum()
        variance += (pa * (1 - pa)).sum()
    pvalue = scistats.chi2.sf((observed - expected) ** 2 / variance, 1)
    print(f"{stats.summary()}; favoured tokens {observed:.0f}, expected {expected:.1f}; chi-square p = {pvalue:.3g}")
    assert pvalue > P_FLOOR


def test_accepted_counts_follow_their_law(setup):
    """Rejection: with q = (1 - e) p + e on the trunk's least likely token z, a draft d != z always passes
    u q(d) < p(d), and z almost never does: slot k is accepted with probability
    alpha_k = sum(min(p_k, q_k)) ~ 1 - e, logged by the drafter from the very rows the accept
    sees. m then follows P(m = j) = alpha_0 .. alpha_{j-1} (1 - alpha_j), capped at the drafts
    verified. 100 sessions of 40 tokens, bursts of 6: the pooled histogram of m over every round
    against the sum of the per-round laws. Mutants that fail it: accept-any-draft-with-mass,
    tau-ignored (and a verify width fixed at 2)."""
    be, trunk, base, prompt = setup
    sampling = SamplingParams(temperature=1.0)
    drafter = TrunkDrafter(base, escape=ESCAPE, seed=5)
    runs = sample(trunk, drafter, prompt, 100, SpecParams(sampling=sampling, tau=0.0, max_new_tokens=40,
                                                          burst_target=6, sampler="rejection"), tokens=40)
    nd = drafter.config.drafts
    stats = merged(runs)
    assert stats.drafted == nd * stats.rounds, "every round verifies all nd drafts (tau 0)"
    expected = np.zeros(nd + 1)
    for _, st, alphas in runs:
        assert len(alphas) == st.rounds
        for a in map(np.asarray, alphas):
            reach = np.concatenate([[1.0], np.cumprod(a)])
            expected += np.append(reach[:-1] * (1 - a), reach[-1])
    observed = np.asarray(stats.histogram + [0] * (nd + 1 - len(stats.histogram)), np.float64)
    assert expected.sum() == pytest.approx(stats.rounds)
    assert stats.mean_accepted_length >= 2.5, stats.summary()
    pvalue = chi2_pvalue(observed, expected)
    print(f"{stats.summary()}; m histogram {observed.astype(int).tolist()}, expected {expected.round(1).tolist()}; "
          f"chi-square p = {pvalue:.3g}")
    assert pvalue > P_FLOOR
