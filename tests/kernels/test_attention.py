"""attention: the kernels (simt, cuda) against the NumPy reference, row invariance bitwise on every
backend (DESIGN section 3), the split structure at every split count, the launch plan, and the
building blocks (mma.sync / ldmatrix fragments, cp.async groups) against their documented semantics.

Tolerance against the reference: |got - ref| <= tol (1 + |ref|), tol 1e-5 for f32 and 1e-2 for
f16/bf16 (outputs rounded to 8 or 11 bits; an MMA, emulated or not, is within 17 * 2^-23 of its
absolute sum of the exact value, simt/tensor_core.h).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import pytest

from dspark.dtypes import suffix
from dspark.errors import CapacityError, DTypeError, KernelArgumentError, ShapeError
from dspark.ops.attention import (DEFAULT_SPLIT, SplitRule, attention, attention_ref, config, launch_plan, plan,
                                  prompt_acc_bytes, prompt_shared_mem_bytes, shared_mem_bytes, validate)
from dspark.ops.kv_commit import kv_commit
from dspark.ops.linear import SHARED_LIMIT
from tests.conftest import poison
from tests.kernels.asan import assert_clean, run_asan

BF16 = np.dtype(ml_dtypes.bfloat16)
F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
DTYPES = [F32, F16, BF16]
TOL = {F32: 1e-5, F16: 1e-2, BF16: 1e-2}
HEADS = [(4, 4), (12, 2)]  # (Hq, Hkv): GQA 1 and 6 (Qwen3.5-27B's 24 / 4)
SMALL = SplitRule(64, 2, 256)  # splits of 1, 2 and then 4 tiles: every size change below 1k keys
TILES = SplitRule.uniform(64)


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
    window_mode: str = "anchor"

    def args(self):
        return self.q, self.k_blk, self.v_blk, self.k_caches, self.v_caches, self.pos, self.row_indptr

    def session(self, b: int) -> "Case":
        r0, r1 = self.row_indptr[b], self.row_indptr[b + 1]
        return replace(self, q=self.q[r0:r1], k_blk=self.k_blk[r0:r1], v_blk=self.v_blk[r0:r1],
                       k_caches=self.k_caches[b : b + 1], v_caches=self.v_caches[b : b + 1],
                       pos=self.pos[b : b + 1], row_indptr=np.array([0, r1 - r0], np.int32))


def indptr_of(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def make_case(rng, dtype, d, hq, hkv, lens, ctxs, mode="causal", window=0, slack=3, window_mode="anchor") -> Case:
    """Random rows. Cache slots no row may read hold NaN, so reading one shows in the output:
    past pos in a causal cache; outside the window's slots in a ring (capacity window + block):
    the last `window` committed rows, or `window - 1` for a per-row window (row 0 reaches
    pos - window + 1)."""
    rows = int(sum(lens))
    randn = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(dtype)  # noqa: E731
    k_caches, v_caches = [], []
    for n, ctx in zip(lens, ctxs):
        cap = ctx + n + slack if mode == "causal" else window + max(n, 1)
        reach = window - 1 if window_mode == "row" else window
        live = np.arange(ctx) if mode == "causal" else np.arange(max(0, ctx - reach), ctx) % cap
        for caches in (k_caches, v_caches):
            c = np.full((hkv, cap, d), np.nan, np.float32).astype(dtype)
            c[:, live] = randn(hkv, live.size, d)
            caches.append(c)
    return Case(randn(rows, hq, d), randn(rows, hkv, d), randn(rows, hkv, d), k_caches, v_caches,
                np.array(ctxs, np.int32), indptr_of(lens), mode, window, window_mode)


def on(be, case: Case) -> Case:
    """The case's arrays on the backend (CuPy for cuda)."""
    a = be.asarray
    return replace(case, q=a(case.q), k_blk=a(case.k_blk), v_blk=a(case.v_blk),
                   k_caches=[a(c) for c in case.k_caches], v_caches=[a(c) for c in case.v_caches])


class PoisonedScratch:
    """The backend's array module, except that `empty` is poisoned (NaN): a split partial the
    combine reads before a kernel wrote it shows in the output."""

    def __init__(self, xp):
        self._xp = xp

    def __getattr__(self, name):
        return getattr(self._xp, name)

    def empty(self, shape, dtype=np.float32, **kw):
        return poison(self._xp, shape, dtype)


def run(be, case: Case, **kw) -> np.ndarray:
    dev = on(be, case)
    out = poison(be.xp, case.q.shape, case.q.dtype)
    poisoned = replace(be, xp=PoisonedScratch(be.xp))
    got = attention(poisoned, *dev.args(), mode=case.mode, window=case.window, window_mode=case.window_mode,
                    out=out, **kw)
    assert got is out
    return be.to_host(out)


def reference(case: Case, **kw) -> np.ndarray:
    return attention_ref(*case.args(), mode=case.mode, window=case.window, window_mode=case.window_mode, **kw)


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


# ---- the split rule --------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", [DEFAULT_SPLIT, SMALL, SplitRule(128, 3, 1 << 20), SplitRule(64, 1, 64 << 12), TILES],
                         ids=str)
def test_split_rule_cuts_whole_tiles_at_fixed_positions(rule):
    j = np.arange(min(200, int(rule.index(2**31 - 1)) + 1))  # every split of an int32 position
    start = rule.start(j)
    assert start[0] == 0 and np.all(np.diff(start) > 0) and np.all(start % 64 == 0)
    np.testing.assert_array_equal(rule.index(start), j)
    np.testing.assert_array_equal(rule.index(start[1:] - 1), j[:-1])
    size = np.diff(start)
    base = rule.per_octave * rule.min_keys
    assert np.all(size[start[:-1] < 2 * base] == rule.min_keys)
    far = start[:-1] >= 2 * base  # octave k >= 1: per_octave splits of 2^k min_keys, up to max_keys
    k = np.floor(np.log2(start[:-1][far] / base)).astype(int)
    np.testing.assert_array_equal(size[far], np.minimum(rule.min_keys << k, rule.max_keys))


def test_default_split_counts():
    """16 splits at 4k keys, 48 at 32k, 144 at 128k: of 256 keys near the start, 1024 from 8k on."""
    assert [int(DEFAULT_SPLIT.index(n - 1)) + 1 for n in (256, 4096, 8192, 32768, 131072)] == [1, 16, 24, 48, 144]
    assert np.all(np.diff(DEFAULT_SPLIT.start(np.arange(24, 200))) == 1024)


@pytest.mark.parametrize("kw,match", [({"min_keys": 100}, "min_keys=100"), ({"min_keys": 0}, "min_keys=0"),
                                      ({"per_octave": 0}, "per_octave=0"), ({"per_octave": 2**30}, "per_octave"),
                                      ({"max_keys": 768}, "max_keys=768"), ({"max_keys": 128}, "max_keys=128")])
def test_split_rule_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SplitRule(**kw)


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
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", ["decode", "tile-edges", "mixed7"])
def test_causal_matches_reference(kernel_backend, rng, batch, dtype, d, heads):
    lens, ctxs = CAUSAL[batch]
    case = make_case(rng, dtype, d, *heads, lens, ctxs)
    assert_close(run(kernel_backend, case), reference(case), dtype)


@pytest.mark.parametrize("dtype,d,heads", [(F32, 64, (8, 2)), (BF16, 128, (4, 4)), (F16, 128, (8, 1)),
                                           (BF16, 256, (12, 2))], ids=str)
def test_prefill_matches_reference(kernel_backend, rng, dtype, d, heads):
    """Hundreds of rows: the session is split into fixed row chunks, one CTA each (the prompt
    kernel for 16-bit K/V, serial for f32)."""
    case = make_case(rng, dtype, d, *heads, *CAUSAL["prefill"])
    assert launch_plan([200, 0, 37], [0, 9, 64], hq=heads[0], hkv=heads[1], head_dim=d,
                       dtype=dtype).strategy == ("serial" if dtype == F32 else "prompt")
    assert_close(run(kernel_backend, case), reference(case), dtype)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", list(BLOCK))
def test_block_matches_reference(kernel_backend, rng, batch, dtype, d, heads):
    lens, ctxs, window = BLOCK[batch]
    case = make_case(rng, dtype, d, *heads, lens, ctxs, mode="block", window=window)
    assert_close(run(kernel_backend, case), reference(case), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_head_dim_256(kernel_backend, rng, dtype):
    lens, ctxs, window = BLOCK["ring3"]
    case = make_case(rng, dtype, 256, 12, 2, lens, ctxs, mode="block", window=window)
    assert_close(run(kernel_backend, case), reference(case), dtype)


# (rows, context, window) of per-row windows (DFlash2's sliding layers) over a ring of capacity
# window + rows. A window below the block's row count bites on both sides of a row.
ROWS = {
    "one": ([8], [1000], 100),
    "short": ([8, 4, 1, 8], [63, 64, 3, 300], 3),
    "mixed": ([8, 8, 1, 3, 8, 2, 5], [0, 1, 63, 64, 65, 300, 1000], 70),
}


def row_case(rng, dtype, d, hq, hkv, batch, **kw) -> Case:
    lens, ctxs, window = ROWS[batch]
    return make_case(rng, dtype, d, hq, hkv, lens, ctxs, mode="block", window=window, window_mode="row", **kw)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", list(ROWS))
def test_row_window_matches_reference(kernel_backend, rng, batch, dtype, d, heads):
    case = row_case(rng, dtype, d, *heads, batch)
    assert_close(run(kernel_backend, case), reference(case), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_window_head_dim_256(kernel_backend, rng, dtype):
    case = row_case(rng, dtype, 256, 12, 2, "short")
    assert_close(run(kernel_backend, case), reference(case), dtype)


@pytest.mark.parametrize("rule", [TILES, SMALL], ids=["tiles", "octaves"])
def test_row_windows_start_in_different_splits(kernel_backend, rng, rule):
    """The rows of one block reach back to different splits (670 - 99 = 571 and 578 straddle the
    tiles' 576; 863 - 99 and 870 - 99 straddle the octave splits' 768): the split-parallel
    kernel numbers its slots from row 0's split and the combine starts each row at its own."""
    case = make_case(rng, BF16, 64, 4, 1, [8, 8, 3, 8], [670, 863, 200, 5], mode="block", window=100,
                     window_mode="row")
    ref = reference(case, split=rule)
    serial = run(kernel_backend, case, split=rule, strategy="serial")
    parallel = run(kernel_backend, case, split=rule, strategy="parallel")
    assert_close(parallel, ref, BF16)
    np.testing.assert_array_equal(bits(serial), bits(parallel))


def test_row_window_is_dflash_s_mask(numpy_backend, rng):
    """The reference's per-row window is dflash's own mask (dflash.model._attention_mask of a
    non-causal sliding layer: |query_position - key_position| < sliding_window), applied here to
    float64 softmax attention over the session's committed rows and block, with a window below
    the block's rows so that both of its sides bite."""
    from tests.peers import peer
    torch = peer("torch")
    mask_of = peer("dflash.model")._attention_mask
    for window in (3, 11):
        case = make_case(rng, np.float32, 64, 4, 2, [8, 5], [40, 2], mode="block", window=window, window_mode="row")
        got = run(numpy_backend, case, split=SMALL)
        for b in range(2):
            s = case.session(b)
            n, ctx = len(s.q), int(s.pos[0])
            slots = np.arange(ctx) % s.k_caches[0].shape[1]
            k = np.concatenate([s.k_caches[0][:, slots], s.k_blk.transpose(1, 0, 2)], axis=1).astype(np.float64)
            v = np.concatenate([s.v_caches[0][:, slots], s.v_blk.transpose(1, 0, 2)], axis=1).astype(np.float64)
            visible = mask_of(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, ctx + n, 1), is_causal=False,
                              sliding_window=window)[0, 0].numpy()
            for i in range(n):
                seen = np.flatnonzero(visible[i])
                assert seen.min() == max(0, ctx + i - window + 1) and seen.max() == min(ctx + n, ctx + i + window) - 1
                for h in range(4):
                    logits = k[h // 2, seen] @ s.q[i, h].astype(np.float64) / 8.0
                    w = np.exp(logits - logits.max())
                    want = w @ v[h // 2, seen] / w.sum()
                    np.testing.assert_allclose(got[case.row_indptr[b] + i, h], want, rtol=1e-5, atol=1e-6)


def test_reference_is_softmax_attention(numpy_backend, rng):
    """The split, tiled recurrence is plain softmax attention, here in float64 on the visible
    keys, with splits of 1, 2 and 4 tiles."""
    case = make_case(rng, np.float32, 64, 8, 2, [3, 5], [300, 0])
    got = run(numpy_backend, case, scale=0.3, split=SMALL)
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


# ---- splits: every split count, both kernels ------------------------------------------------------
def boundary_sessions(rule: SplitRule, counts: int, verify: int = 6):
    """(lens, ctxs): for every split count k <= counts, a decode row on the first key of split
    k - 1, one on the last key of split k - 1, and a verify block straddling the start of split k
    (its rows reach k and k + 1 splits)."""
    lens, ctxs = [], []
    for k in range(1, counts + 1):
        first, last = int(rule.start(k - 1)), int(rule.start(k)) - 1
        lens += [1, 1, verify]
        ctxs += [first, last, last - verify // 2 + 1]
    return lens, ctxs


SPLIT_CASES = {  # rule, split counts covered, dtype, head dim
    "tiles-bf16-d64": (TILES, 12, BF16, 64),
    "octaves-bf16-d64": (SMALL, 9, BF16, 64),
    "octaves-f16-d128": (SMALL, 8, F16, 128),
    "octaves-f32-d64": (SMALL, 9, F32, 64),
    "octaves-bf16-d256": (SMALL, 7, BF16, 256),
    "default-bf16-d128": (DEFAULT_SPLIT, 4, BF16, 128),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_every_split_count_matches_reference_on_both_kernels(kernel_backend, rng, name):
    """Contexts on both sides of every split boundary up to `counts` splits (and the tile edges
    inside the longer splits): the split-parallel kernel + combine and the serial kernel agree
    with the reference, and with each other bitwise."""
    rule, counts, dtype, d = SPLIT_CASES[name]
    lens, ctxs = boundary_sessions(rule, counts)
    case = make_case(rng, dtype, d, 4, 1, lens, ctxs)
    ref = reference(case, split=rule)
    serial = run(kernel_backend, case, split=rule, strategy="serial")
    parallel = run(kernel_backend, case, split=rule, strategy="parallel")
    assert launch_plan(lens, ctxs, hq=4, hkv=1, head_dim=d, dtype=dtype, split=rule).max_splits == counts + 1
    assert_close(parallel, ref, dtype)
    np.testing.assert_array_equal(bits(serial), bits(parallel))


@pytest.mark.parametrize("rule", [TILES, SMALL], ids=["tiles", "octaves"])
def test_block_mode_splits_from_the_window_start(kernel_backend, rng, rule):
    """The drafter's window starts mid-split and mid-tile; both kernels, every count up to 5."""
    lens, ctxs, window = [8, 8, 1, 3, 8], [0, 130, 200, 317, 640], 190
    case = make_case(rng, BF16, 64, 4, 1, lens, ctxs, mode="block", window=window)
    ref = reference(case, split=rule)
    serial = run(kernel_backend, case, split=rule, strategy="serial")
    parallel = run(kernel_backend, case, split=rule, strategy="parallel")
    assert_close(parallel, ref, BF16)
    np.testing.assert_array_equal(bits(serial), bits(parallel))


# ---- row invariance, bitwise --------------------------------------------------------------------
@pytest.mark.parametrize("d,heads,rule", [(64, (4, 4), TILES), (128, (12, 2), SMALL), (256, (4, 1), SMALL),
                                          (128, (8, 2), None)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_verify_rows_equal_decode_steps(any_backend, rng, dtype, d, heads, rule):
    """Property 1: row i of a verify block == the decode step of the same token at pos + i, once
    rows 0..i-1 are committed (by kv_commit). Three sessions verify together, then decode together;
    one block straddles a split boundary, one a tile edge. rule None: the op's own choice."""
    be = any_backend
    vts = rng.integers(1, 9, 3)
    vts[0] = 8
    edge = int((rule or DEFAULT_SPLIT).start(int(rng.integers(1, 4))))
    ctxs = [edge - int(rng.integers(1, 8)), 64 - int(rng.integers(0, 8)), int(rng.integers(0, 700))]
    case = make_case(rng, dtype, d, *heads, vts, ctxs)
    dev = on(be, case)
    verify = be.to_host(attention(be, *dev.args(), split=rule))
    for i in range(max(vts)):
        live = [b for b in range(3) if i < vts[b]]
        rows = [case.row_indptr[b] + i for b in live]
        q, kb, vb = (be.xp.concatenate([a[r : r + 1] for r in rows]) for a in (dev.q, dev.k_blk, dev.v_blk))
        kc, vc = [dev.k_caches[b] for b in live], [dev.v_caches[b] for b in live]
        pos = np.array([ctxs[b] + i for b in live], np.int32)
        one = indptr_of([1] * len(live))
        decode = be.to_host(attention(be, q, kb, vb, kc, vc, pos, one, split=rule))
        np.testing.assert_array_equal(bits(decode), bits(verify[rows]), err_msg=f"decode step {i}")
        kv_commit(be, [kb], [vb], [kc], [vc], pos, np.ones(len(live), np.int32), one)


@pytest.mark.parametrize("rule", [SMALL, None], ids=["small-splits", "default"])
@pytest.mark.parametrize("mode", ["causal", "block", "row"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_session_alone_equals_batched(any_backend, rng, mode, dtype, rule):
    """Property 2: a session's rows are the same alone and batched with 1-6 others of other
    lengths, whichever kernel each launch takes (rule None: the op's own choice of everything)."""
    others = int(rng.integers(1, 7))
    lens = rng.integers(1, 9, others + 1)
    ctxs = rng.integers(0, 300, others + 1)
    ctxs[0] = 1000 if rng.random() < 0.5 else ctxs[0]
    ctxs[int(rng.integers(1, others + 1))] = 1500  # another session's context reaches further
    order = rng.permutation(others + 1)  # the session of interest (index 0) lands anywhere
    case = make_case(rng, dtype, 128, 8, 2, lens[order], ctxs[order], mode="causal" if mode == "causal" else "block",
                     window={"causal": 0, "block": 100, "row": 5}[mode], window_mode="row" if mode == "row" else "anchor")
    b = int(np.flatnonzero(order == 0)[0])
    r0, r1 = case.row_indptr[b], case.row_indptr[b + 1]
    batched = run(any_backend, case, split=rule)
    np.testing.assert_array_equal(bits(run(any_backend, case.session(b), split=rule)), bits(batched[r0:r1]))
    for solo, batch in (("parallel", "serial"), ("serial", "parallel")):
        alone = run(any_backend, case.session(b), split=rule, strategy=solo)
        np.testing.assert_array_equal(bits(alone), bits(run(any_backend, case, split=rule, strategy=batch)[r0:r1]))


@pytest.mark.parametrize("dtype,d", [(BF16, 64), (F32, 128)], ids=str)
def test_prefill_rows_equal_decode_steps(any_backend, rng, dtype, d):
    """A prefill of 120 rows over 30 committed ones: sampled rows equal the decode step at their
    position, bitwise (the cache holding the rows before them), across 8 splits."""
    be = any_backend
    n, ctx = 120, 30
    case = make_case(rng, dtype, d, 8, 2, [n], [ctx])
    full = run(be, case, split=SMALL)
    cache_k, cache_v = case.k_caches[0].copy(), case.v_caches[0].copy()
    cache_k[:, ctx : ctx + n] = case.k_blk.transpose(1, 0, 2)
    cache_v[:, ctx : ctx + n] = case.v_blk.transpose(1, 0, 2)
    for i in sorted({0, 33, 34, 97, n - 1, *rng.integers(0, n, 2).tolist()}):
        step = replace(case, q=case.q[i : i + 1], k_blk=case.k_blk[i : i + 1], v_blk=case.v_blk[i : i + 1],
                       k_caches=[cache_k], v_caches=[cache_v], pos=np.array([ctx + i], np.int32),
                       row_indptr=indptr_of([1]))
        np.testing.assert_array_equal(bits(run(be, step, split=SMALL)), bits(full[i : i + 1]), err_msg=f"row {i}")


@pytest.mark.parametrize("dtype,d,heads,ctx", [(BF16, 64, (4, 4), 0), (F16, 128, (12, 2), 70), (BF16, 256, (12, 2), 130)],
                         ids=str)
def test_prompt_rows_equal_verify_rows_and_decode_steps(kernel_backend, rng, dtype, d, heads, ctx):
    """Property 1 for prompts: the prompt kernel's rows (one pass of 80 rows after `ctx`
    committed ones, or the same rows in two passes of 37 and 43) are bitwise the serial and the
    split-parallel kernel's rows of the same block (a verify's) and the decode step at each row's
    position, across splits of 1, 2 and 4 tiles. GQA 1 and 6 (Qwen3.5-27B's 24 / 4)."""
    be, n = kernel_backend, 80
    case = make_case(rng, dtype, d, *heads, [n], [ctx])
    prompt = run(be, case, split=SMALL, strategy="prompt")
    assert launch_plan([n], [ctx], hq=heads[0], hkv=heads[1], head_dim=d, dtype=dtype).strategy == "prompt"
    np.testing.assert_array_equal(bits(prompt), bits(run(be, case, split=SMALL)))
    for strategy in ("serial", "parallel"):
        np.testing.assert_array_equal(bits(run(be, case, split=SMALL, strategy=strategy)), bits(prompt), strategy)
    assert_close(prompt, reference(case, split=SMALL), dtype)
    cache_k, cache_v = case.k_caches[0].copy(), case.v_caches[0].copy()
    cache_k[:, ctx : ctx + n] = case.k_blk.transpose(1, 0, 2)
    cache_v[:, ctx : ctx + n] = case.v_blk.transpose(1, 0, 2)

    def rows_at(i, j):  # rows [i, j) as their own pass, rows before them in the cache
        return replace(case, q=case.q[i:j], k_blk=case.k_blk[i:j], v_blk=case.v_blk[i:j], k_caches=[cache_k],
                       v_caches=[cache_v], pos=np.array([ctx + i], np.int32), row_indptr=indptr_of([j - i]))
    second = run(be, rows_at(37, n), split=SMALL, strategy="prompt")
    np.testing.assert_array_equal(bits(second), bits(prompt[37:]), "second pass")
    for i in sorted({0, 36, 37, 63, 64, n - 1, *rng.integers(0, n, 2).tolist()}):
        np.testing.assert_array_equal(bits(run(be, rows_at(i, i + 1), split=SMALL)), bits(prompt[i : i + 1]),
                                      err_msg=f"decode step {i}")


def test_prompt_plan(numpy_backend, rng):
    """auto takes the prompt kernel for a causal pass of 16-bit K/V with a session of at least 64
    rows, never for decode and verify blocks, f32 K/V or the drafter's block mode; forcing it
    there is refused. Its CTAs hold 128 items (8 warps), twice the serial kernel's rows, so they read
    about half its K/V; its merged outputs live in the pass's workspace, so at D = 256 its shared
    memory fits an A100's 163 KB a CTA (169 KB did not launch there)."""
    for lens, want in (([64], "prompt"), ([63], "parallel"), ([8] * 32, "serial"), ([1], "parallel")):
        p = launch_plan(lens, [4096] * len(lens), **QWEN35)
        assert p.strategy == want, (lens, p.strategy)
    p = launch_plan([8192], [0], **QWEN35)
    serial = launch_plan([8192], [0], **QWEN35, strategy="serial")
    assert (p.kernel, p.block, p.launches) == ("attention_prompt_bf16_d256", (256,), 1)
    assert (p.rows_per_cta, serial.rows_per_cta) == (21, 10) and p.ctas == 4 * -(-8192 // 21)
    assert p.flops == serial.flops and all(p.bytes[k] == serial.bytes[k] for k in ("q", "out"))
    assert 0.45 * serial.bytes["kv"] < p.bytes["kv"] < 0.55 * serial.bytes["kv"]
    assert p.shared_mem == prompt_shared_mem_bytes(2, 256) <= SHARED_LIMIT[80]
    assert prompt_acc_bytes(8192, 24, 256) == 8192 * 24 * 256 * 4
    assert launch_plan([200], [0], hq=8, hkv=2, head_dim=128, dtype=F32).strategy == "serial"
    for dtype, mode in ((F32, "causal"), (BF16, "block")):
        with pytest.raises(ValueError, match="strategy='prompt' runs causal attention over 16-bit K/V"):
            launch_plan([100], [0], hq=8, hkv=2, head_dim=128, dtype=dtype, mode=mode, window=8, strategy="prompt")


def test_randomised_schedule(simt, rng):
    """Threads in a random order between barriers, cp.async copies landing at random points up to
    their wait: bitwise the same result, on both kernels."""
    for mode, (lens, ctxs, window), dtype in (("causal", (*CAUSAL["mixed7"], 0), F32),
                                              ("causal", ([1, 6], [200, 190], 0), BF16),
                                              ("block", BLOCK["ring3"], F16), ("row", ROWS["short"], BF16)):
        case = make_case(rng, dtype, 64, 8, 2, lens, ctxs, mode="causal" if mode == "causal" else "block",
                         window=window, window_mode="row" if mode == "row" else "anchor")
        for strategy in ("serial", "parallel", "prompt")[: 3 if dtype != F32 and mode == "causal" else 2]:
            ordered = run(simt, case, split=SMALL, strategy=strategy)
            with simt.kernels.schedule(seed=int(rng.integers(1, 2**31))):
                shuffled = run(simt, case, split=SMALL, strategy=strategy)
            np.testing.assert_array_equal(bits(shuffled), bits(ordered))
        assert_close(ordered, reference(case, split=SMALL), dtype)


# ---- the building blocks -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_mma_and_ldmatrix_follow_the_ptx_fragment_layouts(kernel_backend, rng, dtype):
    """Fragments packed by hand from the PTX ISA's layouts equal what ldmatrix (x4, x4 on the
    K-tile layout, x2.trans and x4.trans on the V-tile layout) loads, and the MMA on them is
    A B + C in the C layout. On simt this pins the emulation, on a GPU the hardware."""
    be = kernel_backend
    a, kt, vm = (rng.standard_normal(s).astype(np.float32).astype(dtype) for s in ((16, 16), (8, 16), (16, 16)))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    regs, d = be.xp.zeros((2, 32, 12), np.uint32), be.xp.zeros((16, 8), np.float32)
    name = f"attention_mma_probe_{'bf16' if dtype == BF16 else 'f16'}"
    be.kernels.get_function(name)((1,), (32,), tuple(be.asarray(x) for x in (a, kt, vm, c)) + (regs, d),
                                  shared_mem=2 * 640)
    regs, d = be.to_host(regs), be.to_host(d)
    np.testing.assert_array_equal(regs[1], regs[0])
    exact = a.astype(np.float64) @ kt.astype(np.float64).T + c
    bound = 17 * 2.0**-23 * (np.abs(a.astype(np.float64)) @ np.abs(kt.astype(np.float64)).T + np.abs(c))
    assert np.all(np.abs(d - exact) <= bound)


@pytest.mark.parametrize("zfill", [0, 1])
def test_cp_async_groups(kernel_backend, rng, zfill):
    """wait_group 0, and wait_group 1 behind a newer empty group, land the copy (zero-filled
    where asked); on simt, a missing wait and a wait_group 1 that leaves the copy's group pending
    read stale shared memory, in index order and under a random schedule."""
    be = kernel_backend
    fn = be.kernels.get_function("attention_cp_async_probe")
    n = 64

    def probe(wait):
        src = rng.standard_normal(4 * n).astype(np.float32)
        out = be.xp.zeros(4 * n, np.float32)
        fn((1,), (n,), (be.asarray(src), out, np.int32(wait), np.int32(zfill)), shared_mem=16 * n)
        want = src.reshape(n, 4).copy()
        if zfill:
            want[1::2] = 0
        return np.array_equal(be.to_host(out), np.roll(want, -1, axis=0).reshape(-1))

    assert probe(0) and probe(1)
    if be.name == "simt":
        assert not probe(2) and not probe(3)
        with be.kernels.schedule(seed=int(rng.integers(1, 2**31))):
            assert probe(0) and probe(1)
            assert not all(probe(w) for w in (2, 3, 2, 3))


# ---- the launch plan -----------------------------------------------------------------------------
QWEN35 = dict(hq=24, hkv=4, head_dim=256, dtype="bfloat16")   # Qwen3.5-27B full-attention layers
QWEN3_8B = dict(hq=32, hkv=8, head_dim=128, dtype="bfloat16")


@pytest.mark.parametrize("shape", [QWEN35, QWEN3_8B], ids=["qwen3.5-27b", "qwen3-8b"])
@pytest.mark.parametrize("vt", [1, 8])
def test_plan_fills_an_h200_at_one_session(shape, vt):
    """B = 1 at 32k: split-parallel, at least one CTA per SM of an H200 (132), each key read once
    per kv head; the partials stay small next to the K/V."""
    ctx = 32768
    p = launch_plan([vt], [ctx], **shape)
    kv = 2 * shape["hkv"] * (ctx + vt) * shape["head_dim"] * 2
    assert p.strategy == "parallel" and p.launches == 2
    assert p.ctas >= 132 and p.bytes["kv"] == kv
    assert p.bytes["partials_written"] == p.bytes["partials_read"] < 0.08 * kv
    assert p.cta_keys.max() <= 1024 and p.cta_keys.sum() == shape["hkv"] * (ctx + vt)


@pytest.mark.parametrize("shape", [QWEN35, QWEN3_8B], ids=["qwen3.5-27b", "qwen3-8b"])
def test_plan_walks_serially_when_the_batch_fills_the_gpu(shape):
    """B = 32 verify blocks of 8 at 32k: one CTA per (session, kv head), K/V read once, no partials."""
    p = launch_plan([8] * 32, [32768] * 32, **shape)
    assert p.strategy == "serial" and p.launches == 1 and p.partial_bytes == 0
    assert p.grid == (1, shape["hkv"], 32)
    assert p.bytes["kv"] == 32 * 2 * shape["hkv"] * (32768 + 8) * shape["head_dim"] * 2


@pytest.mark.parametrize("hq,hkv,d,dtype", [(4, 4, 64, F32), (8, 2, 128, BF16), (32, 4, 128, F16),
                                            (24, 4, 256, BF16), (64, 8, 256, BF16)])
def test_verify_reads_each_kv_head_once(numpy_backend, rng, hq, hkv, d, dtype):
    """Work sharing: a verify block (vt <= 8) of every session is one CTA per (split, session, kv
    head), so its K/V tiles are staged once for all rows and GQA heads; prefill is chunked."""
    for lens, strategy in (([8, 1, 5], "serial"), ([8, 1, 5], "parallel"), ([200], "serial")):
        case = make_case(rng, dtype, d, hq, hkv, lens, [70] * len(lens))
        p = plan(validate(numpy_backend, *case.args(), "causal", 0, None), strategy=strategy)
        chunks = 1 if max(lens) <= 8 else -(-max(lens) // p.rows_per_cta)
        assert p.grid == (chunks * max(p.slots, 1), hkv, len(lens))
        if max(lens) <= 8:
            assert p.bytes["kv"] == 2 * hkv * sum(70 + n for n in lens) * d * dtype.itemsize


class Recording:
    """simt's kernels recording each launch's (entry, grid, block, shared memory); with `arch`, as a
    device of that architecture reports them (its plans take that device's shared memory per CTA)."""

    def __init__(self, kernels, arch=None):
        self._kernels, self.arch, self.launched = kernels, arch, []

    def __getattr__(self, name):
        return getattr(self._kernels, name)

    def get_function(self, name):
        fn = self._kernels.get_function(name)

        def launch(grid, block, args, shared_mem=0):
            self.launched.append((name, tuple(grid), tuple(block), shared_mem))
            fn(grid, block, args, shared_mem=shared_mem)
        return launch


def test_plan_and_op_launch_the_same(simt, rng):
    """The op launches what launch_plan says: kernels, grids, blocks and shared memory."""
    kernels = Recording(simt.kernels)
    launched = kernels.launched
    case = make_case(rng, BF16, 256, 12, 2, [3, 1], [400, 90])
    for strategy in ("serial", "parallel", "prompt"):
        launched.clear()
        attention(replace(simt, kernels=kernels), *case.args(), strategy=strategy)
        p = launch_plan([3, 1], [400, 90], hq=12, hkv=2, head_dim=256, dtype=BF16, strategy=strategy)
        smem = prompt_shared_mem_bytes(2, 256) if strategy == "prompt" else shared_mem_bytes(2, 256)
        want = [(p.kernel, p.grid, p.block, smem)]
        if p.combine_kernel:
            want.append((p.combine_kernel, p.combine_grid, p.combine_block, 0))
        assert launched == want


@pytest.mark.parametrize("arch,dtype,d", [("sm_80", F32, 256), ("sm_80", BF16, 256), ("sm_89", BF16, 256),
                                          ("sm_89", F32, 128)], ids=str)
def test_smaller_devices_plans_fit_their_shared_memory_and_give_the_same_bits(simt, rng, arch, dtype, d):
    """Where a device's shared memory per CTA does not hold the H200's attention tiles (an A100's
    163 KB at D = 256; sm_89's 99 KB at f32 D = 128 and 16-bit D = 256), its plans take SMALL_CONFIGS'
    entries (one stage, fewer m-tiles), and a prompt that does not fit walks serially. Every launch
    stays within the device's limit, and each strategy's rows are bitwise the H200 plan's."""
    kernels = Recording(simt.kernels, arch)
    small = replace(simt, kernels=kernels)
    limit = SHARED_LIMIT[int(arch[3:])]
    case = make_case(rng, dtype, d, 12, 2, [3, 70], [400, 90])
    for strategy in ("auto", "serial", "parallel"):
        kernels.launched.clear()
        got = run(small, case, split=SMALL, strategy=strategy)
        assert kernels.launched and all(smem <= limit for *_, smem in kernels.launched), kernels.launched
        if strategy != "auto" or prompt_shared_mem_bytes(dtype.itemsize, d) > limit:   # not the prompt kernel
            assert kernels.launched[0][0] == f"attention_{suffix(dtype, 'dtype')}_d{d}{config(dtype.itemsize, d, limit)[2]}"
            assert config(dtype.itemsize, d, limit)[2], kernels.launched
        np.testing.assert_array_equal(bits(got), bits(run(simt, case, split=SMALL, strategy=strategy)), strategy)
    assert shared_mem_bytes(dtype.itemsize, d) > limit   # the H200's tile: why this device needs its own
    if dtype == BF16 and prompt_shared_mem_bytes(2, d) > limit:
        with pytest.raises(CapacityError, match="strategy='prompt' at head_dim=256"):
            run(small, case, split=SMALL, strategy="prompt")
    elif dtype == BF16:
        np.testing.assert_array_equal(bits(run(small, case, split=SMALL, strategy="prompt")),
                                      bits(run(simt, case, split=SMALL, strategy="prompt")))


def test_a_device_too_small_for_f32_at_d256_is_refused_by_name(simt, rng):
    """f32 K/V at D = 256 needs 155 KB a CTA even in one stage and one m-tile: on sm_89's 99 KB the op
    refuses with a CapacityError naming head_dim, before any launch."""
    kernels = Recording(simt.kernels, "sm_89")
    case = make_case(rng, F32, 256, 4, 2, [2], [30])
    with pytest.raises(CapacityError, match="head_dim=256 over 4-byte K/V"):
        run(replace(simt, kernels=kernels), case)
    assert kernels.launched == []


def test_kernel_refuses_a_plan_with_too_little_shared_memory(simt, rng):
    """The simt build checks the plan's shared memory against the kernel's layout."""
    case = make_case(rng, BF16, 64, 4, 4, [1], [10])
    p = launch_plan([1], [10], hq=4, hkv=4, head_dim=64, dtype=BF16, strategy="serial")
    tables = np.array([case.k_caches[0].ctypes.data, case.v_caches[0].ctypes.data], np.uint64)
    meta = np.array([0, 1, 10, case.k_caches[0].shape[1]], np.int32)
    args = (case.q, case.k_blk, case.v_blk, tables[:1], tables[1:], meta[:2], meta[2:3], meta[3:],
            np.int32(4), np.int32(4), np.int32(p.rows_per_cta), np.int32(0), np.int32(0), np.float32(0.125),
            np.int32(256), np.int32(8), np.int32(1024), np.int32(0), None, None, np.zeros_like(case.q))
    for strategy in ("serial", "prompt"):
        p = launch_plan([1], [10], hq=4, hkv=4, head_dim=64, dtype=BF16, strategy=strategy)
        if strategy == "prompt":  # its merged outputs, f32 [rows, Hq, D]
            args = args[:-3] + (np.zeros(case.q.shape, np.float32), None, args[-1])
        fn = simt.kernels.get_function(p.kernel)
        fn(p.grid, p.block, args, shared_mem=p.shared_mem)
        with pytest.raises(simt.kernels.fault_type, match="launch plan does not match"):
            fn(p.grid, p.block, args, shared_mem=p.shared_mem - 16)


def test_asan_clean():
    assert_clean(run_asan("""
        from tests.kernels.test_attention import make_case, run, reference, assert_close, SMALL
        import ml_dtypes
        rng = np.random.default_rng(0)
        for dtype, d in ((np.float32, 64), (np.float16, 128), (ml_dtypes.bfloat16, 256), (np.float32, 256)):
            for mode, window, rows in (("causal", 0, "anchor"), ("block", 70, "anchor"), ("block", 5, "row")):
                case = make_case(rng, dtype, d, 8, 2, [8, 1, 0, 3], [65, 0, 4, 130], mode=mode, window=window,
                                 slack=0, window_mode=rows)
                for strategy in ("serial", "parallel"):
                    assert_close(run(be, case, split=SMALL, strategy=strategy), reference(case, split=SMALL), dtype)
        print("ok")
    """, families=["attention", "kv_commit"]))


# ---- bad input ------------------------------------------------------------------------------------
def _bad_inputs():
    def edit(**kw):
        return lambda c: replace(c, **kw)

    return [
        ("q 2-d", lambda c: replace(c, q=c.q[:, 0]), ShapeError, r"q has shape \(6, 64\): expected 3 dims"),
        ("head dim", lambda c: replace(c, q=c.q[..., :32].copy()), ShapeError,
         r"head dim 32: expected one of \(64, 128, 256\)"),
        ("q float64", lambda c: replace(c, q=c.q.astype(np.float64)), DTypeError, "q has dtype float64"),
        ("k_blk dtype", lambda c: replace(c, k_blk=c.k_blk.astype(np.float16)), DTypeError,
         "k_blk has dtype float16: expected float32"),
        ("v_blk rows", lambda c: replace(c, v_blk=c.v_blk[:5]), ShapeError, r"v_blk has shape \(5, 2, 64\)"),
        ("gqa", lambda c: replace(c, q=np.concatenate([c.q, c.q[:, :1]], axis=1)), ShapeError,
         "q has 9 heads: expected a multiple of the 2 kv heads"),
        ("gqa too wide", lambda c: replace(c, q=np.repeat(c.q, 9, axis=1)), ShapeError,
         "q has 36 query heads per kv head: at most 32 for float32 at head dim 64"),
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
        ("row window past ring", edit(mode="block", window=10, window_mode="row"), CapacityError,
         r"window=10 exceeds the ring capacity 8 \+ 1"),
        ("window mode", edit(mode="block", window=4, window_mode="query"), ValueError, "window_mode='query'"),
        ("row window 0", edit(mode="block", window=0, window_mode="row"), ValueError,
         "a per-row window is a block-mode window of at least 1 row"),
        ("row window causal", edit(window_mode="row"), ValueError, "window_mode='row' with mode='causal'"),
    ]


@pytest.mark.parametrize("name,mutate,error,match", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_rejects_bad_input(kernel_backend, rng, name, mutate, error, match):
    case = mutate(make_case(rng, np.float32, 64, 8, 2, [2, 4], [3, 5], slack=3))
    with pytest.raises(error, match=match):
        attention(kernel_backend, *on(kernel_backend, case).args(), mode=case.mode, window=case.window,
                  window_mode=case.window_mode)


@pytest.mark.parametrize("kw,error,match", [({"split": 256}, TypeError, "split=256: expected a SplitRule"),
                                            ({"strategy": "fast"}, ValueError, "strategy='fast'")])
def test_rejects_bad_plan_knobs(kernel_backend, rng, kw, error, match):
    case = on(kernel_backend, make_case(rng, np.float32, 64, 4, 4, [2], [3]))
    out = kernel_backend.xp.zeros(case.q.shape, np.float32)
    with pytest.raises(error, match=match):
        attention(kernel_backend, *case.args(), out=out, **kw)
    assert not kernel_backend.to_host(out).any()  # nothing was written


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


# ---- grids sized for a reach (recorded passes: dspark.graphs) ---------------------------------------------
@pytest.mark.parametrize("mode, window", [("causal", 0), ("block", 40)])
def test_a_grid_sized_for_a_reach_gives_the_same_bits(kernel_backend, rng, mode, window):
    """A recorded pass sizes its attention grid for positions its sessions will reach later: the
    CTAs of splits past a row's keys leave at once, and every row gets the bits it gets from the
    grid of today's positions; a causal grid for 1000 keys holds the splits those rows will need."""
    from dspark.ops.attention import reach_splits
    rule = SplitRule.uniform(64)
    lens, ctxs = [3, 5], [70, 200]
    case = make_case(rng, np.float32, 64, 4, 2, lens, ctxs, mode=mode, window=window)
    base = bits(run(kernel_backend, case, split=rule, strategy="parallel"))
    for reach in (300, 1000):
        assert bits(run(kernel_backend, case, split=rule, reach=reach)).tobytes() == base.tobytes()
    p = launch_plan(lens, ctxs, hq=4, hkv=2, head_dim=64, dtype=np.float32, mode=mode, window=window, split=rule,
                    reach=1000)
    assert p.strategy == "parallel" and p.slots == reach_splits(lens, 1000, mode=mode, window=window, split=rule)
    if mode == "causal":
        assert p.slots == 1000 // 64 + 1 and p.idle_ctas > 0
    else:  # a window spans at most two 64-key splits wherever it sits
        assert p.slots == 2
