"""attention: the kernels (simt, cuda) against the NumPy reference, and row invariance, bitwise,
on every backend (DESIGN section 3)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import pytest

from dspark.errors import CapacityError, DTypeError, KernelArgumentError, ShapeError
from dspark.ops.attention import attention, attention_ref, plan, validate
from dspark.ops.kv_commit import kv_commit
from tests.conftest import poison
from tests.kernels.asan import assert_clean, run_asan

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2, BF16: 1e-2}
HEADS = [(4, 4), (8, 2)]  # (Hq, Hkv): GQA ratios 1 and 4


@dataclass
class Case:
    q: np.ndarray
    k_blk: np.ndarray
    v_blk: np.ndarray
    k_caches: list
    v_caches: list
    pos: np.ndarray
    row_indptr: np.ndarray
    mode: str = "causal"
    window: int = 0

    def args(self):
        return self.q, self.k_blk, self.v_blk, self.k_caches, self.v_caches, self.pos, self.row_indptr

    def session(self, b: int) -> "Case":
        r0, r1 = self.row_indptr[b], self.row_indptr[b + 1]
        return replace(self, q=self.q[r0:r1], k_blk=self.k_blk[r0:r1], v_blk=self.v_blk[r0:r1],
                       k_caches=self.k_caches[b : b + 1], v_caches=self.v_caches[b : b + 1],
                       pos=self.pos[b : b + 1], row_indptr=np.array([0, r1 - r0], np.int32))


def indptr_of(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def make_case(rng, dtype, d, hq, hkv, lens, ctxs, mode="causal", window=0, slack=3) -> Case:
    """Random rows. Cache slots no row may read hold NaN, so reading one shows in the output:
    past pos in a causal cache; outside the window's slots in a ring (capacity window + block)."""
    rows = sum(lens)
    randn = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(dtype)  # noqa: E731
    k_caches, v_caches = [], []
    for n, ctx in zip(lens, ctxs):
        cap = ctx + n + slack if mode == "causal" else window + max(n, 1)
        live = np.arange(ctx) if mode == "causal" else np.arange(max(0, ctx - window), ctx) % cap
        for caches in (k_caches, v_caches):
            c = np.full((hkv, cap, d), np.nan, np.float32).astype(dtype)
            c[:, live] = randn(hkv, live.size, d)
            caches.append(c)
    return Case(randn(rows, hq, d), randn(rows, hkv, d), randn(rows, hkv, d), k_caches, v_caches,
                np.array(ctxs, np.int32), indptr_of(lens), mode, window)


def on(be, case: Case) -> Case:
    """The case's arrays on the backend (CuPy for cuda)."""
    a = be.asarray
    return replace(case, q=a(case.q), k_blk=a(case.k_blk), v_blk=a(case.v_blk),
                   k_caches=[a(c) for c in case.k_caches], v_caches=[a(c) for c in case.v_caches])


def run(be, case: Case, **kw) -> np.ndarray:
    dev = on(be, case)
    out = poison(be.xp, case.q.shape, case.q.dtype)
    got = attention(be, *dev.args(), mode=case.mode, window=case.window, out=out, **kw)
    assert got is out
    return be.to_host(out)


def reference(case: Case, **kw) -> np.ndarray:
    return attention_ref(*case.args(), mode=case.mode, window=case.window, **kw)


def assert_close(got, ref, dtype) -> None:
    """|got - ref| <= tol (1 + |ref|) everywhere; NaN anywhere fails."""
    got = got.astype(np.float32)
    ok = np.abs(got - ref) <= TOL[np.dtype(dtype)] * (1 + np.abs(ref))
    if not ok.all():
        bad = np.argwhere(~ok)
        first = ", ".join(f"{tuple(i)}: {got[tuple(i)]} vs {ref[tuple(i)]}" for i in bad[:5])
        raise AssertionError(f"{len(bad)} of {ok.size} outside tolerance; first {first}")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


# ---- against the reference ---------------------------------------------------------------------
# (rows per session, committed context per session): awkward contexts 0, 1, 63, 64, 65, 1000,
# verify widths 1..8, batches of 1, 3 and 7, empty sessions, and a prefill of hundreds of rows.
CAUSAL = {
    "decode": ([1], [1]),
    "tile-edges": ([1, 8, 3], [63, 64, 65]),
    "mixed7": ([5, 1, 8, 2, 7, 4, 6], [1000, 0, 63, 64, 65, 1, 130]),
    "prefill": ([200, 0, 37], [0, 9, 64]),
}
# (rows, context, window) of drafter blocks over a ring of capacity window + rows.
BLOCK = {
    "ring1": ([8], [1000], 100),
    "ring3": ([4, 1, 8], [63, 64, 65], 64),
    "ring7": ([8, 8, 1, 3, 8, 2, 5], [0, 1, 63, 64, 65, 300, 1000], 100),
    "no-window": ([8, 2], [500, 0], 0),
}


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", ["decode", "tile-edges", "mixed7"])
def test_causal_matches_reference(kernel_backend, rng, batch, dtype, d, heads):
    lens, ctxs = CAUSAL[batch]
    case = make_case(rng, dtype, d, *heads, lens, ctxs)
    assert_close(run(kernel_backend, case), reference(case), dtype)


@pytest.mark.parametrize("dtype,d,heads", [(DTYPES[0], 64, (8, 2)), (BF16, 128, (4, 4)), (DTYPES[1], 128, (8, 1))],
                         ids=str)
def test_prefill_matches_reference(kernel_backend, rng, dtype, d, heads):
    """Hundreds of rows: the session is split into fixed row chunks, one CTA each."""
    case = make_case(rng, dtype, d, *heads, *CAUSAL["prefill"])
    assert_close(run(kernel_backend, case), reference(case), dtype)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", list(BLOCK))
def test_block_matches_reference(kernel_backend, rng, batch, dtype, d, heads):
    lens, ctxs, window = BLOCK[batch]
    case = make_case(rng, dtype, d, *heads, lens, ctxs, mode="block", window=window)
    assert_close(run(kernel_backend, case), reference(case), dtype)


def test_reference_is_softmax_attention(numpy_backend, rng):
    """The tiled recurrence is plain softmax attention, here in float64 on the visible keys."""
    case = make_case(rng, np.float32, 64, 8, 2, [3, 5], [70, 0])
    got = run(numpy_backend, case, scale=0.3)
    for b in range(2):
        s = case.session(b)
        n, ctx = len(s.q), int(s.pos[0])
        k = np.concatenate([s.k_caches[0][:, :ctx], s.k_blk.transpose(1, 0, 2)], axis=1).astype(np.float64)
        v = np.concatenate([s.v_caches[0][:, :ctx], s.v_blk.transpose(1, 0, 2)], axis=1).astype(np.float64)
        for i in range(n):
            for h in range(8):
                logits = 0.3 * k[h // 4, : ctx + i + 1] @ s.q[i, h].astype(np.float64)
                w = np.exp(logits - logits.max())
                want = w @ v[h // 4, : ctx + i + 1] / w.sum()
                np.testing.assert_allclose(got[case.row_indptr[b] + i, h], want, rtol=1e-5, atol=1e-6)


def test_scale(kernel_backend, rng):
    case = make_case(rng, np.float32, 128, 4, 1, [3, 2], [40, 70])
    default = run(kernel_backend, case)
    np.testing.assert_array_equal(default, run(kernel_backend, case, scale=1 / np.sqrt(128)))
    assert_close(run(kernel_backend, case, scale=0.05), reference(case, scale=0.05), np.float32)
    assert not np.allclose(default, run(kernel_backend, case, scale=0.05))


def test_empty_batches(any_backend, rng):
    case = make_case(rng, np.float32, 64, 4, 4, [0, 0], [5, 0])
    assert run(any_backend, case).shape == (0, 4, 64)
    none = replace(case, k_caches=[], v_caches=[], pos=np.zeros(0, np.int32), row_indptr=np.zeros(1, np.int32))
    assert run(any_backend, none).shape == (0, 4, 64)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (32, 4)])
def test_verify_reads_each_kv_head_once(numpy_backend, rng, hq, hkv):
    """Work sharing: a verify block (vt <= 8) of every session fits one CTA per (session, kv
    head), so its K/V tiles are staged once for all rows and GQA heads; prefill is chunked."""
    for lens, chunks in (([8, 1, 5], 1), ([200], -(-200 // max(1, 64 // (hq // hkv))))):
        case = make_case(rng, np.float32, 64, hq, hkv, lens, [70] * len(lens))
        launch = plan(validate(numpy_backend, *case.args(), "causal", 0, None))
        assert launch.grid == (chunks, hkv, len(lens))


# ---- row invariance, bitwise --------------------------------------------------------------------
@pytest.mark.parametrize("d,heads", [(64, (4, 4)), (128, (8, 2))], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_verify_rows_equal_decode_steps(any_backend, rng, dtype, d, heads):
    """Property 1: row i of a verify block == the decode step of the same token at pos + i, once
    rows 0..i-1 are committed (by kv_commit). Three sessions verify together, then decode together."""
    be = any_backend
    vts = rng.integers(1, 9, 3)
    ctxs = [int(rng.integers(0, 130)), 64 - int(rng.integers(0, 8)), int(rng.integers(0, 1000))]
    case = make_case(rng, dtype, d, *heads, vts, ctxs)
    dev = on(be, case)
    verify = be.to_host(attention(be, *dev.args()))
    for i in range(max(vts)):
        live = [b for b in range(3) if i < vts[b]]
        rows = [case.row_indptr[b] + i for b in live]
        q, kb, vb = (be.xp.concatenate([a[r : r + 1] for r in rows]) for a in (dev.q, dev.k_blk, dev.v_blk))
        kc, vc = [dev.k_caches[b] for b in live], [dev.v_caches[b] for b in live]
        pos = np.array([ctxs[b] + i for b in live], np.int32)
        one = indptr_of([1] * len(live))
        decode = be.to_host(attention(be, q, kb, vb, kc, vc, pos, one))
        np.testing.assert_array_equal(bits(decode), bits(verify[rows]), err_msg=f"decode step {i}")
        kv_commit(be, [kb], [vb], [kc], [vc], pos, np.ones(len(live), np.int32), one)


@pytest.mark.parametrize("mode", ["causal", "block"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
def test_session_alone_equals_batched(any_backend, rng, mode, dtype):
    """Property 2: a session's rows are the same alone and batched with 1-6 others of other lengths."""
    others = int(rng.integers(1, 7))
    lens = rng.integers(1, 9, others + 1)
    ctxs = rng.integers(0, 300, others + 1)
    ctxs[0] = 1000 if rng.random() < 0.5 else ctxs[0]
    order = rng.permutation(others + 1)  # the session of interest (index 0) lands anywhere
    case = make_case(rng, dtype, 128, 8, 2, lens[order], ctxs[order], mode=mode,
                     window=100 if mode == "block" else 0)
    b = int(np.flatnonzero(order == 0)[0])
    batched = run(any_backend, case)
    alone = run(any_backend, case.session(b))
    r0, r1 = case.row_indptr[b], case.row_indptr[b + 1]
    np.testing.assert_array_equal(bits(alone), bits(batched[r0:r1]))


def test_randomised_schedule(simt, rng):
    """Threads in a random order between barriers: bitwise the same result."""
    for mode, (lens, ctxs, window) in (("causal", (*CAUSAL["mixed7"], 0)), ("causal", (*CAUSAL["decode"], 0)),
                                       ("block", BLOCK["ring3"])):
        case = make_case(rng, np.float32, 64, 8, 2, lens, ctxs, mode=mode, window=window)
        ordered = run(simt, case)
        with simt.kernels.schedule(seed=int(rng.integers(1, 2**31))):
            shuffled = run(simt, case)
        np.testing.assert_array_equal(bits(shuffled), bits(ordered))
        assert_close(shuffled, reference(case), np.float32)


def test_asan_clean():
    assert_clean(run_asan("""
        from tests.kernels.test_attention import make_case, run, reference, assert_close
        import ml_dtypes
        rng = np.random.default_rng(0)
        for dtype, d in ((np.float32, 64), (np.float16, 128), (ml_dtypes.bfloat16, 64)):
            for mode, window in (("causal", 0), ("block", 70)):
                for lens in ([8, 1, 0, 3], [1, 1]):  # 8 warps; 4 warps (decode)
                    case = make_case(rng, dtype, d, 8, 2, lens, [65, 0, 4, 130][: len(lens)], mode=mode,
                                     window=window, slack=0)
                    assert_close(run(be, case), reference(case), dtype)
        print("ok")
    """, families=["attention", "kv_commit"]))


# ---- bad input ------------------------------------------------------------------------------------
def _bad_inputs():
    def edit(**kw):
        return lambda c: replace(c, **kw)

    return [
        ("q 2-d", lambda c: replace(c, q=c.q[:, 0]), ShapeError, r"q has shape \(6, 64\): expected 3 dims"),
        ("head dim", lambda c: replace(c, q=c.q[..., :32].copy()), ShapeError, "head dim 32: expected one of"),
        ("q float64", lambda c: replace(c, q=c.q.astype(np.float64)), DTypeError, "q has dtype float64"),
        ("k_blk dtype", lambda c: replace(c, k_blk=c.k_blk.astype(np.float16)), DTypeError,
         "k_blk has dtype float16: expected float32"),
        ("v_blk rows", lambda c: replace(c, v_blk=c.v_blk[:5]), ShapeError, r"v_blk has shape \(5, 2, 64\)"),
        ("gqa", lambda c: replace(c, q=np.concatenate([c.q, c.q[:, :1]], axis=1)), ShapeError,
         "q has 9 heads: expected a multiple of the 2 kv heads"),
        ("indptr end", edit(row_indptr=np.array([0, 2, 5], np.int32)), ShapeError,
         "row_indptr must start at 0 and end at 6"),
        ("indptr dtype", edit(row_indptr=np.array([0, 2, 6], np.int64)), DTypeError, "row_indptr has dtype int64"),
        ("pos length", edit(pos=np.array([3], np.int32)), ShapeError, r"pos has shape \(1,\): expected \(2,\)"),
        ("pos dtype", edit(pos=np.array([3, 4], np.int64)), DTypeError, "pos has dtype int64"),
        ("pos negative", edit(pos=np.array([3, -1], np.int32)), CapacityError, r"pos\[1\]=-1"),
        ("caches count", lambda c: replace(c, k_caches=c.k_caches[:1]), ShapeError, "k_caches has 1 entries"),
        ("cache heads", lambda c: replace(c, k_caches=[c.k_caches[0], c.k_caches[1][:1]]), ShapeError,
         r"k_caches\[1\] has shape \(1, 12, 64\): expected \(2, capacity, 64\)"),
        ("v cache shape", lambda c: replace(c, v_caches=[c.v_caches[0], c.v_caches[1][:, :9]]), ShapeError,
         r"v_caches\[1\] has shape"),
        ("cache dtype", lambda c: replace(c, v_caches=[c.v_caches[0].astype(BF16), c.v_caches[1]]), DTypeError,
         r"v_caches\[0\] has dtype bfloat16: expected float32 \(the dtype of q\)"),
        ("past capacity", edit(pos=np.array([3, 9], np.int32)), CapacityError,
         "session 1: pos=9 . 4 rows exceeds the cache capacity 12"),
        ("mode", edit(mode="sliding"), ValueError, "mode='sliding'"),
        ("window in causal", edit(window=4), ValueError, "applies only to mode='block'"),
        ("window past ring", edit(mode="block", window=9), CapacityError, "window=9 exceeds the ring capacity 8"),
    ]


@pytest.mark.parametrize("name,mutate,error,match", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_rejects_bad_input(kernel_backend, rng, name, mutate, error, match):
    case = mutate(make_case(rng, np.float32, 64, 8, 2, [2, 4], [3, 5], slack=3))
    with pytest.raises(error, match=match):
        attention(kernel_backend, *on(kernel_backend, case).args(), mode=case.mode, window=case.window)


def test_rejects_bad_out(kernel_backend, rng):
    be = kernel_backend
    case = on(be, make_case(rng, np.float32, 64, 4, 4, [2], [3]))
    with pytest.raises(ShapeError, match=r"out has shape \(2, 4, 32\)"):
        attention(be, *case.args(), out=be.xp.empty((2, 4, 32), np.float32))
    with pytest.raises(DTypeError, match="out has dtype float16"):
        attention(be, *case.args(), out=be.xp.empty((2, 4, 64), np.float16))


def test_block_rows_may_be_views_but_caches_must_be_dense(kernel_backend, rng):
    """q / k_blk / v_blk may be strided views (the op makes them contiguous); a cache, reached
    through a pointer table, must be a C-contiguous, 16-byte aligned array."""
    be = kernel_backend
    case = make_case(rng, np.float32, 64, 4, 2, [3, 2], [7, 1])
    wide = np.stack([case.q, np.zeros_like(case.q)], axis=-1).reshape(5, 4, 128)  # q: every other column
    dev = on(be, case)
    got = attention(be, *replace(dev, q=be.asarray(wide)[..., ::2]).args())
    assert_close(be.to_host(got), reference(case), np.float32)
    shape = dev.k_caches[1].shape
    strided = be.xp.zeros((shape[0], 2 * shape[1], shape[2]), np.float32)[:, ::2]
    with pytest.raises(KernelArgumentError, match=r"k_caches\[1\] is not C-contiguous"):
        attention(be, *replace(dev, k_caches=[dev.k_caches[0], strided]).args())
    shifted = be.xp.zeros(dev.v_caches[0].size + 1, np.float32)[1:].reshape(dev.v_caches[0].shape)
    with pytest.raises(KernelArgumentError, match=r"v_caches\[0\] starts at an address that is not 16-byte aligned"):
        attention(be, *replace(dev, v_caches=[shifted, dev.v_caches[1]]).args())
