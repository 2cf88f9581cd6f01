"""Mixed passes: plain decode rows riding a speculative round's trunk pass (dspark.session.Riders).

A plain sequence rides as a verify column of width 1 with no drafts, committed and rolled forward
by one row; its column is bitwise the decode step at that position (row invariance, DESIGN
section 3). Exactness hides the bugs here: a rider run as a pass of its own (right tokens, the
weights read twice: the trunk passes are counted), a rider committed at a stale position or
picked with a stale position's noise, a rider dropped from the pass. Each test below fails under
one: the caches are compared bitwise with plain decode's, the sampled riders' tokens with plain
sampled decode's, and the trunk's passes are counted."""

import numpy as np
import pytest

from dspark import cost, gain
from dspark.backends import contract
from dspark.decode import PlainBatch, plain_generate, prefill_anchor
from dspark.errors import NonFiniteRowsError, StateError
from dspark.memory import Memory
from dspark.models.presets import tiny_pair
from dspark.params import SamplingParams, SpecParams
from dspark.session import DsparkSpecSession, Riders, spec_round
from dspark.worker import GateConfig, Worker
from tests.session.test_gain import FrozenClock, shared
from tests.session.test_worker import code_prompt, prompt, shipped  # noqa: F401 (the fixture)

RIDERS = [(None, 9), (SamplingParams(temperature=0.9, seed=5), 30), (SamplingParams(temperature=1.2, top_p=0.9, seed=7), 5)]


def count_passes(trunk, monkeypatch) -> list:
    """Record every trunk pass: (committed in the pass (a decode or prompt pass), its sessions)."""
    passes = []
    real = trunk.forward

    def forward(caches, tokens, **kw):
        passes.append((kw.get("commit"), len(caches)))
        return real(caches, tokens, **kw)
    monkeypatch.setattr(trunk, "forward", forward)
    return passes


def plain_batch(trunk, rng_seed: int) -> PlainBatch:
    """Three plain sequences (greedy, sampled, sampled and filtered) at different contexts and
    budgets (one ends after 5 tokens, one after 9: the riders change between rounds)."""
    rng = np.random.default_rng(rng_seed)
    batch = PlainBatch(trunk)
    for (sampling, budget), n in zip(RIDERS, (7, 33, 18)):
        cache = trunk.new_cache()
        last, _ = prefill_anchor(trunk, cache, prompt(rng, n), sampling)
        batch.join(cache, last, budget, sampling=sampling)
    return batch


def same_cache(trunk, a, b) -> bool:
    """Bitwise the same rows and state (and chunk tails where the trunk's prompt passes read them)."""
    host = trunk.be.to_host
    return a.pos == b.pos and (a.chunk_len == b.chunk_len or not trunk.chunked_gdn) and all(
        np.array_equal(host(x), host(y)) for name in ("k", "v", "state", "conv")
        for x, y in zip(getattr(a, name), getattr(b, name)))


@pytest.mark.parametrize("backend, rollback", [("numpy", "checkpoint"), ("numpy", "replay"), ("simt", "checkpoint"),
                                               ("cuda", "checkpoint")])
def test_riders_decode_as_plain_steps_in_the_rounds_pass(request, backend, rollback, monkeypatch):
    """Two speculative sessions carry three plain sequences round after round: each round is ONE
    trunk pass; every rider's token, cache (K/V, recurrent state, conv window, pos) and sampled
    pick equal a plain batch stepping alone, bitwise; the sessions emit what they emit alone. On
    the kernels (simt, cuda) too: a verify column of width 1 beside wider ones is a decode step."""
    be = request.getfixturevalue({"numpy": "numpy_backend"}.get(backend, backend))
    trunk, drafter = tiny_pair(be, 21)
    rng = np.random.default_rng(8)
    prompts = [prompt(rng, n) for n in (11, 26)]
    # launches="plain": rounds op by op (rounds replayed from recordings carry no riders)
    params = SpecParams(max_new_tokens=200, rollback=rollback, launches="plain")
    spec = [DsparkSpecSession.prime(trunk, drafter, p, params) for p in prompts]
    twins = [DsparkSpecSession.prime(trunk, drafter, p, params) for p in prompts]
    mixed, alone = plain_batch(trunk, 4), plain_batch(trunk, 4)
    passes = count_passes(trunk, monkeypatch)
    rounds = 0
    while mixed.active():
        riders = Riders(mixed.riders())
        del passes[:]
        got = spec_round(spec, riders)
        assert passes == [(False, len(spec) + len(riders.seqs))], passes  # one pass, the riders in it
        if riders.seqs:
            assert set(riders.picks) == {s.id for s in riders.seqs}
        out = mixed.step(picks=riders.picks if riders.seqs else {})
        assert list(out.values()) == list(alone.step().values())
        for a, b in zip(mixed.sequences.values(), alone.sequences.values()):
            assert (a.last, a.emitted, a.finished) == (b.last, b.emitted, b.finished)
            assert same_cache(trunk, a.cache, b.cache)
        assert got == spec_round(twins)
        rounds += 1
    assert rounds == 30 and [s.emitted for s in spec] == [s.emitted for s in twins]
    assert [s.emitted for s in alone.sequences.values()][0] == plain_generate(trunk, prompt(np.random.default_rng(4), 7), 9)


def test_step_refuses_picks_for_other_sequences(numpy_backend):
    """Picks for other sequences than the riders are refused, and nothing moves."""
    trunk, _ = tiny_pair(numpy_backend, 21)
    batch = plain_batch(trunk, 4)
    ids = [s.id for s in batch.riders()]
    before = [(s.last, list(s.emitted)) for s in batch.sequences.values()]
    for picks in ({i: 1 for i in ids[:-1]}, {**{i: 1 for i in ids}, -5: 1}):
        with pytest.raises(StateError, match="riders"):
            batch.step(picks=picks)
    assert [(s.last, list(s.emitted)) for s in batch.sequences.values()] == before


def test_mixed_step_prices_the_riders_at_their_marginal_rows():
    """Rounds at 2 s a row, plain rows 0.1 s beyond the first. Beside 2 plain rows riding the
    round's pass a session speculates iff (t + 2) / (2 + 2 x 0.1) > 3 / 1.2, i.e. t > 3.5; as a
    pass of its own the plain step costs 1.1 s more and t must pass 5.75."""
    m = shared(2.0, 0.1)
    edge = 3 / 1.2 * 2.2 - 2
    for t, want in ((edge - 0.05, 0), (edge + 0.05, 1)):
        k, rates = gain.joint_split(m, [(t, 8.0, "greedy", False)], 2, 0, mixed=True)
        assert k == want, (t, rates)
        assert rates[1] == pytest.approx((t + 2) / 2.2)
        assert gain.joint_split(m, [(t, 8.0, "greedy", False)], 2, 0)[0] == 0
    # with no live round the plain rows are a pass of their own, mixed or not
    assert gain.step_rate(m, [], 3, 0, mixed=True) == pytest.approx(3 / 1.2)


def test_a_round_with_riders_is_recorded_less_their_price():
    """A round that carried 2 riders took 2.6 s; the riders' marginal rows cost 0.1 s each, so the
    round alone is priced 2.4 s, as a round without riders."""
    m = shared(2.0, 0.1)
    before = m.round_seconds(1, 8, 0)
    m.record("round", 1, 0, before + 0.2, width=8, riders=2, rider_rule="greedy")
    assert m.round_seconds(1, 8, 0) == pytest.approx(before)
    assert m.rider_seconds(2, 0) == pytest.approx(0.2)


def test_mixed_session_gain_is_the_steps_rate_against_riding(numpy_backend):
    """A session of t tokens a round at 2 s a round, beside 2 riding plain rows at 0.1 s: with it
    speculative (t + 2) / 2.2 tokens/s, with it a third rider 3 / 1.2: gain 1 at t = 3.5."""
    from types import SimpleNamespace
    from collections import deque
    trunk, drafter = tiny_pair(numpy_backend, 21)
    with cost.using(trunk.be, shared(2.0, 0.1)):
        for t, above in ((3.45, False), (3.55, True)):
            s = SimpleNamespace(be=trunk.be, drafter=SimpleNamespace(acceptance=Memory(), accept_floor=t, config=drafter.config),
                                params=SpecParams(), cache=SimpleNamespace(pos=0), recent=deque([(t, 8)] * 32))
            g = gain.session_gain(s, [s], 2, "greedy")
            assert (g > 1) == above, (t, g)


def test_worker_mixes_where_the_joint_decision_says(shipped, monkeypatch):
    """Greedy code (accepts well) and two hot sampled requests, rounds at 2 s a row and plain rows
    0.1 s: the joint decision speculates the code beside the plain pair, whose steps ride its
    rounds: no decode pass of its own runs while it speculates. Every stream is plain decode's
    (greedy) or plain sampled decode's with its seed; with mix=False the plain pair runs passes of
    its own and the decision keeps everything plain."""
    trunk, drafter = shipped
    rng = np.random.default_rng(0)
    hot = [SamplingParams(temperature=1.0, top_p=0.95, seed=s) for s in (3, 4)]
    reqs = [(code_prompt(trunk, rng, 40), 96, None), (code_prompt(trunk, rng, 50), 12, hot[0]),
            (code_prompt(trunk, rng, 30), 7, hot[1])]
    want = [plain_generate(trunk, p, n, sampling=s) for p, n, s in reqs]
    for mix in (True, False):
        drafter.acceptance.clear()
        passes = count_passes(trunk, monkeypatch)
        with cost.using(trunk.be, shared(2.0, 0.1)):
            w = Worker(trunk, drafter, GateConfig(low=4, high=8), spec=SpecParams(burst_target=8), mix=mix)
            ids = [w.submit(p, n, s) for p, n, s in reqs]
            w.run()
        assert [w.result(i) for i in ids] == want
        admits = {e.request: e.what for e in w.events if e.what.startswith("admit")}
        decodes = sum(1 for commit, _ in passes if commit) - len(reqs)  # less each request's prompt pass
        m = w.metrics()
        if mix:
            assert admits == {ids[0]: "admit_spec", ids[1]: "admit_plain", ids[2]: "admit_plain"}, w.events
            assert decodes == 0 and m["dspark:plain_steps"] == 0, passes
            # the longer plain request's 12 tokens: 11 decoded in rounds, the last emitted with nothing to decode
            assert m["dspark:mixed_rounds"] == 11
        else:
            assert set(admits.values()) == {"admit_plain"}, w.events
            assert 0 < decodes <= m["dspark:plain_steps"] and m["dspark:mixed_rounds"] == 0


def test_a_failing_rider_is_retired_and_the_others_go_on(shipped):
    """A plain request whose cache holds a NaN fails inside a mixed round: the round raises before
    anything commits, the speculative session re-runs alone, the plain step alone finds the
    culprit and retires it; the other streams are plain decode's."""
    trunk, drafter = shipped
    rng = np.random.default_rng(2)
    reqs = [(code_prompt(trunk, rng, 40), 40, None), (code_prompt(trunk, rng, 30), 20, None),
            (code_prompt(trunk, rng, 35), 20, SamplingParams(temperature=1.0, seed=1))]
    drafter.acceptance.clear()
    with cost.using(trunk.be, shared(2.0, 0.1)):
        w = Worker(trunk, drafter, GateConfig(low=4, high=8), spec=SpecParams(burst_target=8))
        ids = [w.submit(p, n, s) for p, n, s in reqs]
        w.step()
        assert [w.requests[i].mode for i in ids] == ["spec", "plain", "plain"], w.events
        victim = w.plain.sequences[w.requests[ids[1]].plain_id]
        victim.cache.state[0][...] = np.nan
        w.run()
    assert w.requests[ids[1]].mode == "failed" and "NaN" in w.requests[ids[1]].error
    for i in (ids[0], ids[2]):
        p, n, s = reqs[i - ids[0]]
        assert w.result(i) == plain_generate(trunk, p, n, sampling=s)


UNIFORM = {"greedy": (None, None, None),  # a batch all greedy or all sampled: on cuda, a recorded step
           "sampled": (SamplingParams(temperature=0.9, seed=5), SamplingParams(temperature=0.7, top_k=20, seed=3),
                       SamplingParams(temperature=1.2, top_p=0.9, seed=7))}


@pytest.mark.parametrize("backend", ["numpy", "cuda"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_plain_step_with_a_nan_row_goes_on_for_the_others(numpy_backend, backend, kind):
    """A plain step over three sequences, the middle one's recurrent state poisoned with NaN after
    two steps: the step raises NonFiniteRowsError naming it, with the tokens the other two emitted;
    it is finished with the error and emitted nothing, and the other two, stepped on by the same
    step, run on to plain decode's streams of their prompts alone. On cuda the step is a recorded
    pass (the batch is all greedy or all sampled; the CuPy contract stand-in). Fails if the step
    raised for the whole batch after its decode committed every row (the healthy sequences would
    skip a position at their next step) or dropped the others' picks."""
    be = numpy_backend if backend == "numpy" else contract.backend()
    trunk, _ = tiny_pair(be, 21)
    rng = np.random.default_rng(5)
    prompts, budgets = [prompt(rng, n) for n in (7, 19, 12)], (8, 12, 6)
    batch = PlainBatch(trunk)
    for p, n, sampling in zip(prompts, budgets, UNIFORM[kind]):
        cache = trunk.new_cache()
        last, _ = prefill_anchor(trunk, cache, p, sampling)
        batch.join(cache, last, n, sampling=sampling)
    batch.step()
    batch.step()
    seqs = list(batch.sequences.values())
    seqs[1].cache.state[0][...] = np.nan
    victim = (seqs[1].last, list(seqs[1].emitted))
    with pytest.raises(NonFiniteRowsError, match=f"sequences \\[{seqs[1].id}\\]") as err:
        batch.step()
    assert set(err.value.failed) == {seqs[1].id} and "contains NaN" in err.value.failed[seqs[1].id]
    assert err.value.emitted == {seqs[0].id: seqs[0].emitted[-1], seqs[2].id: seqs[2].emitted[-1]}
    assert seqs[1].finished and seqs[1].error == err.value.failed[seqs[1].id]
    assert (seqs[1].last, seqs[1].emitted) == victim
    batch.leave(seqs[1].id).cache.free()
    batch.run()
    for i in (0, 2):
        assert seqs[i].emitted == plain_generate(trunk, prompts[i], budgets[i], sampling=UNIFORM[kind][i])
        assert seqs[i].cache.pos == prompts[i].size + len(seqs[i].emitted) - 1
        seqs[i].cache.free()
