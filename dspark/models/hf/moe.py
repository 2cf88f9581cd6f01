"""Mixture-of-experts checkpoints, mapped onto the trunk's MoE FFN (dspark.models.moe): qwen3_moe
(Qwen3-30B-A3B) and qwen3_5_moe / qwen3_5_moe_text (Qwen3.5-35B-A3B), as transformers'
modeling_qwen3_moe.py / modeling_qwen3_5_moe.py compute them:

| convention | qwen3_moe | qwen3_5_moe, qwen3_5_moe_text |
|---|---|---|
| sparse layers | i not in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0; the others a dense MLP of intermediate_size | every layer |
| top-k weights renormalized | with norm_topk_prob (default False) | always |
| shared expert | none | shared_expert_intermediate_size wide, times sigmoid(shared_expert_gate(h)) |
| expert count | num_experts (transformers 5 writes num_local_experts) | num_experts |

The router (both): softmax of h @ gate in f32, top-k (ties to the lower expert), the weights cast
to the hidden dtype (dspark's hidden states are f32: the identity). No capacity limit.

Expert tensors come in the two layouts save_pretrained writes, for both model types:
* per expert (the default): `mlp.experts.{e}.gate_proj.weight` [I, d], `up_proj` [I, d],
  `down_proj` [d, I], mapped by `layer_table`;
* fused (save_original_format=False): `mlp.experts.gate_up_proj` [E, 2I, d] (expert e's gate rows,
  then its up rows) and `mlp.experts.down_proj` [E, d, I]. `unfuse` presents each expert's part as a
  tensor of the first layout's name: a byte range of the file, memory-mapped, no copy.

Bad input is a CheckpointError naming the key or tensor: an expert count or top-k the config
contradicts or the kernels cannot run (dspark.ops.moe.MAX_EXPERTS, MAX_TOP_K), mlp_only_layers
outside the layers, a fused tensor of another shape than the config's.
"""

from __future__ import annotations

import numpy as np

from ...ops.moe import MAX_EXPERTS, MAX_TOP_K
from ..config import TrunkConfig
from .checkpoint import DTYPES, CheckpointError, TensorInfo

MOE_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text")
# transformers' defaults, for a config.json that leaves a key out
DEFAULTS = {"qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
            "qwen3_5_moe": dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                shared_expert_intermediate_size=512)}


def moe_fields(model_type: str, t: dict, n: int) -> dict:
    """The TrunkConfig fields of a MoE text config `t` of n layers ({} for a dense model)."""
    if model_type not in MOE_TYPES:
        return {}
    qwen35 = model_type != "qwen3_moe"
    defaults = DEFAULTS["qwen3_5_moe" if qwen35 else "qwen3_moe"]
    count_key = next((k for k in ("num_experts", "num_local_experts") if k in t), "num_experts")
    experts = int(t.get(count_key, defaults["num_experts"]))
    if qwen35:
        ffn = ("moe",) * n
    else:
        step, only = int(t.get("decoder_sparse_step", 1)), list(t.get("mlp_only_layers") or [])
        if step < 1:
            raise CheckpointError(f"config decoder_sparse_step={step}: expected >= 1")
        bad = [i for i in only if not (isinstance(i, int) and 0 <= i < n)]
        if bad:
            raise CheckpointError(f"config mlp_only_layers has {bad[0]!r}: expected layer indices in [0, {n})")
        ffn = tuple("moe" if i not in only and experts > 0 and (i + 1) % step == 0 else "mlp" for i in range(n))
        if "moe" not in ffn:
            return {}
    top_k = int(t.get("num_experts_per_tok", defaults["num_experts_per_tok"]))
    hidden = int(t.get("moe_intermediate_size", defaults["moe_intermediate_size"]))
    shared = int(t.get("shared_expert_intermediate_size", defaults["shared_expert_intermediate_size"])) if qwen35 else 0
    if not 1 <= experts <= MAX_EXPERTS:
        raise CheckpointError(f"config {count_key}={experts}: expected 1 to {MAX_EXPERTS} (the router kernel's "
                              f"most experts)")
    if not 1 <= top_k <= min(experts, MAX_TOP_K):
        raise CheckpointError(f"config num_experts_per_tok={top_k}: expected 1 to {count_key}={experts}"
                              + (f" (and at most {MAX_TOP_K}, the router kernel's)" if experts > MAX_TOP_K else ""))
    if hidden < 1 or shared < 0 or (qwen35 and shared < 1):
        raise CheckpointError(f"config moe_intermediate_size={hidden}"
                              + (f", shared_expert_intermediate_size={shared}" if qwen35 else "") + ": expected >= 1")
    return dict(ffn=ffn, experts=experts, expert_top_k=top_k, expert_hidden=hidden, shared_expert_hidden=shared,
                expert_renorm=True if qwen35 else bool(t.get("norm_topk_prob", False)))


def layer_table(c: TrunkConfig) -> dict[str, tuple[str, str]]:
    """Checkpoint name inside a MoE decoder layer -> (our name inside the layer, layout)."""
    out = {"mlp.gate.weight": ("moe.router", "T")}
    for e in range(c.experts):
        for theirs, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            out[f"mlp.experts.{e}.{theirs}.weight"] = (f"moe.experts.{e}.{ours}", "T")
    if c.shared_expert_hidden:
        for theirs, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            out[f"mlp.shared_expert.{theirs}.weight"] = (f"moe.shared.{ours}", "T")
        out["mlp.shared_expert_gate.weight"] = ("moe.shared_gate", "T")
    return out


def unfuse(tensors: dict, c: TrunkConfig, prefix: str) -> int:
    """Replace every MoE layer's fused expert tensors in `tensors` (name -> TensorInfo) by their
    per-expert parts under the per-expert layout's names; returns how many fused tensors it split."""
    E, I, d = c.experts, c.expert_hidden, c.d_model
    split = 0
    for i, kind in enumerate(c.ffn_kinds):
        if kind != "moe":
            continue
        p = f"{prefix}layers.{i}.mlp.experts."
        for fused, shape, parts in ((p + "gate_up_proj", (E, 2 * I, d), (("gate_proj", I),
                                                                         ("up_proj", I))),
                                    (p + "down_proj", (E, d, I), (("down_proj", d),))):
            info = tensors.get(fused)
            if info is None:
                continue
            if info.shape != shape:
                raise CheckpointError(f"tensor {fused!r} has shape {info.shape}: expected {shape} (num_experts, "
                                      + ("2 x moe_intermediate_size, hidden_size)" if len(parts) == 2 else
                                         "hidden_size, moe_intermediate_size)"))
            dtype = DTYPES.get(info.dtype)
            if dtype is None or info.end - info.start != int(np.prod(shape)) * dtype.itemsize:
                raise CheckpointError(f"tensor {fused!r}: dtype {info.dtype}, {info.end - info.start} bytes for "
                                      f"shape {shape}: expected F32, F16 or BF16 of that shape")
            del tensors[fused]
            split += 1
            row_bytes = shape[2] * dtype.itemsize
            for e in range(E):
                at = info.start + e * shape[1] * row_bytes
                for name, n_rows in parts:
                    per = f"{p}{e}.{name}.weight"
                    if per in tensors:
                        raise CheckpointError(f"tensors {fused!r} and {per!r}: both expert layouts in one "
                                              f"checkpoint")
                    tensors[per] = TensorInfo(info.file, info.dtype, (n_rows, shape[2]), at, at + n_rows * row_bytes)
                    at += n_rows * row_bytes
    return split
