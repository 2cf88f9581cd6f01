"""A profiling script (profiling/<name>.py) imported as a module, so tests call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PROFILING = Path(__file__).resolve().parents[1] / "profiling"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, PROFILING / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod
