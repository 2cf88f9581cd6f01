"""Quantized Hugging Face checkpoints: block-scaled FP8 (the Qwen3 / Qwen3.5 FP8 releases,
transformers' fine-grained FP8), read as stored; every other scheme refused by name.

Config (config.json's `quantization_config`, or its text_config's): quant_method "fp8", fmt
"e4m3", activation_scheme "dynamic", weight_block_size [128, 128], scale_fmt absent or "float",
no modules_to_convert; modules_to_not_convert names the modules left in their stored dtype,
possibly with a prefix a text-only load strips (model.language_model.), so names match after that
prefix, by whole dotted suffix (or as a prefix of the module), as transformers matches them.

Tensors: the header's dtype decides. A decoder-layer linear stored as F8_E4M3 [N, K] needs
`<module>.weight_scale_inv` of shape [ceil(N / 128), ceil(K / 128)], F32 or BF16, every scale
finite and positive; a listed module stored as F8, an F8 weight without its scale, a 16-bit weight
with a scale, an F8 embedding or LM head are refused by name. NaN bytes (0x7F, 0xFF) are refused
when the weight is read (dspark.models.hf.target.LazyWeights), before it reaches the backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...ops.fp8 import BLOCK
from .checkpoint import CheckpointError, TensorInfo

SCALE = "weight_scale_inv"
F8 = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16")
# Schemes people ship that dspark does not serve, by quant_method, and what they are.
OTHER_METHODS = {"gptq": "GPTQ int4/int8", "awq": "AWQ int4", "compressed-tensors": "compressed-tensors",
                 "bitsandbytes": "bitsandbytes int8/nf4", "mxfp4": "MXFP4", "modelopt": "ModelOpt (NVFP4 / FP8)",
                 "nvfp4": "NVFP4", "fbgemm_fp8": "FBGEMM per-row FP8", "torchao": "torchao", "hqq": "HQQ",
                 "quanto": "quanto", "eetq": "EETQ", "gguf": "GGUF"}
TEXT_PREFIXES = ("model.language_model.", "model.")


@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint's FP8 quantization_config, once accepted."""
    not_convert: tuple[str, ...] = ()
    block: tuple[int, int] = (BLOCK, BLOCK)

    def lists(self, module: str) -> str | None:
        """The modules_to_not_convert entry that names `module` (a checkpoint module name), if one does."""
        name = strip_prefix(module)
        for entry in self.not_convert:
            e = strip_prefix(entry)
            if name == e or name.endswith("." + e) or name.startswith(e + "."):
                return entry
        return None

    def describe(self) -> str:
        return f"FP8 e4m3, {self.block[0]}x{self.block[1]} blocks, dynamic activations"


def strip_prefix(name: str) -> str:
    for p in TEXT_PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def quantization_of(config: dict) -> Fp8Format | None:
    """The FP8 format of a config.json (top level, else its text_config), None when it has no
    quantization_config; CheckpointError for anything else, naming the key."""
    q = config.get("quantization_config")
    text = config.get("text_config")
    if q is None and isinstance(text, dict):
        q = text.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"config quantization_config={q!r}: expected a mapping")
    where = "config quantization_config"
    method = q.get("quant_method")
    if method != "fp8":
        what = OTHER_METHODS.get(str(method).lower())
        raise CheckpointError(f"{where}.quant_method={method!r}" + (f" ({what})" if what else "")
                              + ": dspark serves block-scaled FP8 (quant_method 'fp8') only")
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}.fmt={q['fmt']!r}: dspark serves e4m3 FP8 weights only")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{where}.activation_scheme={q['activation_scheme']!r}: dspark serves 'dynamic' "
                              f"(static activation scales are not read)")
    if q.get("scale_fmt") not in (None, "float"):
        raise CheckpointError(f"{where}.scale_fmt={q['scale_fmt']!r}: dspark serves float scales only")
    if q.get("modules_to_convert"):
        raise CheckpointError(f"{where}.modules_to_convert={q['modules_to_convert']!r}: dspark quantizes no "
                              f"module the checkpoint stores unquantized (FP8 embeddings are not served)")
    block = q.get("weight_block_size")
    if block is None:
        raise CheckpointError(f"{where}.weight_block_size is missing: per-tensor FP8 is not served (dspark serves "
                              f"[{BLOCK}, {BLOCK}] blocks)")
    if list(block) != [BLOCK, BLOCK]:
        raise CheckpointError(f"{where}.weight_block_size={list(block)!r}: the FP8 kernels take [{BLOCK}, {BLOCK}]")
    not_convert = q.get("modules_to_not_convert") or ()
    if isinstance(not_convert, str) or not all(isinstance(e, str) for e in not_convert):
        raise CheckpointError(f"{where}.modules_to_not_convert={not_convert!r}: expected a list of module names")
    return Fp8Format(tuple(not_convert))


def check_linear(ckpt, name: str, info: TensorInfo, fmt: Fp8Format | None, linear: bool) -> str | None:
    """For a tensor the trunk reads: its scale's name if it is an FP8 weight (after every check of
    the module doc), None if not; CheckpointError naming the tensor otherwise. `linear`: a
    decoder-layer linear (the only tensors served in FP8)."""
    scale = name[: -len("weight")] + SCALE if name.endswith(".weight") else None
    has_scale = scale is not None and scale in ckpt.tensors
    if info.dtype != F8:
        if has_scale:
            raise CheckpointError(f"tensor {scale!r} scales {name!r}, which is stored as {info.dtype}: a 16-bit "
                                  f"weight takes no scale")
        return None
    if not linear:
        raise CheckpointError(f"tensor {name!r} is {F8}: dspark serves FP8 for decoder-layer linears only (the "
                              f"embedding, LM head and norms stay 16-bit)")
    if fmt is None:
        raise CheckpointError(f"tensor {name!r} is {F8} but config.json has no quantization_config")
    module = name[: -len(".weight")]
    entry = fmt.lists(module)
    if entry is not None:
        raise CheckpointError(f"tensor {name!r} is {F8}, but quantization_config.modules_to_not_convert lists "
                              f"{entry!r}")
    if not has_scale:
        raise CheckpointError(f"tensor {name!r} is {F8} and its scale {scale!r} is missing")
    s = ckpt.tensors[scale]
    n, k = info.shape
    want = (-(-n // BLOCK), -(-k // BLOCK))
    if s.shape != want:
        raise CheckpointError(f"tensor {scale!r} has shape {s.shape}: expected {want}, one scale per {BLOCK}x{BLOCK} "
                              f"block of {name!r} {info.shape}")
    if s.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"tensor {scale!r} has dtype {s.dtype}: expected F32 or BF16")
    values = np.asarray(ckpt.array(scale), np.float32)
    bad = np.flatnonzero(~(np.isfinite(values) & (values > 0)))
    if bad.size:
        at = np.unravel_index(int(bad[0]), values.shape)
        raise CheckpointError(f"tensor {scale!r}[{', '.join(map(str, at))}]={float(values[at])!r}: a scale must be "
                              f"finite and positive")
    return scale
