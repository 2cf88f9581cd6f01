"""The CuPy contract, with no GPU: the whole `cuda` code path on dspark.backends.contract, a CPU
stand-in whose attribute surface is exactly the installed CuPy's (introspected from cupy.ndarray,
its flags, cupy.cuda.MemoryPointer and MemoryPool, the cupy module and cupy.cuda), which refuses
implicit host<->device conversion like CuPy and runs dspark's own cubins' kernels through simt.

Every op, the trunk and drafter, a greedy and a sampled session, demotion into PlainBatch and the
worker with its prefix store run through the `cuda` Backend built on the stand-in, and must give
bit for bit what the simt backend gives. The same run counts device->host copies, syncs and
launches per greedy and per sampled round and prints them (`pytest -s`; recorded in
profiling/RESULTS.md, printed alone by `python profiling/round_counts.py`).

cupy-cuda12x is in the test extra (it imports without a GPU): nothing here skips.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark import profile
from dspark.backends import contract
from dspark.decode import PlainBatch, plain_generate
from dspark.models.presets import tiny_pair
from dspark.ops.argmax import argmax_rows
from dspark.prefix_store import PrefixStore
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams, spec_burst
from dspark.worker import GateConfig, Worker
from tests.gpu.op_cases import CASES, run_case
from tests.scripts import load_script

import cupy  # noqa: E402  (in the test extra: a missing CuPy is an error here, never a skip)


@pytest.fixture(scope="module")
def dev():
    return contract.backend()


# ---- the surface ----------------------------------------------------------------------------------
def test_surface_comes_from_the_installed_cupy(dev):
    from cupy._core import flags
    assert contract.SURFACE["cupy.ndarray.flags"] == {n for n in dir(flags.Flags) if not n.startswith("__")}
    assert contract.SURFACE["cupy.ndarray"] == set(dir(cupy.ndarray))
    assert contract.SURFACE["cupy"] == set(dir(cupy))
    assert contract.surface_excess() == [], "the stand-in's ndarray defines names cupy.ndarray lacks"
    a = dev.xp.zeros((2, 3), np.float32)
    for touch in (lambda: a.flags.writeable, lambda: a.ctypes, lambda: a.setflags(write=False),
                  lambda: dev.xp.no_such_function, lambda: dev.xp.cuda.no_such_thing, lambda: a.data.no_such):
        with pytest.raises(contract.ContractError, match="CuPy .* dspark must not use it"):
            touch()
    assert dev.xp.get_default_memory_pool().used_bytes() >= a.nbytes


def test_no_implicit_conversion_between_host_and_device(dev):
    xp = dev.xp
    a = xp.arange(6, dtype=np.float32).reshape(2, 3)
    host = np.ones((2, 3), np.float32)
    for mix in (lambda: np.asarray(a), lambda: a + host, lambda: host + a, lambda: xp.maximum(a, host),
                lambda: xp.concatenate([a, host]), lambda: np.concatenate([a, host]), lambda: range(a[0, 0])):
        with pytest.raises(TypeError):
            mix()
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        a[...] = host
    with profile.counting() as c:
        b = a * np.float32(2) + 1            # scalars are fine
        a[xp.asarray(np.array([1]))] = b[:1]  # one explicit upload
        total = float(b.sum())               # one copy back, one sync
    assert (c.h2d, c.d2h, c.syncs) == (1, 1, 1) and total == 36.0
    assert "d2h tests" not in str(c.sites)  # sites name dspark lines only


def test_contract_fails_when_a_flags_writeable_read_is_put_back(dev, monkeypatch, rng):
    """The mutation this test exists for: a launch that asks CuPy's flags for `writeable`."""
    from dspark.backends import launch
    monkeypatch.setattr(launch, "readonly", lambda a: not a.flags.writeable)
    x = dev.asarray(rng.standard_normal((2, 50)).astype(np.float32))
    with pytest.raises(contract.ContractError, match="flags has no attribute 'writeable'"):
        argmax_rows(dev, x)


# ---- every op: the stand-in's cuda run equals simt bit for bit ---------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_op_on_cuda_equals_simt(case, dev, simt, rng):
    inputs = case.build(rng)
    want = run_case(case, simt, inputs, lambda a: a, np.asarray)
    with profile.counting() as c:
        got = run_case(case, dev, inputs, dev.asarray, dev.to_host)
    assert got == want, case.name
    assert c.launches >= 1, f"{case.name} launched no kernel on cuda"


# ---- models, sessions, demotion, worker ----------------------------------------------------------------
def workload(be) -> dict:
    """The whole cuda code path once, on the tiny pair: returns every token stream it produced."""
    trunk, drafter = tiny_pair(be, 7)
    rng = np.random.default_rng(5)
    p = [rng.integers(0, 256, n).astype(np.int32) for n in (17, 9, 23)]
    out = {"plain": plain_generate(trunk, p[0], 20)}
    for rollback in ("checkpoint", "replay"):
        s = DsparkSpecSession.prime(trunk, drafter, p[0], SpecParams(max_new_tokens=20, burst_target=8,
                                                                      rollback=rollback))
        while not s.finished():
            s.burst()
        out[f"greedy/{rollback}"] = s.emitted
    for sampler in ("coupled", "rejection"):
        sampled = SpecParams(max_new_tokens=16, burst_target=8, sampler=sampler,
                             sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=11))
        pair = [DsparkSpecSession.prime(trunk, drafter, q, sampled) for q in p[:2]]
        while not all(s.finished() for s in pair):
            spec_burst([s for s in pair if not s.finished()])
        out[f"sampled/{sampler}"] = [s.emitted for s in pair]
    s = DsparkSpecSession.prime(trunk, drafter, p[1], SpecParams(max_new_tokens=18, burst_target=6))
    s.burst()
    cache, last = s.into_demoted()
    batch = PlainBatch(trunk)
    sid = batch.join(cache, last, 18, list(s.emitted))
    batch.run()
    out["demoted"] = batch.leave(sid).emitted
    out["demoted_plain"] = plain_generate(trunk, p[1], 18)
    coupled = SamplingParams(temperature=0.9, top_k=40, seed=4)
    s = DsparkSpecSession.prime(trunk, drafter, p[1], SpecParams(max_new_tokens=18, burst_target=6, sampling=coupled))
    s.burst()
    cache, last = s.into_demoted()
    sid = batch.join(cache, last, 18, list(s.emitted), coupled)
    batch.run()
    out["demoted_coupled"] = batch.leave(sid).emitted
    assert out["demoted_coupled"] == plain_generate(trunk, p[1], 18, sampling=coupled)
    w = Worker(trunk, drafter, GateConfig(low=2, high=3), store=PrefixStore(8 << 20), spec=SpecParams(burst_target=4, policy="always"))
    a = w.submit(p[2], 14)
    w.step()                                   # spec; its prompt-end capture is published
    b = w.submit(p[2], 14)                     # the same prompt: restored, not primed
    c = w.submit(p[1], 10, SamplingParams(temperature=0.9, seed=3))  # plain, sampled
    w.run()                                    # three active: a and b are demoted
    out["worker"] = [w.result(i) for i in (a, b, c)]
    out["worker_events"] = sorted({e.what for e in w.events})
    out["store"] = (w.store.stats.published, w.store.stats.hits)
    return out


def test_models_sessions_demotion_and_worker_on_cuda_equal_simt(dev, simt):
    got, want = workload(dev), workload(simt)
    assert got == want
    assert got["greedy/checkpoint"] == got["greedy/replay"] == got["plain"]
    assert got["demoted"] == got["demoted_plain"]
    assert got["worker"][0] == got["worker"][1]
    assert {"restore", "demote", "admit_plain"} <= set(got["worker_events"]) and got["store"] == (1, 1)


def test_trunk_and_drafter_on_cuda_equal_simt_with_bf16_kv(dev, simt, rng):
    """A bf16 KV cache where this CuPy has bfloat16 (the capability is asked of CuPy itself)."""
    from dspark.dtypes import dtype_supported
    from dspark.dtypes import BF16
    if not dtype_supported(cupy, BF16):
        pytest.skip(f"CuPy {cupy.__version__} has no bfloat16 arrays")
    p = rng.integers(0, 256, 21).astype(np.int32)
    logits = []
    for be in (dev, simt):
        trunk, drafter = tiny_pair(be, 3, kv_dtype="bfloat16")
        cache = trunk.new_cache()
        tp = trunk.prefill(cache, p)
        kv = drafter.new_kv("contract/bf16")
        drafter.ingest([kv], tp.taps, tp.row_indptr)
        _, dl = drafter.block_pass([kv], [int(p[-1])])
        step = trunk.decode([cache], [int(p[-1])])
        logits.append([be.to_host(x).tobytes() for x in (tp.logits, dl, step.logits)])
    assert logits[0] == logits[1]


# ---- counts ---------------------------------------------------------------------------------------
MAX_SYNCS = 2   # device->host waits per round, greedy or sampled (issue 16: at most 2 per greedy round)


def released_pair(tmp_path, head: str):
    """A tiny hybrid qwen3_5 target saved by transformers and a DeepSpec drafter with a `head`
    Markov head ("gated" or "rnn") saved by the peer fixtures, both loaded on the stand-in."""
    from dspark.models.hf import load_drafter, load_target
    from tests.models import drafter_peers as peers
    from tests.models.hf_models import QWEN35, build, reference
    case = QWEN35[0]
    build(case, tmp_path)
    model = reference(case, tmp_path)
    sizes = peers.sizes_of(model)
    peer = peers.deepspec_model(5, target=model, sizes=sizes, taps=(-1, sizes.target_layers - 2), block=4,
                                markov_head_type=head).eval()
    peer.save_pretrained(tmp_path / "drafter")
    be = contract.backend()
    trunk = load_target(tmp_path, be)
    drafter = load_drafter(tmp_path / "drafter", trunk)
    assert drafter.config.markov == head
    return trunk, drafter


def test_round_counts_meet_the_targets(capsys, tmp_path):
    """At most two device->host waits per round, greedy and sampled (either sampler), for the tiny pair, the
    embedded pair and released layouts whose Markov head runs slot by slot (gated, rnn): the
    drafts, confidences and NaN flags come back in one copy, (m, next) and the verify's flags in
    another; nothing per layer, nothing per slot. Launches and bytes are printed."""
    counting = load_script("round_counts")
    pairs = {"tiny": None, "embedded": counting.embedded_pair()}
    for head in ("gated", "rnn"):
        pairs[f"deepspec-{head} on qwen3_5"] = released_pair(tmp_path / head, head)
    lines = []
    for name, pair in pairs.items():
        for rule in counting.RULES:
            c, rounds, batch = counting.round_counts(rule, rounds=2, pair=pair)
            lines.append(f"{name} {rule} round (B={batch}): {c.line(rounds)}; {c.bytes_line(rounds)}")
            assert c.syncs <= MAX_SYNCS * rounds, (name, rule, dict(c.sites))
            assert c.d2h <= MAX_SYNCS * rounds and c.launches and c.sites
            assert sum(c.by_name.values()) == c.launches
            assert all(site.split()[1].startswith("dspark/") for site in c.sites), c.sites
            assert c.bytes["state"] and c.bytes["checkpoints"] and c.bytes["kv_commit"]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
