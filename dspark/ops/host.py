"""The numpy backend's native paths (dspark._cpu, csrc/cpu/host_ops.cpp) for the ops whose NumPy
references cost most per step after the product:

* `delta_walk`: gdn_scan_ref's walk of each session's columns through the gated delta rule
  (delta_rule_ref per column, with the per-column checkpoints);
* `rmsnorm`: rmsnorm_numpy;
* `attention_products`: attention._attend's two products per tile of keys (q.k and p.v, each a
  product then a halving sum).

Each does its reference's arithmetic operation for operation, NumPy's pairwise sums included
(csrc/cpu/pairwise.h), so the numpy backend keeps the reference's bits at native speed; the tests
hold every one to its reference with array_equal. The references stay the oracles, and run in
their place where dspark._cpu is not built (`NATIVE` is False): the same bits, slower.
"""

from __future__ import annotations

import numpy as np

from .product import NATIVE, _module, get_num_threads

F32 = np.float32
WALK_PER_THREAD = 1 << 18  # state entries updated (columns x H x dv x dk): less runs on one thread


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=F32)


def delta_walk(S, q, k, v, alpha, beta, col_indptr, out, state_ckpt=None, *, threads: int | None = None) -> None:
    """gdn.delta_walk_ref natively: S [B, H, dv, dk] f32 (C-contiguous, updated in place), q, k
    [cols, H, dk], v [cols, H, dv], alpha, beta [cols, H] -> out [cols, H, dv] and state_ckpt
    [cols, H, dv, dk] (the state after each column) when given. The (session, head) pairs are
    split across `threads` (default: get_num_threads() when there are at least WALK_PER_THREAD
    state updates a thread, else one); the bits do not depend on it."""
    B, H, dv, dk = S.shape
    cols = int(col_indptr[-1])
    o = out if out.flags.c_contiguous and out.shape[0] == cols else np.empty((cols, H, dv), F32)
    ck = None
    if state_ckpt is not None:
        ck = state_ckpt if state_ckpt.flags.c_contiguous and state_ckpt.shape[0] == cols else \
            np.empty((cols, H, dv, dk), F32)
    if threads is None:  # a decode step's walk is not worth waking a thread for
        threads = max(1, min(get_num_threads(), cols * H * dv * dk // WALK_PER_THREAD))
    _module().delta_columns(S, _f32(q), _f32(k), _f32(v), _f32(alpha), _f32(beta),
                            np.ascontiguousarray(col_indptr, dtype=np.int32), B, H, dv, dk, o, ck, threads)
    if o is not out:
        out[:cols] = o
    if ck is not None and ck is not state_ckpt:
        state_ckpt[:cols] = ck


def rmsnorm(x, weight, eps: float) -> np.ndarray:
    """norm.rmsnorm_numpy natively: x [..., n] f32, weight [n] f32 -> a new f32 array like x."""
    x = _f32(x)
    n = x.shape[-1] if x.ndim else 1
    y = np.empty(x.shape, F32)
    if x.size:
        _module().rmsnorm(x, _f32(weight), float(F32(eps)), x.size // n, n, y)
    return y


class AttentionProducts:
    """attention._attend's products natively (attention.NumpyProducts is the NumPy pair)."""

    @staticmethod
    def scores(q, kt) -> np.ndarray:
        """q [n, Hkv, G, D] . kt [Hkv, L, D] -> [n, Hkv, G, L], halving over D."""
        return _per_tile("attention_scores", q, kt, kt.shape[1])

    @staticmethod
    def weighted(p, vt) -> np.ndarray:
        """p [n, Hkv, G, L] . vt [Hkv, L, D] -> [n, Hkv, G, D], halving over L."""
        return _per_tile("attention_weighted", p, vt, vt.shape[2])


def _per_tile(name: str, a, b, last: int) -> np.ndarray:
    """dspark._cpu.<name> over a [n, Hkv, G, *] and b [Hkv, L, D] -> [n, Hkv, G, last]."""
    n, hkv, g, _ = a.shape
    out = np.empty((n, hkv, g, last), F32)
    getattr(_module(), name)(_f32(a), _f32(b), n, hkv, g, b.shape[1], b.shape[2], out)
    return out


attention_products = AttentionProducts()
