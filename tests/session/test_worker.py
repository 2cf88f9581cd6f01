"""Worker: the gate's transitions, prefix publication and restore, failure isolation, and a
seeded simulated load whose outputs, greedy and sampled, must equal solo plain decode byte for
byte.

The gate and load tests run the shipped pair on held-out code, so speculative sessions accept
several drafts per round (mean accepted length >= 3) before they are demoted or finish: a random
drafter accepts nothing, and the state a demotion hands over would then never have been through
a partial accept and its rollback."""

import json
from pathlib import Path

import numpy as np
import pytest

from dspark.decode import plain_generate
import dspark.worker as worker_mod
from dspark.errors import CapacityError, NonFiniteError, TokenRangeError
from dspark.models.presets import tiny_pair
from dspark.prefix_store import PrefixStore
from dspark.session import SamplingParams, SpecParams
from dspark.stats import SpecStats
from dspark.worker import GateConfig, Worker


@pytest.fixture(scope="module")
def pair():
    import dspark
    return tiny_pair(dspark.get_backend("numpy"), 21)


@pytest.fixture(scope="module")
def shipped():
    import dspark
    from dspark.models import load_default
    return load_default(dspark.get_backend("numpy"))


def prompt(rng, n):
    return rng.integers(0, 256, n).astype(np.int32)


HELDOUT = [bytes.fromhex(h) for h in json.loads(Path(__file__).with_name("heldout_prompts.json").read_text())["prompts"]]


def code_prompt(trunk, rng, n, follow=48):
    """The last n bytes of a held-out prompt (code the shipped pair never saw), then `follow`
    tokens of the trunk's own greedy continuation: text of the kind the drafter learnt to follow."""
    p = np.frombuffer(HELDOUT[int(rng.integers(len(HELDOUT)))][-n:], np.uint8).astype(np.int32)
    return np.concatenate([p, plain_generate(trunk, p, follow)]).astype(np.int32)


def test_gate_config():
    assert GateConfig().demote_at == 4
    assert GateConfig(low=3, high=2).demote_at == 4  # high <= low means low + 1
    assert GateConfig(low=0, high=1).demote_at == 1
    for bad in (dict(low=-1), dict(high=1.5), dict(low=True)):
        with pytest.raises(ValueError, match="GateConfig"):
            GateConfig(**bad)


@pytest.mark.parametrize("sampler", ["coupled", "rejection"])
def test_scripted_arrivals_pin_the_gate_transitions(shipped, sampler):
    """low=2, high=3: two requests get spec; the third goes plain, and once three are active at
    a burst boundary the live demotable spec sessions are demoted: the greedy one, and the sampled
    one under the coupled sampler (never under rejection sampling). A demoted coupled request
    ends with plain sampled decode's text for its seed."""
    trunk, drafter = shipped
    rng = np.random.default_rng(0)
    sampling = SamplingParams(temperature=0.7, top_k=20, seed=3)
    w = Worker(trunk, drafter, GateConfig(low=2, high=3), spec=SpecParams(burst_target=16, sampler=sampler, policy="always"))
    a = w.submit(code_prompt(trunk, rng, 90), 60)
    b = w.submit(code_prompt(trunk, rng, 100), 40, sampling)
    w.step()  # both admitted to spec (active 1 <= 2, then 2 <= 2)
    c = w.submit(code_prompt(trunk, rng, 70), 40)
    w.step()  # c: active 3 > 2 -> plain; now active 3 >= 3: a is demoted, b too when coupled
    at_demotion = w.stats  # the demoted sessions' rounds
    w.run()
    got = [(e.step, e.request, e.what) for e in w.events if e.what != "finish"]
    demoted_b = [(2, b, "demote")] if sampler == "coupled" else []
    assert got == [(1, a, "admit_spec"), (1, b, "admit_spec"), (2, c, "admit_plain"), (2, a, "demote")] + demoted_b
    assert w.requests[a].demoted and w.requests[b].demoted == (sampler == "coupled")
    print(f"before the demotion: {at_demotion.summary()}")
    assert at_demotion.mean_accepted_length >= 3.0, at_demotion.summary()  # a accepted drafts, then demoted
    assert w.result(a) == plain_generate(trunk, w.requests[a].prompt, 60)
    assert w.result(c) == plain_generate(trunk, w.requests[c].prompt, 40)
    if sampler == "coupled":
        assert w.result(b) == plain_generate(trunk, w.requests[b].prompt, 40, sampling=sampling)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=30, seed=5)],
                         ids=["greedy", "coupled"])
@pytest.mark.parametrize("gate", [GateConfig(0, 1), GateConfig(2, 4), GateConfig(64, 65)])
def test_restore_from_a_published_prefix_is_exact(pair, gate, sampling):
    """A request restored from a published capture emits what a primed one and plain decode emit
    (a coupled sampled one too: its first anchor is the pick at the capture's position)."""
    trunk, drafter = pair
    rng = np.random.default_rng(1)
    p = prompt(rng, 30)
    store = PrefixStore(10 * 2**20)
    w = Worker(trunk, drafter, gate, store=store, spec=SpecParams(burst_target=8, policy="always"))
    first = w.submit(p, 25, sampling, namespace="tenant-a")
    w.run()
    if gate.low:  # published only by spec sessions
        assert len(store) == 1
    second = w.submit(p, 25, sampling, namespace="tenant-a")
    other = w.submit(p, 25, sampling, namespace="tenant-b")
    w.run()
    want = plain_generate(trunk, p, 25, sampling=sampling)
    assert w.result(first) == w.result(second) == w.result(other) == want
    assert w.requests[second].restored == (gate.low > 0)
    assert not w.requests[other].restored  # never across namespaces
    store.clear()


def test_prefix_store_budget_dedupe_and_refusals(pair):
    trunk, drafter = pair
    from dspark.session import DsparkSpecSession
    rng = np.random.default_rng(2)
    caps = []
    for n in (10, 11, 12):
        s = DsparkSpecSession.prime(trunk, drafter, prompt(rng, n), SpecParams())
        caps.append(s.take_prefix_capture())
        s.close()
    size = caps[0].nbytes
    store = PrefixStore(2 * size + size // 2)
    assert store.publish("x", caps[0]) and store.publish("x", caps[1])
    assert store.lookup("x", caps[0].prompt) is caps[0]  # caps[0] is now the most recent
    assert store.publish("x", caps[2])  # evicts caps[1], the least recently used
    assert store.bytes <= store.budget and len(store) == 2 and store.stats.evicted == 1
    assert store.lookup("x", caps[1].prompt) is None and store.lookup("y", caps[0].prompt) is None
    with pytest.raises(TypeError, match="namespace=3: expected a str"):
        store.lookup(3, caps[0].prompt)
    with pytest.raises(ValueError, match="budget_bytes=-1"):
        PrefixStore(-1)
    s = DsparkSpecSession.prime(trunk, drafter, prompt(rng, 13), SpecParams())
    big = s.take_prefix_capture()
    s.close()
    with pytest.raises(CapacityError, match="exceeds the store's whole budget"):
        PrefixStore(size // 2).publish("x", big)
    big.free()
    store.clear()


def test_bad_requests_are_refused_and_others_go_on(pair):
    trunk, drafter = pair
    rng = np.random.default_rng(3)
    w = Worker(trunk, drafter)
    ok = w.submit(prompt(rng, 8), 10)
    with pytest.raises(TokenRangeError, match=r"prompt_ids\[1\]=999"):
        w.submit([1, 999], 10)
    with pytest.raises(TypeError, match="namespace"):
        w.submit([1, 2], 10, namespace=7)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        w.submit([1, 2], 0)
    w.run()
    assert w.result(ok) == plain_generate(trunk, w.requests[ok].prompt, 10)


def test_a_failing_request_never_takes_down_the_others(pair, monkeypatch):
    trunk, drafter = pair
    rng = np.random.default_rng(4)
    w = Worker(trunk, drafter, GateConfig(low=3, high=8), spec=SpecParams(burst_target=4, policy="always"))
    ids = [w.submit(prompt(rng, n), 20) for n in (6, 9, 12)]
    w.step()
    victim = w.requests[ids[1]].session
    orig = worker_mod.spec_burst

    def burst(sessions, target=None, stop=None, ride=None):
        if victim in sessions:
            raise NonFiniteError("logits: row 0 contains NaN (injected)")
        return orig(sessions, target, stop, ride)

    monkeypatch.setattr(worker_mod, "spec_burst", burst)
    w.run()
    assert w.requests[ids[1]].mode == "failed" and "NaN" in w.requests[ids[1]].error
    for i in (ids[0], ids[2]):
        assert w.result(i) == plain_generate(trunk, w.requests[i].prompt, 20)


def test_tokens_stream_through_the_callback(pair):
    trunk, drafter = pair
    got = {}
    w = Worker(trunk, drafter, on_tokens=lambda rid, toks, done: got.setdefault(rid, []).extend(toks))
    rid = w.submit([1, 2, 3], 15)
    w.run()
    assert got[rid] == w.result(rid)


def alone(trunk, drafter, p, n, sampling):
    """The request sent alone to a fresh worker: speculative from its prime to its end."""
    w = Worker(trunk, drafter, spec=SpecParams(burst_target=6, tau=0.35, max_verify=8, policy="always"))
    rid = w.submit(p, n, sampling)
    w.run()
    assert not w.requests[rid].demoted
    return w.result(rid)


def plain_streams(trunk, requests) -> list[list[int]]:
    """Plain decode of every (prompt, max_new, sampling) in one PlainBatch: what plain_generate
    gives each alone (plain decode is row-invariant), in one pass over the steps."""
    from dspark.decode import PlainBatch, prefill_anchor
    batch, sids, caches = PlainBatch(trunk), [], []
    for p, n, sampling in requests:
        caches.append(trunk.new_cache())
        last, _ = prefill_anchor(trunk, caches[-1], p, sampling)
        sids.append(batch.join(caches[-1], last, n, sampling=sampling))
    batch.run()
    for c in caches:
        c.free()
    return [batch.sequences[sid].emitted for sid in sids]


def test_seeded_simulated_load(shipped, monkeypatch):
    """32 requests arriving over time, greedy and sampled (coupled, the default sampler), four
    namespaces, repeated prompts, a small prefix store. Every request's text is that of plain
    decode with its sampling, and each sampled request's text equals the same request sent alone,
    whether the load sent it to plain decode, demoted it or left it speculative to its end."""
    trunk, drafter = shipped
    spec_stats = {}  # session id -> (greedy, its SpecStats after its latest burst)

    def spy_burst(sessions, target=None, stop=None, ride=None):
        out = real_burst(sessions, target, stop, ride)
        spec_stats.update({s.id: (s.params.sampling.greedy, s.stats) for s in sessions})
        return out

    real_burst = worker_mod.spec_burst
    monkeypatch.setattr(worker_mod, "spec_burst", spy_burst)
    be = trunk.be
    rng = np.random.default_rng(77)
    base_prompts = [code_prompt(trunk, rng, int(n)) for n in rng.integers(64, 129, 6)]
    settings = [dict(temperature=0.8, top_k=20), dict(temperature=0.5, top_p=0.9), dict(temperature=1.0, min_p=0.05),
                dict(temperature=0.3)]
    arrivals = []  # (step, prompt, max_new, sampling, namespace)
    for i in range(32):
        p = base_prompts[int(rng.integers(len(base_prompts)))]
        sampled = rng.random() < 0.4
        sampling = SamplingParams(**settings[i % 4], seed=i % 7) if sampled else SamplingParams()
        arrivals.append((int(rng.integers(0, 60)), p, int(rng.integers(16, 64)), sampling,
                         ("alpha", "beta", "gamma", "delta")[int(rng.integers(4))]))
    arrivals.sort(key=lambda a: a[0])
    before = be.alloc.owners()
    store = PrefixStore(8 * 2**20)  # three or so captures of the shipped pair: entries get evicted
    budget_seen = []
    w = Worker(trunk, drafter, GateConfig(low=3, high=5), store=store,
               spec=SpecParams(burst_target=6, tau=0.35, max_verify=8, policy="always"))  # the command line's width
    lookups, owner_ns = [], {}
    real_lookup, real_publish = store.lookup, store.publish

    def spy_lookup(ns, p):
        hit = real_lookup(ns, p)
        lookups.append((ns, tuple(p.tolist()), hit))
        return hit

    def spy_publish(ns, cap):
        owner_ns[id(cap)] = ns
        return real_publish(ns, cap)

    store.lookup, store.publish = spy_lookup, spy_publish
    ids = {}
    step = 0
    while arrivals or not w.done():
        while arrivals and arrivals[0][0] <= step:
            _, p, n, sampling, ns = arrivals.pop(0)
            ids[w.submit(p, n, sampling, namespace=ns)] = (p, n, sampling, ns)
        w.step()
        budget_seen.append(store.bytes)
        step += 1
    demoted = {e.request for e in w.events if e.what == "demote"}
    restored = {e.request for e in w.events if e.what == "restore"}
    plain_admitted = {e.request for e in w.events if e.what == "admit_plain"}
    sampled = {rid for rid, (_, _, sampling, _) in ids.items() if not sampling.greedy}
    plain = plain_streams(trunk, [(p, n, sampling) for p, n, sampling, _ in ids.values()])
    for (rid, (p, n, sampling, ns)), want in zip(ids.items(), plain):
        r = w.requests[rid]
        assert r.mode == "done", r.error
        assert w.result(rid) == want, rid
        if rid in sampled:
            assert w.result(rid) == alone(trunk, drafter, p, n, sampling), rid
    # the load sent sampled requests down every path: plain from the start, demoted, spec to the end
    assert sampled & demoted and sampled & plain_admitted and sampled - demoted - plain_admitted
    assert demoted - sampled and restored, "the load must exercise demotion and restore"
    for greedy in (True, False):
        st = SpecStats()
        for g, s in spec_stats.values():
            st = st.merge(s) if g == greedy else st
        # the spec sessions (among them the ones that get demoted) accepted drafts
        print(f"{'greedy' if greedy else 'sampled'} spec rounds: {st.summary()}")
        assert st.rounds >= 12 and st.mean_accepted_length >= (3.0 if greedy else 2.0), st.summary()
    assert max(budget_seen) <= store.budget and store.peak_bytes <= store.budget
    hits = [(ns, key, hit) for ns, key, hit in lookups if hit is not None]
    assert hits
    for ns, key, hit in hits:  # a hit is an entry published in the same namespace, for this prompt
        assert owner_ns[id(hit)] == ns and hit.prompt == key
    store.clear()
    assert be.alloc.owners() == before  # every cache, draft KV, snapshot and capture was freed


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_failing_plain_step_retires_one_and_the_others_stay_exact(pair, kind):
    """Three plain requests (the gate admits none to speculation); after the first step one's
    recurrent state turns NaN. The batch's next plain step goes on for the others and the culprit
    is retired with NonFiniteError; the others' caches hold exactly prompt + emitted rows, and
    their streams are plain decode's of each prompt alone. Fails if the worker stepped each
    sequence alone after the batch's step had committed every row: each healthy sequence would be
    decoded twice at successive positions."""
    trunk, drafter = pair
    rng = np.random.default_rng(6)
    samplings = [SamplingParams()] * 3 if kind == "greedy" else \
        [SamplingParams(temperature=0.9, seed=s) for s in (1, 2, 3)]
    reqs = [(prompt(rng, n), 14, s) for n, s in zip((6, 19, 11), samplings)]
    w = Worker(trunk, drafter, GateConfig(low=0, high=8), spec=SpecParams(burst_target=4))
    ids = [w.submit(p, n, s) for p, n, s in reqs]
    w.step()
    assert [w.requests[i].mode for i in ids] == ["plain"] * 3, w.events
    w.plain.sequences[w.requests[ids[1]].plain_id].cache.state[0][...] = np.nan
    w.step()
    assert w.requests[ids[1]].mode == "failed" and "NonFiniteError" in w.requests[ids[1]].error
    for i in (ids[0], ids[2]):
        r = w.requests[i]
        s = w.plain.sequences[r.plain_id]
        assert s.cache.pos == r.prompt.size + len(s.emitted) and r.tokens == s.emitted, (i, s.cache.pos)
    w.run()
    for i, (p, n, s) in zip(ids, reqs):
        if i != ids[1]:
            assert w.result(i) == plain_generate(trunk, p, n, sampling=s)
