"""The NumPy side of the parity checks (no torch here: tests/train/test_parity.py runs without it).

`numpy_trunk` and `numpy_block` run the shipped models the way the session does (prefill, ingest
of the committed rows' taps, block_pass at the anchor), for comparison with the torch mirror's
whole-sequence forward. The two differ by f32 summation order only (BLAS vs the reference's
fixed orders, chunked vs stepwise gdn), so the tolerance is relative to the logit scale.
"""

from __future__ import annotations

import numpy as np

ATOL = 5e-4     # |numpy - torch| <= ATOL + RTOL * |torch|; measured differences are ~1e-5
RTOL = 5e-4


def numpy_trunk(trunk, ids) -> tuple[np.ndarray, np.ndarray]:
    """(logits [T, V], taps [T, n_taps*d]) of a prefill of ids from position 0."""
    be = trunk.be
    cache = trunk.new_cache(owner="parity/trunk")
    try:
        tp = trunk.prefill(cache, np.asarray(ids, np.int32))
        return be.to_host(tp.logits), be.to_host(tp.taps)
    finally:
        cache.free()


def numpy_block(trunk, drafter, ids, pos: int) -> dict[str, np.ndarray]:
    """The drafter at anchor position pos after committing ids[:pos]: block hidden and logits
    [b, .], and per slot k with the teacher-forced previous token ids[pos+k]: Markov-biased logits
    and the confidence."""
    be = trunk.be
    cache = trunk.new_cache(owner="parity/cache")
    kv = drafter.new_kv("parity/draft_kv")
    try:
        tp = trunk.prefill(cache, np.asarray(ids[:pos], np.int32))
        drafter.ingest([kv], tp.taps, tp.row_indptr)
        hidden, logits = drafter.block_pass([kv], [int(ids[pos])])
        b = drafter.config.block
        prev = np.asarray(ids[pos : pos + b], np.int32)
        bias, emb = drafter.markov_bias(prev)
        return {"hidden": be.to_host(hidden), "logits": be.to_host(logits),
                "markov_logits": be.to_host(logits + bias), "conf": be.to_host(drafter.confidence(hidden, emb))}
    finally:
        cache.free()
        kv.free()


def max_excess(got: np.ndarray, want: np.ndarray) -> float:
    """max(|got - want| - (ATOL + RTOL |want|)): <= 0 when within tolerance."""
    return float(np.max(np.abs(got - want) - (ATOL + RTOL * np.abs(want))))
