"""Coupled sampled sessions run against plain sampled decode: the checks that the tiny pair
(tests/session/test_coupled.py) and the transformers-built targets (tests/models/test_hf_targets.py)
share. A steered drafter (dspark.models.oracle.TrunkDrafter) follows each session it drafts for;
a trained one (the embedded pair's) needs no help."""

from dspark.decode import PlainBatch, plain_generate, prefill_anchor
from dspark.session import DsparkSpecSession, SpecParams, spec_burst
from dspark.stats import SpecStats

N = 30


def params(sampling, **kw) -> SpecParams:
    return SpecParams(**{"max_new_tokens": N, "burst_target": 6, "tau": 0.0, "sampler": "coupled",
                         "sampling": sampling, **kw})


def prime(trunk, drafter, p, sp, **kw) -> DsparkSpecSession:
    s = DsparkSpecSession.prime(trunk, drafter, p, params(sp, **kw))
    if hasattr(drafter, "follow"):
        drafter.follow(s)
    return s


def run(trunk, drafter, p, sp, **kw) -> DsparkSpecSession:
    s = prime(trunk, drafter, p, sp, **kw)
    while not s.finished():
        spec_burst([s])
    return s


def check_alone_and_batched(trunk, drafter, reqs, n: int, bursts=(1, 4, 7, 13)) -> SpecStats:
    """Each request alone, in its own burst size, then all of them in one batch they join a burst
    apart: every stream is plain sampled decode's for its seed. Returns the alone runs' stats."""
    want = [plain_generate(trunk, p, n, sampling=sp) for p, sp in reqs]
    total = SpecStats()
    for (p, sp), burst, w in zip(reqs, bursts, want):
        s = run(trunk, drafter, p, sp, max_new_tokens=n, burst_target=burst)
        assert s.emitted == w, burst
        total = total.merge(s.stats)
        s.close()
    batch = [prime(trunk, drafter, p, sp, max_new_tokens=n, burst_target=5) for p, sp in reqs]
    joined = []
    while not all(s.finished() for s in batch):
        joined = batch[: len(joined) + 1]
        spec_burst(joined)
    assert [s.emitted for s in batch] == want
    for s in batch:
        s.close()
    return total


def check_demotion_at_every_boundary(trunk, drafter, req, others, n: int) -> int:
    """For every burst boundary k of the request's run (k = 0: right after the prime), a fresh
    session runs k bursts, is demoted, and finishes inside a PlainBatch that already decodes the
    `others` (prompt, sampling): the stream is plain sampled decode's, and the session's draft KV
    is freed at the demotion. Returns the number of boundaries."""
    be = trunk.be
    p, sp = req
    want = plain_generate(trunk, p, n, sampling=sp)
    s, bursts = prime(trunk, drafter, p, sp, max_new_tokens=n), 0
    while not s.finished():
        spec_burst([s])
        bursts += 1
    assert s.emitted == want
    s.close()
    for k in range(bursts):
        s = prime(trunk, drafter, p, sp, max_new_tokens=n)
        s.take_prefix_capture().free()
        for _ in range(k):
            spec_burst([s])
        assert not s.finished()
        emitted, owner = list(s.emitted), s.owner
        cache, last = s.into_demoted()
        assert not any(o.startswith(owner) for o in be.alloc.owners())
        batch, caches = PlainBatch(trunk), [cache]
        for q, sq in others:
            c = trunk.new_cache()
            last_o, _ = prefill_anchor(trunk, c, q, sq)
            caches.append(c)
            batch.join(c, last_o, 50, sampling=sq)
        batch.step()
        sid = batch.join(cache, last, n, emitted, sp)
        while not batch.sequences[sid].finished:
            batch.step()
        assert batch.leave(sid).emitted == want, k
        for c in caches:
            c.free()
    return bursts
