"""The embedded default pair: a small hybrid trunk and its DSpark drafter, trained on the Python
standard library's sources (dspark/train/, RECORD.md in the data folder says how).

The files sit beside this module in default/ (trunk.json, trunk.safetensors, drafter.json,
drafter.safetensors), found relative to __file__ so that an installed wheel and an editable
checkout read the same place.
"""

from __future__ import annotations

import re
from pathlib import Path

DEFAULT_DIR = Path(__file__).with_name("default")


def load_default(backend=None):
    """(HybridTrunk, DsparkDrafter) of the shipped weights on `backend`: a Backend, a backend
    name, or None for dspark.get_backend's default."""
    from ..backends import Backend, get_backend
    from .drafter import DsparkDrafter
    from .trunk import HybridTrunk
    be = backend if isinstance(backend, Backend) else get_backend(backend)
    if not (DEFAULT_DIR / "trunk.json").exists():
        raise FileNotFoundError(f"the default weights are missing from {DEFAULT_DIR}: reinstall dspark, or "
                                f"rebuild them with python -m dspark.train (see dspark/train/__init__.py)")
    trunk = HybridTrunk.load(DEFAULT_DIR, be)
    drafter = DsparkDrafter.load(DEFAULT_DIR, trunk)
    drafter.accept_floor = recorded_floors()["mean accepted length"]
    drafter.sampled_accept = recorded_sampled_acceptance()
    return trunk, drafter


def recorded_floors() -> dict[str, float]:
    """measure -> floor, from the table under RECORD.md's "Acceptance floors" heading (greedy)."""
    text = (DEFAULT_DIR / "RECORD.md").read_text()
    section = text.split("## Acceptance floors", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([a-z][^|]*?) \| [0-9.]+ \| ([0-9.]+) \|$", section, re.M)
    return {name: float(floor) for name, floor in rows}


def recorded_sampled_acceptance() -> dict[float, float]:
    """temperature -> the coupled sampler's mean accepted length, from RECORD.md's "Coupled sampled
    acceptance" table."""
    text = (DEFAULT_DIR / "RECORD.md").read_text()
    section = text.split("## Coupled sampled acceptance", 1)[1].split("\n## ", 1)[0]
    return {float(t): float(m) for t, m in re.findall(r"^\| ([0-9.]+) \| ([0-9.]+) \|$", section, re.M)}
