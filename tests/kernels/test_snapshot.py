"""snapshot_save / snapshot_restore / checkpoint_select: exact batched copies, one launch each."""

import dataclasses

import numpy as np
import pytest

from dspark.errors import CapacityError, DTypeError, KernelArgumentError, ShapeError, StateError
from dspark.ops.snapshot import checkpoint_select, checkpoint_select_ref, snapshot_restore, snapshot_save
from tests.conftest import poison
from tests.kernels.asan import assert_clean, run_asan

F32 = np.float32
FAMILIES = ["gdn_scan", "snapshot"]  # the same set as test_gdn.py: one cached ASan build


class CountingKernels:
    """Wraps an executor and records every launch by kernel name."""

    def __init__(self, inner):
        self.inner, self.launches = inner, []

    def get_function(self, name):
        fn = self.inner.get_function(name)

        def launch(*args, **kwargs):
            self.launches.append(name)
            return fn(*args, **kwargs)
        return launch


def counting(be):
    kernels = CountingKernels(be.kernels)
    return dataclasses.replace(be, kernels=kernels), kernels


def random_bits(rng, shape):
    """Arbitrary f32 bit patterns (NaNs, infinities, subnormals included): a copy must keep them all."""
    return rng.integers(0, 2**32, size=shape, dtype=np.uint32).view(F32)


# Gdn states and conv windows of a few layers and sessions, plus odd sizes: one element, empty,
# not a multiple of 4, and larger than one block's chunk.
SHAPES = [(3, 32, 16), (112, 3), (7,), (1,), (0,), (2, 128, 64), (5, 3)]


def make_tensors(be, rng, shapes, misaligned=False):
    out = []
    for i, s in enumerate(shapes):
        host = random_bits(rng, s)
        if misaligned and i % 2:  # a view 4 bytes past a 16-byte boundary: the scalar path
            flat = be.xp.empty(host.size + 1, F32)
            a = flat[1:].reshape(s)
            a[...] = be.asarray(host)
            out.append(a)
        else:
            out.append(be.asarray(host))
    return out


def bits(be, arrays):
    return [be.to_host(a).view(np.uint32) for a in arrays]


@pytest.mark.parametrize("misaligned", [False, True])
def test_save_and_restore_are_exact_single_launches(kernel_backend, rng, misaligned):
    be, kernels = counting(kernel_backend)
    live = make_tensors(be, rng, SHAPES, misaligned)
    snap = [poison(be.xp, s, F32) for s in SHAPES]
    original = bits(be, live)
    snapshot_save(be, live, snap)
    assert kernels.launches == ["snapshot_copy_f32"]
    for i, (x, y) in enumerate(zip(bits(be, snap), original)):
        np.testing.assert_array_equal(x, y, err_msg=f"snap[{i}]")
    for a in live:  # the verify overwrites the live state
        a[...] = np.nan
    snapshot_restore(be, snap, live)
    assert kernels.launches == ["snapshot_copy_f32"] * 2
    for i, (x, y) in enumerate(zip(bits(be, live), original)):
        np.testing.assert_array_equal(x, y, err_msg=f"live[{i}]")


def test_empty_lists_are_a_no_op(any_backend):
    snapshot_save(any_backend, [], [])
    snapshot_restore(any_backend, [], [])


def make_checkpoints(be, rng, ts, state_shape=(3, 32, 16), conv_shape=(112, 3)):
    cols, B = sum(ts), len(ts)
    indptr = np.concatenate([[0], np.cumsum(ts)]).astype(np.int32)
    sc, cc = be.asarray(random_bits(rng, (cols, *state_shape))), be.asarray(random_bits(rng, (cols, *conv_shape)))
    snap_s = [be.asarray(random_bits(rng, state_shape)) for _ in range(B)]
    snap_c = [be.asarray(random_bits(rng, conv_shape)) for _ in range(B)]
    return sc, cc, be.asarray(indptr), snap_s, snap_c


@pytest.mark.parametrize("ts", [[8], [3, 1, 8], [2, 7, 1, 8, 5, 3, 4], [0, 4, 0], []])
def test_checkpoint_select_matches_reference(kernel_backend, rng, ts):
    be, kernels = counting(kernel_backend)
    sc, cc, indptr, snap_s, snap_c = make_checkpoints(be, rng, ts)
    keep = np.array([rng.integers(0, t + 1) for t in ts], np.int32)
    live_s = [poison(be.xp, (3, 32, 16), F32) for _ in ts]
    live_c = [poison(be.xp, (112, 3), F32) for _ in ts]
    checkpoint_select(be, sc, cc, live_s, live_c, indptr, be.asarray(keep), snap_states=snap_s, snap_convs=snap_c)
    assert kernels.launches == (["checkpoint_select_f32"] if ts else [])
    h = be.to_host
    ref_s = [np.full((3, 32, 16), np.nan, F32) for _ in ts]
    ref_c = [np.full((112, 3), np.nan, F32) for _ in ts]
    checkpoint_select_ref(h(sc), h(cc), ref_s, ref_c, h(indptr), keep, [h(x) for x in snap_s], [h(x) for x in snap_c])
    for b in range(len(ts)):
        np.testing.assert_array_equal(h(live_s[b]).view(np.uint32), ref_s[b].view(np.uint32))
        np.testing.assert_array_equal(h(live_c[b]).view(np.uint32), ref_c[b].view(np.uint32))
        src = (h(snap_s[b]), h(snap_c[b])) if keep[b] == 0 else (h(sc)[h(indptr)[b] + keep[b] - 1],
                                                                 h(cc)[h(indptr)[b] + keep[b] - 1])
        np.testing.assert_array_equal(ref_s[b].view(np.uint32), src[0].view(np.uint32))
        np.testing.assert_array_equal(ref_c[b].view(np.uint32), src[1].view(np.uint32))


def test_checkpoint_select_without_snapshots(any_backend, rng):
    be = any_backend
    sc, cc, indptr, _, _ = make_checkpoints(be, rng, [4, 2])
    live_s, live_c = [be.xp.zeros((3, 32, 16), F32) for _ in range(2)], [be.xp.zeros((112, 3), F32) for _ in range(2)]
    checkpoint_select(be, sc, cc, live_s, live_c, indptr, be.asarray(np.array([4, 1], np.int32)))
    h = be.to_host
    np.testing.assert_array_equal(h(live_s[0]).view(np.uint32), h(sc)[3].view(np.uint32))
    np.testing.assert_array_equal(h(live_c[1]).view(np.uint32), h(cc)[4].view(np.uint32))


def test_keep_zero_needs_the_snapshot(any_backend, rng):
    """keep = 0 keeps nothing of the verify: without the snapshot there is no right answer, so
    the call is refused (and changes nothing) instead of leaving the post-verify state live."""
    be = any_backend
    sc, cc, indptr, snap_s, snap_c = make_checkpoints(be, rng, [4, 2])
    live_s, live_c = [be.xp.zeros((3, 32, 16), F32) for _ in range(2)], [be.xp.zeros((112, 3), F32) for _ in range(2)]
    keep = be.asarray(np.array([3, 0], np.int32))
    with pytest.raises(StateError, match=r"keep\[1\]=0 rolls session 1 back to before the verify: pass snap_states"):
        checkpoint_select(be, sc, cc, live_s, live_c, indptr, keep)
    assert not any(be.to_host(a).any() for a in live_s + live_c)
    checkpoint_select(be, sc, cc, live_s, live_c, indptr, keep, snap_states=snap_s, snap_convs=snap_c)
    np.testing.assert_array_equal(be.to_host(live_s[1]).view(np.uint32), be.to_host(snap_s[1]).view(np.uint32))


def test_bad_inputs_are_refused(any_backend, rng):
    be = any_backend
    sc, cc, indptr, snap_s, snap_c = make_checkpoints(be, rng, [4, 2])
    live_s, live_c = [be.xp.zeros((3, 32, 16), F32) for _ in range(2)], [be.xp.zeros((112, 3), F32) for _ in range(2)]
    keep = be.asarray(np.array([1, 1], np.int32))

    def select(**kw):
        args = dict(state_ckpt=sc, conv_ckpt=cc, states=live_s, conv_windows=live_c, col_indptr=indptr, keep=keep)
        args.update(kw)
        checkpoint_select(be, **args)

    with pytest.raises(CapacityError, match=r"keep\[1\]=3 is outside \[0, 2\]: session 1 has 2 verify columns"):
        select(keep=be.asarray(np.array([4, 3], np.int32)))
    with pytest.raises(CapacityError, match=r"keep\[0\]=-1 is outside \[0, 4\]"):
        select(keep=be.asarray(np.array([-1, 1], np.int32)))
    with pytest.raises(DTypeError, match="keep has dtype int64: expected int32"):
        select(keep=be.asarray(np.array([1, 1], np.int64)))
    with pytest.raises(ShapeError, match=r"keep has shape \(3,\): expected \(2,\)"):
        select(keep=be.asarray(np.array([1, 1, 1], np.int32)))
    with pytest.raises(ShapeError, match="col_indptr must start at 0 and end at 6"):
        select(col_indptr=be.asarray(np.array([0, 4, 5], np.int32)))
    with pytest.raises(ShapeError, match=r"states\[1\] has shape \(3, 16, 32\): expected \(3, 32, 16\)"):
        select(states=[live_s[0], be.xp.zeros((3, 16, 32), F32)])
    with pytest.raises(ShapeError, match="conv_windows has 1 arrays: expected 2, one per session"):
        select(conv_windows=live_c[:1])
    with pytest.raises(ShapeError, match="snap_states and snap_convs go together"):
        select(snap_states=snap_s)
    with pytest.raises(ShapeError, match=r"state_ckpt has shape \(6, 3, 32\): expected 4 dims"):
        select(state_ckpt=sc[..., 0])
    with pytest.raises(DTypeError, match="live\\[0\\] has dtype float16: expected float32"):
        snapshot_save(be, [be.xp.zeros(4, np.float16)], [be.xp.zeros(4, np.float16)])
    with pytest.raises(ShapeError, match=r"snap\[0\] has shape \(5,\): expected \(4,\) as live\[0\]"):
        snapshot_save(be, [be.xp.zeros(4, F32)], [be.xp.zeros(5, F32)])
    with pytest.raises(ShapeError, match="snap has 0 arrays: expected 1"):
        snapshot_save(be, [be.xp.zeros(4, F32)], [])
    with pytest.raises(KernelArgumentError, match=r"live\[0\] is not C-contiguous"):
        snapshot_restore(be, [be.xp.zeros(4, F32)], [be.xp.zeros(8, F32)[::2]])
    assert not any(be.to_host(a).any() for a in live_s + live_c)


def test_random_schedule_gives_the_same_bits(simt, rng):
    sc, cc, indptr, snap_s, snap_c = make_checkpoints(simt, rng, [3, 0, 5])
    keep = np.array([2, 0, 5], np.int32)
    results = []
    for seed in (None, int(rng.integers(1, 2**31))):
        live_s, live_c = [poison(np, (3, 32, 16), F32) for _ in range(3)], [poison(np, (112, 3), F32) for _ in range(3)]
        snap = [poison(np, s, F32) for s in SHAPES]
        live = make_tensors(simt, np.random.default_rng(1), SHAPES, misaligned=True)
        if seed is None:
            checkpoint_select(simt, sc, cc, live_s, live_c, indptr, keep, snap_states=snap_s, snap_convs=snap_c)
            snapshot_save(simt, live, snap)
        else:
            with simt.kernels.schedule(seed):
                checkpoint_select(simt, sc, cc, live_s, live_c, indptr, keep, snap_states=snap_s, snap_convs=snap_c)
                snapshot_save(simt, live, snap)
        results.append(bits(simt, live_s + live_c + snap))
    for x, y in zip(*results):
        np.testing.assert_array_equal(x, y)


ASAN_SCRIPT = """
from dspark.ops.snapshot import checkpoint_select, snapshot_restore, snapshot_save
rng = np.random.default_rng(3)
shapes = [(3, 32, 16), (112, 3), (7,), (1,), (0,), (2, 128, 64), (5, 3)]
live = [rng.standard_normal(s).astype(np.float32) for s in shapes]
flat = np.empty(8, np.float32)
live.append(flat[1:])  # misaligned: the scalar tail path
live[-1][...] = 1.5
snap = [np.empty_like(a) for a in live]
snapshot_save(be, live, snap)
restored = [np.zeros_like(a) for a in live]
snapshot_restore(be, snap, restored)
for x, y in zip(live, restored):
    np.testing.assert_array_equal(x, y)
ts = [3, 0, 5, 1]
cols = sum(ts)
sc = rng.standard_normal((cols, 3, 32, 16)).astype(np.float32)
cc = rng.standard_normal((cols, 112, 3)).astype(np.float32)
indptr = np.concatenate([[0], np.cumsum(ts)]).astype(np.int32)
states, convs = [np.zeros((3, 32, 16), np.float32) for _ in ts], [np.zeros((112, 3), np.float32) for _ in ts]
checkpoint_select(be, sc, cc, states, convs, indptr, np.array([3, 0, 1, 1], np.int32),
                  snap_states=[np.ones((3, 32, 16), np.float32)] * 4, snap_convs=[np.ones((112, 3), np.float32)] * 4)
np.testing.assert_array_equal(states[0], sc[2])
np.testing.assert_array_equal(states[1], 1.0)
np.testing.assert_array_equal(convs[3], cc[8])
print("ok")
"""


def test_asan_clean(simt):
    r = run_asan(ASAN_SCRIPT, families=FAMILIES)
    assert_clean(r)
    assert "ok" in r.stdout
