"""The numpy backend's product (dspark.ops.product, csrc/cpu/product.h): the native code against its
NumPy twin bit for bit at awkward sizes, every weight dtype, thread count and instruction set; a
row alone equal to the same row in any product; refusing bad thread counts."""

import numpy as np
import pytest

import dspark
from dspark.dtypes import BF16
from dspark.errors import ShapeError
from dspark.ops import product as prod
from dspark.ops.linear import TOLERANCE, linear, linear_numpy
from tests.conftest import poison
from tests.peers import peer

_cpu = peer("dspark._cpu")  # built by pip install -e .; a tree without it (a GPU machine) runs the twins

DTYPES = [np.float32, np.float16, BF16]
DTYPE_IDS = ["f32", "f16", "bf16"]
ISAS = list(_cpu.isas)  # the AVX-512 and AVX2 builds where the CPU has them, the baseline one always
# (rows, K, N): streamed (1, 2 rows) and tiled (3+: one group of rows, several), K past a block
# (64) and not a multiple of 8, N past a tiled strip (1008) and the widest streamed one (8192),
# ragged vectors and panels, a strip's last panel of whole vectors read by a narrower tile (N =
# 1040: 2 AVX-512 vectors, 1 AVX2 one past the strip; 112: 1 AVX-512 vector past two panels)
SIZES = [(1, 1, 1), (2, 5, 3), (3, 31, 127), (1, 1000, 8300), (2, 257, 8195), (7, 257, 513), (9, 130, 2050),
         (33, 129, 255), (1, 4, 9), (8, 70, 1040), (5, 65, 112)]


def inputs(rng, rows, k, n, dtype):
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(max(k, 1))).astype(dtype)
    return x, w


def native(x, w, threads, isa=""):
    out = poison(np, (x.shape[0], w.shape[1]), np.float32)
    prod.product(x, w, out, threads=threads, isa=isa)
    return out


LAYOUTS = {"rowmajor": lambda w: w, "panelled": prod.Panelled}  # w as stored, and as the loader lays it out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("size", SIZES, ids=[f"{r}x{k}x{n}" for r, k, n in SIZES])
def test_native_equals_its_twin_bitwise(rng, size, dtype):
    x, w = inputs(rng, *size, dtype)
    expect = prod.product_ref(x, w)
    for layout, lay in LAYOUTS.items():
        for isa in ISAS:
            for threads in (1, 2, 3):
                np.testing.assert_array_equal(native(x, lay(w), threads, isa), expect,
                                              err_msg=f"{layout}, {isa}, {threads} threads")
    # and within f32 rounding of the BLAS chunks the other orders are held to
    bound = TOLERANCE * (np.abs(x).astype(np.float64) @ np.abs(w.astype(np.float32)).astype(np.float64)) + 1e-30
    assert np.all(np.abs(expect.astype(np.float64) - linear_numpy(x, w)) <= bound)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_row_alone_equals_the_row_in_any_product(rng, dtype, threads, layout):
    """Rows 1, 2, 7, 8, 9, 33 and 300: every kernel (streamed, tiled in place, packed, panel-major),
    several strips, blocks of K and column splits; a row's bits never change."""
    k, n = 300, 700
    x, w = inputs(rng, 300, k, n, dtype)
    w = LAYOUTS[layout](w)
    alone = np.concatenate([native(x[i : i + 1], w, threads) for i in range(300)])
    for rows in (1, 2, 7, 8, 9, 33, 300):
        np.testing.assert_array_equal(native(x[:rows], w, threads), alone[:rows], err_msg=f"{rows} rows")
        start = int(rng.integers(0, 300 - rows + 1))  # anywhere in the batch, not only first
        np.testing.assert_array_equal(native(x[start : start + rows], w, threads), alone[start : start + rows])


def test_the_thread_count_and_the_instruction_set_change_no_bit(rng):
    x, w = inputs(rng, 11, 333, 3001, BF16)
    expect = native(x, w, 1, ISAS[-1])
    for isa in ISAS:
        for threads in (1, 2, 3, 5, 8):
            np.testing.assert_array_equal(native(x, w, threads, isa), expect, err_msg=f"{isa}, {threads} threads")


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
def test_16_bit_weights_give_the_product_of_their_widening(rng, dtype):
    for rows in (1, 2, 5, 40):
        x, w = inputs(rng, rows, 257, 1030, dtype)
        np.testing.assert_array_equal(native(x, w, 2), native(x, w.astype(np.float32), 2))


def test_special_values_follow_the_reference(rng):
    """Subnormal, infinite and zero f16 weights widen exactly (the AVX-512 and AVX2 builds convert
    with vcvtph2ps, the baseline with integer arithmetic) and propagate as the reference's multiply-adds do."""
    x, w = inputs(rng, 3, 64, 40, np.float16)
    w[0, :8] = [np.inf, -np.inf, 6e-8, -6e-8, 0.0, -0.0, 65504, np.float16(1e-5)]
    x[1, 5] = 0.0
    for isa in ISAS:
        np.testing.assert_array_equal(native(x, w, 1, isa), prod.product_ref(x, w), err_msg=isa)


def test_an_instruction_set_this_cpu_lacks_is_refused(rng):
    """Running another set's code would stop the process on an illegal instruction."""
    from dspark.errors import BackendUnavailable
    x, w = inputs(rng, 3, 8, 8, np.float32)
    out = poison(np, (3, 8), np.float32)
    before = out.copy()
    for bad in ("avx1024", "AVX2", "sse9"):
        with pytest.raises(BackendUnavailable, match=rf"isa='{bad}': expected one this CPU runs, .*base"):
            prod.product(x, w, out, isa=bad)
    np.testing.assert_array_equal(out.view(np.uint32), before.view(np.uint32))  # untouched


def test_linear_on_the_numpy_backend_is_the_native_product(numpy_backend, rng):
    x, w = inputs(rng, 6, 100, 77, BF16)
    out = poison(np, (6, 77), np.float32)
    assert linear(numpy_backend, x, w, out=out) is out
    np.testing.assert_array_equal(out, prod.product_ref(x, w))
    strided = np.asfortranarray(x)  # any layout in: copied to rows first
    np.testing.assert_array_equal(linear(numpy_backend, strided, w), out)
    view = poison(np, (6, 154), np.float32)[:, ::2]  # a strided out is written through a copy
    linear(numpy_backend, x, w, out=view)
    np.testing.assert_array_equal(view, out)
    with pytest.raises(ShapeError, match=r"w has shape \(99, 77\): expected \(100, N\)"):
        linear(numpy_backend, x, w[:99])
    # the loader's panel-major layout: the same bits through the op, the same checks
    np.testing.assert_array_equal(linear(numpy_backend, x, prod.Panelled(w), out=poison(np, (6, 77), np.float32)), out)
    with pytest.raises(ShapeError, match=r"w has shape \(99, 77\): expected \(100, N\)"):
        linear(numpy_backend, x, prod.Panelled(w[:99]))


def test_thread_count_setting(monkeypatch):
    before = dspark.get_num_threads()
    try:
        dspark.set_num_threads(3)
        assert dspark.get_num_threads() == 3
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(ValueError, match=r"threads=.*: expected an int >= 1"):
                dspark.set_num_threads(bad)
        assert dspark.get_num_threads() == 3  # a refused value leaves the setting alone
    finally:
        dspark.set_num_threads(before)
    monkeypatch.setenv("DSPARK_NUM_THREADS", "2")
    assert prod.default_threads() == 2
    monkeypatch.setenv("DSPARK_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="DSPARK_NUM_THREADS='zero': expected an int >= 1"):
        prod.default_threads()


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_rows_equal_decode_rows(numpy_backend, rng, monkeypatch, threads):
    """A trunk whose products are wider than a block of K and a strip of N, split across threads
    even when small: the prompt pass's rows (packed products) equal the decode steps' (streamed)
    and a verify's columns, bitwise."""
    from dataclasses import replace

    from dspark.models.presets import QWEN35_CONVENTIONS, TINY_TRUNK
    from dspark.models import HybridTrunk
    monkeypatch.setattr(prod, "WORK_PER_THREAD", 1)
    before = dspark.get_num_threads()
    dspark.set_num_threads(threads)
    try:
        config = replace(TINY_TRUNK, d_model=136, mlp_hidden=300, **QWEN35_CONVENTIONS)
        trunk = HybridTrunk.random(config, int(rng.integers(1000)), numpy_backend)
        p = rng.integers(0, 256, 21).astype(np.int32)
        a, b = trunk.new_cache(), trunk.new_cache()
        full = trunk.prefill(a, p)
        for j, t in enumerate(p[:-6]):
            step = trunk.decode([b], [t])
            np.testing.assert_array_equal(full.logits[j], step.logits[0], err_msg=f"row {j}")
        verify = trunk.verify([b], [p[-6:]])
        np.testing.assert_array_equal(verify.logits, full.logits[-6:])
        np.testing.assert_array_equal(verify.taps, full.taps[-6:])
    finally:
        dspark.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_transposed_weights_are_read_in_place(rng, dtype):
    """A tied LM head is the embedding's transpose: read as it is stored (no copy per call), the
    same bits as its contiguous copy, for one row and many."""
    for rows, k, n in ((1, 130, 300), (2, 257, 33), (9, 64, 1000)):
        x, _ = inputs(rng, rows, k, n, dtype)
        e = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(dtype)  # the embedding [vocab, d]
        assert not e.T.flags.c_contiguous
        expect = prod.product_ref(x, np.ascontiguousarray(e.T))
        for isa in ISAS:
            for threads in (1, 2):
                np.testing.assert_array_equal(native(x, e.T, threads, isa), expect, err_msg=f"{rows} rows, {isa}")


def test_a_forked_child_multiplies_with_threads_of_its_own(rng):
    """The worker pool does not survive fork(): a child process starts its own instead of waiting
    on the parent's workers."""
    import multiprocessing
    x, w = inputs(rng, 4, 300, 2000, np.float32)
    expect = native(x, w, 2)  # the parent's pool is up
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as p:
        got = p.apply_async(prod.product, (x, w), dict(threads=2)).get(timeout=60)
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_panelled_weight_holds_the_matrix(rng, dtype):
    """Panelled keeps every entry (its last panel zero past N) and NumPy sees the row-major matrix."""
    for k, n in ((1, 1), (5, 47), (7, 48), (3, 49), (64, 1000)):
        w = (rng.standard_normal((k, n))).astype(dtype)
        p = prod.Panelled(w)
        assert p.shape == (k, n) and p.dtype == w.dtype and p.panels.shape == (-(-n // prod.PANEL), k, prod.PANEL)
        assert np.array_equal(np.asarray(p).view(np.uint8), w.view(np.uint8))
        assert not prod.widen(p.panels[-1][:, n - (p.panels.shape[0] - 1) * prod.PANEL :]).any()  # zeros past N
        part = prod.PanelledColumns(p, n // 3, n - n // 3)
        assert part.shape == (k, n - n // 3) and np.array_equal(np.asarray(part).view(np.uint8),
                                                                 w[:, n // 3 :].view(np.uint8))
