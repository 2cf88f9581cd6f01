"""Mixture-of-experts targets against transformers itself: tiny random qwen3_moe and qwen3_5_moe
models (16 experts, top-4; qwen3_moe with norm_topk_prob True and False and a dense layer among
its sparse ones; Qwen3.5's gated shared expert) that transformers built and saved in both expert
layouts, loaded by dspark: the logits of a prefill and decode steps (f32 on numpy; bf16 on simt,
with the routing pinned, below), greedy generation over 40 tokens, what the loader made of them,
the refusals; speculative decoding on them stays exact (solo, batched, demoted) on numpy and simt;
and a DFlash drafter on a Qwen3.5-MoE target accepts what dflash_generate accepts, round by round.

bf16 on simt: the activations' rounding to bf16 moves the router's logits by about 1e-2, so where
two experts' probabilities are that close the two sides can route a row differently, and a row
routed differently differs by a whole expert's share. transformers therefore takes dspark's routing
for that comparison (its router computes its own logits and weights over the experts dspark chose);
the choice itself is checked in f32 against transformers' own (the numpy test) and against its twin
bit for bit (tests/kernels/test_moe.py).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from dspark.decode import PlainBatch, plain_generate
from dspark.errors import DTypeError
from dspark.models import moe as moe_model
from dspark.models.hf import CheckpointError, load_target
from dspark.session import DsparkSpecSession, SpecParams, spec_burst
from tests.models.hf_models import MOE_CASES, QWEN3_MOE, QWEN35_MOE, assert_logits_close, hf_greedy, hf_logits
from tests.models.test_hf_targets import live_prompts, oracle_for, prompt_of, saved  # noqa: F401 (a fixture)
from tests.peers import peer

torch = peer("torch")

STEPS = 6
GREEDY = 40
# The bf16 checkpoints, one of each model type (one layout each: the layouts load to the same weights,
# checked against transformers in f32). The f32 ones are left out: on these tiny unit-scale hybrids,
# bf16 activations drift 10-20 % from f32 ones whatever the FFN (the dense qwen3_5-v2k-untied: 21 %).
BF16_CASES = [c for c in MOE_CASES if c.dtype == "bfloat16"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def steps_of(case):
    return np.random.default_rng(case.seed + 100).integers(0, case.config["vocab_size"], STEPS)


def our_logits(trunk, p, steps):
    be, cache = trunk.be, trunk.new_cache()
    out = [be.to_host(trunk.prefill(cache, p).logits)]
    out += [be.to_host(trunk.decode([cache], [t]).logits)[0] for t in steps]
    cache.free()
    return out


@pytest.mark.parametrize("case", MOE_CASES, ids=repr)
def test_logits_match_transformers_f32_on_numpy(saved, numpy_backend, case):
    """Prefill, then decode steps through each side's own cache, within 1e-4 of the largest logit."""
    d, model = saved(case)
    p, steps = prompt_of(case), steps_of(case)
    want = hf_logits(model, p, steps)
    for j, (got, w) in enumerate(zip(our_logits(load_target(d, numpy_backend), p, steps), want)):
        assert_logits_close(got, w, f"{case.name} pass {j}")


def logged_routes(monkeypatch) -> list:
    """The experts dspark's MoE layers route to from now on (each layer's ids, in call order), the
    routes PinnedRouting gives transformers."""
    routes, route = [], moe_model.route

    def logged(*a, **kw):
        r = route(*a, **kw)
        routes.append(np.asarray(r.ids).copy())
        return r
    monkeypatch.setattr(moe_model, "route", logged)
    return routes


class PinnedRouting:
    """transformers' MoE routers, each call taking the experts of the next entry of `routes` (a
    row's experts, as dspark chose them) instead of its own top-k; its logits, softmax and weights
    (renormalized where the model renormalizes) are its own."""

    def __init__(self, routes):
        self.routes = list(routes)

    def __enter__(self):
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35
        from transformers.models.qwen3_moe import modeling_qwen3_moe as q3
        self.classes = [(c, c.forward) for c in (q3.Qwen3MoeTopKRouter, q35.Qwen3_5MoeTopKRouter)]
        routes = self.routes

        def forward(router, hidden_states):
            logits = torch.nn.functional.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)
            probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
            ids = torch.as_tensor(routes.pop(0), dtype=torch.long)
            top = probs.gather(1, ids)
            if getattr(router, "norm_topk_prob", True):  # Qwen3.5-MoE always renormalizes
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), ids
        for c, _ in self.classes:
            c.forward = forward
        return self

    def __exit__(self, *exc):
        for c, f in self.classes:
            c.forward = f


@pytest.mark.parametrize("case", BF16_CASES, ids=repr)
def test_logits_match_transformers_bf16_on_simt(saved, simt, monkeypatch, case):
    """bf16 weights on simt (the tensor-core grouped product, activations rounded to bf16), routing
    pinned (module doc): within 2e-2 of the largest logit of transformers in f32."""
    d, model = saved(case)
    trunk = load_target(d, simt, dtype="bfloat16")
    assert trunk.w[f"layers.{trunk.config.ffn_kinds.index('moe')}.moe.w_gate_up"].dtype.name == "bfloat16"
    p, steps = prompt_of(case), steps_of(case)[:3]
    routes = logged_routes(monkeypatch)
    got = our_logits(trunk, p, steps)
    with PinnedRouting(routes) as pinned:
        want = hf_logits(model, p, steps)
    assert not pinned.routes, "transformers routed as many times as dspark"
    for j, (g, w) in enumerate(zip(got, want)):
        err, scale = float(np.abs(g - w).max()), float(np.abs(w).max())
        assert err <= 2e-2 * scale, f"{case.name} pass {j}: max |diff| {err:.3g} > 2e-2 x max |logit| {scale:.3g}"


@pytest.mark.parametrize("case", MOE_CASES, ids=repr)
def test_greedy_matches_transformers_generate(saved, numpy_backend, case):
    d, model = saved(case)
    p = prompt_of(case)
    assert plain_generate(load_target(d, numpy_backend), p, GREEDY) == hf_greedy(model, p, GREEDY)


def test_checkpoints_are_what_the_cases_claim(saved, numpy_backend):
    """The FFN kind per layer, the renormalization, the shared expert and the layouts read are the
    cases' (and so transformers'): a dense layer where mlp_only_layers and decoder_sparse_step put
    one, fused tensors split expert by expert, the vision tower skipped."""
    want = {"qwen3_moe-renorm-mlp-only": (("moe", "mlp", "moe"), True, 0),
            "qwen3_moe-sparse-step-fused-bf16": (("mlp", "moe", "mlp", "moe"), False, 0),
            "qwen3_5_moe-text-fused": (("moe",) * 4, True, 48),
            "qwen3_5_moe-vision-bf16": (("moe",) * 3, True, 40)}
    for case in MOE_CASES:
        d, _ = saved(case)
        trunk = load_target(d, numpy_backend)
        c, src = trunk.config, trunk.source
        assert (c.ffn_kinds, c.expert_renorm, c.shared_expert_hidden) == want[case.name], case.name
        assert (c.experts, c.expert_top_k, c.expert_hidden) == (16, 4, 32)
        assert any("fused expert tensors" in n for n in src.notes) == case.fused, case.name
        assert (src.skipped.get("model.visual.", 0) > 0) == (case.family == "qwen3_5_moe"), case.name
        i = c.ffn_kinds.index("moe")
        assert trunk.w[f"layers.{i}.moe.w_gate_up"].shape == (16, c.d_model, 64)
        assert np.shares_memory(trunk.w[f"layers.{i}.moe.experts.3.w_up"], trunk.w[f"layers.{i}.moe.w_gate_up"])
    assert {(c.family, c.fused) for c in MOE_CASES} >= {("qwen3_moe", False), ("qwen3_moe", True)}
    assert {c.fused for c in QWEN35_MOE} == {True, False}


@pytest.mark.parametrize("case", [QWEN3_MOE[0], QWEN35_MOE[1]], ids=repr)
def test_both_expert_layouts_load_the_same_weights(saved, numpy_backend, case):
    """The same model saved per expert and fused loads to the same trunk, bit for bit."""
    other = replace(case, name=f"{case.name}-other-layout", fused=not case.fused)
    (a, _), (b, _) = saved(case), saved(other)
    ta, tb = load_target(a, numpy_backend), load_target(b, numpy_backend)
    assert ta.config == tb.config and set(ta.host_weights) == set(tb.host_weights)
    for name in ta.host_weights:
        assert np.array_equal(ta.host_weights[name], tb.host_weights[name]), name


def edited(saved, case, tmp_path, **config):
    """A copy of the case's checkpoint with config.json keys (of the text config) replaced."""
    d, _ = saved(case)
    out = tmp_path / case.name
    shutil.copytree(d, out)
    raw = json.loads((out / "config.json").read_text())
    (raw.get("text_config") if "text_config" in raw else raw).update(config)
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("case,config,match", [
    (QWEN3_MOE[0], {"num_experts_per_tok": 17}, r"config num_experts_per_tok=17: expected 1 to num_local_experts=16"),
    (QWEN3_MOE[0], {"num_local_experts": 1024}, r"config num_local_experts=1024: expected 1 to 512"),
    (QWEN3_MOE[0], {"mlp_only_layers": [3]}, r"config mlp_only_layers has 3: expected layer indices in \[0, 3\)"),
    (QWEN3_MOE[0], {"decoder_sparse_step": 0}, r"config decoder_sparse_step=0: expected >= 1"),
    (QWEN3_MOE[0], {"num_local_experts": 15}, r"unknown tensor 'model.layers.0.mlp.experts.15.down_proj.weight'"),
    (QWEN3_MOE[0], {"mlp_only_layers": [0]}, r"unknown tensor 'model.layers.0.mlp.experts.0.down_proj.weight'"),
    (QWEN35_MOE[0], {"num_experts": 15}, r"tensor 'model.layers.0.mlp.experts.gate_up_proj' has shape \(16, 64, 64\): "
                                         r"expected \(15, 64, 64\) \(num_experts, 2 x moe_intermediate_size"),
    (QWEN35_MOE[0], {"moe_intermediate_size": 16}, r"'model.layers.0.mlp.experts.gate_up_proj' has shape"),
    (QWEN35_MOE[1], {"num_experts": 17},
     r"tensor 'model.language_model.layers.0.mlp.experts.16.down_proj.weight' is missing"),
    (QWEN35_MOE[1], {"shared_expert_intermediate_size": 8},
     r"tensor 'model.language_model.layers.0.mlp.shared_expert.gate_proj.weight' has shape \(40, 64\): "
     r"expected \(8, 64\)"),
], ids=["top-k", "experts-max", "mlp-only", "sparse-step", "expert-count", "dense-layer", "fused-count",
        "fused-width", "missing-expert", "shared-width"])
def test_bad_moe_checkpoints_are_refused_naming_the_key(saved, numpy_backend, tmp_path, case, config, match):
    """Each raises a CheckpointError naming the config key or tensor, before anything is allocated."""
    path = edited(saved, case, tmp_path, **config)
    before = numpy_backend.alloc.bytes("weights")
    with pytest.raises(CheckpointError, match=match):
        load_target(path, numpy_backend)
    assert numpy_backend.alloc.bytes("weights") == before


def test_f16_experts_are_refused_on_the_kernels(saved, simt):
    d, _ = saved(QWEN3_MOE[0])
    before = simt.alloc.bytes("weights")
    with pytest.raises(DTypeError, match="a mixture-of-experts trunk on 'simt' stores its matrices as float32 or "
                                         "bfloat16"):
        load_target(d, simt, dtype="float16")
    assert simt.alloc.bytes("weights") == before


# ---- speculative decoding on MoE targets --------------------------------------------------------
def check_speculation_exact(trunk, case, n: int, sessions: int, solo: bool = True) -> None:
    """One session alone (checkpoint rollback) equals plain greedy decode (`solo`); then `sessions`
    share every verify, and after the first burst one is demoted to plain batched decode: every
    stream is its plain greedy decode (verify columns equal decode steps, batched rows solo ones)."""
    live = live_prompts(case, trunk, n, sessions)
    if solo:
        (p, want), drafter = live[0], oracle_for(trunk, case.seed, [*live[0][0].tolist(), *live[0][1]], hit_rate=0.5)
        s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=n, burst_target=4))
        while not s.finished():
            s.burst()
        assert s.emitted == want
        assert sum(s.stats.histogram[1:]) > 0 and s.stats.histogram[0] > 0, s.stats.summary()  # accepts, rejections
        s.close()
    drafter = oracle_for(trunk, case.seed + 1, hit_rate=0.6)
    batch = []
    for p, want in live:
        drafter.next_stream = [*p.tolist(), *want]
        batch.append(DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=n, burst_target=4,
                                                                           rollback="replay")))
    spec_burst(batch)
    first = batch[0]
    assert not first.finished()
    cache, last = first.into_demoted()
    plain = PlainBatch(trunk)
    sid = plain.join(cache, last, n, first.emitted)
    rest = batch[1:]
    while not all(s.finished() for s in rest):
        spec_burst([s for s in rest if not s.finished()])
        plain.step()
    plain.run()
    assert plain.leave(sid).emitted == live[0][1]
    assert [s.emitted for s in rest] == [want for _, want in live[1:]]
    hist = [sum(h) for h in zip(*(s.stats.histogram for s in batch))]
    assert sum(hist[1:]) > 0 and hist[0] > 0, hist  # accepts and rejections
    cache.free()


@pytest.mark.parametrize("case", [QWEN3_MOE[0], QWEN35_MOE[0]], ids=repr)
def test_speculative_greedy_is_exact_on_numpy(saved, numpy_backend, case):
    d, _ = saved(case)
    check_speculation_exact(load_target(d, numpy_backend), case, 24, 3)


def test_speculative_greedy_is_exact_on_simt_bf16(saved, simt):
    """The kernels, bf16 weights (the tensor-core grouped product), a gated shared expert."""
    case = QWEN35_MOE[1]
    d, _ = saved(case)
    check_speculation_exact(load_target(d, simt, dtype="bfloat16"), case, 8, 2, solo=False)


def test_dflash_on_a_moe_target_accepts_what_dflash_generate_accepts(tmp_path_factory, numpy_backend, monkeypatch):
    """A DFlash drafter (z-lab's DFlashDraftModel, saved by dflash) on the Qwen3.5-MoE target: round by
    round, the block dspark verifies and the drafts it accepts are dflash_generate's
    (tests/models/test_drafter_e2e.py's machinery)."""
    from tests.models import test_drafter_e2e as e2e
    case = QWEN35_MOE[0]
    w = e2e.saved_world(tmp_path_factory.mktemp(f"dflash-{case.name}"), case, numpy_backend,
                        lambda layers: {"dflash": e2e.formats(layers)["dflash"]})
    e2e.check_rounds_equal_dflash_generate(w, "dflash", monkeypatch)
