"""The peer packages (torch, transformers, dflash, speculators): the oracles of the real-model
tests. Outside CI a missing peer skips the module that needs it; under CI=true it is an error,
because an oracle test that does not run proves nothing."""

from __future__ import annotations

import importlib
import os

import pytest

IN_CI = os.environ.get("CI") == "true"


def peer(name: str):
    """The imported module `name` (a peer, or a part of dspark built apart), or a module-level skip
    (a failure under CI=true)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if IN_CI:
            pytest.fail(f"the oracle package {name!r} is required in CI (the test extra has it): {e}")
        pytest.skip(f"{name} is not installed (the test extra has it)", allow_module_level=True)
