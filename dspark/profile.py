"""NVTX ranges around the round phases (draft, propose, verify, accept, commit, rollback,
ingest), for Nsight Systems timelines.

They cost nothing when no profiler is attached: `phase()` then returns one shared no-op context
manager. A profiler that injects NVTX (Nsight Systems / Compute set NVTX_INJECTION64_PATH) turns
them on, as does DSPARK_NVTX=1.
"""

from __future__ import annotations

import contextlib
import functools
import os

DOMAIN = "dspark"
_NULL = contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
    if os.environ.get("DSPARK_NVTX") == "0":
        return False
    return bool(os.environ.get("NVTX_INJECTION64_PATH") or os.environ.get("DSPARK_NVTX") == "1")


def phase(name: str):
    """A context manager marking one round phase."""
    if not enabled():
        return _NULL
    import nvtx
    return nvtx.annotate(name, domain=DOMAIN)
