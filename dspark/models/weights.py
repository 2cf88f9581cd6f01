"""Weight tables: the expected name -> shape of every tensor, random init, save and load.

Weights are NumPy arrays on the host (f32 for the embedded models; a Hugging Face checkpoint's
may be f16 or bf16, memory-mapped); `trunk_to_backend` moves them once. Files are safetensors (through
the `safetensors` NumPy API) or `.npz`, with the config as JSON beside them. Loading checks every
tensor's name, shape and dtype against the config and names the first mismatch.

Names are ours, whatever the checkpoint calls them (dspark.models.hf maps Hugging Face names):
matrices are [in, out] (x @ w), norms are the stored vectors, and `norm_offset` is added on the
backend (`trunk_to_backend`), so `trunk.w[...]` always holds the factor a norm multiplies by.

FP8 checkpoints (dspark.ops.fp8): a quantized linear arrives as an Fp8Host (e4m3 bytes and block
scales) and stays so on the backend, an Fp8Matrix; no dequantized copy is ever made.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..dtypes import BF16
from ..errors import DTypeError, ShapeError
from ..ops.fp8 import BLOCK as FP8_BLOCK, Fp8Host, Fp8Matrix
from .config import TrunkConfig
from .drafter_config import drafter_spec  # noqa: F401  (the drafter's table lives beside its config)
from .moe import moe_spec, stacked_layout, stacks

F32 = np.dtype(np.float32)
STORAGE = (F32, np.dtype(np.float16), BF16)
OFFSET_NORMS = ("norm1", "norm2", "final_norm", "q_norm", "k_norm")  # where TrunkConfig.norm_offset applies
F32_ONLY = ("conv", "A_log", "dt_bias")  # read by the gdn kernels as f32, whatever the storage dtype


def trunk_spec(c: TrunkConfig) -> dict[str, tuple[int, ...]]:
    d, F = c.d_model, c.mlp_hidden
    spec = {"embed": (c.vocab, d)}
    for i, kind in enumerate(c.layers):
        p = f"layers.{i}."
        spec[p + "norm1"] = (d,)
        spec[p + "norm2"] = (d,)
        if kind == "attn":
            spec[p + "attn.wq"] = (d, c.attn_heads * c.head_dim * (2 if c.attn_gate else 1))
            spec[p + "attn.wk"] = (d, c.attn_kv_heads * c.head_dim)
            spec[p + "attn.wv"] = (d, c.attn_kv_heads * c.head_dim)
            spec[p + "attn.wo"] = (c.attn_heads * c.head_dim, d)
            if c.qk_norm:
                spec[p + "attn.q_norm"] = (c.head_dim,)
                spec[p + "attn.k_norm"] = (c.head_dim,)
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
        if c.ffn_kinds[i] == "moe":
            spec.update(moe_spec(c, p))
        else:
            spec[p + "mlp.w_gate"] = (d, F)
            spec[p + "mlp.w_up"] = (d, F)
            spec[p + "mlp.w_down"] = (F, d)
    spec["final_norm"] = (d,)
    if not c.tie_embeddings:
        spec["lm_head"] = (d, c.vocab)
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


def check_weights(weights: dict[str, np.ndarray], spec: dict[str, tuple[int, ...]], what: str,
                  dtypes: tuple = (F32,), dtype_of: dict | None = None) -> None:
    """Every tensor of the spec and nothing else, each of its shape and of one of `dtypes`
    (`dtype_of` names the tensors that take other dtypes); the first mismatch is named."""
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
        want = (dtype_of or {}).get(name, dtypes)
        if w.dtype not in want:
            raise DTypeError(f"{what}: tensor {name!r} has dtype {w.dtype}, expected "
                             f"{' or '.join(str(np.dtype(t)) for t in want)}")


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


# Projections of one layer input, stored side by side as one [in, sum of outs] matrix so that one
# GEMM computes them all (fewer launches; dspark.ops.linear's summation order per output, and with
# it row invariance, is unchanged: fusing only widens N). Each part stays reachable under its own name
# as a column view of the fused matrix. A fused matrix's columns may round differently from the
# part's own product on some BLAS, never differently between rows or batches.
FUSED = {"attn.wqkv": ("attn.wq", "attn.wk", "attn.wv"), "gdn.w_in": ("gdn.w_qkv", "gdn.w_z", "gdn.w_a", "gdn.w_b"),
         "mlp.w_gate_up": ("mlp.w_gate", "mlp.w_up"), "moe.w_route": ("moe.router", "moe.shared_gate"),
         "moe.shared.w_gate_up": ("moe.shared.w_gate", "moe.shared.w_up")}


def fused_parts(names) -> dict[str, tuple[str, ...]]:
    """Fused name -> its parts' names, for every complete group among `names` (per layer)."""
    have, out = set(names), {}
    for name in names:
        for fused, parts in FUSED.items():
            prefix = name[: -len(parts[0])] if name.endswith("." + parts[0]) or name == parts[0] else None
            if prefix is not None and all(prefix + q in have for q in parts):
                out[prefix + fused] = tuple(prefix + q for q in parts)
    return out


def trunk_to_backend(be, c: TrunkConfig, weights, dtype, progress=None) -> dict:
    """The trunk's weights on the backend, one tensor at a time (a memory-mapped checkpoint is
    read once): matrices stored as `dtype` (f32, f16 or bf16; rounded to nearest even when
    narrower than the file), vectors and the gdn kernels' inputs as f32, `norm_offset` added to
    the norms it applies to. A tied LM head is a view of the embedding, no copy. Projections of
    one layer input are fused (FUSED): `layers.i.attn.wqkv` and so on. FP8 linears (Fp8Host) stay
    e4m3 and scales (Fp8Matrix, multiplying with `dtype` activations on the kernel backends); a
    fused group that cannot be one matrix is a ColumnRuns (`column_runs`). `progress(name)`, where
    given, hears of each of our tensors once it is on the backend."""
    def host_of(name):
        host = np.array(weights[name], dtype=storage_dtype(name, np.shape(weights[name]), dtype), order="C")  # a copy
        if name.rsplit(".", 1)[-1] in OFFSET_NORMS and c.norm_offset:
            host = np.float32(c.norm_offset) + host  # f32 add, as transformers' (1.0 + w.float())
        return host

    def upload(names):
        runs = []
        for run in column_runs([weights[q] for q in names]):
            parts = [names[i] for i in run]
            if isinstance(weights[parts[0]], Fp8Host):
                q = np.ascontiguousarray(np.concatenate([np.asarray(weights[p].q).view(np.uint8) for p in parts], axis=1))
                s = np.ascontiguousarray(np.concatenate([np.asarray(weights[p].scale, F32) for p in parts], axis=1))
                runs.append(Fp8Matrix(be.xp.asarray(q), be.xp.asarray(s), np.dtype(dtype)))
            else:
                runs.append(be.xp.asarray(host_of(parts[0]) if len(parts) == 1
                                          else np.concatenate([host_of(p) for p in parts], axis=1)))
        return runs
    return _trunk_layout(be, c, {name: np.shape(w) for name, w in weights.items()}, upload, progress)


def column_runs(parts) -> list[list[int]]:
    """The parts of a fused group (in column order) as runs that can each be one matrix: 16-bit /
    f32 parts together, FP8 parts together while each but the run's last spans whole 128-column
    blocks (so the run's scale grid is its parts' grids side by side). Indices into `parts`."""
    runs: list[list[int]] = []
    for i, p in enumerate(parts):
        fp8 = isinstance(p, Fp8Host)
        prev = parts[i - 1] if i else None
        joins = prev is not None and isinstance(prev, Fp8Host) == fp8 and (not fp8 or prev.shape[1] % FP8_BLOCK == 0)
        if joins:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def trunk_placeholders(be, c: TrunkConfig, dtype) -> dict:
    """The trunk's weights as trunk_to_backend lays them out, uninitialised: the shapes, storage
    dtypes and fused layout without a checkpoint (on the CuPy stand-in's null memory, without
    memory: profiling/host_round.py prices Qwen3.5-27B's host path so)."""
    spec = trunk_spec(c)

    def empty(names):
        first = spec[names[0]]
        shape = first if len(names) == 1 else (first[0], sum(spec[q][1] for q in names))
        return [be.xp.zeros(shape, storage_dtype(names[0], first, dtype))]  # null memory: free; a GPU: no NaN
    return _trunk_layout(be, c, spec, empty)


def storage_dtype(name: str, shape, dtype) -> np.dtype:
    """What a trunk tensor is stored as on the backend: f32 for vectors and the gdn kernels'
    inputs, `dtype` for the matrices."""
    return F32 if len(shape) == 1 or name.rsplit(".", 1)[-1] in F32_ONLY else np.dtype(dtype)


# The matrices the trunk multiplies by (dspark.models.trunk's `linear` calls): on the numpy backend
# with its native product they are laid out panel-major (dspark.ops.product.Panelled) in place of
# the row-major array, the same bits, a verify's tiles reading w sequentially.
PRODUCT_MATRICES = ("attn.wqkv", "attn.wo", "gdn.w_in", "gdn.wo", "mlp.w_gate_up", "mlp.w_down", "lm_head",
                    "moe.router", "moe.w_route", "moe.shared.w_gate_up", "moe.shared.w_down")


def _laid_out(be, name: str, arr):
    from ..ops import product
    if (be.kernels is None and product.NATIVE and not isinstance(arr, Fp8Matrix)
            and any(name == m or name.endswith("." + m) for m in PRODUCT_MATRICES)):
        return product.Panelled(arr)
    return arr


def _trunk_layout(be, c: TrunkConfig, shapes: dict, make, progress=None) -> dict:
    """name -> backend array: `make(names)` gives the named tensors side by side (a fused group)
    or one tensor, as a list of runs of columns (column_runs; one run is one matrix), owned by
    'weights'; each part of a group is a column view (of a panel-major matrix, a PanelledColumns;
    of an FP8 one, an Fp8Matrix of its bytes and scales). A failure (a refused tensor) frees what
    was made before it."""
    from ..ops.linear import ColumnRuns
    from ..ops.product import Panelled, PanelledColumns
    out, owned = {}, []
    done = progress or (lambda name: None)
    experts = stacks(shapes)  # a MoE layer's experts: one [E, K, N] array per stack (dspark.models.moe)
    stacked = {q for per_expert in experts.values() for parts in per_expert for q in parts}
    groups = fused_parts([name for name in shapes if name not in stacked])
    grouped = {q for parts in groups.values() for q in parts} | stacked

    def own(name, m):
        m = _laid_out(be, name, m)
        for a in (m.q, m.scale) if isinstance(m, Fp8Matrix) else (m,):
            owned.append(be.alloc.adopt(a, "weights"))
        return m

    def view(m, at, width):
        if isinstance(m, Fp8Matrix):
            return m.columns(at, width)
        return PanelledColumns(m, at, width) if isinstance(m, Panelled) else m[:, at : at + width]

    def one_matrix(parts):  # an expert's slice: 16-bit, f32 or FP8 in whole blocks (hf.moe refuses the rest)
        runs = make(parts)
        if len(runs) != 1:
            raise ShapeError(f"tensors {parts[0]!r} and {parts[-1]!r}: FP8 expert parts must span whole "
                             f"{FP8_BLOCK}-column blocks to stack as one matrix (or be all FP8 or all 16-bit)")
        return runs[0]
    try:
        for name in shapes:
            if name not in grouped:
                (m,) = make((name,))
                out[name] = own(name, m)
                done(name)
        for fused, parts in groups.items():
            runs = [own(fused, m) for m in make(parts)]
            at, starts = 0, []
            for m in runs:
                starts.append(at)
                at += m.shape[1]
            out[fused] = runs[0] if len(runs) == 1 else ColumnRuns(tuple(zip(runs, starts)))
            r, at = 0, 0
            for q in parts:
                width = shapes[q][1]
                while at >= starts[r] + runs[r].shape[1]:
                    r += 1
                out[q] = view(runs[r], at - starts[r], width)
                at += width
                done(q)
        out.update(stacked_layout(be, experts, shapes, one_matrix, done, owned))
    except BaseException:
        for a in owned:
            be.alloc.free(a)
        raise
    if c.tie_embeddings:
        out["lm_head"] = out["embed"].T
    return out
