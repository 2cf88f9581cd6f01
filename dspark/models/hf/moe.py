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

FP8 checkpoints (dspark.models.hf.quantization): quantized experts are served in both layouts, kept
e4m3 with their 128 x 128 block scales and stacked per layer (dspark.models.moe):
* per expert: `mlp.experts.{e}.gate_proj.weight` F8_E4M3 beside `...gate_proj.weight_scale_inv`, as
  for a dense linear;
* fused, as transformers' fine-grained FP8 integration holds them (FP8Experts): `mlp.experts.
  gate_up_proj` F8_E4M3 [E, 2I, d] with `mlp.experts.gate_up_proj_scale_inv` [E, ceil(2I / 128),
  ceil(d / 128)], and `down_proj` with `down_proj_scale_inv` [E, ceil(d / 128), ceil(I / 128)];
  `unfuse` presents each expert's part of the scales as its `weight_scale_inv` (a byte range).
The router (`mlp.gate`) and the shared expert's gate stay as stored (modules_to_not_convert).
An expert's [gate | up] is one matrix of one scale grid, so FP8 gate and up need
moe_intermediate_size a multiple of 128 (the released FP8 MoE checkpoints' 512 and 768); and a
layer's experts are all FP8 or all 16-bit, per stack (`check_fp8_experts`).

Bad input is a CheckpointError naming the key or tensor: an expert count or top-k the config
contradicts or the kernels cannot run (dspark.ops.moe.MAX_EXPERTS, MAX_TOP_K), mlp_only_layers
outside the layers, a fused tensor of another shape than the config's, a fused FP8 tensor without
its scale or with a scale of another shape or dtype, FP8 experts the stacks cannot hold (above).
"""

from __future__ import annotations

import numpy as np

from ...ops.fp8 import BLOCK as FP8_BLOCK
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
                                      f"shape {shape}: expected F32, F16, BF16 or F8_E4M3 of that shape")
            scales = fused_scales(tensors, fused, info, shape, parts)
            del tensors[fused]
            split += 1
            row_bytes = shape[2] * dtype.itemsize
            for e in range(E):
                at = info.start + e * shape[1] * row_bytes
                for j, (name, n_rows) in enumerate(parts):
                    per = f"{p}{e}.{name}.weight"
                    if per in tensors:
                        raise CheckpointError(f"tensors {fused!r} and {per!r}: both expert layouts in one "
                                              f"checkpoint")
                    tensors[per] = TensorInfo(info.file, info.dtype, (n_rows, shape[2]), at, at + n_rows * row_bytes)
                    at += n_rows * row_bytes
                    if scales is not None:
                        tensors[per + "_scale_inv"] = scales[e][j]
    return split


def fused_scales(tensors: dict, fused: str, info: TensorInfo, shape: tuple, parts) -> list | None:
    """For a fused F8_E4M3 expert tensor: per expert, per part, its scales' TensorInfo (the rows
    of the part's 128-row blocks in `<fused>_scale_inv`, popped from `tensors`); None for a 16-bit
    one. CheckpointError naming the tensor for a scale missing, misshaped or mistyped, or parts
    that share a block."""
    if info.dtype != "F8_E4M3":
        return None  # a 16-bit tensor with a scale is refused later, as an unknown tensor
    name = fused + "_scale_inv"
    scale = tensors.get(name)
    if scale is None:
        raise CheckpointError(f"tensor {fused!r} is F8_E4M3 and its scale {name!r} is missing")
    E, n, k = shape
    want = (E, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if scale.shape != want:
        raise CheckpointError(f"tensor {name!r} has shape {scale.shape}: expected {want}, one scale per "
                              f"{FP8_BLOCK}x{FP8_BLOCK} block of each expert of {fused!r} {shape}")
    itemsize = {"F32": 4, "BF16": 2}.get(scale.dtype)
    if itemsize is None or scale.end - scale.start != int(np.prod(want)) * itemsize:
        raise CheckpointError(f"tensor {name!r} has dtype {scale.dtype}: expected F32 or BF16")
    if len(parts) > 1 and parts[0][1] % FP8_BLOCK:
        raise CheckpointError(f"tensor {fused!r} is F8_E4M3 with moe_intermediate_size={parts[0][1]}: FP8 experts "
                              f"need it a multiple of {FP8_BLOCK} (gate and up in whole scale blocks)")
    del tensors[name]
    row_bytes = want[2] * itemsize
    out = []
    for e in range(E):
        at, per = scale.start + e * want[1] * row_bytes, []
        for _, n_rows in parts:
            blocks = -(-n_rows // FP8_BLOCK)
            per.append(TensorInfo(scale.file, scale.dtype, (blocks, want[2]), at, at + blocks * row_bytes))
            at += blocks * row_bytes
        out.append(per)
    return out


def check_fp8_experts(where: dict, c: TrunkConfig) -> int:
    """The FP8 experts of the planned tensors (our name -> (checkpoint name, layout, scale or None)):
    every stack all FP8 or all not, FP8 gate and up only at moe_intermediate_size a multiple of 128
    (module doc); returns how many expert matrices are FP8. CheckpointError naming the tensor."""
    count = 0
    for i, kind in enumerate(c.ffn_kinds):
        if kind != "moe":
            continue
        for stack in (("w_gate", "w_up"), ("w_down",)):
            names = [f"layers.{i}.moe.experts.{e}.{part}" for e in range(c.experts) for part in stack]
            fp8 = [where[n][2] is not None for n in names]
            if any(fp8) and not all(fp8):
                odd = names[fp8.index(not fp8[0])]
                raise CheckpointError(f"tensor {where[odd][0]!r} is {'F8_E4M3' if not fp8[0] else 'not F8_E4M3'} "
                                      f"unlike {where[names[0]][0]!r}: a layer's experts are all FP8 or all 16-bit "
                                      f"(one stack)")
            if fp8[0] and len(stack) == 2 and c.expert_hidden % FP8_BLOCK:
                raise CheckpointError(f"tensor {where[names[0]][0]!r} is F8_E4M3 with moe_intermediate_size="
                                      f"{c.expert_hidden}: FP8 experts need it a multiple of {FP8_BLOCK} (gate and "
                                      f"up in whole scale blocks)")
            count += sum(fp8)
    return count
