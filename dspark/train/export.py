"""Stage 3: write the default pair into dspark/models/default/ (configs as config.to_json writes
them, safetensors weights named and shaped as trunk_spec / drafter_spec), then parity.npz: fixed
held-out token sequences with the torch mirror's trunk logits and drafter block outputs, which the
NumPy forward must reproduce (tests/train/test_parity.py). Checks that parity before returning.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .. import get_backend
from ..models.config import to_json
from ..models.default import DEFAULT_DIR
from ..models.drafter import DsparkDrafter
from ..models.trunk import HybridTrunk
from ..models.weights import save_tensors
from . import data, parity
from .recipe import DRAFTER, TRUNK

PARITY_LEN = 100
PARITY_ANCHORS = ((12, 80), (40, 92))   # per sequence: before and past the drafter window (64)


def parity_ids() -> np.ndarray:
    _, held = data.split()
    return data.code_prompts(held, len(PARITY_ANCHORS), PARITY_LEN, np.random.default_rng(7)).astype(np.int32)


def export(out: Path, dest: Path = DEFAULT_DIR) -> dict:
    import torch

    from .torch_model import TorchDrafter, TorchTrunk, as_tensors
    from .torch_parity import torch_block, torch_trunk
    with np.load(out / "trunk.npz") as z:
        tw = {k: z[k].astype(np.float32) for k in z.files}
    with np.load(out / "drafter.npz") as z:
        dw = {k: z[k].astype(np.float32) for k in z.files}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "trunk.json").write_text(to_json(TRUNK))
    (dest / "drafter.json").write_text(to_json(DRAFTER))
    save_tensors(dest / "trunk.safetensors", tw)
    save_tensors(dest / "drafter.safetensors", dw)

    torch.set_num_threads(min(2, torch.get_num_threads()))
    tt = TorchTrunk(TRUNK, as_tensors(tw))
    td = TorchDrafter(DRAFTER, tt, as_tensors(dw))
    ids = parity_ids()
    record = {"ids": ids, "anchors": np.array(PARITY_ANCHORS, np.int32)}
    record["trunk_logits"] = np.stack([torch_trunk(tt, s)[0] for s in ids])
    for name in ("hidden", "logits", "markov_logits", "conf"):
        record[f"block_{name}"] = np.stack([np.stack([torch_block(td, s, int(p))[name] for p in anchors])
                                            for s, anchors in zip(ids, PARITY_ANCHORS)])
    np.savez(dest / "parity.npz", **record)

    trunk = HybridTrunk.load(dest, get_backend("numpy"))
    drafter = DsparkDrafter.load(dest, trunk)
    diffs = check(trunk, drafter, dict(np.load(dest / "parity.npz")))
    sizes = {p.name: p.stat().st_size for p in sorted(dest.iterdir()) if p.is_file()}
    report = {"parity_max_abs_diff": diffs, "sizes": sizes,
              "weights_bytes": sizes["trunk.safetensors"] + sizes["drafter.safetensors"]}
    (out / "export.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


def check(trunk, drafter, ref: dict) -> dict[str, float]:
    """Max |numpy - torch| per output; raises when one is outside parity's tolerance."""
    worst = {}
    for i, s in enumerate(ref["ids"]):
        logits, _ = parity.numpy_trunk(trunk, s)
        pairs = [("trunk_logits", logits, ref["trunk_logits"][i])]
        for j, pos in enumerate(ref["anchors"][i]):
            got = parity.numpy_block(trunk, drafter, s, int(pos))
            pairs += [(f"block_{n}", got[n], ref[f"block_{n}"][i, j]) for n in got]
        for name, got, want in pairs:
            if parity.max_excess(got, want) > 0:
                raise AssertionError(f"parity: {name} of sequence {i} differs by {np.abs(got - want).max():.3g}, "
                                     f"beyond {parity.ATOL} + {parity.RTOL} |ref|")
            worst[name] = max(worst.get(name, 0.0), float(np.abs(got - want).max()))
    return worst
