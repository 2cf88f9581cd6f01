"""FP8 mixture-of-experts targets against transformers: tiny qwen3_moe and qwen3_5_moe models (16
experts, top-4) that transformers built, quantized by the tests' FP8 recipe (tests/models/fp8_models.py:
experts, shared expert and attention / gdn linears e4m3 with 128 x 128 block scales; the router and
the shared expert's gate left as stored), saved as Hugging Face FP8 directories. transformers loads
the same directory (on a CPU its fine-grained FP8 integration dequantizes every expert): dspark's
logits within 1e-4 in f32 on numpy, greedy identical over 40 tokens; bf16 on simt (the FP8 grouped
product) within 2e-2 with the routing pinned (tests/models/test_moe_targets.py's module doc says
why); speculative greedy exact on numpy and simt. The experts stay e4m3 and scales, stacked, with no
16-bit copy; the report counts them.

The fused layout (`mlp.experts.gate_up_proj` F8_E4M3 beside `gate_up_proj_scale_inv`, as
transformers' FP8Experts holds it) has no CPU oracle in transformers 5.19: its dequantizing load
reports those scales as unexpected and reads the e4m3 bytes as weights. Its oracle is the same
model saved per expert: the same stacks bit for bit, and transformers running the checkpoint whose
experts are the ml_dtypes dequantization of the stored bytes (fp8_models.dequantized_copy).
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest

from dspark.decode import plain_generate
from dspark.dtypes import BF16
from dspark.models.hf import CheckpointError, load_target
from dspark.ops.fp8 import Fp8Matrix, Fp8Stack
from tests.models.fp8_models import (MOE_FP8_CASES, QWEN35_MOE_FP8, QWEN3_MOE_FP8, dequantized_copy,
                                     save_tensors, tensors_of)
from tests.models.hf_models import assert_logits_close, hf_greedy, hf_logits, model_class, require_transformers
from tests.models.test_moe_targets import PinnedRouting, logged_routes

GREEDY = 40
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def peer(fp8_dir):
    """directory -> transformers' model loaded from it at float32."""
    made = {}

    def get(d, family):
        if d not in made:
            torch, transformers = require_transformers()
            made[d] = model_class(transformers, family).from_pretrained(d, dtype=torch.float32).eval()
        return made[d]
    return get


def prompt_of(case, n=11, seed=0):
    return np.random.default_rng(case.base.seed + seed).integers(0, case.base.config["vocab_size"], n).astype(np.int32)


def moe_layers(trunk):
    return [i for i, kind in enumerate(trunk.config.ffn_kinds) if kind == "moe"]


@pytest.mark.parametrize("case", MOE_FP8_CASES, ids=repr)
def test_logits_and_greedy_match_transformers_on_numpy(fp8_dir, peer, numpy_backend, case):
    """Prefill and 4 decode steps within 1e-4 of the largest logit; 40 greedy tokens identical; the
    experts held as FP8 stacks."""
    d = fp8_dir(case)
    trunk, model = load_target(d, numpy_backend), peer(d, case.base.family)
    for i in moe_layers(trunk):
        assert isinstance(trunk.w[f"layers.{i}.moe.w_gate_up"], Fp8Stack)
    p, steps = prompt_of(case), prompt_of(case, 4, seed=1)
    want = hf_logits(model, p, steps)
    cache = trunk.new_cache()
    assert_logits_close(trunk.prefill(cache, p).logits, want[0], f"{case.name} prefill")
    for j, tok in enumerate(steps):
        assert_logits_close(trunk.decode([cache], [tok]).logits[0], want[j + 1], f"{case.name} step {j}")
    assert plain_generate(trunk, p, GREEDY) == hf_greedy(model, p, GREEDY)


@pytest.mark.parametrize("case", MOE_FP8_CASES, ids=repr)
def test_bf16_on_simt_matches_transformers_with_the_routing_pinned(fp8_dir, peer, simt, monkeypatch, case):
    """simt keeps the checkpoint's bf16 (dtype=None on an FP8 checkpoint): the FP8 grouped product with
    bf16 activations, within 2e-2 of the largest logit of transformers in f32 over the experts dspark
    chose."""
    d = fp8_dir(case)
    trunk = load_target(d, simt)
    assert trunk.weight_dtype == BF16
    stack = trunk.w[f"layers.{moe_layers(trunk)[0]}.moe.w_gate_up"]
    assert isinstance(stack, Fp8Stack) and stack.compute == BF16
    p, steps = prompt_of(case), prompt_of(case, 2, seed=1)
    routes = logged_routes(monkeypatch)
    cache = trunk.new_cache()
    got = [trunk.prefill(cache, p).logits] + [trunk.decode([cache], [t]).logits[0] for t in steps]
    with PinnedRouting(routes) as pinned:
        want = hf_logits(peer(d, case.base.family), p, steps)
    assert not pinned.routes, "transformers routed as many times as dspark"
    for j, (g, w) in enumerate(zip(got, want)):
        err, scale = float(np.abs(g - w).max()), float(np.abs(w).max())
        assert err <= 2e-2 * scale, f"{case.name} pass {j}: max |diff| {err:.3g} > 2e-2 x max |logit| {scale:.3g}"


def test_experts_stay_e4m3_and_the_report_counts_them(fp8_dir, numpy_backend, simt, capsys):
    """Per layer one stack of e4m3 bytes [E, d, 2I] and one of f32 scales, each expert's parts views
    of it (no copy: the allocator holds the stacks' bytes once); the router and the shared gate kept
    as stored, the shared expert quantized; the summary and `dspark info --model` say how many
    matrices are experts (counted, not listed)."""
    from dspark.cli import main
    d = fp8_dir(QWEN35_MOE_FP8)
    assert main(["info", "--model", str(d)]) == 0
    lines = {line.split(":")[0].strip(): line for line in capsys.readouterr().out.splitlines()}
    quantized = lines["quantized (FP8 e4m3, 128x128 blocks, dynamic activations)"]
    assert "layers.0.moe.shared.w_gate" in quantized and ".moe.experts." not in quantized
    assert quantized.endswith(" and 96 MoE expert matrices")  # 2 layers of 16 experts x 3
    assert "layers.0.moe.router" in lines["left as stored"]
    for be in (numpy_backend, simt):
        trunk = load_target(d, be)
        src, c = trunk.source, trunk.config
        E, dm, I = c.experts, c.d_model, c.expert_hidden
        assert src.quantized_experts == 3 * E * len(moe_layers(trunk))
        assert {"layers.0.moe.router", "layers.0.moe.shared_gate"} <= set(src.kept)
        assert "layers.0.moe.shared.w_gate" in src.quantized and "layers.0.moe.experts.7.w_up" in src.quantized
        assert f"({src.quantized_experts} of them MoE experts)" in src.summary()
        gu, down = trunk.w["layers.0.moe.w_gate_up"], trunk.w["layers.0.moe.w_down"]
        assert gu.q.dtype == np.uint8 and gu.q.shape == (E, dm, 2 * I) and gu.scale.shape == (E, 1, 2)
        assert down.q.shape == (E, I, dm) and down.scale.dtype == np.float32
        up = trunk.w["layers.0.moe.experts.5.w_up"]
        assert isinstance(up, Fp8Matrix) and np.shares_memory(up.q, gu.q) and np.shares_memory(up.scale, gu.scale)
        w = tensors_of(d)
        name = "model.language_model.layers.0.mlp.experts.5.up_proj.weight"
        assert np.array_equal(np.asarray(up.q), w[name].view(np.uint8).T)
        assert np.array_equal(np.asarray(up.scale), w[name + "_scale_inv"].astype(np.float32).T)
        layers = len(moe_layers(trunk))
        held = sum(trunk.w[f"layers.{i}.moe.{s}"].nbytes for i in moe_layers(trunk) for s in ("w_gate_up", "w_down"))
        assert held == layers * E * (3 * dm * I + 4 * 3)  # a byte a weight, and 3 f32 scales an expert
        assert src.device_bytes - held < layers * E * 3 * dm * I * 2, "room for a 16-bit copy of the experts"


def fused_of(case):
    return replace(case, name=f"{case.name}-fused", base=replace(case.base, name=f"{case.base.name}-fused",
                                                                 fused=True))


def test_the_fused_fp8_layout_loads_the_per_expert_layouts_bytes(fp8_dir, peer, numpy_backend, tmp_path):
    """The same model saved fused (gate_up_proj F8_E4M3 and gate_up_proj_scale_inv) loads to the
    per-expert save's stacks bit for bit, and its logits are within 1e-4 of transformers running its
    ml_dtypes dequantization (module doc: transformers cannot dequantize the fused FP8 layout)."""
    case = QWEN3_MOE_FP8
    fused = fused_of(case)
    a, b = load_target(fp8_dir(case), numpy_backend), load_target(fp8_dir(fused), numpy_backend)
    assert any("fused expert tensors" in n for n in b.source.notes)
    assert b.source.quantized_experts == a.source.quantized_experts > 0
    for i in moe_layers(a):
        for s in ("w_gate_up", "w_down"):
            x, y = a.w[f"layers.{i}.moe.{s}"], b.w[f"layers.{i}.moe.{s}"]
            assert np.array_equal(x.q, y.q) and np.array_equal(x.scale, y.scale), (i, s)
    dequantized_copy(fp8_dir(fused), tmp_path / "f32")
    p = prompt_of(case)
    want = hf_logits(peer(tmp_path / "f32", case.base.family), p, [])[0]
    assert_logits_close(b.prefill(b.new_cache(), p).logits, want, "fused prefill")


def edited_tensors(src, d, change):
    shutil.copytree(src, d)
    tensors = tensors_of(src)
    change(tensors)
    save_tensors(d, tensors)
    return d


EXPERT = "model.layers.0.mlp.experts.3.gate_proj.weight"


@pytest.mark.parametrize("fused,change,match", [
    (False, lambda t: t.update({EXPERT + "_scale_inv": np.concatenate([t[EXPERT + "_scale_inv"]] * 2)}),
     r"tensor 'model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv' has shape \(2, 1\): expected \(1, 1\)"),
    (False, lambda t: t.pop(EXPERT + "_scale_inv"),
     r"tensor 'model.layers.0.mlp.experts.3.gate_proj.weight' is F8_E4M3 and its scale "
     r"'model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv' is missing"),
    (False, lambda t: (t.pop(EXPERT + "_scale_inv"), t.update({EXPERT: t[EXPERT].astype(np.float32).astype(BF16)})),
     r"tensor 'model.layers.0.mlp.experts.3.gate_proj.weight' is not F8_E4M3 unlike "
     r"'model.layers.0.mlp.experts.0.gate_proj.weight': a layer's experts are all FP8 or all 16-bit"),
    (True, lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_scale_inv":
                               t["model.layers.0.mlp.experts.gate_up_proj_scale_inv"][:, :1]}),
     r"tensor 'model.layers.0.mlp.experts.gate_up_proj_scale_inv' has shape \(16, 1, 1\): expected \(16, 2, 1\)"),
    (True, lambda t: t.pop("model.layers.2.mlp.experts.down_proj_scale_inv"),
     r"tensor 'model.layers.2.mlp.experts.down_proj' is F8_E4M3 and its scale "
     r"'model.layers.2.mlp.experts.down_proj_scale_inv' is missing"),
], ids=["scale-shape", "scale-missing", "mixed-stack", "fused-scale-shape", "fused-scale-missing"])
def test_bad_fp8_experts_are_refused_naming_the_tensor(fp8_dir, numpy_backend, simt, tmp_path, fused, change, match):
    """Each raises a CheckpointError naming the tensor, before anything is allocated (numpy, simt)."""
    case = fused_of(QWEN3_MOE_FP8) if fused else QWEN3_MOE_FP8
    d = edited_tensors(fp8_dir(case), tmp_path / "bad", change)
    for be in (numpy_backend, simt):
        before = be.alloc.bytes("weights")
        with pytest.raises(CheckpointError, match=match):
            load_target(d, be)
        assert be.alloc.bytes("weights") == before


def test_fp8_gate_and_up_need_whole_scale_blocks(fp8_dir, numpy_backend, tmp_path):
    """moe_intermediate_size 64 (gate and up sharing a 128-column block of the stack) is refused by
    name, in both layouts."""
    small = replace(QWEN3_MOE_FP8, name="qwen3_moe-fp8-i64", base=replace(
        QWEN3_MOE_FP8.base, name="qwen3_moe-fp8-i64-base", config=dict(QWEN3_MOE_FP8.base.config,
                                                                       moe_intermediate_size=64)))
    for case, tensor in ((small, "model.layers.0.mlp.experts.0.gate_proj.weight"),
                         (fused_of(small), "model.layers.0.mlp.experts.gate_up_proj")):
        with pytest.raises(CheckpointError, match=f"tensor '{tensor}' is F8_E4M3 with moe_intermediate_size=64: FP8 "
                                                  "experts need it a multiple of 128"):
            load_target(fp8_dir(case), numpy_backend)


@pytest.mark.parametrize("backend", ["numpy_backend", "simt", "contract"], ids=["numpy", "simt", "contract"])
def test_speculative_greedy_is_exact_on_an_fp8_moe_target(fp8_dir, request, backend):
    """Speculative greedy equals plain greedy on the FP8 Qwen3.5-MoE target (verify columns through
    the FP8 grouped product equal decode steps, batched sessions solo ones, a demoted one its plain
    stream): tests/models/test_moe_targets.py's check, on numpy, simt and the cuda code path (the
    CuPy contract stand-in: recorded rounds and graphs)."""
    from dspark.backends import contract
    from tests.models.test_moe_targets import check_speculation_exact
    be = contract.backend() if backend == "contract" else request.getfixturevalue(backend)
    trunk = load_target(fp8_dir(QWEN35_MOE_FP8), be)
    check_speculation_exact(trunk, QWEN35_MOE_FP8.base, 8, 2, solo=backend == "numpy_backend")
