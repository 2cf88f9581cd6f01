"""A Hugging Face model directory: where it is, its config.json (and generation_config.json, where
it has one), and its safetensors tensors.

Tensors are read from the safetensors files directly (an 8-byte header length, a JSON header of
name -> dtype, shape and byte range, then the data), memory-mapped, so that checking every name,
shape and dtype costs no tensor reads and a 27B checkpoint is never held in memory twice. bf16
is `ml_dtypes.bfloat16`, which the `safetensors` NumPy API cannot return. Targets and drafters
(dspark.models.hf.target, dspark.models.hf.drafters) both read through this one reader.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...dtypes import BF16
from ...errors import CheckpointError
from ...ops.fp8 import E4M3

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION = "generation_config.json"
# Weights are float; drafters also store integer and bool token maps (speculators' d2t / t2d).
DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": BF16, "I64": np.dtype(np.int64),
          "I32": np.dtype(np.int32), "BOOL": np.dtype(np.bool_), "F8_E4M3": E4M3}  # F8: FP8 checkpoints' bytes

__all__ = ["Checkpoint", "CheckpointError", "TensorInfo", "locate", "read_header", "read_json"]


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str            # safetensors code: F32, F16, BF16, ...
    shape: tuple[int, ...]
    start: int            # byte offset of the data in the file
    end: int


def locate(path) -> Path:
    """The model directory: `path` itself, or a hub id ("Qwen/Qwen3-8B") resolved in the local
    huggingface_hub cache. Nothing is downloaded."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    text = str(path)
    if p.exists() or text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise CheckpointError(f"path={text!r}: expected a model directory (config.json + safetensors) or a hub id")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"path={text!r} is not a directory, and huggingface_hub is not installed to find it "
                              f"in the local hub cache (pip install huggingface_hub, or pass the directory)") from None
    try:
        return Path(snapshot_download(text, local_files_only=True))
    except Exception as e:  # the hub raises several types for "not cached"; all mean the same here
        raise CheckpointError(f"path={text!r}: not a directory, and not in the local Hugging Face cache "
                              f"({type(e).__name__}); dspark never downloads: fetch it first "
                              f"(huggingface-cli download {text})") from None


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path.name} is missing from {path.parent}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of one .safetensors file, from its header alone."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        size = path.stat().st_size
        if n > size - 8:
            raise CheckpointError(f"{path}: header length {n} exceeds the file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        info = TensorInfo(path, meta["dtype"], tuple(int(d) for d in meta["shape"]), base + start, base + end)
        if info.end > size:
            raise CheckpointError(f"{path}: tensor {name!r} runs past the end of the file")
        out[name] = info
    return out


class Checkpoint:
    """config.json and the tensors of a model directory (single or sharded safetensors)."""

    def __init__(self, path):
        self.path = locate(path)
        self.config = read_json(self.path / "config.json")
        gen = self.path / GENERATION
        self.generation_config = read_json(gen) if gen.is_file() else None  # generate()'s defaults, if saved
        self.tensors = self._index()

    def _index(self) -> dict[str, TensorInfo]:
        d = self.path
        if (d / INDEX).is_file():
            weight_map = read_json(d / INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{d / INDEX}: expected a 'weight_map' of tensor name -> file")
            files = sorted(set(weight_map.values()))
        elif (d / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            found = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            raise CheckpointError(f"{d}: no {SINGLE} or {INDEX}"
                                  + (f" (found {', '.join(found)}: only safetensors are read)" if found else ""))
        tensors: dict[str, TensorInfo] = {}
        for name in files:
            if not (d / name).is_file():
                raise CheckpointError(f"{INDEX} lists shard {name!r}, which is missing from {d}")
            tensors.update(read_header(d / name))
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in tensors or tensors[name].file.name != file:
                    raise CheckpointError(f"{INDEX} places tensor {name!r} in {file!r}, which does not hold it")
        return tensors

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped NumPy array, in its stored dtype."""
        info = self.tensors[name]
        dtype = DTYPES.get(info.dtype)
        if dtype is None:
            raise CheckpointError(f"tensor {name!r} has dtype {info.dtype}: expected one of {', '.join(DTYPES)}")
        count = int(np.prod(info.shape, dtype=np.int64))
        if (info.end - info.start) != count * dtype.itemsize:
            raise CheckpointError(f"tensor {name!r}: {info.end - info.start} bytes for shape {info.shape} "
                                  f"of {info.dtype}")
        if count == 0:
            return np.zeros(info.shape, dtype)
        return np.memmap(info.file, dtype=dtype, mode="r", offset=info.start, shape=info.shape)
