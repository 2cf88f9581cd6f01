"""DsparkSpecSession (greedy): exactness against plain decode, the burst invariant, demotion and
its memory accounting, captures, statistics, and bad input leaving state intact."""

import numpy as np
import pytest

from dspark.decode import PlainBatch, plain_generate
from dspark.errors import CapacityError, ShapeError, StateError, TokenRangeError
from dspark.models.oracle import OracleDrafter, greedy_continuation
from dspark.models.presets import tiny_pair
from dspark.profile import phase
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams, spec_burst


def prompt(rng, n):
    return rng.integers(0, 256, n).astype(np.int32)


def oracle(trunk, drafter, p, max_new, hit_rate=0.8):
    """The drafter, made to hit the trunk's greedy stream often (partial accepts of every length
    occur) and to accept drafts past the request's end (its last round is cut at the EOS or at
    the budget)."""
    o = OracleDrafter(drafter, hit_rate=hit_rate, seed=len(p))
    o.next_stream = [*np.asarray(p).tolist(), *greedy_continuation(trunk, p, max_new + drafter.config.block)]
    o.next_stop = len(p) + len(plain_generate(trunk, p, max_new)) - 1
    return o


def run_spec(trunk, drafter, p, params):
    s = DsparkSpecSession.prime(trunk, drafter, p, params)
    while not s.finished():
        spec_burst([s])
        assert s.finished() or s.cache.pos == len(p) + len(s.emitted)
    return s


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
@pytest.mark.parametrize("verify", ["confidence", "ladder"])
def test_greedy_spec_equals_plain(model_backend, rng, verify, rollback):
    trunk, drafter = tiny_pair(model_backend, int(rng.integers(1000)))
    p = prompt(rng, int(rng.integers(1, 60)))
    want = plain_generate(trunk, p, 30)
    drafter = oracle(trunk, drafter, p, 30)
    s = run_spec(trunk, drafter, p, SpecParams(max_new_tokens=30, burst_target=7, verify=verify, rollback=rollback))
    assert s.emitted == want
    assert len(want) < 10 or sum(s.stats.histogram[1:]) > 0  # partial accepts were exercised
    assert s.finish_reason == ("eos" if want[-1] == trunk.config.eos_id else "budget")
    assert s.stats.rounds + s.stats.accepted > len(s.emitted)  # the last round's accepted block was cut


def test_batched_sessions_equal_solo_sessions(model_backend):
    """Five sessions that accept several drafts per round (an oracle drafter), in one batch that
    they join at different rounds, emit exactly what each emits alone, on every backend."""
    trunk, drafter = tiny_pair(model_backend, 3)
    rng = np.random.default_rng(3)
    prompts = [prompt(rng, int(n)) for n in rng.integers(1, 50, 5)]
    params = SpecParams(max_new_tokens=24, burst_target=5)
    o = OracleDrafter(drafter, hit_rate=0.85, seed=3)
    solo, batch, stats = [], [], []
    for p in prompts:
        o.next_stream = [*p.tolist(), *greedy_continuation(trunk, p, 24 + drafter.config.block)]  # each kv its own
        s = run_spec(trunk, o, p, params)
        solo.append(s.emitted)
        stats.append(s.stats)
        s.close()
        batch.append(DsparkSpecSession.prime(trunk, o, p, params))
    joined = []
    while not all(s.finished() for s in batch):
        joined = batch[: len(joined) + 1] if len(joined) < len(batch) else joined  # one more joins each burst
        spec_burst(joined)
        for s, p in zip(batch, prompts):
            assert s.finished() or s.cache.pos == len(p) + len(s.emitted)
    assert [s.emitted for s in batch] == solo
    # the drafter is row-invariant too: every session drafted and accepted as it did alone
    assert [(s.stats.histogram, s.stats.verified_at) for s in batch] == [(st.histogram, st.verified_at) for st in stats]
    assert solo == [plain_generate(trunk, p, 24) for p in prompts]
    total = stats[0]
    for st in stats[1:]:
        total = total.merge(st)
    assert total.mean_accepted_length >= 3.0, total.summary()


@pytest.mark.parametrize("verify", ["confidence", "ladder"])
def test_max_verify_caps_the_verify_width(numpy_backend, rng, verify):
    trunk, drafter = tiny_pair(numpy_backend, 12, block=8)
    p = prompt(rng, 20)
    drafter = oracle(trunk, drafter, p, 40, hit_rate=1.0)
    s = run_spec(trunk, drafter, p, SpecParams(max_new_tokens=40, verify=verify, tau=0.0, max_verify=4))
    assert s.emitted == plain_generate(trunk, p, 40)
    assert len(s.stats.verified_at) <= 3  # at most 3 drafts (vt <= 4) were ever verified


def test_context_cap_stops_exactly_where_plain_does(numpy_backend, rng):
    trunk, drafter = tiny_pair(numpy_backend, 4, max_ctx=40)
    p = prompt(rng, 33)
    want = plain_generate(trunk, p, 100)
    assert len(want) == 40 - 33 + 1
    s = run_spec(trunk, drafter, p, SpecParams(max_new_tokens=100))
    assert s.emitted == want and s.finish_reason == "context"


def live_after_a_burst(trunk, drafter, rng, params, target=None):
    """(session, prompt): a session still unfinished after one burst (a random trunk may emit EOS
    early: try another prompt then). An OracleDrafter is pointed at each prompt's stream."""
    for _ in range(20):
        p = prompt(rng, 20)
        if isinstance(drafter, OracleDrafter):
            drafter.next_stream = [*p.tolist(), *greedy_continuation(trunk, p, params.max_new_tokens + 8)]
        s = DsparkSpecSession.prime(trunk, drafter, p, params)
        s.burst(target)
        if not s.finished():
            return s, p
        s.close()
    raise AssertionError("every prompt finished within one burst")


def owners(be, sid):
    return {o: b for o, b in be.alloc.owners().items() if o.startswith((f"spec/{sid}/", f"cache/{sid}"))}


def test_demotion_frees_the_speculative_state(numpy_backend):
    """A session that accepted several drafts per round (partial accepts rolled back) is demoted
    after a burst and finishes exactly in plain decode."""
    be = numpy_backend
    trunk, drafter = tiny_pair(be, 5)
    drafter = OracleDrafter(drafter, hit_rate=0.9, seed=5)
    s, p = live_after_a_burst(trunk, drafter, np.random.default_rng(5),
                              SpecParams(max_new_tokens=50, burst_target=24, capture=False))
    assert s.stats.mean_accepted_length >= 3.0 and sum(s.stats.histogram[1:-1]) > 0, s.stats.summary()
    before = owners(be, s.id)
    # the draft KV is all a greedy session holds besides its cache: no snapshot (the verify never
    # writes the recurrent state) and no device counter
    assert before[f"spec/{s.id}/draft_kv"] > 0 and set(before) == {f"spec/{s.id}/draft_kv", f"cache/{s.id}"}
    cache_bytes = before[f"cache/{s.id}"]
    total = be.alloc.bytes()
    cache, last = s.into_demoted()
    after = owners(be, s.id)
    assert after == {f"cache/{s.id}": cache_bytes}
    freed = sum(v for k, v in before.items() if k.startswith("spec/"))
    assert be.alloc.bytes() == total - freed
    # the demoted cache continues exactly
    batch = PlainBatch(trunk)
    sid = batch.join(cache, last, 50, s.emitted)
    batch.run()
    assert batch.leave(sid).emitted == plain_generate(trunk, p, 50)
    cache.free()
    assert owners(be, s.id) == {}


def test_demotion_refusals_leave_the_session_intact(numpy_backend, rng):
    trunk, drafter = tiny_pair(numpy_backend, 6)
    p = prompt(rng, 10)
    sampled = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(sampling=SamplingParams(temperature=0.8, seed=1),
                                                                    sampler="rejection"))
    snap = numpy_backend.alloc.owners()
    with pytest.raises(StateError, match="sampled by rejection cannot be demoted"):
        sampled.into_demoted()
    assert numpy_backend.alloc.owners() == snap and sampled.cache is not None
    sampled.close()

    done = run_spec(trunk, drafter, p, SpecParams(max_new_tokens=5))
    with pytest.raises(StateError, match="finished"):
        done.into_demoted()
    done.close()

    s, _ = live_after_a_burst(trunk, drafter, rng, SpecParams(max_new_tokens=40), 4)
    s.into_demoted()
    with pytest.raises(StateError, match="demoted"):
        s.into_demoted()
    with pytest.raises(StateError, match="demoted"):
        s.round()


def test_demotion_mid_round_is_refused(numpy_backend, rng, monkeypatch):
    trunk, drafter = tiny_pair(numpy_backend, 7)
    s = DsparkSpecSession.prime(trunk, drafter, prompt(rng, 10), SpecParams(max_new_tokens=40))
    seen = []
    real = drafter.block_pass

    def reentrant(kvs, anchors):
        with pytest.raises(StateError, match="mid-round"):
            s.into_demoted()
        seen.append(True)
        return real(kvs, anchors)

    monkeypatch.setattr(drafter, "block_pass", reentrant)
    s.round()
    assert seen and s.kv is not None
    s.check_invariant()


def test_prefix_capture_is_taken_exactly_once(numpy_backend, rng):
    trunk, drafter = tiny_pair(numpy_backend, 8)
    p = prompt(rng, 15)
    s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=30))
    cap = s.take_prefix_capture()
    assert cap.pos == 15 and cap.prompt == tuple(p.tolist()) and cap.nbytes > 0
    assert s.take_prefix_capture() is None
    restored = DsparkSpecSession.restore(trunk, drafter, cap, SpecParams(max_new_tokens=30))
    while not restored.finished():
        restored.burst()
    assert restored.emitted == plain_generate(trunk, p, 30)
    off = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(capture=False))
    with pytest.raises(StateError, match="capture is off"):
        off.take_prefix_capture()
    for x in (s, restored, off):
        x.close()
    cap.free()


def test_statistics(numpy_backend, rng):
    trunk, drafter = tiny_pair(numpy_backend, 9)
    s = run_spec(trunk, drafter, prompt(rng, 12), SpecParams(max_new_tokens=40))
    st = s.stats
    assert st.rounds == s.rounds == sum(st.histogram)
    assert st.accepted == sum(m * n for m, n in enumerate(st.histogram))
    assert st.mean_accepted_length == pytest.approx(1 + st.accepted / st.rounds)
    assert st.accepted_at[0] <= st.verified_at[0] == st.rounds
    assert all(0 <= a <= 1 for a in st.acceptance_by_position)
    merged = st.merge(st)
    assert merged.rounds == 2 * st.rounds and merged.mean_accepted_length == pytest.approx(st.mean_accepted_length)
    s.close()


@pytest.mark.parametrize("bad,err,match", [
    ([1, 2, 300], TokenRangeError, r"prompt_ids\[2\]=300 is outside the vocabulary \[0, 258\)"),
    ([1, -1], TokenRangeError, r"prompt_ids\[1\]=-1 is outside the vocabulary"),
    ([], ShapeError, "prompt_ids is empty"),
    (list(range(256)), CapacityError, "prompt_ids has 256 tokens: the context holds 256"),
    (np.array([1.5, 2.0]), TokenRangeError, "expected integer token ids"),
    (np.zeros((2, 2), np.int32), ShapeError, "expected a 1-D sequence"),
])
def test_bad_prompts_are_refused_and_allocate_nothing(numpy_backend, bad, err, match):
    trunk, drafter = tiny_pair(numpy_backend, 10)
    before = numpy_backend.alloc.owners()
    with pytest.raises(err, match=match):
        DsparkSpecSession.prime(trunk, drafter, bad, SpecParams())
    assert numpy_backend.alloc.owners() == before


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(verify="wide"), "verify='wide'"),
    (dict(rollback="undo"), "rollback='undo'"), (dict(tau=1.5), "tau=1.5"), (dict(burst_target=0), "burst_target=0"),
    (dict(max_verify=1), "max_verify=1"),
])
def test_bad_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(min_p=1.0), "min_p"),
    (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed"),
])
def test_bad_sampling_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_failing_round_leaves_the_session_as_it_was(numpy_backend, rng, monkeypatch):
    trunk, drafter = tiny_pair(numpy_backend, 11)
    s, p = live_after_a_burst(trunk, drafter, rng, SpecParams(max_new_tokens=40), 3)
    state = [a.copy() for a in s.cache.recurrent()]
    pos, emitted, last = s.cache.pos, list(s.emitted), s.last

    def poisoned(*a, **k):
        raise FloatingPointError("injected failure in accept")

    import dspark.session as session_mod
    monkeypatch.setattr(session_mod, "greedy_accept", poisoned)
    with pytest.raises(FloatingPointError):
        s.round()
    assert (s.cache.pos, s.emitted, s.last) == (pos, emitted, last)
    assert all(np.array_equal(a, b) for a, b in zip(s.cache.recurrent(), state))
    monkeypatch.undo()
    while not s.finished():
        s.burst()
    assert s.emitted == plain_generate(trunk, p, 40)


def test_nvtx_phases_cost_nothing_without_a_profiler():
    assert phase("verify") is phase("draft")  # one shared no-op context manager
    with phase("verify"):
        pass


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_every_round_leaves_the_state_plain_decode_would(numpy_backend, rollback):
    """After each round the trunk's cache holds bitwise what plain decode of the same tokens
    holds: gdn state, conv windows and the committed K/V rows. The emitted stream alone cannot
    show a rollback that keeps one column too many (a small state error rarely flips an argmax
    of the tiny model); the state itself does. Fixed seeds: partial accepts of several lengths
    occur every run."""
    trunk, drafter = tiny_pair(numpy_backend, 7)
    p = prompt(np.random.default_rng(3), 23)
    s = DsparkSpecSession.prime(trunk, oracle(trunk, drafter, p, 40, hit_rate=0.6), p,
                                SpecParams(max_new_tokens=40, rollback=rollback))
    partial = 0
    while not s.finished():
        s.round()
        tokens = [*p.tolist(), *s.emitted][: s.cache.pos]
        plain = trunk.new_cache()
        trunk.prefill(plain, tokens)
        assert plain.pos == s.cache.pos
        assert all(np.array_equal(a, b) for a, b in zip(s.cache.recurrent(), plain.recurrent())), s.cache.pos
        assert all(np.array_equal(a[:, : plain.pos], b[:, : plain.pos])
                   for a, b in zip([*s.cache.k, *s.cache.v], [*plain.k, *plain.v]))
        plain.free()
        partial = sum(s.stats.histogram[: drafter.config.block - 1])
    assert partial >= 3, s.stats.histogram
