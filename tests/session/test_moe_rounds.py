"""A mixture-of-experts trunk (a tiny random one: 16 experts, top-4, a gated shared expert, a dense
layer among the sparse ones) through the round: a verify column equals the decode step at its
position bitwise on numpy, simt and the CuPy contract stand-in; on the stand-in, rounds recorded
and replayed as CUDA graphs (the router's worst-case grids reading its device counts: no sync) equal
the rounds run op by op, and the distinct experts each MoE layer's router reports
(dspark.profile) are the same replayed; demotion after recorded rounds equals plain decode."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dspark import profile
from dspark.backends import contract
from dspark.decode import PlainBatch, plain_generate
from dspark.models.oracle import bigram_drafter, greedy_continuation
from dspark.models.presets import TINY_TRUNK
from dspark.models.trunk import HybridTrunk
from dspark.models.weights import random_weights, trunk_spec
from dspark.session import DsparkSpecSession, SpecParams, spec_round

MOE = replace(TINY_TRUNK, ffn=("moe", "moe", "mlp", "moe"), experts=16, expert_top_k=4, expert_hidden=32,
              shared_expert_hidden=24, expert_renorm=True, max_ctx=128)
WEIGHTS = random_weights(trunk_spec(MOE), 3)


def moe_trunk(be, dtype=None):
    return HybridTrunk(MOE, WEIGHTS, be, dtype=dtype)


@pytest.fixture(params=["numpy", "simt", "contract"])
def moe_backend(request):
    if request.param == "contract":
        return contract.backend()
    return request.getfixturevalue({"numpy": "numpy_backend"}.get(request.param, request.param))


def test_a_verify_column_equals_the_decode_step(moe_backend):
    """Each column of a 5-column verify is bitwise the decode step at its position (f32 on numpy,
    bf16 on the kernels: the grouped product's 16-row tile at 1 and at 5 rows)."""
    be = moe_backend
    trunk = moe_trunk(be, None if be.kernels is None else "bfloat16")
    prompt = np.arange(3, 40, 3, dtype=np.int32)
    cand = np.array([7, 100, 3, 250, 9], np.int32)
    a, b = trunk.new_cache(), trunk.new_cache()
    trunk.prefill(a, prompt)
    trunk.prefill(b, prompt)
    got = be.to_host(trunk.verify([a], [cand]).logits)
    for j, tok in enumerate(cand):
        assert np.array_equal(got[j], be.to_host(trunk.decode([b], [tok]).logits)[0]), f"column {j}"


def rounds(trunk, drafter, prompts, n, launches):
    """Two sessions share every round; after two, the first is demoted to plain batched decode.
    Returns (per round: each session's new tokens, the distinct experts of every MoE layer of its
    verify), both streams, and the CUDA graphs the rounds launched."""
    sessions = [DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=n, verify="ladder",
                                                                      max_verify=4, launches=launches, capture=False))
                for p in prompts]
    log, graphs = [], 0
    for _ in range(2):
        with profile.counting() as c:
            out = spec_round(sessions)
        log.append((out, c.distinct_experts()))
        graphs += c.graphs
    cache, last = sessions[0].into_demoted()
    batch = PlainBatch(trunk, launches)
    sid = batch.join(cache, last, n, sessions[0].emitted)
    while not sessions[1].finished():
        with profile.counting() as c:
            out = spec_round(sessions[1:])
        log.append((out, c.distinct_experts()))
        graphs += c.graphs
        batch.step()
    batch.run()
    streams = [batch.leave(sid).emitted, sessions[1].emitted]
    cache.free()
    sessions[1].close()
    return log, streams, graphs


def test_recorded_rounds_equal_op_by_op_rounds_and_report_the_same_experts():
    be = contract.backend()
    trunk = moe_trunk(be)
    prompts = [np.arange(5, 60, 7, dtype=np.int32), np.arange(200, 213, dtype=np.int32)]
    n = 12
    ahead = [greedy_continuation(trunk, p, 14) for p in prompts]
    drafter = bigram_drafter(trunk, [np.concatenate([[p[-1]], s]) for p, s in zip(prompts, ahead)], 0.8, 3)
    want = [plain_generate(trunk, p, n, launches="plain") for p in prompts]
    plain_log, plain_streams, _ = rounds(trunk, drafter, prompts, n, "plain")
    graph_log, graph_streams, graphs = rounds(trunk, drafter, prompts, n, "graph")
    assert plain_streams == graph_streams == want
    assert graph_log == plain_log
    assert graphs > 0  # passes replayed as graphs (their first runs record and capture them)
    moe_layers = [i for i, f in enumerate(MOE.ffn) if f == "moe"]
    for out, experts in plain_log:
        rows = len(out) * 4  # the ladder's widest verify of the round's sessions bounds its rows
        assert [layer for layer, _ in experts] == moe_layers
        assert all(MOE.expert_top_k <= n_e <= min(MOE.experts, rows * MOE.expert_top_k) for _, n_e in experts)
