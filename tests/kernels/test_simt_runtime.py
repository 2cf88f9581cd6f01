"""The simt runtime: each primitive against NumPy, the debug modes, and the argument checks."""

import numpy as np
import pytest

from dspark.errors import KernelArgumentError
from dspark.kernel_sources import load_json, scan
from tests.conftest import poison
from tests.kernels.asan import assert_clean, run_asan

i32, f32 = np.int32, np.float32


@pytest.mark.parametrize("n", [32, 64, 96, 256, 1024])
def test_primitives_match_numpy(simt, n):
    out = poison(np, (n, 12), f32)
    simt.kernels.get_function("selftest_primitives")((1,), (n,), (out,))
    t = np.arange(n)
    lane, base = t % 32, t - t % 32
    warp_n = np.minimum(32, n - base)  # lanes that exist in each thread's warp
    exp = np.zeros((n, 12), np.float64)
    exp[:, 0] = base
    x = t ^ 5
    exp[:, 1] = np.where((x & ~31) == (t & ~31), x, t)
    exp[:, 2] = np.where(lane + 3 < 32, t + 3, t)
    exp[:, 3] = np.where(lane >= 2, t - 2, t)
    exp[:, 5] = [(1.0 if (b <= 7 < b + w) else 0.0) for b, w in zip(base, warp_n)]
    exp[:, 6] = 1
    exp[:, 7] = [sum(range(b, b + 32)) for b in base]
    exp[:, 8] = np.sum(t % 3 == 0)
    exp[:, 9] = 1
    exp[:, 10] = 1
    exp[:, 11] = n * (n + 1) // 2
    ballot = np.array([sum(1 << l for l in range(32) if (b + l) & 1) for b in base], np.uint32)
    np.testing.assert_array_equal(out[:, 4].view(np.uint32), ballot)
    exp[:, 4] = out[:, 4]  # compared bitwise above
    np.testing.assert_array_equal(out, exp.astype(f32))


@pytest.mark.parametrize("n", [1, 19, 33])
def test_full_mask_on_partial_warp_is_an_error(simt, n):
    # Strict by design: on hardware the missing lanes' values are undefined.
    out = poison(np, (n, 12), f32)
    with pytest.raises(simt.kernels.fault_type, match="mask names lanes that do not exist"):
        simt.kernels.get_function("selftest_primitives")((1,), (n,), (out,))


def test_partial_warp_op_is_an_error_not_a_hang(simt):
    out = poison(np, 32, f32)
    with pytest.raises(simt.kernels.fault_type, match="reached by part of a warp"):
        simt.kernels.get_function("selftest_partial_warp")((1,), (32,), (out,))


def test_3d_grid_and_block_indexing(simt):
    grid, block = (3, 2, 2), (5, 3, 2)
    nb, nt = 12, 30
    out = poison(np, (nb, nt), f32)
    simt.kernels.get_function("selftest_indexing")(grid, block, (out,))
    bz, by, bx = np.meshgrid(range(2), range(2), range(3), indexing="ij")
    tz, ty, tx = np.meshgrid(range(2), range(3), range(5), indexing="ij")
    b = (bx + 10 * by + 100 * bz).reshape(-1, 1)
    t = (tx + 10 * ty + 100 * tz).reshape(1, -1)
    np.testing.assert_array_equal(out, (b * 1000 + t).astype(f32))


def test_blocks_run_in_a_random_order_under_a_schedule(simt):
    """A GPU starts and finishes CTAs in any order: under a schedule seed simt runs a launch's blocks
    in a random permutation (a kernel that adds partials as its CTAs complete gives other bits), in
    index order without one."""
    grid = (5, 3, 2)

    def arrivals():
        order = poison(np, 30, np.int32)
        simt.kernels.get_function("selftest_arrival")(grid, (32,), (np.zeros(1, np.uint32), order))
        return order

    np.testing.assert_array_equal(arrivals(), np.arange(30))
    with simt.kernels.schedule(seed=3):
        orders = [arrivals() for _ in range(3)]
    for order in orders:
        np.testing.assert_array_equal(np.sort(order), np.arange(30))
    assert not any(np.array_equal(order, np.arange(30)) for order in orders)
    assert not np.array_equal(orders[0], orders[1])


@pytest.mark.parametrize("n,threads", [(1, 32), (100, 64), (5000, 1024), (58112, 512)])
def test_dynamic_shared_memory(simt, rng, n, threads):
    x = rng.standard_normal(n).astype(f32)
    out = poison(np, n, f32)
    simt.kernels.get_function("selftest_dynamic_smem")((1,), (threads,), (x, out, i32(n)), shared_mem=4 * n)
    np.testing.assert_array_equal(out, x[::-1])


def test_sm90_limits_are_enforced(simt):
    fn = simt.kernels.get_function("selftest_dynamic_smem")
    x = np.zeros(4, f32)
    with pytest.raises(KernelArgumentError, match="threads, more than 1024"):
        fn((1,), (32, 33), (x, x.copy(), i32(4)))
    with pytest.raises(KernelArgumentError, match="shared_mem"):
        fn((1,), (32,), (x, x.copy(), i32(4)), shared_mem=227 * 1024 + 4)
    with pytest.raises(KernelArgumentError, match="block.z"):
        fn((1,), (1, 1, 65), (x, x.copy(), i32(4)))


def test_python_int_for_int32_names_the_parameter(simt):
    x, out = np.zeros(8, f32), np.zeros(8, f32)
    fn = simt.kernels.get_function("selftest_shift")
    with pytest.raises(KernelArgumentError, match=r"parameter 'n' \(int\) needs numpy.int32, got int"):
        fn((1,), (8,), (x, out, 8))
    with pytest.raises(KernelArgumentError, match=r"parameter 'n' .* needs numpy.int32, got int64"):
        fn((1,), (8,), (x, out, np.int64(8)))


def test_pointer_checks_name_the_parameter(simt):
    fn = simt.kernels.get_function("selftest_shift")
    x, out = np.zeros(8, f32), np.zeros(8, f32)
    with pytest.raises(KernelArgumentError, match=r"'in' .* needs 4-byte elements, got float64"):
        fn((1,), (8,), (x.astype(np.float64), out, i32(8)))
    with pytest.raises(KernelArgumentError, match=r"'out' .* C-contiguous"):
        fn((1,), (8,), (x, np.zeros(16, f32)[::2], i32(8)))
    ro = np.zeros(8, f32)
    ro.flags.writeable = False
    with pytest.raises(KernelArgumentError, match=r"'out' .* read-only"):
        fn((1,), (8,), (x, ro, i32(8)))
    with pytest.raises(KernelArgumentError, match="expected a tuple of 3 arguments"):
        fn((1,), (8,), (x, out))


def test_randomised_schedule_catches_a_missing_barrier(simt, rng):
    n = 256
    racy = simt.kernels.get_function("selftest_racy_shift")
    fixed = simt.kernels.get_function("selftest_shift")

    def run(fn):
        x = rng.standard_normal(n).astype(f32)  # fresh data: stale shared memory cannot pass
        out = poison(np, n, f32)
        fn((1,), (n,), (x, out, i32(n)))
        return np.array_equal(out, np.concatenate([x[:1], x[:-1]]))

    # In index order the race happens to resolve correctly...
    assert run(racy)
    with simt.kernels.schedule(seed=12345):
        # ...a random order between barriers exposes it, while the correct kernel still passes.
        assert not all(run(racy) for _ in range(3))
        assert all(run(fixed) for _ in range(3))


def test_randomised_schedule_keeps_correct_kernels_correct(simt, rng):
    with simt.kernels.schedule(seed=7):
        test_primitives_match_numpy(simt, 256)


def test_f16_bf16_conversions_round_to_nearest_even(simt, rng):
    import ml_dtypes
    specials = np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e-8, 6e-8, 3e-5, 1e30, -np.inf, np.inf, np.nan,
                         2.0**-24, 2.0**-25, 3 * 2.0**-26, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8], f32)
    x = np.concatenate([specials, rng.standard_normal(5000) * 10.0 ** rng.integers(-9, 6, 5000)]).astype(f32)
    n = x.size
    h, b, back = poison(np, n, np.uint16), poison(np, n, np.uint16), poison(np, 2 * n, f32)
    simt.kernels.get_function("selftest_convert")(((n + 255) // 256,), (256,), (x, i32(n), h, b, back))
    with np.errstate(over="ignore"):
        want_h = x.astype(np.float16)
    want_b = x.astype(ml_dtypes.bfloat16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(h[~nan], want_h.view(np.uint16)[~nan])
    np.testing.assert_array_equal(b[~nan], want_b.view(np.uint16)[~nan])
    assert np.isnan(h.view(np.float16)[nan]).all() and np.isnan(b.view(ml_dtypes.bfloat16)[nan].astype(f32)).all()
    np.testing.assert_array_equal(back[0::2][~nan], want_h.astype(f32)[~nan])
    np.testing.assert_array_equal(back[1::2][~nan], want_b.astype(f32)[~nan])


def test_signatures_agree_with_the_compiler(simt):
    """What Python parsed from the source is what the host compiler deduced."""
    parsed = simt.kernels.signatures
    compiled = simt.kernels.compiled_kernels()
    assert set(parsed) == set(compiled)
    for name, sig in parsed.items():
        got = [(c, e, k) for c, e, k in compiled[name]]
        want = [(p.code, p.elem if p.code == "ptr" else p.elem, p.is_const) for p in sig.params]
        assert got == want, name


def test_signature_table_is_current():
    """The shipped table matches the sources (a stale build would launch with old signatures)."""
    assert scan() == load_json()


def test_asan_build_catches_out_of_bounds():
    r = run_asan("""
        out = np.zeros(30, np.float32)
        be.kernels.get_function("selftest_oob_write")((1,), (32,), (out, np.int32(30)))
        print("NOT CAUGHT")
    """, families=["selftest"])
    assert "NOT CAUGHT" not in r.stdout
    assert r.returncode != 0
    assert "heap-buffer-overflow" in r.stderr, r.stderr[-3000:]
    assert "selftest_oob_write" in r.stderr


def test_asan_build_passes_a_correct_kernel():
    assert_clean(run_asan("""
        x = np.arange(100, dtype=np.float32)
        out = np.zeros(100, np.float32)
        be.kernels.get_function("selftest_shift")((1,), (128,), (x, out, np.int32(100)))
        assert out[5] == 4
    """, families=["selftest"]))
