"""The host side of a round: NaN checks deferred to the round's two synchronisations, pointer
tables cached per batch (and never used stale), and rollbacks from a verify that never writes the
recurrent state, bit-exact with plain decode, on the numpy and simt backends and on the `cuda`
code path over the CuPy stand-in. The sync and launch counts themselves are asserted in
tests/gpu/test_cupy_contract.py."""

from dataclasses import replace

import numpy as np
import pytest

from dspark.backends import contract
from dspark.decode import plain_generate
from dspark.errors import NonFiniteError
from dspark.models import DsparkDrafter
from dspark.models.presets import TINY_DRAFTER, tiny_pair
from dspark.session import DsparkSpecSession, SpecParams, spec_round
from tests.session.test_session import oracle, prompt

LAYOUTS = {"vanilla": {}, "gated": dict(markov="gated", confidence="hidden"),
           "none": dict(markov="none", markov_rank=0, confidence="none")}


@pytest.fixture(params=["numpy", "simt", "contract"])
def round_backend(request):
    if request.param == "contract":
        return contract.backend()
    return request.getfixturevalue("simt" if request.param == "simt" else "numpy_backend")


def pair(be, seed, layout="vanilla", **trunk):
    t, d = tiny_pair(be, seed, **trunk)
    if layout != "vanilla":
        d = DsparkDrafter.random(replace(TINY_DRAFTER, **LAYOUTS[layout]), t, seed + 1)
    return t, d


def finish_as_plain(trunk, sessions, prompts, budget):
    """Run the batch's remaining rounds; every session's stream must be plain decode's."""
    while not all(s.finished() for s in sessions):
        spec_round([s for s in sessions if not s.finished()])
    assert [s.emitted for s in sessions] == [plain_generate(trunk, p, budget) for p in prompts]


def snapshot_of(be, s):
    """Everything a failed round must leave as it was."""
    host = be.to_host
    return (s.cache.pos, s.kv.pos, list(s.emitted), s.last, s.rounds, s.stats.rounds,
            [host(a).tobytes() for a in (*s.cache.recurrent(), *s.cache.k, *s.cache.v, *s.kv.k, *s.kv.v)])


# ---- NaN: raised at the round's sync, nothing changed ---------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_nan_in_the_drafters_logits_raises_and_changes_nothing(round_backend, layout):
    """The chain's argmax flags are read back with the drafts (one copy): a NaN in session 1's
    slot logits raises naming session 1, and no session of the batch has changed."""
    be = round_backend
    trunk, drafter = pair(be, 21, layout)
    ps = [prompt(np.random.default_rng(i), 9 + i) for i in range(3)]
    sessions = [DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=30)) for p in ps]
    spec_round(sessions)
    before = [snapshot_of(be, s) for s in sessions]
    nd = drafter.config.drafts
    real = drafter.draft

    def poisoned(kvs, anchors):
        hidden, logits = real(kvs, anchors)
        logits[nd + 2, 5] = np.nan  # session 1, slot 2
        return hidden, logits

    drafter.draft = poisoned
    with pytest.raises(NonFiniteError, match="drafter logits: session 1 contains NaN"):
        spec_round(sessions)
    assert [snapshot_of(be, s) for s in sessions] == before
    del drafter.draft
    finish_as_plain(trunk, sessions, ps, 30)


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_nan_in_the_verify_logits_raises_and_changes_nothing(round_backend, rollback):
    """The accept's flags come back with (m, next): a NaN in session 2's verify column raises
    there, after the verify ran, and every session's caches and recurrent state are untouched
    (the verify never writes them; there is no snapshot to restore)."""
    be = round_backend
    trunk, drafter = pair(be, 22)
    params = SpecParams(max_new_tokens=30, rollback=rollback)
    ps = [prompt(np.random.default_rng(i), 12 + i) for i in range(3)]
    sessions = [DsparkSpecSession.prime(trunk, drafter, p, params) for p in ps]
    spec_round(sessions)
    before = [snapshot_of(be, s) for s in sessions]
    real = trunk.verify

    def poisoned(caches, cand, **kw):
        tp = real(caches, cand, **kw)
        tp.logits[int(tp.row_indptr[2]), 3] = np.nan
        return tp

    trunk.verify = poisoned
    with pytest.raises(NonFiniteError, match="verify logits: session 2 contains NaN"):
        spec_round(sessions)
    assert [snapshot_of(be, s) for s in sessions] == before
    del trunk.verify
    finish_as_plain(trunk, sessions, ps, 30)


# ---- pointer tables per batch ---------------------------------------------------------------------------
def test_tables_are_reused_per_batch_and_rebuilt_when_it_changes(simt):
    trunk, _ = pair(simt, 23)
    a, b = trunk.new_cache(), trunk.new_cache()
    t_ab = trunk.tables([a, b])
    assert trunk.tables([a, b]) is t_ab                    # the same batch: no rebuild, no upload
    assert trunk.tables([b, a]) is not t_ab                # another order is another batch
    assert trunk.tables([a]) is not t_ab
    assert all(x is y for x, y in zip(t_ab.states[0].arrays, (a.state[0], b.state[0])))
    with pytest.raises(TypeError):
        a.state[0] = a.state[0].copy()                     # buffer lists are tuples: no silent swap
    old = a.version
    a.state = tuple(x.copy() for x in a.state)             # replacing them makes a new version
    assert a.version != old and trunk.tables([a, b]) is not t_ab
    assert trunk.tables([a, b]).states[0].arrays[0] is a.state[0]
    b.free()                                               # freeing drops every batch it was in
    assert all(b.version not in key for key in trunk._tables._entries)


@pytest.mark.parametrize("backend", ["numpy", "simt", "contract"])
def test_a_stale_table_is_never_used(backend, request):
    """Rounds of a batch reuse its tables (built once); a session whose cache buffers move (the
    same Cache object, new arrays), a session whose cache is replaced, and a batch that changes
    get fresh ones. With tables kept by anything but the buffers' versions (the Cache objects'
    identities, say), the moved session's rounds would write its old arrays and its stream would
    leave plain decode's."""
    be = contract.backend() if backend == "contract" else request.getfixturevalue(
        "simt" if backend == "simt" else "numpy_backend")
    trunk, drafter = pair(be, 24)
    ps = [prompt(np.random.default_rng(40 + i), 10 + 3 * i) for i in range(3)]
    params = SpecParams(max_new_tokens=26)
    sessions = [DsparkSpecSession.prime(trunk, drafter, p, params) for p in ps]
    spec_round(sessions)
    built = trunk._tables.builds
    spec_round(sessions)
    assert trunk._tables.builds == built, "the same batch rebuilt its tables"
    c = sessions[1].cache
    c.k, c.v, c.state, c.conv = ([x.copy() for x in group] for group in (c.k, c.v, c.state, c.conv))
    spec_round(sessions)
    assert trunk._tables.builds > built
    moved = sessions[2].cache.copy(f"cache/moved/{sessions[2].id}")
    sessions[2].cache.free()
    sessions[2].cache = moved
    spec_round(sessions)
    spec_round(sessions[1:])                  # the batch changes: session 0 sits this round out
    spec_round(sessions[::-1])                # and another order
    finish_as_plain(trunk, sessions, ps, 26)


# ---- rollback from a verify that never writes the state -----------------------------------------------
@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_zero_draft_round_after_a_full_accept_is_exact(round_backend, rollback):
    """The known failure of lazy checkpoint selection: a full accept (keep = vt), then a round
    that verifies only its anchor (vt = 1, at the end of the context). Each must continue from
    the state after exactly the kept columns."""
    be = round_backend
    found = False
    for n in range(20, 34):
        trunk, drafter = pair(be, 25, max_ctx=48)
        p = prompt(np.random.default_rng(n), n)
        want = plain_generate(trunk, p, 100)
        o = oracle(trunk, drafter, p, 100, hit_rate=1.0)
        s = DsparkSpecSession.prime(trunk, o, p, SpecParams(max_new_tokens=100, rollback=rollback, tau=0.0))
        rounds = []
        while not s.finished():
            before = (s.stats.drafted, s.stats.accepted)
            spec_round([s])
            rounds.append((s.stats.drafted - before[0], s.stats.accepted - before[1]))
        assert s.emitted == want and s.finish_reason == "context"
        full_then_zero = any(d > 0 and a == d and nxt == (0, 0) for (d, a), nxt in zip(rounds, rounds[1:]))
        found = found or full_then_zero
        s.close()
        if found:
            break
    assert found, "no prompt length gave a full accept followed by a zero-draft round"
