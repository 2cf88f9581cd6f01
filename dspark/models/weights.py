"""Weight tables: the expected name -> shape of every tensor, random init, save and load.

Weights are f32 NumPy arrays on the host; `to_backend` moves them once. Files are safetensors
(through the `safetensors` NumPy API) or `.npz`, with the config as JSON beside them. Loading
checks every tensor's name, shape and dtype against the config and names the first mismatch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import DTypeError, ShapeError
from .config import DrafterConfig, TrunkConfig


def trunk_spec(c: TrunkConfig) -> dict[str, tuple[int, ...]]:
    d, F = c.d_model, c.mlp_hidden
    spec = {"embed": (c.vocab, d)}
    for i, kind in enumerate(c.layers):
        p = f"layers.{i}."
        spec[p + "norm1"] = (d,)
        spec[p + "norm2"] = (d,)
        if kind == "attn":
            spec[p + "attn.wq"] = (d, c.attn_heads * c.head_dim)
            spec[p + "attn.wk"] = (d, c.attn_kv_heads * c.head_dim)
            spec[p + "attn.wv"] = (d, c.attn_kv_heads * c.head_dim)
            spec[p + "attn.wo"] = (c.attn_heads * c.head_dim, d)
        else:
            H = c.gdn_heads
            spec[p + "gdn.w_qkv"] = (d, c.gdn_channels)
            spec[p + "gdn.w_a"] = (d, H)
            spec[p + "gdn.w_b"] = (d, H)
            spec[p + "gdn.w_z"] = (d, H * c.gdn_dv)
            spec[p + "gdn.conv"] = (c.gdn_channels, c.conv_kernel)
            spec[p + "gdn.A_log"] = (H,)
            spec[p + "gdn.dt_bias"] = (H,)
            spec[p + "gdn.o_norm"] = (c.gdn_dv,)
            spec[p + "gdn.wo"] = (H * c.gdn_dv, d)
        spec[p + "mlp.w_gate"] = (d, F)
        spec[p + "mlp.w_up"] = (d, F)
        spec[p + "mlp.w_down"] = (F, d)
    spec["final_norm"] = (d,)
    spec["lm_head"] = (d, c.vocab)
    return spec


def drafter_spec(c: DrafterConfig, t: TrunkConfig) -> dict[str, tuple[int, ...]]:
    d, F = c.d_model, c.mlp_hidden
    spec = {"fc": (len(t.tap_layers) * t.d_model, d), "fc_norm": (d,)}
    for i in range(c.layers):
        p = f"layers.{i}."
        spec[p + "norm1"] = (d,)
        spec[p + "norm2"] = (d,)
        spec[p + "attn.wq"] = (d, c.heads * c.head_dim)
        spec[p + "attn.wk"] = (d, c.kv_heads * c.head_dim)
        spec[p + "attn.wv"] = (d, c.kv_heads * c.head_dim)
        spec[p + "attn.k_norm"] = (c.head_dim,)
        spec[p + "attn.wo"] = (c.heads * c.head_dim, d)
        spec[p + "mlp.w_gate"] = (d, F)
        spec[p + "mlp.w_up"] = (d, F)
        spec[p + "mlp.w_down"] = (F, d)
    spec["markov.w1"] = (t.vocab, c.markov_rank)
    spec["markov.w2"] = (c.markov_rank, t.vocab)
    spec["conf.w"] = (d + c.markov_rank,)
    spec["conf.b"] = (1,)
    return spec


def random_weights(spec: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Scaled Gaussian matrices, unit norms, gdn decay parameters in their usual ranges."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in spec.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("norm") or leaf.endswith("_norm") or leaf == "final_norm":
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif leaf == "A_log":
            w = np.log(rng.uniform(1.0, 16.0, shape))
        elif leaf == "dt_bias":
            w = np.log(np.expm1(rng.uniform(0.001, 0.1, shape)))
        elif leaf == "conv":
            w = rng.standard_normal(shape) / 2.0
        elif leaf == "b":
            w = np.zeros(shape)
        elif len(shape) == 1:
            w = rng.standard_normal(shape) * 0.1
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[0])
        out[name] = w.astype(np.float32)
    return out


def check_weights(weights: dict[str, np.ndarray], spec: dict[str, tuple[int, ...]], what: str) -> None:
    missing = sorted(set(spec) - set(weights))
    if missing:
        raise ShapeError(f"{what}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
    extra = sorted(set(weights) - set(spec))
    if extra:
        raise ShapeError(f"{what}: unexpected tensor {extra[0]!r}")
    for name, shape in spec.items():
        w = weights[name]
        if tuple(w.shape) != tuple(shape):
            raise ShapeError(f"{what}: tensor {name!r} has shape {tuple(w.shape)}, expected {tuple(shape)}")
        if w.dtype != np.float32:
            raise DTypeError(f"{what}: tensor {name!r} has dtype {w.dtype}, expected float32")


def save_tensors(path: Path, weights: dict[str, np.ndarray]) -> None:
    path = Path(path)
    if path.suffix == ".npz":
        np.savez(path, **weights)
    elif path.suffix == ".safetensors":
        from safetensors.numpy import save_file
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(path))
    else:
        raise ValueError(f"path={str(path)!r}: expected a .safetensors or .npz file")


def load_tensors(path: Path) -> dict[str, np.ndarray]:
    path = Path(path)
    if path.suffix == ".npz":
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file
        return load_file(str(path))
    raise ValueError(f"path={str(path)!r}: expected a .safetensors or .npz file")


def load_model(directory, name: str, kind):
    """(config, tensors) from `name`.json beside `name`.safetensors or `name`.npz."""
    from .config import from_json
    d = Path(directory)
    config = from_json(d / f"{name}.json", kind)
    path = next((d / f"{name}{s}" for s in (".safetensors", ".npz") if (d / f"{name}{s}").exists()), None)
    if path is None:
        raise FileNotFoundError(f"no {name}.safetensors or {name}.npz in {d}")
    return config, load_tensors(path)


def save_model(directory, name: str, config, weights: dict[str, np.ndarray], fmt: str = "safetensors") -> None:
    from .config import to_json
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.json").write_text(to_json(config))
    save_tensors(d / f"{name}.{fmt}", weights)


def to_backend(be, weights: dict[str, np.ndarray]) -> dict:
    """Move weights to the backend once; owned by 'weights' in its allocator."""
    return {k: be.alloc.adopt(be.xp.array(v, dtype=np.float32), "weights") for k, v in weights.items()}
