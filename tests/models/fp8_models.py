"""FP8 checkpoints for the tests: transformers' own Fp8Quantize recipe, written once here, applied
to the tiny models that transformers built (tests/models/hf_models.py) and saved as Hugging Face
FP8 directories (quantization_config, modules_to_not_convert, F8_E4M3 weights beside their
`weight_scale_inv` block scales); and the independent dequantization (ml_dtypes) that checks edge
blocks, which transformers' loader gets wrong (it derives the block from the scale grid).

The recipe, per 128 x 128 block of a weight [N, K] (edge blocks cut at N and K):
    amax = max |w|;  scale = 448 / amax (1 for an all-zero block);  weight_scale_inv = 1 / scale
    q = e4m3(clamp(w * scale, -448, 448)), round to nearest even
all in f32, as transformers' Fp8Quantize computes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import ml_dtypes
import numpy as np

from dspark.models.hf.checkpoint import Checkpoint
from tests.models.hf_models import GDN_ATTN, MOE_SHAPE, Case, build

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = np.float32(448.0)
BLOCK = 128


def quantize(w, scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(q as e4m3fn [N, K], weight_scale_inv [ceil(N/128), ceil(K/128)] of scale_dtype) by the recipe."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = np.zeros((nb * BLOCK, kb * BLOCK), np.float32)
    padded[:n, :k] = w
    blocks = padded.reshape(nb, BLOCK, kb, BLOCK)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, FP8_MAX / np.where(amax > 0, amax, np.float32(1)), np.float32(1)).astype(np.float32)
    inv = (np.float32(1) / scale).astype(np.float32)
    if np.dtype(scale_dtype) != np.float32:  # a bf16-scale checkpoint: the stored inverse is what dequantizes
        inv = inv.astype(scale_dtype)
        scale = (np.float32(1) / inv.astype(np.float32)).astype(np.float32)
    scaled = blocks * scale[:, None, :, None]
    q = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(E4M3).reshape(nb * BLOCK, kb * BLOCK)[:n, :k]
    return np.ascontiguousarray(q), inv


def dequantize(q, inv) -> np.ndarray:
    """w [N, K] f32 = e4m3(q) * inv per block: ml_dtypes' decode, not dspark's."""
    q = np.asarray(q).view(E4M3).astype(np.float32)
    n, k = q.shape
    s = np.asarray(inv).astype(np.float32)
    return q * np.repeat(np.repeat(s, BLOCK, axis=0), BLOCK, axis=1)[:n, :k]


@dataclass(frozen=True)
class Fp8Case:
    """A tiny transformers model (`base`, saved in its dtype) quantized by the recipe: every
    decoder-layer linear except those `not_convert` names (matched as transformers matches them)."""
    name: str
    base: Case
    not_convert: tuple[str, ...] = ("lm_head",)
    scale_dtype: str = "float32"
    extra: dict = field(default_factory=dict, hash=False)   # more quantization_config keys

    def __repr__(self):
        return self.name


LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                   "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")


FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # [E, N, K], as FP8Experts holds them


def is_layer_linear(name: str) -> bool:
    return ".layers." in name and not name.startswith("model.visual.") and name.endswith(".weight") \
        and name[: -len(".weight")].rsplit(".", 1)[-1] in LINEAR_SUFFIXES


def is_fused_experts(name: str) -> bool:
    return ".layers." in name and name.endswith(FUSED_EXPERTS)


def listed(module: str, not_convert) -> bool:
    """transformers' should_convert_module, negated: a prefix, an exact name or a suffix."""
    return any(module.startswith(e + ".") or module == e or module.endswith(e) for e in not_convert)


def quantization_config(case: Fp8Case) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": list(case.not_convert), **case.extra}


def tensors_of(d: Path) -> dict[str, np.ndarray]:
    ckpt = Checkpoint(d)
    return {name: np.array(ckpt.array(name)) for name in ckpt.tensors}


def save_tensors(d: Path, tensors: dict[str, np.ndarray]) -> None:
    """One model.safetensors (torch writes e4m3 and bf16 natively), replacing any shards."""
    import torch
    from safetensors.torch import save_file
    for p in list(d.glob("*.safetensors")) + list(d.glob("*.safetensors.index.json")):
        p.unlink()
    out = {}
    for name, a in tensors.items():
        if a.dtype == E4M3:
            out[name] = torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        elif a.dtype == ml_dtypes.bfloat16:
            out[name] = torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
        else:
            out[name] = torch.from_numpy(np.ascontiguousarray(a))
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})


def edit_config(d: Path, change) -> None:
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))


def build_fp8(case: Fp8Case, d: Path) -> None:
    """transformers saves the base model into `d`, which is then quantized in place by the recipe."""
    build(case.base, d)
    quantize_dir(d, case)


def quantize_dir(d: Path, case: Fp8Case) -> None:
    """Every layer linear not listed, by the recipe; fused 3-D experts [E, N, K] expert by expert,
    their scales `<name>_scale_inv` [E, ceil(N / 128), ceil(K / 128)] (transformers' FP8Experts)."""
    tensors = tensors_of(d)
    scale_dtype = ml_dtypes.bfloat16 if case.scale_dtype == "bfloat16" else np.float32
    for name in [n for n in tensors if is_layer_linear(n) and not listed(n[: -len(".weight")], case.not_convert)]:
        q, inv = quantize(tensors[name].astype(np.float32), scale_dtype)
        tensors[name] = q
        tensors[name[: -len("weight")] + "weight_scale_inv"] = inv
    for name in [n for n in tensors if is_fused_experts(n) and not listed(n, case.not_convert)]:
        per = [quantize(w.astype(np.float32), scale_dtype) for w in tensors[name]]
        tensors[name] = np.stack([q for q, _ in per])
        tensors[name + "_scale_inv"] = np.stack([inv for _, inv in per])
    save_tensors(d, tensors)
    edit_config(d, lambda cfg: cfg.update(quantization_config=quantization_config(case)))


def dequantized_copy(src: Path, d: Path, dtype=np.float32) -> None:
    """`src` with every FP8 weight dequantized (`dequantize`, ml_dtypes) and stored as `dtype`,
    its scales and quantization_config gone: the independent oracle of edge blocks."""
    import shutil
    shutil.copytree(src, d)
    tensors = tensors_of(src)
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        w = name[: -len("_scale_inv")]
        q, inv = tensors[w], tensors.pop(name)
        tensors[w] = (np.stack([dequantize(a, b) for a, b in zip(q, inv)]) if q.ndim == 3
                      else dequantize(q, inv)).astype(dtype)
    save_tensors(d, tensors)
    edit_config(d, lambda cfg: cfg.pop("quantization_config"))


# ---- the cases ---------------------------------------------------------------------------------------
# Shapes the peer dequantizes right: every quantized dimension at most 128 or a multiple of 128.
QWEN3_FP8 = Fp8Case("qwen3-fp8", Case("qwen3-fp8-base", "qwen3", dict(
    vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64), dtype="bfloat16", seed=21), not_convert=("lm_head",))
# Qwen3.5 as its FP8 releases leave it: gdn's in_proj_a / in_proj_b 16-bit (and one more module, by
# its full name), scales f32.
QWEN35_FP8 = Fp8Case("qwen3_5-fp8", Case("qwen3_5-fp8-base", "qwen3_5_text", dict(
    vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, layer_types=GDN_ATTN), dtype="bfloat16", seed=22),
    not_convert=("lm_head", "in_proj_a", "in_proj_b", "model.layers.3.mlp.down_proj"))
# Edge blocks (K = 160 and N = 200, 64, ...: neither a multiple of 128) and bf16 scales, the
# multimodal layout (model.language_model. names, modules_to_not_convert with that prefix).
EDGE_FP8 = Fp8Case("qwen3_5-fp8-edge", Case("qwen3_5-fp8-edge-base", "qwen3_5", dict(
    vocab_size=300, hidden_size=160, intermediate_size=200, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=32,
    linear_value_head_dim=32, layer_types=["linear_attention", "full_attention"]), dtype="bfloat16", seed=23),
    not_convert=("lm_head", "model.language_model.layers.0.linear_attn.in_proj_a",
                 "model.language_model.layers.0.linear_attn.in_proj_b", "model.visual"), scale_dtype="bfloat16")
FP8_CASES = [QWEN3_FP8, QWEN35_FP8]
# Mixture-of-experts FP8 checkpoints (16 experts, top-4; moe_intermediate_size 128: an expert's gate
# and up in whole scale blocks, as the released FP8 MoE checkpoints' 512 and 768), the router and the
# shared expert's gate left as stored, as those releases list them.
MOE_FP8_SHAPE = dict(MOE_SHAPE, moe_intermediate_size=128)
MOE_NOT_CONVERT = ("lm_head", "mlp.gate", "shared_expert_gate")
# qwen3_moe: a dense FP8 MLP between two sparse layers, renormalized top-k, per-expert tensors, f32 scales
QWEN3_MOE_FP8 = Fp8Case("qwen3_moe-fp8", Case("qwen3_moe-fp8-base", "qwen3_moe", dict(
    MOE_FP8_SHAPE, num_hidden_layers=3, intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[1]),
    dtype="bfloat16", seed=24), not_convert=MOE_NOT_CONVERT)
# qwen3_5_moe (the multimodal layout): gdn and attention, a gated FP8 shared expert, bf16 scales, gdn's
# a and b left 16-bit
QWEN35_MOE_FP8 = Fp8Case("qwen3_5_moe-fp8", Case("qwen3_5_moe-fp8-base", "qwen3_5_moe", dict(
    MOE_FP8_SHAPE, num_hidden_layers=2, shared_expert_intermediate_size=48, linear_num_key_heads=1,
    linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
    layer_types=["linear_attention", "full_attention"]), dtype="bfloat16", seed=25),
    not_convert=MOE_NOT_CONVERT + ("in_proj_a", "in_proj_b", "model.visual"), scale_dtype="bfloat16")
MOE_FP8_CASES = [QWEN3_MOE_FP8, QWEN35_MOE_FP8]


def unprefixed(case: Fp8Case) -> Fp8Case:
    """The same checkpoint with its modules_to_not_convert written without model.language_model."""
    return replace(case, not_convert=tuple(e.replace("model.language_model.", "") for e in case.not_convert))
