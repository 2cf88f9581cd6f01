"""Seeds: a sampled request without one draws a fresh 64-bit seed from the OS when it is admitted
(Worker.submit, DsparkSpecSession.prime, plain_generate), and reports it; that seed given back
reproduces its text; an explicit seed gives the stream it always gave; greedy ignores seeds.

The bug this guards keeps every stream valid: a seed None mapped to a constant (or drawn once
inside SamplingParams, shared by every request that reuses the object) makes every unseeded
request print the same text. The first test fails under it."""

import numpy as np
import pytest

from dspark.decode import PlainBatch, first_token, plain_generate
from dspark.models.presets import tiny_pair
from dspark.params import SamplingParams, seeded
from dspark.session import DsparkSpecSession, SpecParams
from dspark.worker import GateConfig, Worker

HOT = SamplingParams(temperature=0.9)  # one object, reused by every request below
PROMPTS = ([1, 2, 3, 4, 5], [9, 8, 7], [200, 17, 33, 4, 60, 61])


@pytest.fixture(scope="module")
def pair():
    import dspark
    return tiny_pair(dspark.get_backend("numpy"), 21)


def test_unseeded_requests_differ_and_their_seed_reproduces_them(pair):
    trunk, drafter = pair
    for p in PROMPTS:
        a, b = plain_generate(trunk, p, 12, sampling=HOT), plain_generate(trunk, p, 12, sampling=HOT)
        assert a.seed != b.seed and a != b, (a.seed, b.seed)
        assert 0 <= a.seed < 2**64
        assert plain_generate(trunk, p, 12, sampling=SamplingParams(temperature=0.9, seed=a.seed)) == a
    assert HOT.seed is None  # drawn at admission, never into the shared object


def test_sessions_and_worker_requests_draw_their_own_seed(pair):
    """Two sessions primed with one SpecParams get two seeds, each the seed of its coupled stream
    (plain sampled decode's); the worker draws at submit: Request.seed, and the result's seed, which
    given back reproduces the text. A greedy request reports no seed, whatever it was given."""
    trunk, drafter = pair
    params = SpecParams(max_new_tokens=10, sampling=HOT, capture=False, policy="always")
    sessions = [DsparkSpecSession.prime(trunk, drafter, PROMPTS[0], params) for _ in range(2)]
    for s in sessions:
        while not s.finished():
            s.round()
        s.close()
    assert sessions[0].seed != sessions[1].seed and params.sampling.seed is None
    for s in sessions:
        assert s.emitted == plain_generate(trunk, PROMPTS[0], 10, sampling=SamplingParams(temperature=0.9, seed=s.seed))
    w = Worker(trunk, drafter, GateConfig(low=2, high=4), spec=SpecParams(burst_target=4, policy="always"))
    ids = [w.submit(PROMPTS[1], 12, HOT) for _ in range(2)] + [w.submit(PROMPTS[1], 12, SamplingParams(seed=7))]
    w.run()
    got = [w.result(i) for i in ids]
    assert [g.seed for g in got] == [w.requests[i].seed for i in ids] and got[2].seed is None
    assert got[0].seed != got[1].seed and got[0] != got[1]
    again = w.submit(PROMPTS[1], 12, SamplingParams(temperature=0.9, seed=got[0].seed))
    w.run()
    assert w.result(again) == got[0] == plain_generate(trunk, PROMPTS[1], 12, sampling=SamplingParams(
        temperature=0.9, seed=got[0].seed))


def test_explicit_seeds_give_the_streams_they_always_gave(pair):
    """Plain sampled decode of the tiny pair with explicit seeds, as printed before seeds could be
    drawn (the coupled sampler's equality tests pin the speculative streams to these)."""
    trunk, _ = pair
    want = {(0.9, 0, 1.0, 5): [86, 221, 202, 134, 91, 191, 222, 182, 242, 1, 85, 197],
            (1.2, 0, 0.9, 2**64 - 1): [193, 28, 56, 59, 134, 243, 12, 83, 64, 60, 90, 117],
            (0.7, 20, 1.0, 0): [34, 59, 206, 250, 124, 158, 112, 52, 85, 232, 54, 51]}
    for (t, k, p, seed), tokens in want.items():
        sp = SamplingParams(temperature=t, top_k=k, top_p=p, seed=seed)
        out = plain_generate(trunk, PROMPTS[0], 12, sampling=sp)
        assert out == tokens and out.seed == seed


def test_a_pick_without_a_seed_is_refused(pair):
    """Below admission nothing draws a seed: a pick or a plain sequence without one is an error that
    names it, and nothing moved."""
    trunk, _ = pair
    cache = trunk.new_cache()
    try:
        logits = trunk.be.asarray(np.zeros((1, trunk.config.vocab), np.float32))
        with pytest.raises(ValueError, match=r"samplings\[0\].seed is None"):
            first_token(trunk.be, logits, 3, HOT)
        batch = PlainBatch(trunk)
        with pytest.raises(ValueError, match="sampling.seed is None"):
            batch.join(cache, 1, 4, sampling=HOT)
        assert not batch.sequences
    finally:
        cache.free()
    assert seeded(None) is None and seeded(SamplingParams()) == SamplingParams()  # greedy: as it is
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(temperature=0.9, seed=bad)
