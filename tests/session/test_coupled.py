"""Coupled sampled speculation (SpecParams(sampler="coupled")): for a fixed seed the speculative
stream is plain sampled decode's, token for token, alone or batched, in any burst size and with a
demotion at any burst boundary; and the accept is the coupled one, which exactness alone cannot
show.

Exactness cannot see the drafter's side: the emitted tokens are the target's picks whatever the
drafter proposes, so a drafter drawing with other noise than the target's (another stream, the
round instead of the position) or an accept that takes drafts the target merely allows would keep
every stream exact on some drafter. Two checks look at the accept itself: a drafter whose
filtered rows are the target's must have every draft accepted, and each round must accept exactly
the drafts that equal the plain stream at their positions, no more and no fewer. The distribution
(chi-square against the trunk's filtered law): tests/session/test_lossless.py.

The drafter is dspark.models.oracle.TrunkDrafter: its q is the trunk's own filtered distribution,
tilted, so rounds accept some drafts and reject others at every slot.
"""

import numpy as np
import pytest

import dspark.spec_sampling as spec_sampling
from dspark.decode import plain_generate, prefill_anchor
from dspark.errors import StateError
from dspark.models.oracle import TrunkDrafter
from dspark.models.presets import tiny_pair
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams, spec_burst
from dspark.spec_sampling import pick_at
from tests.session.coupled_runs import N, check_alone_and_batched, check_demotion_at_every_boundary, params, prime, run
REQUESTS = [(12, SamplingParams(temperature=0.8, top_k=20, seed=3)),
            (3, SamplingParams(temperature=0.6, top_p=0.9, seed=1234)),
            (20, SamplingParams(temperature=1.1, min_p=0.05, seed=2)),
            (41, SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=0))]


@pytest.fixture(scope="module")
def pairs():
    made = {}

    def get(be):
        if be.name not in made:
            made[be.name] = tiny_pair(be, 31, max_ctx=96)
        return made[be.name]
    return get


def prompts():
    rng = np.random.default_rng(2)
    return [(rng.integers(0, 256, n).astype(np.int32), sp) for n, sp in REQUESTS]


def test_coupled_stream_is_plain_sampled_decode(model_backend, pairs):
    """Four requests with their own prompts, filters and seeds: alone, each in its own burst size
    (1 to 13 tokens), and in one batch they join a burst apart, each emits plain sampled decode's
    stream for its seed; another seed gives another stream. The rounds accept partial blocks."""
    trunk, base = pairs(model_backend)
    drafter = TrunkDrafter(base, tilt=0.6, seed=7)
    reqs = prompts()
    total = check_alone_and_batched(trunk, drafter, reqs, N)
    print(total.summary())
    nd = drafter.config.drafts
    assert total.mean_accepted_length >= 1.8 and sum(total.histogram[1:nd]) >= 4, total.summary()
    p, sp = reqs[0]
    assert plain_generate(trunk, p, N, sampling=SamplingParams(**{**sp.__dict__, "seed": 4})) != \
        plain_generate(trunk, p, N, sampling=sp)


def test_demotion_at_every_burst_boundary(model_backend, pairs):
    trunk, base = pairs(model_backend)
    (p, sp), (q, sq) = prompts()[0], prompts()[2]
    others = [(q[:9], sq), (q[:17], SamplingParams(temperature=0.5, seed=11))]
    assert check_demotion_at_every_boundary(trunk, TrunkDrafter(base, tilt=0.6, seed=7), (p, sp), others, N) >= 4


@pytest.fixture(scope="module")
def shipped():
    made = {}

    def get(be):
        if be.name not in made:
            from dspark.models import load_default
            made[be.name] = load_default(be)
        return made[be.name]
    return get


def test_embedded_pair_coupled_stream_is_plain_sampled_decode(model_backend, shipped):
    """The shipped pair, its trained drafter unsteered, on held-out code: three requests alone (bursts
    of 1, 4 and 7 tokens) and batched, and one with a demotion at every burst boundary, emit plain
    sampled decode's stream; the drafts are really accepted."""
    import json
    from pathlib import Path
    trunk, drafter = shipped(model_backend)
    held = json.loads(Path(__file__).with_name("heldout_prompts.json").read_text())["prompts"]
    samplings = [SamplingParams(temperature=0.3, seed=5), SamplingParams(temperature=0.8, top_k=20, seed=6),
                 SamplingParams(temperature=1.0, top_p=0.95, seed=7)]
    reqs = [(np.frombuffer(bytes.fromhex(h), np.uint8).astype(np.int32)[-n:], sp)
            for h, n, sp in zip(held[:3], (24, 40, 56), samplings)]
    n = 16
    total = check_alone_and_batched(trunk, drafter, reqs, n, bursts=(1, 4, 7))
    print(total.summary())
    assert total.mean_accepted_length >= 2.0 and sum(total.histogram[1:]) > 0, total.summary()
    assert check_demotion_at_every_boundary(trunk, drafter, reqs[0], [reqs[1]], n) >= 2


def test_prime_restore_and_plain_take_the_same_first_token(numpy_backend, pairs):
    """The first anchor is the pick at the first position after the prompt, under either sampler,
    primed or restored, and plain decode's first token."""
    trunk, base = pairs(numpy_backend)
    p = prompts()[1][0]
    for seed in range(6):
        sp = SamplingParams(temperature=1.0, seed=seed)
        cache = trunk.new_cache()
        plain, _ = prefill_anchor(trunk, cache, p, sp)
        cache.free()
        for sampler in ("coupled", "rejection"):
            s = DsparkSpecSession.prime(trunk, base, p, params(sp, sampler=sampler))
            cap = s.take_prefix_capture()
            r = DsparkSpecSession.restore(trunk, base, cap, params(sp, sampler=sampler))
            assert s.last == r.last == plain, (seed, sampler)
            for x in (s, r):
                x.close()
            cap.free()


def rounds_of(monkeypatch):
    """Spy on the coupled accept: per round, (session id, anchor position, candidates, m)."""
    seen = []

    def spy(live, tp, cands, vts):
        m, nxt = real(live, tp, cands, vts)
        seen.extend((s.id, s.cache.pos, [int(t) for t in c], int(k)) for s, c, k in zip(live, cands, m))
        return m, nxt

    real = spec_sampling.accept_coupled
    monkeypatch.setattr(spec_sampling, "accept_coupled", spy)
    return seen


def picks_past_the_end(trunk, p, sp, n: int) -> list[int]:
    """Plain sampled decode's picks, n of them, straight past EOS: what the verify picks beyond the
    end of a request."""
    be, cache = trunk.be, trunk.new_cache()
    logits, out = trunk.prefill(cache, p).logits[-1:], []
    for _ in range(n):
        out.append(int(pick_at(be, logits, [sp], [cache.pos])[0]))
        logits = trunk.decode([cache], [out[-1]]).logits
    cache.free()
    return out


def test_a_drafter_that_is_the_target_has_every_draft_accepted(numpy_backend, pairs, monkeypatch):
    """tilt 0: the drafter's filtered rows are the target's at every slot (top-p off: a second
    top-p cut over already cut rows could shrink them). With the same position's noise on both
    sides its proposal is the target's pick, so every verified draft is accepted. A drafter
    drawing with other noise (another stream, the round's counter, the draft slot) agrees by
    chance only, and its stream stays exact."""
    trunk, base = pairs(numpy_backend)
    drafter = TrunkDrafter(base, tilt=0.0, seed=7)
    seen = rounds_of(monkeypatch)
    for (p, sp), fix in zip(prompts(), (dict(), dict(temperature=1.4), dict(min_p=0.02), dict(top_p=1.0))):
        sp = SamplingParams(**{**sp.__dict__, "top_p": 1.0, **fix})
        s = run(trunk, drafter, p, sp)
        assert s.emitted == plain_generate(trunk, p, N, sampling=sp)
        assert s.stats.accepted == s.stats.drafted and s.stats.rounds >= 6, s.stats.summary()
        s.close()
    assert len(seen) >= 24


def test_each_round_accepts_exactly_the_drafts_that_agree(numpy_backend, pairs, monkeypatch):
    """Round by round, m equals the length of the longest prefix of its drafts that equal the
    plain sampled stream at their positions (past the request's end too: the picks run on past the
    budget and any EOS, as the verify's do), and the session's statistics add up to those m. An accept that takes a
    draft the target merely gives mass to, or that stops early, fails here even where the text
    stays exact."""
    trunk, base = pairs(numpy_backend)
    drafter = TrunkDrafter(base, tilt=0.6, seed=7)
    seen = rounds_of(monkeypatch)
    nd = drafter.config.drafts
    ms = []
    for p, sp in prompts():
        beyond = picks_past_the_end(trunk, p, sp, N + nd + 1)
        stream = [*p.tolist(), *beyond]
        s = run(trunk, drafter, p, sp)
        assert s.emitted == beyond[: len(s.emitted)]
        mine = [(pos, cand, m) for sid, pos, cand, m in seen if sid == s.id]
        assert len(mine) == s.stats.rounds and sum(m for _, _, m in mine) == s.stats.accepted
        for pos, cand, m in mine:
            assert cand[0] == stream[pos]  # the anchor
            agree = 0
            while agree < len(cand) - 1 and cand[agree + 1] == stream[pos + agree + 1]:
                agree += 1
            assert m == agree, (pos, cand, stream[pos: pos + len(cand) + 1], m)
            ms.append(m)
        s.close()
    hist = np.bincount(ms, minlength=nd + 1)
    print(f"m histogram {hist.tolist()}")
    assert hist[0] > 0 and hist[1:nd].sum() > 0, hist  # rejections at the first slot and later


def test_rules_do_not_mix_and_rejection_sessions_are_not_demoted(numpy_backend, pairs):
    trunk, base = pairs(numpy_backend)
    p, sp = prompts()[0]
    a = DsparkSpecSession.prime(trunk, base, p, params(sp))
    b = DsparkSpecSession.prime(trunk, base, p, params(sp, sampler="rejection"))
    g = DsparkSpecSession.prime(trunk, base, p, params(SamplingParams()))
    with pytest.raises(ValueError, match=r"mixes accept rules \['coupled', 'rejection'\]"):
        spec_burst([a, b])
    with pytest.raises(ValueError, match=r"mixes accept rules \['coupled', 'greedy'\]"):
        spec_burst([g, a])
    assert a.params.demotable and g.params.demotable and not b.params.demotable
    with pytest.raises(StateError, match="sampled by rejection cannot be demoted"):
        b.into_demoted()
    for s in (a, b, g):
        assert s.rounds == 0 and s.emitted == []
        s.close()
    with pytest.raises(ValueError, match="SpecParams.sampler='gumbel'"):
        SpecParams(sampler="gumbel")


def test_the_host_proposal_is_the_launches_proposal(numpy_backend, shipped, monkeypatch):
    """The host reference's coupled proposal (spec_sampling.propose_on_host: checks made once,
    noise drawn ahead, the Markov bias from a table, no prob) proposes, round by round, the
    drafts, confidences and statuses of the launches' (propose_by_slots: markov_logits and
    sample_filtered per slot), for a batch of sessions with their own filters, seeds and
    positions. The streams stay exact whatever the drafter proposes, so a slot
    drawn with another slot's stream or another row's filter shows only here."""
    trunk, drafter = shipped(numpy_backend)
    held = [np.frombuffer(b"def walk(root):\n    for ", np.uint8), np.frombuffer(b"import os\nx = [", np.uint8),
            np.frombuffer(b"class A:\n", np.uint8)]
    samplings = [SamplingParams(temperature=0.3, seed=5), SamplingParams(temperature=0.8, top_p=0.95, seed=6),
                 SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=7)]
    real, seen = spec_sampling.coupled_proposals, []
    monkeypatch.setattr(spec_sampling, "coupled_proposals",
                        lambda d, B, got: seen.append({k: v.copy() for k, v in got.items()}) or real(d, B, got))

    def proposals(propose):
        monkeypatch.setattr(spec_sampling, "propose_on_host", propose)
        seen.clear()
        batch = [prime(trunk, drafter, p.astype(np.int32), sp, max_new_tokens=24) for p, sp in zip(held, samplings)]
        while not all(s.finished() for s in batch):
            spec_burst(batch)
        out = [s.emitted for s in batch]
        for s in batch:
            s.close()
        return list(seen), out

    lean, lean_out = proposals(spec_sampling.propose_on_host)
    each, each_out = proposals(spec_sampling.propose_by_slots)
    assert lean_out == each_out and len(lean) == len(each) >= 4
    for a, b in zip(lean, each):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
