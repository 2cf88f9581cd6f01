"""Sampled speculative sessions under the rejection sampler: seeded streams that do not depend
on the batch, with a drafter that accepts; no draw is ever reused; temperature 0 is plain greedy.
Losslessness itself: test_lossless.py; the coupled sampler (whose streams are plain sampled
decode's, alone and batched): test_coupled.py."""

import numpy as np

from dspark.decode import plain_generate
from dspark.models.oracle import TrunkDrafter
from dspark.models.presets import tiny_pair
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams, spec_burst

SAMPLING = SamplingParams(temperature=0.6, top_p=0.9, seed=1234)


def run_alone(trunk, drafter, prompt, sampling, max_new):
    s = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=max_new, sampling=sampling,
                                                                   burst_target=6, tau=0.0, sampler="rejection"))
    drafter.follow(s)
    while not s.finished():
        spec_burst([s])
    out, stats = list(s.emitted), s.stats
    s.close()
    return out, stats


def test_same_seed_same_stream_alone_and_batched(model_backend):
    """Four sessions with their own prompts, seeds and filters join one batch a burst apart (so
    their round counters differ) and emit exactly what each emits alone; another seed differs.
    The drafter is the trunk's own distribution, tilted: most rounds accept several drafts, so
    the accept, residual and bonus draws all take part."""
    trunk, base = tiny_pair(model_backend, 31, max_ctx=96)
    rng = np.random.default_rng(2)
    requests = [(rng.integers(0, 256, int(n)).astype(np.int32), sp) for n, sp in zip((12, 3, 20, 41), (
        SAMPLING, SamplingParams(temperature=0.8, seed=0), SamplingParams(temperature=0.7, top_k=5, seed=1),
        SamplingParams(temperature=1.1, min_p=0.05, seed=2)))]
    drafter = TrunkDrafter(base, tilt=0.25, seed=7)
    alone = [run_alone(trunk, drafter, p, sp, 30) for p, sp in requests]
    total = alone[0][1]
    for _, st in alone[1:]:
        total = total.merge(st)
    print(total.summary())
    assert total.mean_accepted_length >= 2.5, total.summary()
    batch = []
    for p, sp in requests:
        s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=30, sampling=sp, burst_target=6,
                                                                    tau=0.0, sampler="rejection"))
        drafter.follow(s)
        batch.append(s)
    joined = []
    while not all(s.finished() for s in batch):
        joined = batch[: len(joined) + 1]
        spec_burst(joined)
    assert [s.emitted for s in batch] == [out for out, _ in alone]
    other, _ = run_alone(trunk, drafter, requests[0][0], SamplingParams(**{**SAMPLING.__dict__, "seed": 1235}), 30)
    assert other != alone[0][0]
    for s in batch:
        s.close()


def test_no_draw_is_ever_reused(monkeypatch):
    """Every Philox draw of a session sampled by rejection, over several bursts, comes from its own
    (seed, counter, stream): the first anchor (PICK at its position), each draft slot (DRAFT, slot
    k) and each round's accept (which derives its ACCEPT, RESIDUAL and BONUS words from (seed,
    counter) inside). (The coupled sampler shares a position's noise on purpose.)"""
    import dspark
    import dspark.spec_sampling as ss
    trunk, base = tiny_pair(dspark.get_backend("numpy"), 31, max_ctx=96)
    seen = []

    def spy_sample(be, logits, filters, streams, *a, **k):
        seen.extend(zip(*(np.asarray(x).tolist() for x in (streams.seed, streams.counter, streams.stream))))
        return real_sample(be, logits, filters, streams, *a, **k)

    def spy_accept(be, drafts, indptr, q, p, seed, counter, **k):
        seen.extend((s, c, "accept") for s, c in zip(np.asarray(seed).tolist(), np.asarray(counter).tolist()))
        return real_accept(be, drafts, indptr, q, p, seed, counter, **k)

    real_sample, real_accept = ss.sample_filtered, ss.speculative_accept
    monkeypatch.setattr(ss, "sample_filtered", spy_sample)
    monkeypatch.setattr(ss, "speculative_accept", spy_accept)
    drafter = TrunkDrafter(base, tilt=0.25, seed=7)
    sessions = []
    for seed, n in ((5, 12), (6, 30)):
        p = np.random.default_rng(seed).integers(0, 256, n).astype(np.int32)
        s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=40, burst_target=4, tau=0.0,
                                                                  sampling=SamplingParams(temperature=0.8, seed=seed),
                                                                  sampler="rejection"))
        drafter.follow(s)
        sessions.append(s)
    while not all(s.finished() for s in sessions):
        spec_burst(sessions)
    assert sum(s.stats.rounds for s in sessions) >= 8 and len(seen) > 40
    assert len(set(seen)) == len(seen), "a draw was reused"
    for s in sessions:
        s.close()


def test_greedy_sampling_params_are_plain_greedy():
    import dspark
    trunk, drafter = tiny_pair(dspark.get_backend("numpy"), 31)
    prompt = np.random.default_rng(5).integers(0, 256, 12).astype(np.int32)
    s = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=20,
                                                                   sampling=SamplingParams(temperature=0.0, seed=9)))
    while not s.finished():
        s.burst()
    assert s.emitted == plain_generate(trunk, prompt, 20)
    s.close()
