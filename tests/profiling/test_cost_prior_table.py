"""dspark/cost_prior_h200.json (the cost model's prior on `cuda`) is what profiling/perf_model.py
predicts now: every shape it knows has its own entry under its fingerprint, and the figures,
recomputed here (the embedded pair's whole grid, a corner of each other shape's), are the shipped
ones, so the table cannot go stale. Regenerate it with `python profiling/perf_model.py --prior-table`."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from dspark import cost_prior
from tests.profiling.test_bench import PROFILING

sys.path.insert(0, str(PROFILING))
import perf_model as pm  # noqa: E402

SHIPPED = cost_prior.table()["entries"]


def shipped_at(entry: dict, batches, widths, contexts) -> dict:
    """The shipped entry's figures on a sub-grid."""
    bi = [entry["batches"].index(b) for b in batches]
    wi = [entry["widths"].index(w) for w in widths]
    ci = [entry["contexts"].index(c) for c in contexts]
    return {"plain": [[entry["plain"][b][c] for c in ci] for b in bi],
            "round": [[[entry["round"][b][w][c] for c in ci] for w in wi] for b in bi],
            "verify": [[[entry["verify"][b][w][c] for c in ci] for w in wi] for b in bi]}


def test_every_shape_of_the_performance_model_has_its_own_entry():
    shapes = pm.shapes()
    keys = {cost_prior.fingerprint(s.trunk, s.drafter, s.weight_format): s for s in shapes.values()}
    assert len(keys) == len(shapes), "two shapes share a fingerprint"
    assert set(SHIPPED) == set(keys)
    for key, s in keys.items():
        e = SHIPPED[key]
        assert e["shape"] == s.label
        assert e["batches"] == list(cost_prior.BATCHES) and e["widths"] == list(range(2, s.drafter.block + 1))
        assert e["contexts"] == list(cost_prior.contexts_for(s.trunk.max_ctx, s.drafter.block))
    assert SHIPPED[keys_of("qwen3.5-27b")]["contexts"][-1] == cost_prior.LAST_CONTEXT


def keys_of(name: str) -> str:
    s = pm.shapes()[name]
    return cost_prior.fingerprint(s.trunk, s.drafter, s.weight_format)


@pytest.mark.parametrize("name,batches,widths,contexts", [
    ("embedded", None, None, None),                        # the whole grid
    ("qwen3.5-27b", [1, 32], [2, 8], [1024, 32768]),
    ("qwen3-8b", [1, 16], [8], [512, 32768]),
    ("qwen3.8-27b-dflash2", [2], [5], [4096]),
    ("qwen3.8-27b-dspark", [32], [8], [2048]),
    ("qwen3.5-27b-fp8", [1, 2], [8], [8192, 32768]),
    ("qwen3.8-27b-fp8-dflash2", [1], [8], [8192]),
])
def test_the_shipped_table_is_what_the_performance_model_predicts(name, batches, widths, contexts):
    s = pm.shapes()[name]
    now = pm.prior_entry(s, batches, widths, contexts)
    assert now["fingerprint"] in SHIPPED
    e = SHIPPED[now["fingerprint"]]
    if batches is None:
        assert (now["batches"], now["widths"], now["contexts"]) == (e["batches"], e["widths"], e["contexts"])
    want = shipped_at(e, now["batches"], now["widths"], now["contexts"])
    for kind in ("plain", "round", "verify"):
        np.testing.assert_allclose(now[kind], want[kind], rtol=1e-4, err_msg=kind)


def test_the_table_is_small():
    # About 8 kB a shape (ten now): package data every install carries.
    assert cost_prior.TABLE.stat().st_size < 96_000
