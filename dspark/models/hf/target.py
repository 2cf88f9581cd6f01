"""Targets from Hugging Face checkpoints: qwen3 (dense attention) and qwen3_5 / qwen3_5_text
(Gated-DeltaNet + gated attention), and their mixture-of-experts models qwen3_moe and qwen3_5_moe /
qwen3_5_moe_text (dspark.models.hf.moe: the FFN kind per layer, the router, both expert layouts),
mapped onto the one trunk (TrunkConfig + our tensor names).

Config: `config_of` reads config.json (the text config nested under `text_config` for qwen3_5)
into a TrunkConfig, with the end-of-sequence ids where transformers' generate() finds them
(`eos_ids_of`: generation_config.json first). Every numeric convention is a field of it, set here
per model_type, exactly as transformers' modeling_qwen3.py / modeling_qwen3_5.py compute:

| convention | qwen3, qwen3_moe | qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text |
|---|---|---|
| RMSNorm weight | w | 1 + w (zero-centred), except the gdn output norm: w |
| q/k RMSNorm per head before RoPE | yes | yes |
| q_proj | [H*D, d] | [H*2D, d]: per head [q (D) | gate (D)]; output * sigmoid(gate) before o_proj |
| RoPE | full head, rope_parameters | first int(D * partial_rotary_factor) dims (0.25) |
| mixers | attention | layer_types: linear_attention -> gdn, full_attention -> attn |
| FFN | MLP; qwen3_moe: MoE by layer (hf.moe) | MLP; the _moe types: MoE in every layer (hf.moe) |

RoPE scaling: default, linear and yarn (dynamic and the others depend on more than the position
and are refused). Qwen3.5's mrope (mrope_section, mrope_interleaved) is a no-op for text: the three
position axes are equal for text tokens, so interleaving them changes no frequency.

Tensors: `tensor_map` is the one table of checkpoint name -> (our name, layout). Checkpoint
matrices are [out, in] and ours [in, out] ("T"); conv1d is [C, 1, 4] and ours [C, 4] ("conv").
Text-only serving skips two groups of tensors by rule, and the load reports how many it skipped:
`model.visual.*` (the Qwen3.5 vision tower) and `mtp.*` (the multi-token-prediction head, which
transformers also drops). A tied checkpoint's `lm_head.weight`, if present, is skipped too: the
LM head is the embedding. Every other name must be in the table.

FP8 checkpoints (block-scaled e4m3, dspark.models.hf.quantization): each decoder-layer linear
stored as F8_E4M3 keeps its bytes and `weight_scale_inv` block scales on the backend
(dspark.ops.fp8.Fp8Matrix), MoE experts included, stacked per layer (dspark.ops.fp8.Fp8Stack; both
expert layouts: hf.moe); the rest loads as above. The report lists what is quantized, and how many
of those matrices are experts.

Refusals (one CheckpointError naming the config key or tensor, raised before anything is
allocated on the backend, or, for an FP8 weight's NaN bytes, when that weight is read, with what
was allocated before it freed): a model_type not served, an expert count or top-k the config or the
kernels cannot hold (hf.moe), a feature the
trunk lacks (attention or MLP bias, sliding windows, an activation other than SiLU, a conv width
other than 4), a missing, misshaped or unknown tensor, a tensor dtype other than f32/f16/bf16 (or
e4m3 where the FP8 format allows it), a quantization other than block-scaled FP8 and every
inconsistency of an FP8 checkpoint (quantization.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ...dtypes import BF16
from ...ops.attention import HEAD_DIMS
from ...ops.fp8 import Fp8Host, nan_bytes
from ...progress import TensorProgress
from ...ops.gdn import scan_plan
from ...ops.linear import tensor_cores
from ..config import TrunkConfig
from ..weights import STORAGE, trunk_spec
from .checkpoint import Checkpoint, CheckpointError
from .moe import check_fp8_experts, layer_table as moe_layer_table, moe_fields, unfuse
from .quantization import F8, Fp8Format, check_linear, quantization_of

SERVED = ("qwen3", "qwen3_5", "qwen3_5_text", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text")
ATTENTION_ONLY = ("qwen3", "qwen3_moe")    # every layer full attention, Qwen3's conventions
NESTED = ("qwen3_5", "qwen3_5_moe")        # the multimodal checkpoints: the text config under text_config
DEFAULT_MAX_CTX = 4096           # cache rows per session unless load_target(max_ctx=) says otherwise
SKIPPED = {"qwen3": (), "qwen3_5": ("model.visual.", "mtp."), "qwen3_5_text": ("mtp.",), "qwen3_moe": (),
           "qwen3_5_moe": ("model.visual.", "mtp."), "qwen3_5_moe_text": ("mtp.",)}
MIXERS = {"linear_attention": "gdn", "full_attention": "attn"}

# checkpoint name inside a decoder layer -> (our name inside layer i, layout)
LAYER = {
    "input_layernorm.weight": ("norm1", ""),
    "post_attention_layernorm.weight": ("norm2", ""),
    "mlp.gate_proj.weight": ("mlp.w_gate", "T"),
    "mlp.up_proj.weight": ("mlp.w_up", "T"),
    "mlp.down_proj.weight": ("mlp.w_down", "T"),
}
ATTN = {
    "self_attn.q_proj.weight": ("attn.wq", "T"),
    "self_attn.k_proj.weight": ("attn.wk", "T"),
    "self_attn.v_proj.weight": ("attn.wv", "T"),
    "self_attn.o_proj.weight": ("attn.wo", "T"),
    "self_attn.q_norm.weight": ("attn.q_norm", ""),
    "self_attn.k_norm.weight": ("attn.k_norm", ""),
}
GDN = {
    "linear_attn.in_proj_qkv.weight": ("gdn.w_qkv", "T"),
    "linear_attn.in_proj_z.weight": ("gdn.w_z", "T"),
    "linear_attn.in_proj_b.weight": ("gdn.w_b", "T"),
    "linear_attn.in_proj_a.weight": ("gdn.w_a", "T"),
    "linear_attn.conv1d.weight": ("gdn.conv", "conv"),
    "linear_attn.A_log": ("gdn.A_log", ""),
    "linear_attn.dt_bias": ("gdn.dt_bias", ""),
    "linear_attn.norm.weight": ("gdn.o_norm", ""),
    "linear_attn.out_proj.weight": ("gdn.wo", "T"),
}
TOP = {"embed_tokens.weight": ("embed", ""), "norm.weight": ("final_norm", "")}


def size_text(nbytes: int) -> str:
    """Bytes for a person: 53.81 GB, 170.4 MB, 12.0 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{nbytes} B"


@dataclass
class LoadReport:
    """What load_target read: kept on the trunk as `trunk.source`; `summary()` says it in one line."""
    path: Path
    model_type: str
    dtypes: dict[str, int]                             # checkpoint dtype -> tensors read
    skipped: dict[str, int] = field(default_factory=dict)  # rule (name prefix) -> tensors skipped
    notes: list[str] = field(default_factory=list)
    stored: str = ""                                   # the matrices' dtype on the backend
    device_bytes: int = 0                              # the weights' bytes on the backend (its allocator's count)
    backend: str = ""
    quantization: str = ""                             # the checkpoint's scheme (Fp8Format.describe), if quantized
    quantized: list[str] = field(default_factory=list)  # our names of the linears kept e4m3 + scales
    quantized_experts: int = 0                         # of them, MoE expert matrices (stacked e4m3 + scales)
    kept: list[str] = field(default_factory=list)       # our names of the linears left in their stored dtype
    scale_dtypes: dict[str, int] = field(default_factory=dict)  # scale dtype -> FP8 linears

    def summary(self) -> str:
        read = ", ".join(f"{d} {n}" for d, n in self.dtypes.items())
        parts = [f"{self.model_type} from {self.path}: {sum(self.dtypes.values())} tensors ({read})"
                 + (f" stored as {self.stored}, {size_text(self.device_bytes)} on {self.backend}" if self.backend else "")]
        if self.quantization:
            scales = ", ".join(f"{d} {n}" for d, n in self.scale_dtypes.items())
            experts = f" ({self.quantized_experts} of them MoE experts)" if self.quantized_experts else ""
            parts.append(f"{self.quantization}: {len(self.quantized)} linears kept e4m3{experts} with {scales} block "
                         f"scales, {len(self.kept)} left unquantized")
        parts += [f"skipped {n} {rule}* tensors" for rule, n in self.skipped.items()]
        return "; ".join(parts + self.notes)


# ---- config ----------------------------------------------------------------------------------
def text_config(config: dict) -> tuple[str, dict]:
    """(model_type, the text model's config) after the refusals that need only the config."""
    model_type = config.get("model_type")
    text = config.get("text_config") if model_type in NESTED else config
    if not isinstance(text, dict):
        raise CheckpointError(f"config.json of model_type {model_type!r} has no text_config")
    if model_type not in SERVED:
        raise CheckpointError(f"model_type={model_type!r}: dspark serves {', '.join(SERVED)}")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                    ("use_sliding_window", False)):
        if text.get(key, ok) != ok:
            raise CheckpointError(f"config {key}={text[key]!r}: dspark serves {key}={ok!r} only")
    if text.get("linear_conv_kernel_dim", 4) != 4:
        raise CheckpointError(f"config linear_conv_kernel_dim={text['linear_conv_kernel_dim']}: the gdn kernels "
                              f"implement 4")
    return model_type, text


def layer_types(model_type: str, t: dict) -> tuple[str, ...]:
    n = int(t["num_hidden_layers"])
    types = t.get("layer_types")
    if types is None:
        if model_type in ATTENTION_ONLY:
            return ("attn",) * n
        every = int(t.get("full_attention_interval", 4))  # transformers' default pattern
        return tuple("attn" if (i + 1) % every == 0 else "gdn" for i in range(n))
    if len(types) != n:
        raise CheckpointError(f"config layer_types has {len(types)} entries: expected num_hidden_layers={n}")
    dense = model_type in ATTENTION_ONLY
    bad = [x for x in types if x not in MIXERS or (dense and x != "full_attention")]
    if bad:
        raise CheckpointError(f"config layer_types has {bad[0]!r}: dspark serves "
                              f"{'full_attention' if dense else ', '.join(MIXERS)}")
    return tuple(MIXERS[x] for x in types)


def rope_of(model_type: str, t: dict) -> tuple[float, float, tuple]:
    """(theta, rotary fraction, scaling pairs) from rope_parameters (or the older rope_theta and
    rope_scaling keys)."""
    params = dict(t.get("rope_parameters") or {})
    legacy = dict(t.get("rope_scaling") or {})
    params = {**legacy, **params}
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    theta = float(params.get("rope_theta", t.get("rope_theta", 10000.0)))
    default_fraction = 1.0 if model_type in ATTENTION_ONLY else 0.25  # transformers' Qwen3.5 default
    fraction = float(params.get("partial_rotary_factor", t.get("partial_rotary_factor", default_fraction)))
    kind = params.get("rope_type", "default")
    if kind == "default":
        return theta, fraction, ()
    if kind not in ("linear", "yarn"):
        raise CheckpointError(f"config rope_type={kind!r}: dspark serves default, linear and yarn")
    keep = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
            "attention_factor", "truncate")
    scaling = {k: params[k] for k in keep if params.get(k) is not None}
    if kind == "yarn":
        if "original_max_position_embeddings" not in scaling:
            raise CheckpointError("config rope_type='yarn' needs original_max_position_embeddings")
        scaling.setdefault("factor", t["max_position_embeddings"] / scaling["original_max_position_embeddings"])
    elif "factor" not in scaling:
        raise CheckpointError("config rope_type='linear' needs factor")
    return theta, fraction, tuple(sorted({"rope_type": kind, **scaling}.items()))


def eos_ids_of(config: dict, generation: dict | None, vocab: int) -> tuple[int, ...]:
    """Every id that ends a stream, as transformers' generate() takes them: the eos_token_id of
    generation_config.json where the directory has that file (transformers then reads no other:
    without the key there, nothing stops a stream), else config.json's, top level first, then its
    text_config's. A single id or a list (Qwen: <|im_end|> and <|endoftext|>)."""
    if generation is not None:
        where, value = "generation_config.json eos_token_id", generation.get("eos_token_id")
    else:
        where, value = "config eos_token_id", config.get("eos_token_id")
        text = config.get("text_config")
        if value is None and isinstance(text, dict):
            where, value = "config text_config.eos_token_id", text.get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab]
    if bad:
        raise CheckpointError(f"{where}={value!r}: {bad[0]!r} is not a token id in [0, {vocab})")
    return tuple(dict.fromkeys(ids))


def config_of(config: dict, max_ctx: int | None = None, tap_layers=None, generation: dict | None = None
              ) -> TrunkConfig:
    """The TrunkConfig of a served config.json (raises CheckpointError otherwise); `generation`
    is generation_config.json where the directory has one (its end-of-sequence ids)."""
    model_type, t = text_config(config)
    hybrid = model_type not in ATTENTION_ONLY
    layers = layer_types(model_type, t)
    moe = moe_fields(model_type, t, len(layers))
    heads = int(t["num_attention_heads"])
    theta, fraction, scaling = rope_of(model_type, t)
    n = len(layers)
    max_pos = int(t.get("max_position_embeddings", DEFAULT_MAX_CTX))
    if max_ctx is not None and not 1 <= int(max_ctx) <= max_pos:
        raise CheckpointError(f"max_ctx={max_ctx}: expected 1 to the model's max_position_embeddings={max_pos}")
    try:
        eos = eos_ids_of(config, generation, int(t["vocab_size"]))
        return TrunkConfig(
            vocab=int(t["vocab_size"]),
            eos_id=eos[0] if eos else -1,
            extra_eos_ids=eos[1:],
            mask_id=int(t["vocab_size"]) - 1,  # a placeholder id: a drafter format brings its own
            d_model=int(t["hidden_size"]),
            # the dense MLP's width; a model with no dense layer (Qwen3.5-MoE) need not have one
            mlp_hidden=int(t["intermediate_size"] if "mlp" in moe.get("ffn", ("mlp",)) else
                           t.get("intermediate_size", 0)),
            layers=layers,
            attn_heads=heads,
            attn_kv_heads=int(t.get("num_key_value_heads") or heads),
            head_dim=int(t.get("head_dim") or int(t["hidden_size"]) // heads),
            rope_theta=theta,
            gdn_heads=int(t.get("linear_num_value_heads", 1)),
            gdn_k_heads=int(t.get("linear_num_key_heads", 1)),
            gdn_dk=int(t.get("linear_key_head_dim", 16)),
            gdn_dv=int(t.get("linear_value_head_dim", 16)),
            norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            tap_layers=tuple(tap_layers) if tap_layers is not None else tuple(sorted({max(0, n // 2 - 1), n - 1})),
            max_ctx=int(max_ctx or min(max_pos, DEFAULT_MAX_CTX)),
            norm_offset=1.0 if hybrid else 0.0,
            qk_norm=True,
            attn_gate=hybrid,
            rope_fraction=fraction,
            rope_scaling=scaling,
            # qwen3_5's tie flag is the composite config's (transformers ties by it, not text_config's)
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            **moe,
        )
    except KeyError as e:
        raise CheckpointError(f"config.json of model_type {model_type!r} has no {e.args[0]!r}") from None
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"config.json of model_type {model_type!r}: {e}") from None


def check_kernels(c: TrunkConfig) -> None:
    """Shapes the kernels cannot run are refused at load, not at the first forward."""
    if "attn" in c.layers and c.head_dim not in HEAD_DIMS:
        raise CheckpointError(f"config head_dim={c.head_dim}: the attention kernel serves "
                              f"{', '.join(map(str, HEAD_DIMS))}")
    if "gdn" in c.layers:
        try:
            scan_plan(c.gdn_heads, c.gdn_dk, c.gdn_dv, c.gdn_key_heads)
        except ValueError as e:
            raise CheckpointError(f"config linear_key_head_dim={c.gdn_dk}, linear_value_head_dim={c.gdn_dv}: "
                                  f"the gdn kernels refuse them ({e})") from None


# ---- tensors ---------------------------------------------------------------------------------
def text_prefix(model_type: str, names) -> str:
    """Where the language model's tensors sit: model.language_model. (Qwen3_5ForConditionalGeneration)
    or model. (the CausalLM classes)."""
    for prefix in ("model.language_model.", "model."):
        if prefix + "embed_tokens.weight" in names:
            return prefix
    raise CheckpointError(f"tensor 'model.embed_tokens.weight' is missing (model_type {model_type!r}; also looked "
                          f"for 'model.language_model.embed_tokens.weight')")


def tensor_map(c: TrunkConfig, prefix: str) -> dict[str, tuple[str, str]]:
    """Checkpoint tensor name -> (our name, layout) for every tensor the trunk needs."""
    out = {prefix + k: v for k, v in TOP.items()}
    for i, kind in enumerate(c.layers):
        p = f"{prefix}layers.{i}."
        ffn = LAYER if c.ffn_kinds[i] == "mlp" else {**{k: v for k, v in LAYER.items() if not k.startswith("mlp.")},
                                                     **moe_layer_table(c)}
        for table in (ffn, ATTN if kind == "attn" else GDN):
            out.update({p + k: (f"layers.{i}.{ours}", how) for k, (ours, how) in table.items()})
    if not c.tie_embeddings:
        out["lm_head.weight"] = ("lm_head", "T")
    return out


def checkpoint_shape(shape: tuple, how: str) -> tuple:
    if how == "T":
        return tuple(reversed(shape))
    if how == "conv":
        return (shape[0], 1, shape[1])
    return tuple(shape)


def as_ours(array: np.ndarray, how: str) -> np.ndarray:
    """A view of a checkpoint tensor in our layout (no copy: the backend copy is made later)."""
    if how == "T":
        return array.T
    if how == "conv":
        return array.reshape(array.shape[0], array.shape[2])
    return array


def plan(ckpt: Checkpoint, config: TrunkConfig, model_type: str, fmt: Fp8Format | None = None
         ) -> tuple[dict, LoadReport]:
    """(our name -> checkpoint name, layout and the FP8 scale's name or None, report) after checking
    every tensor's presence, name, shape and dtype (and an FP8 checkpoint's scales: quantization.py).
    Reads headers, and the scales."""
    prefix = text_prefix(model_type, ckpt.tensors)
    fused = unfuse(ckpt.tensors, config, prefix)  # fused 3-D expert tensors read as per-expert views
    names = set(ckpt.tensors)
    wanted = tensor_map(config, prefix)
    spec = trunk_spec(config)
    report = LoadReport(ckpt.path, model_type, {})
    rules = SKIPPED[model_type] + (("lm_head.",) if config.tie_embeddings else ())
    scales = {n[: -len("weight")] + "weight_scale_inv" for n in wanted if n.endswith(".weight")} & names
    for name in sorted(names - set(wanted) - scales):
        rule = next((r for r in rules if name.startswith(r)), None)
        if rule is None:
            raise CheckpointError(f"unknown tensor {name!r} in {ckpt.path} (model_type {model_type!r}): dspark "
                                  f"does not know what it is, so it will not serve this checkpoint")
        report.skipped[rule] = report.skipped.get(rule, 0) + 1
    missing = sorted(set(wanted) - names)
    if missing:
        raise CheckpointError(f"tensor {missing[0]!r} is missing from {ckpt.path} ({len(missing)} missing in all)")
    where = {}
    for name, (ours, how) in wanted.items():
        info = ckpt.tensors[name]
        expected = checkpoint_shape(spec[ours], how)
        if info.shape != expected:
            raise CheckpointError(f"tensor {name!r} has shape {info.shape}: expected {expected} for this config")
        linear = how == "T" and ours.startswith("layers.")
        if info.dtype not in ("F32", "F16", "BF16", F8):
            raise CheckpointError(f"tensor {name!r} has dtype {info.dtype}: expected F32, F16 or BF16"
                                  + (" (or F8_E4M3 with block scales)" if linear else "")
                                  + " (other quantized formats are not served)")
        scale = check_linear(ckpt, name, info, fmt, linear)
        if scale is not None:
            report.quantized.append(ours)
            sd = ckpt.tensors[scale].dtype
            report.scale_dtypes[sd] = report.scale_dtypes.get(sd, 0) + 1
        elif linear and fmt is not None:
            report.kept.append(ours)
        report.dtypes[info.dtype] = report.dtypes.get(info.dtype, 0) + 1
        where[ours] = (name, how, scale)
    if fmt is not None:
        report.quantization = fmt.describe()
    report.quantized_experts = check_fp8_experts(where, config) if "moe" in config.ffn_kinds else 0
    if "lm_head." in report.skipped:
        report.notes.append("tied embeddings: lm_head.weight ignored, the LM head is the embedding")
    if fused:
        report.notes.append(f"{fused} fused expert tensors read expert by expert")
    return where, report


class LazyWeights(Mapping):
    """our name -> the checkpoint tensor in our layout, memory-mapped on access; the trunk
    converts one tensor at a time onto the backend, so the checkpoint is never held twice."""

    def __init__(self, ckpt: Checkpoint, where: dict):
        self._ckpt, self._where = ckpt, where

    def __getitem__(self, name):
        checkpoint_name, how, scale = self._where[name]
        array = self._ckpt.array(checkpoint_name)
        if scale is None:
            return as_ours(array, how)
        bad = nan_bytes(array)  # e4m3 has no infinities; its NaN bytes would poison every sum they reach
        if bad:
            raise CheckpointError(f"tensor {checkpoint_name!r} holds {bad} e4m3 NaN bytes (0x7F / 0xFF)")
        return Fp8Host(as_ours(array, how), as_ours(self._ckpt.array(scale), how), checkpoint_name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def storage_dtype(dtype) -> np.dtype:
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d not in STORAGE:
        raise ValueError(f"dtype={dtype!r}: expected float32, float16 or bfloat16")
    return d


def holds(backend, dtype) -> bool:
    """Whether the backend's array module has arrays of `dtype` (some CuPy versions lack bf16)."""
    try:
        backend.xp.zeros(1, dtype)
        return True
    except (TypeError, ValueError):
        return False


def default_dtype(backend, checkpoint_dtype) -> np.dtype:
    """dtype=None: float32 on the CPU backends (BLAS multiplies f32; widening per call would only
    cost time), the checkpoint's own dtype on cuda (bf16 stays bf16: half the memory and the
    tensor-core GEMM, which rounds the activations to bf16 as bf16 engines do; float32 on a CuPy
    without bf16 arrays or a device without tensor cores)."""
    if backend.name != "cuda" or not holds(backend, checkpoint_dtype) or not tensor_cores(backend):
        return np.dtype(np.float32)
    return np.dtype(checkpoint_dtype)


def fp8_storage(be, storage: np.dtype, dtype, checkpoint_dtype) -> np.dtype:
    """The storage dtype of an FP8 checkpoint's unquantized matrices, which is also its FP8
    products' activation type on the kernel backends (W8A16 on tensor cores: 16-bit there; dtype
    None picks the checkpoint's 16-bit type, else bf16). The numpy backend keeps `storage`."""
    if be.kernels is None:
        return storage
    if not tensor_cores(be):
        raise CheckpointError(f"FP8 weights need tensor cores (sm_80 or later); this device is {be.kernels.arch}")
    if storage.itemsize == 2:
        return storage
    if dtype is not None:
        raise ValueError(f"dtype={storage}: FP8 weights on {be.name!r} multiply with 16-bit activations on tensor "
                         f"cores (W8A16): expected bfloat16 or float16 (the numpy backend computes in float32)")
    wide = np.dtype(checkpoint_dtype)
    return wide if wide.itemsize == 2 and holds(be, wide) else BF16


def inspect_target(path, max_ctx: int | None = None) -> LoadReport:
    """The LoadReport of a served checkpoint without loading it: config and headers (and FP8
    scales) read, every refusal of load_target's made, nothing allocated (`dspark info --model`)."""
    ckpt = Checkpoint(path)
    model_type, _ = text_config(ckpt.config)
    config = config_of(ckpt.config, max_ctx, None, ckpt.generation_config)
    check_kernels(config)
    return plan(ckpt, config, model_type, quantization_of(ckpt.config))[1]


def load_target(path, backend=None, dtype=None, *, max_ctx: int | None = None, tap_layers=None,
                kv_dtype: str = "float32", progress: bool | None = None):
    """A HybridTrunk from a Hugging Face model directory (or a hub id in the local cache).

    backend: a Backend, a backend name, or None for dspark.get_backend's default. dtype: storage
    dtype of the weight matrices on the backend (float32, float16, bfloat16; narrower than the
    checkpoint rounds to nearest even); None: see `default_dtype`. max_ctx: cache rows per
    session (default min(max_position_embeddings, 4096), at most max_position_embeddings; a cache
    the backend has no room for is refused when it is made, dspark.models.cache.require_room).
    tap_layers: the default taps (layer outputs, hidden_states[i + 1]); a drafter can ask for
    others per call. kv_dtype: the K/V cache's storage (float32, as transformers computes; float16
    or bfloat16 halve it). The trunk's `source` is a LoadReport: dtypes read, tensors skipped by
    rule, the bytes on the backend, what an FP8 checkpoint quantizes. Raises CheckpointError before
    allocating anything when the checkpoint cannot be served (an FP8 weight's NaN bytes: when it is
    read, freeing what was allocated). An FP8 checkpoint's quantized linears stay e4m3 with their
    block scales on every backend; on simt and cuda they multiply with 16-bit activations, so there
    dtype=None gives bf16 (the checkpoint's 16-bit type) and float32 is refused (`fp8_storage`). `progress`: a bar of the tensors reaching the backend, shard by
    shard (dspark.progress: None shows it while stderr is a terminal unless DSPARK_PROGRESS=0; True
    / False force it on / off).
    """
    from ...backends import Backend, get_backend
    from ..trunk import HybridTrunk
    if dtype is not None:
        dtype = storage_dtype(dtype)
    ckpt = Checkpoint(path)
    model_type, _ = text_config(ckpt.config)
    config = config_of(ckpt.config, max_ctx, tap_layers, ckpt.generation_config)
    if kv_dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"kv_dtype={kv_dtype!r}: expected 'float32', 'float16' or 'bfloat16'")
    config = replace(config, kv_dtype=kv_dtype)
    check_kernels(config)
    where, report = plan(ckpt, config, model_type, quantization_of(ckpt.config))
    be = backend if isinstance(backend, Backend) else get_backend(backend)
    embed_dtype = {"F32": np.float32, "F16": np.float16, "BF16": BF16}[ckpt.tensors[where["embed"][0]].dtype]
    storage = default_dtype(be, embed_dtype) if dtype is None else dtype
    if report.quantized:
        storage = fp8_storage(be, storage, dtype, embed_dtype)
    if not holds(be, storage):
        raise ValueError(f"dtype={storage}: backend {be.name!r} has no {storage} arrays (this CuPy lacks them)")
    before = be.alloc.bytes("weights")
    with TensorProgress(ckpt.tensors, [name for name, _, _ in where.values()], f"loading {ckpt.path.name}",
                        progress) as bar:
        trunk = HybridTrunk(config, LazyWeights(ckpt, where), be, dtype=storage,
                            progress=lambda ours: bar.done(where[ours][0]))
    report.stored, report.device_bytes, report.backend = storage.name, be.alloc.bytes("weights") - before, be.name
    trunk.source = report
    return trunk
