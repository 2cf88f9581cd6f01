"""kv_commit: the kernel (simt, cuda) against the NumPy reference, exactly, over several layers,
ring wrap-around and keep = 0; and every bad input rejected before anything is written."""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import pytest

from dspark.errors import CapacityError, DTypeError, KernelArgumentError, ShapeError
from dspark.ops.kv_commit import kv_commit, kv_commit_ref
from tests.kernels.asan import assert_clean, run_asan

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


@dataclass
class Commit:
    k_blk: list       # per layer [rows, Hkv, D]
    v_blk: list
    k_caches: list    # per layer, per session [Hkv, capacity, D]
    v_caches: list
    pos: np.ndarray
    keep: np.ndarray
    row_indptr: np.ndarray
    ring: bool = False

    def args(self):
        return self.k_blk, self.v_blk, self.k_caches, self.v_caches, self.pos, self.keep, self.row_indptr


def make_commit(rng, dtype, d, hkv, layers, rows, pos, keep, capacity, ring=False) -> Commit:
    """Random scratch; caches hold random bits (every slot distinct), so any stray write shows."""
    def rand(*shape):
        return rng.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8).view(dtype)[..., 0]

    indptr = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    blk = [[rand(int(indptr[-1]), hkv, d) for _ in range(layers)] for _ in range(2)]
    caches = [[[rand(hkv, c, d) for c in capacity] for _ in range(layers)] for _ in range(2)]
    return Commit(blk[0], blk[1], caches[0], caches[1], np.array(pos, np.int32), np.array(keep, np.int32), indptr, ring)


def on(be, c: Commit) -> Commit:
    a = be.asarray
    return replace(c, k_blk=[a(x) for x in c.k_blk], v_blk=[a(x) for x in c.v_blk],
                   k_caches=[[a(x) for x in layer] for layer in c.k_caches],
                   v_caches=[[a(x) for x in layer] for layer in c.v_caches])


def caches_bits(c: Commit, be=None) -> list:
    """Every cache's bytes, on the host."""
    host = be.to_host if be is not None else np.asarray
    return [host(x).view(np.uint8).copy() for caches in (c.k_caches, c.v_caches) for layer in caches for x in layer]


def expected(c: Commit) -> Commit:
    want = replace(c, k_caches=[[x.copy() for x in layer] for layer in c.k_caches],
                   v_caches=[[x.copy() for x in layer] for layer in c.v_caches])
    kv_commit_ref(*want.args(), ring=c.ring)
    return want


# (rows, pos, keep, capacity) per session
CASES = {
    "verify": ([3, 8, 1], [0, 57, 1000], [2, 8, 1], [8, 70, 1004]),
    "keep0": ([4, 2, 5], [10, 3, 0], [0, 2, 0], [20, 5, 5]),
    "all-keep0": ([2, 3], [1, 2], [0, 0], [4, 6]),
    "full": ([8], [0], [8], [8]),
}
RING_CASES = {  # the drafter's KV: a ring of capacity window + block; positions wrap
    "wrap": ([8, 4, 3], [60, 1000, 5], [8, 4, 0], [64, 72, 10]),
    "exact-lap": ([5, 5], [59, 128], [5, 5], [64, 64]),
    "whole-ring": ([6], [3], [6], [6]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,hkv,layers", [(64, 1, 1), (128, 2, 3)], ids=str)
@pytest.mark.parametrize("ring,case", [(False, k) for k in CASES] + [(True, k) for k in RING_CASES])
def test_matches_reference_exactly(kernel_backend, rng, ring, case, dtype, d, hkv, layers):
    rows, pos, keep, capacity = (RING_CASES if ring else CASES)[case]
    c = make_commit(rng, dtype, d, hkv, layers, rows, pos, keep, capacity, ring)
    want = caches_bits(expected(c))
    dev = on(kernel_backend, c)
    kv_commit(kernel_backend, *dev.args(), ring=ring)
    for got, exp in zip(caches_bits(dev, kernel_backend), want):
        np.testing.assert_array_equal(got, exp)


def test_reference_semantics(numpy_backend, rng):
    c = make_commit(rng, DTYPES[0], 64, 2, 2, [3, 4], [5, 6], [2, 4], [8, 8], ring=True)
    before = [[x.copy() for x in layer] for layer in c.k_caches]
    kv_commit(numpy_backend, *c.args(), ring=True)
    for layer in range(2):
        # session 0: rows 0, 1 -> slots 5, 6; session 1: rows 3..6 (scratch rows) -> positions 6..9 -> slots 6, 7, 0, 1
        np.testing.assert_array_equal(c.k_caches[layer][0][:, [5, 6]], c.k_blk[layer][0:2].transpose(1, 0, 2))
        np.testing.assert_array_equal(c.k_caches[layer][1][:, [6, 7, 0, 1]], c.k_blk[layer][3:7].transpose(1, 0, 2))
        np.testing.assert_array_equal(c.k_caches[layer][1][:, 2:6], before[layer][1][:, 2:6])
        untouched = [0, 1, 2, 3, 4, 7]
        np.testing.assert_array_equal(c.k_caches[layer][0][:, untouched], before[layer][0][:, untouched])


def test_randomised_schedule(simt, rng):
    c = make_commit(rng, DTYPES[2], 128, 2, 2, *RING_CASES["wrap"], ring=True)
    want = caches_bits(expected(c))
    with simt.kernels.schedule(seed=int(rng.integers(1, 2**31))):
        kv_commit(simt, *c.args(), ring=True)
    for got, exp in zip(caches_bits(c, simt), want):
        np.testing.assert_array_equal(got, exp)


def test_asan_clean():
    assert_clean(run_asan("""
        from tests.kernels.test_kv_commit import make_commit, expected, caches_bits, DTYPES
        rng = np.random.default_rng(0)
        for dtype in DTYPES:
            for ring, case in ((False, ([3, 8, 1], [0, 57, 9], [3, 8, 1], [3, 65, 10])),
                               (True, ([8, 4], [60, 1000], [8, 4], [64, 4]))):
                c = make_commit(rng, dtype, 64, 2, 2, *case, ring=ring)
                want = caches_bits(expected(c))
                from dspark.ops.kv_commit import kv_commit
                kv_commit(be, *c.args(), ring=ring)
                assert all(np.array_equal(a, b) for a, b in zip(caches_bits(c), want))
        print("ok")
    """, families=["attention", "kv_commit"]))


# ---- bad input ------------------------------------------------------------------------------------
def _bad_inputs():
    def edit(**kw):
        return lambda c: replace(c, **kw)

    def layer_list(c, field, value):
        return replace(c, **{field: value(getattr(c, field))})

    return [
        ("keep past scratch", edit(keep=np.array([4, 1], np.int32)), CapacityError,
         r"keep\[0\]=4 exceeds the 3 scratch rows of session 0"),
        ("past capacity", edit(pos=np.array([0, 9], np.int32)), CapacityError,
         r"session 1: pos=9 \+ keep=2 exceeds the capacity 10 of k_caches\[0\]\[1\]"),
        ("ring lap", lambda c: replace(c, ring=True, keep=np.array([3, 2], np.int32),
                                       k_caches=[[x[:, :2] for x in layer] for layer in c.k_caches],
                                       v_caches=[[x[:, :2] for x in layer] for layer in c.v_caches]),
         CapacityError, r"keep\[0\]=3 exceeds the ring capacity 2"),
        ("negative pos", edit(pos=np.array([0, -2], np.int32)), CapacityError, r"pos\[1\]=-2: expected >= 0"),
        ("negative keep", edit(keep=np.array([-1, 0], np.int32)), CapacityError, r"keep\[0\]=-1"),
        ("keep dtype", edit(keep=np.array([1, 1], np.int64)), DTypeError, "keep has dtype int64"),
        ("pos length", edit(pos=np.array([1, 1, 1], np.int32)), ShapeError, r"pos has shape \(3,\): expected \(2,\)"),
        ("indptr", edit(row_indptr=np.array([0, 3, 4], np.int32)), ShapeError,
         "row_indptr must start at 0 and end at 5"),
        ("v_blk layers", lambda c: layer_list(c, "v_blk", lambda x: x[:1]), ShapeError, "v_blk has 1 entries"),
        ("k_blk empty", edit(k_blk=[]), ShapeError, "k_blk is empty"),
        ("blk dtype", lambda c: layer_list(c, "v_blk", lambda x: [x[0], np.zeros(x[1].shape, np.float16)]), DTypeError,
         r"v_blk\[1\] has dtype float16: expected float32"),
        ("blk shape", lambda c: layer_list(c, "k_blk", lambda x: [x[0], x[1][:, :1]]), ShapeError,
         r"k_blk\[1\] has shape \(5, 1, 64\)"),
        ("sessions", lambda c: layer_list(c, "k_caches", lambda x: [layer[:1] for layer in x]), ShapeError,
         r"k_caches\[0\] has 1 entries: expected a list of 2 caches"),
        ("cache dtype",
         lambda c: layer_list(c, "v_caches", lambda x: [x[0], [x[1][0], np.zeros(x[1][1].shape, np.float16)]]),
         DTypeError, r"v_caches\[1\]\[1\] has dtype float16"),
        ("cache head dim", lambda c: layer_list(c, "k_caches", lambda x: [x[0], [x[1][0][..., :32], x[1][1]]]),
         ShapeError, r"k_caches\[1\]\[0\] has shape \(2, 6, 32\): expected \(2, capacity, 64\)"),
        ("v cache capacity", lambda c: layer_list(c, "v_caches", lambda x: [[x[0][0][:, :5], x[0][1]], x[1]]),
         ShapeError, r"v_caches\[0\]\[0\] has shape \(2, 5, 64\): expected \(2, 6, 64\)"),
    ]


@pytest.mark.parametrize("name,mutate,error,match", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_rejects_bad_input_and_writes_nothing(kernel_backend, rng, name, mutate, error, match):
    c = mutate(make_commit(rng, DTYPES[0], 64, 2, 2, [3, 2], [0, 3], [3, 2], [6, 10]))
    dev = on(kernel_backend, c)
    before = caches_bits(dev, kernel_backend)
    with pytest.raises(error, match=match):
        kv_commit(kernel_backend, *dev.args(), ring=c.ring)
    for got, exp in zip(caches_bits(dev, kernel_backend), before):
        np.testing.assert_array_equal(got, exp)


def test_caches_must_be_dense_aligned_and_writable(simt, rng):
    """Caches are reached through a pointer table, so the op checks what the launcher cannot."""
    c = make_commit(rng, DTYPES[0], 64, 2, 1, [3, 2], [0, 3], [3, 2], [6, 10])
    read_only = c.k_caches[0][1].copy()
    read_only.flags.writeable = False
    flat = np.zeros(2 * 6 * 64 + 1, np.float32)
    for caches, match in (([c.k_caches[0][0], read_only], r"k_caches\[0\]\[1\] is read-only"),
                          ([np.zeros((2, 12, 64), np.float32)[:, ::2], c.k_caches[0][1]], "is not C-contiguous"),
                          ([flat[1:].reshape(2, 6, 64), c.k_caches[0][1]], "not 16-byte aligned")):
        with pytest.raises(KernelArgumentError, match=match):
            kv_commit(simt, *replace(c, k_caches=[caches]).args())
