"""Recorded rounds (dspark.graphs) on the CuPy contract stand-in, whose kernels run on simt: a
round replayed as CUDA graphs, and one issued by the host from its recording, equal the round run
op by op, bit for bit, over a run that holds every accepted length 0..vt-1 of its widths, sessions
verifying at different widths in one batch (padding), a split-count change of the verify attention
(the context crosses 256 keys), a cut at the budget and one at EOS, and a join and a leave between
rounds (a batch of two whose second session changes); demotion after recorded rounds equals plain
decode, and plain decode's own recorded steps equal it too.

The drafter is dspark.models.oracle.bigram_drafter: real weights whose Markov head knows most of
the trunk's continuation, so rounds accept often, and a round of it is kernels only. Mutants this
file kills (profiling/mutants.toml): a position baked into the recording, a recording reused after
a join, a grid recorded for a shorter context.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark import graphs, profile
from dspark.backends import contract
from dspark.decode import PlainBatch, plain_generate, prefill_anchor
from dspark.errors import NonFiniteError
from dspark.models.oracle import bigram_drafter, greedy_continuation
from dspark.models.presets import tiny_pair
from dspark.ops.attention import SplitRule, launch_plan
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams, spec_round

MAX_CTX = 320
SPLIT = SplitRule.uniform(64)   # the trunk's attention splits: a context crosses one every 64 keys
BUDGETS = (30, 30, 26)
WIDTH = 4                       # max_verify: the ladder verifies 3 or 4 columns


GREEDY = (SamplingParams(),) * 3
# Coupled sampled sessions, each with its own filters and seed (every sampling phase records).
SAMPLED = (SamplingParams(temperature=0.7, top_k=20, seed=11), SamplingParams(temperature=0.9, top_p=0.9, seed=5),
           SamplingParams(temperature=0.6, min_p=0.05, seed=2))


def build_world(samplings):
    """(trunk, drafter, prompts, budgets, plain streams, samplings): session A starts at 100 keys and
    crosses two split boundaries of the trunk's attention (128, 192); B's budget ends inside one of
    its accepted blocks, and the trunk's end-of-sequence id is a token C accepts inside a block (both
    cuts). The drafter knows most of each plain stream (greedy, or sampled with the session's seed)."""
    be = contract.backend()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (100, 30, 40)]

    def make(**config):
        trunk, _ = tiny_pair(be, 5, max_ctx=MAX_CTX, **config)
        trunk.attention_split = SPLIT
        return trunk
    trunk = make()
    # The drafter knows most of each continuation, past any end (so a last round accepts past it).
    ahead = [greedy_continuation(trunk, p, 40) if sp.greedy else plain_generate(trunk, p, 40, sampling=sp,
                                                                                  launches="plain")
             for p, sp in zip(prompts, samplings)]
    drafter = bigram_drafter(trunk, [np.concatenate([[p[-1]], s]) for p, s in zip(prompts, ahead)], 0.8, 3)
    # A session's rounds do not depend on its batch: where B's and C's blocks fall, alone.
    blocks = [rounds_alone(trunk, drafter, p, sp) for p, sp in zip(prompts[1:], samplings[1:])]
    budget_b = next(a + 1 for a, b in blocks[0][4:] if b - a >= 3)
    eos = next(ahead[2][a] for a, b in blocks[1][3:] if b - a >= 3 and ahead[2][a] not in ahead[2][:a]
               and ahead[2][a] not in ahead[0][:BUDGETS[0]] and ahead[2][a] not in ahead[1][:budget_b])
    trunk = make(eos_id=int(eos))
    drafter = bigram_drafter(trunk, [np.concatenate([[p[-1]], s]) for p, s in zip(prompts, ahead)], 0.8, 3)
    budgets = (BUDGETS[0], budget_b, BUDGETS[2])
    streams = [plain_generate(trunk, p, n, sampling=sp, launches="plain")
               for p, n, sp in zip(prompts, budgets, samplings)]
    assert streams[2][-1] == eos and len(streams[2]) < budgets[2] and len(streams[1]) == budget_b
    return trunk, drafter, prompts, budgets, streams, samplings


@pytest.fixture(scope="module")
def world():
    return build_world(GREEDY)


@pytest.fixture(scope="module")
def sampled_world():
    return build_world(SAMPLED)


def rounds_alone(trunk, drafter, prompt, sampling) -> list[tuple[int, int]]:
    """[emitted before, after] of each round of a session alone (budget 40)."""
    s = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=40, verify="ladder", max_verify=WIDTH,
                                                                   launches="plain", capture=False, sampling=sampling))
    out = []
    while not s.finished():
        before = len(s.emitted)
        spec_round([s])
        out.append((before, len(s.emitted)))
    s.close()
    return out


def state_of(be, s):
    """Every buffer a round writes, as bytes."""
    c, kv = s.cache, s.kv
    arrays = [*c.k, *c.v, *c.state, *c.conv] + ([*kv.k, *kv.v] if kv is not None and kv.k else [])
    return [be.to_host(a).tobytes() for a in arrays]


def scenario(world, launches: str):
    """A alone, then A with B (a join), then A with C (C joins as B leaves), then each batch to its
    end. Returns (per round: each session's emitted tokens and (m, vt-1) history), final states,
    sessions)."""
    trunk, drafter, prompts, budgets, _, samplings = world
    be = trunk.be
    params = [SpecParams(max_new_tokens=n, verify="ladder", max_verify=WIDTH, launches=launches, capture=False,
                         sampling=sp) for n, sp in zip(budgets, samplings)]
    log = []

    def rounds(batch, n):
        for _ in range(n):
            live = [s for s in batch if not s.finished()]
            if not live:
                return
            drafted = [s.stats.drafted for s in live]
            out = spec_round(live)
            log.append([(toks, s.m_prev, s.stats.drafted - d + 1) for s, toks, d in zip(live, out, drafted)])

    A = DsparkSpecSession.prime(trunk, drafter, prompts[0], params[0])
    rounds([A], 6)
    B = DsparkSpecSession.prime(trunk, drafter, prompts[1], params[1])
    rounds([A, B], 3)
    C = DsparkSpecSession.prime(trunk, drafter, prompts[2], params[2])
    rounds([A, C], 3)
    rounds([A, B], 2)
    rounds([B, C], 40)
    rounds([A, B], 40)
    sessions = (A, B, C)
    return log, [state_of(be, s) for s in sessions], sessions


@pytest.fixture(scope="module")
def runs(world):
    return {mode: scenario(world, mode) for mode in ("plain", "graph", "eager")}


@pytest.fixture(scope="module")
def sampled_runs(sampled_world):
    return {mode: scenario(sampled_world, mode) for mode in ("plain", "graph", "eager")}


def check_equal_bitwise(world, runs) -> None:
    streams = world[4]
    plain_log, plain_state, plain_sessions = runs["plain"]
    for mode in ("graph", "eager"):
        log, state, sessions = runs[mode]
        assert log == plain_log, mode
        assert state == plain_state, mode
        assert [s.emitted for s in sessions] == [s.emitted for s in plain_sessions] == streams
    reasons = [s.finish_reason for s in runs["graph"][2]]
    assert reasons == ["budget", "budget", "eos"]


def test_recorded_rounds_equal_plain_rounds_bitwise(world, runs):
    """Graph replays and host-issued recordings give, round by round, the tokens, accepted
    counts and verify widths of the op-by-op round, and leave every cache, state and draft KV
    bitwise the same; all three streams are plain decode's."""
    check_equal_bitwise(world, runs)


def test_recorded_sampled_rounds_equal_plain_rounds_bitwise(sampled_world, sampled_runs):
    """The same for coupled sampled sessions (their own filters and seeds): recorded rounds whose
    drafter picks and verify picks read their positions, seeds and filters from the passes' inputs
    blocks give the op-by-op round's tokens, accepted counts, widths and buffers, and the streams
    are plain sampled decode's."""
    check_equal_bitwise(sampled_world, sampled_runs)
    trunk, drafter = sampled_world[:2]
    assert graphs.supported(trunk, drafter, "coupled") and not graphs.supported(trunk, drafter, "rejection")
    assert graphs.round_graphs(drafter, "graph").store.records > 0


def test_a_recorded_coupled_proposal_draws_at_each_rounds_positions(world):
    """The bigram drafter's picks hardly depend on their noise, so a stale position in a replayed
    draft pass would leave the rounds above exact. A random drafter's do: round after round, the
    recorded draft pass (replayed after the first) proposes the op-by-op proposal's drafts and
    confidences, bit for bit."""
    trunk, _, prompts = world[:3]
    from dspark.models.presets import random_drafter
    from dspark.spec_sampling import propose_sampled
    drafter = random_drafter(trunk, 3)
    nd = drafter.config.drafts
    s = DsparkSpecSession.prime(trunk, drafter, prompts[2][:20], SpecParams(
        max_new_tokens=40, max_verify=WIDTH, capture=False, sampling=SamplingParams(temperature=1.0, seed=9)))
    runner = graphs.round_graphs(drafter, "graph")
    for _ in range(3):
        with runner:
            drafts, conf = runner.propose([s])
        dh, dl = drafter.draft([s.kv], [s.last])
        want, want_conf, _ = propose_sampled([s], drafter, dl, dh, nd, kernels=True)
        np.testing.assert_array_equal(drafts, want)
        np.testing.assert_array_equal(conf, want_conf)
        spec_round([s])
    assert runner.store.records >= 1 and len({int(t) for t in drafts[0]}) > 1
    s.close()


def test_the_kernels_only_coupled_proposal_is_the_references(world):
    """The coupled proposal that rounds record (spec_sampling.run_coupled_propose, simt kernels)
    against NumPy: slot k's draft is the filtered Gumbel-max pick of the chain's logits (the block
    rows plus the greedy chain's bias of x_{k-1}) with the noise of (seed, PICK, position pos + k +
    1), for two sessions with their own filters and seeds; the confidences are the head's of those
    drafts. Exactness cannot see this: the emitted tokens are the target's picks whatever the
    drafter proposes."""
    from dspark.models.presets import random_drafter
    from dspark.ops.heads import markov_logits_ref
    from dspark.ops.sampling import sample_filtered_ref
    from dspark.spec_sampling import filters_for, pick_streams, propose_sampled
    trunk, _, prompts = world[:3]
    be = trunk.be
    drafter = random_drafter(trunk, 4)
    nd = drafter.config.drafts
    samplings = (SamplingParams(temperature=1.0, top_k=30, seed=3), SamplingParams(temperature=0.8, top_p=0.9, seed=8))
    live = [DsparkSpecSession.prime(trunk, drafter, p[:n], SpecParams(sampling=sp, capture=False))
            for p, n, sp in zip(prompts, (20, 27), samplings)]
    dh, dl = drafter.draft([s.kv for s in live], [s.last for s in live])
    drafts, conf, _ = propose_sampled(live, drafter, dl, dh, nd, kernels=True)
    logits, hidden = be.to_host(dl), be.to_host(dh)
    w1, w2 = (be.to_host(drafter.w[k]) for k in ("markov.w1", "markov.w2"))
    anchors = np.array([s.last for s in live], np.int32)
    want, prev = np.zeros((2, nd), np.int32), None
    for k in range(nd):
        row = markov_logits_ref(logits, w1, w2, anchors, prev, k, nd)
        prev = sample_filtered_ref(row, filters_for(samplings), pick_streams(samplings, [s.cache.pos + k + 1 for s in live]),
                                   "gumbel")["token"]
        want[:, k] = prev
    np.testing.assert_array_equal(drafts, want)
    assert len(set(want.reshape(-1).tolist())) > 2
    if drafter.has_confidence:
        from dspark.ops.heads import confidence_features_ref
        feats = confidence_features_ref(hidden, w1 if drafter.config.confidence == "markov" else None, anchors, want)
        lin = feats @ be.to_host(drafter.w["conf.w"]).astype(np.float64)
        np.testing.assert_allclose(conf.reshape(-1), 1 / (1 + np.exp(-(lin + float(be.to_host(drafter.w["conf.b"])[0])))),
                                   rtol=1e-5)
    for s in live:
        s.close()


@pytest.mark.parametrize("which", ["greedy", "sampled"])
def test_the_run_holds_what_it_must(request, which):
    """Every accepted length 0..vt-1 of the widths verified, two widths in one batch (padding),
    the verify attention's split count changing between recorded rounds, cuts at the budget and at
    EOS inside an accepted block."""
    world = request.getfixturevalue("world" if which == "greedy" else "sampled_world")
    runs = request.getfixturevalue("runs" if which == "greedy" else "sampled_runs")
    trunk, drafter, prompts = world[:3]
    log, _, sessions = runs["graph"]
    accepted = {m for rnd in log for (_, m, _) in rnd}
    assert accepted >= set(range(WIDTH)), accepted
    assert any(len({vt for (_, _, vt) in rnd}) == 2 for rnd in log if len(rnd) == 2), "no padded verify"
    A = sessions[0]
    c = trunk.config
    splits = [launch_plan([WIDTH], [p], hq=c.attn_heads, hkv=c.attn_kv_heads, head_dim=c.head_dim, dtype=np.float32,
                          split=SPLIT).max_splits for p in (len(prompts[0]), A.cache.pos - WIDTH)]
    assert splits[0] > 1 and splits[1] > splits[0], splits  # split-parallel grids, and more splits later
    # A last round that accepted more than it kept: its block was cut (at the budget, at EOS).
    cut = {s.finish_reason for s in sessions if s.stats.rounds + s.stats.accepted > len(s.emitted)}
    assert cut == {"budget", "eos"}, [(s.finish_reason, s.stats.rounds, s.stats.accepted, len(s.emitted))
                                      for s in sessions]


def test_recordings_are_keyed_by_the_batch_and_dropped_with_a_session(world):
    """A join records the new batch's passes; a session's recordings go when its buffers are
    freed, the other batches' stay; the workspaces of a batch size no recording holds any more are
    freed with them."""
    trunk, drafter, prompts = world[:3]
    params = SpecParams(max_new_tokens=12, verify="full", max_verify=3, launches="graph", capture=False)
    a, b, c = (DsparkSpecSession.prime(trunk, drafter, p[:20], params) for p in prompts)
    runner = graphs.round_graphs(drafter, "graph")
    spec_round([a, b])
    made = runner.store.records
    spec_round([a, b])
    assert runner.store.records == made, "the same batch recorded again"
    spec_round([a, c])
    assert runner.store.records > made, "a new batch replayed another batch's recording"
    spec_round([a, b, c])   # the only batch of three: its workspaces go with its recordings
    assert ("verify", 3) in runner._workspaces
    before = runner.workspace_bytes()
    held_c = [k for k in runner.store._entries if c.cache.version in k[0]]
    held_b = [k for k in runner.store._entries if b.cache.version in k[0] and k not in held_c]
    assert held_c and held_b
    c.close()
    assert all(k in runner.store._entries for k in held_b)
    assert not any(k in runner.store._entries for k in held_c)
    assert not any(n == 3 for _, n in runner._workspaces) and ("verify", 2) in runner._workspaces
    assert runner.workspace_bytes() < before
    a.close()
    b.close()


@pytest.mark.parametrize("which", ["greedy", "sampled"])
def test_demotion_after_recorded_rounds_equals_plain_decode(request, which):
    """A session demoted after recorded rounds (greedy, or coupled sampled) finishes in recorded
    plain decode steps with plain decode's stream."""
    trunk, drafter, prompts, budgets, streams, samplings = request.getfixturevalue(
        "world" if which == "greedy" else "sampled_world")
    s = DsparkSpecSession.prime(trunk, drafter, prompts[1], SpecParams(max_new_tokens=budgets[1], burst_target=6,
                                                                      max_verify=WIDTH, capture=False,
                                                                      sampling=samplings[1]))
    s.burst()
    assert s.rounds >= 2 and graphs.round_graphs(drafter, "graph").store.records
    cache, last = s.into_demoted()
    batch = PlainBatch(trunk, "graph")
    sid = batch.join(cache, last, budgets[1], list(s.emitted), sampling=samplings[1])
    with profile.counting() as counts:
        batch.run()
    assert batch.leave(sid).emitted == streams[1]
    # One step recorded (its launches issued as it ran), every other a replayed graph.
    per_step = counts.graph_nodes // counts.graphs
    assert counts.graphs and counts.launches == counts.graph_nodes + per_step
    cache.free()


@pytest.mark.parametrize("launches", ["graph", "eager"])
def test_recorded_sampled_decode_steps_equal_plain_decode(sampled_world, launches):
    """Plain sampled decode of a batch of two, each step a recorded pass whose picks read their
    positions from its inputs block: the plain streams (sequences joining and leaving the batch
    as they finish)."""
    trunk, _, prompts, budgets, streams, samplings = sampled_world
    got = [plain_generate(trunk, prompts[0], budgets[0], sampling=samplings[0], launches=launches)]
    assert got == streams[:1]
    runner = graphs.decode_graphs(trunk, launches)
    made = runner.store.records
    caches, batch = [], PlainBatch(trunk, launches)
    ids = []
    for i in (1, 2):
        caches.append(trunk.new_cache())
        last, _ = prefill_anchor(trunk, caches[-1], prompts[i], samplings[i])
        ids.append(batch.join(caches[-1], last, budgets[i], sampling=samplings[i]))
    batch.step()
    with profile.counting() as counts:  # a step of a recorded batch: no array operation, one pass
        batch.step()
    assert runner.store.records > made and counts.array_ops == 0 and counts.graphs == (launches == "graph"), \
        counts.line()
    batch.run()
    assert [batch.leave(i).emitted for i in ids] == streams[1:]
    for c in caches:
        c.free()


def test_a_prompt_pass_after_recorded_rounds_equals_the_op_by_op_path(world):
    """Recorded rounds move the recurrent state with no host code, so the host marks the chunk
    tails they outdate (graphs.RoundGraphs.commit). Rounds, a prompt pass in chunks on the same
    cache (a follow-up turn, trunk.prompt_passes), replayed rounds, and a second prompt pass give
    the op-by-op path's logits and leave its cache bitwise. The replayed rounds commit exactly 64
    rows (a budget cut), so a chunk tail left from the first prompt pass would line up with the
    position and be resumed."""
    from dataclasses import replace
    trunk, drafter, prompts = world[:3]
    assert trunk.chunked_gdn
    rng = np.random.default_rng(3)
    more = [rng.integers(0, 256, n).astype(np.int32) for n in (40, 50)]
    got = {}
    for launches in ("plain", "graph"):
        s = DsparkSpecSession.prime(trunk, drafter, prompts[0][:60], SpecParams(
            max_new_tokens=1000, verify="ladder", max_verify=WIDTH, launches=launches, capture=False))
        logits = []
        for turn in range(2):
            if turn:  # the replayed rounds: to a budget 64 tokens on
                s.params = replace(s.params, max_new_tokens=len(s.emitted) + 64)
                while not s.finished():
                    spec_round([s])
            else:
                for _ in range(3):
                    spec_round([s])
            pos, tail = s.cache.pos, s.cache.chunk_len
            logits += [trunk.be.to_host(tp.logits) for tp in trunk.prompt_passes(s.cache, more[turn], chunk=16)
                       if tp.logits is not None]
            if turn:
                assert pos % 64 == tail_after_first and tail == -1, (pos, tail, tail_after_first)
            tail_after_first = s.cache.chunk_len
            assert tail_after_first >= 0   # the prompt pass's tails describe the live state
        got[launches] = (s.emitted, logits, state_of(trunk.be, s))
        s.close()
    assert got["graph"][0] == got["plain"][0]
    for a, b in zip(got["graph"][1], got["plain"][1]):
        np.testing.assert_array_equal(a, b)
    assert got["graph"][2] == got["plain"][2]


def test_recorded_round_counts(world):
    """A recorded round: two copies back (its two waits), three uploads (one per pass), three
    graph launches and no launch or array operation issued by the host; eager: the recording's
    launches issued by the host, nothing else."""
    trunk, drafter, prompts = world[:3]
    for launches in ("graph", "eager"):
        s = DsparkSpecSession.prime(trunk, drafter, prompts[1][:24], SpecParams(max_new_tokens=40, verify="full",
                                                                                max_verify=3, launches=launches,
                                                                                capture=False))
        spec_round([s])
        spec_round([s])
        with profile.counting() as c:
            spec_round([s])
        assert (c.syncs, c.d2h, c.h2d, c.array_ops) == (2, 2, 3, 0), (launches, c.line())
        if launches == "graph":
            assert c.graphs == 3 and c.launches == c.graph_nodes > 0
        else:
            assert c.graphs == 0 and c.launches > 0
        s.close()


def test_nan_in_a_recorded_round_raises_and_changes_nothing(world):
    """A NaN reaching session 1's drafter logits (its draft KV ring) raises at the first copy back,
    one reaching session 0's verify logits (its K cache) at the second, naming the session; no
    session's caches or positions changed."""
    trunk, drafter, prompts = world[:3]
    be = trunk.be
    params = SpecParams(max_new_tokens=20, max_verify=WIDTH, launches="graph", capture=False)
    sessions = [DsparkSpecSession.prime(trunk, drafter, p[:16], params) for p in prompts[:2]]
    spec_round(sessions)

    def snapshot():
        return [(s.cache.pos, s.kv.pos, list(s.emitted), s.last, state_of(be, s)) for s in sessions]
    sessions[1].kv.v[0][...] = np.nan
    before = snapshot()
    with pytest.raises(NonFiniteError, match="drafter logits: session 1 contains NaN"):
        spec_round(sessions)
    assert snapshot() == before
    sessions[1].kv.v[0][...] = 0
    sessions[0].cache.k[0][...] = np.nan
    before = snapshot()
    with pytest.raises(NonFiniteError, match="verify logits: session 0 contains NaN"):
        spec_round(sessions)
    assert snapshot() == before
    for s in sessions:
        s.close()


def test_a_pass_that_reads_the_device_cannot_be_recorded(world):
    trunk = world[0]
    be = trunk.be
    a = be.xp.zeros(4, np.float32)
    with pytest.raises(graphs.RecordingError, match="1 device->host copies"):
        graphs.record(be, lambda: (float(a[0]), None))
    with pytest.raises(graphs.RecordingError, match="1 array operations"):
        graphs.record(be, lambda: (a + 1, None))
