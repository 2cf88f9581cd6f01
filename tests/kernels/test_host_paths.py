"""The numpy backend's native paths (dspark.ops.host, csrc/cpu/host_ops.cpp) against the NumPy
references they replace, bit for bit: the gated delta rule's walk over the columns, and RMSNorm
(NumPy's pairwise sums included, csrc/cpu/pairwise.h)."""

import numpy as np
import pytest

from dspark.dtypes import BF16
from dspark.ops import gdn, host, norm
from tests.conftest import poison

F32 = np.float32


def walk_inputs(rng, lens, heads, dk, dv):
    cols = int(sum(lens))
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731 (the scan's l2-normed q, k)
    return dict(S=(rng.standard_normal((len(lens), heads, dv, dk)) * 0.3).astype(F32),
                q=unit(rng.standard_normal((cols, heads, dk))).astype(F32),
                k=unit(rng.standard_normal((cols, heads, dk))).astype(F32),
                v=rng.standard_normal((cols, heads, dv)).astype(F32),
                alpha=rng.uniform(0.5, 1.0, (cols, heads)).astype(F32),
                beta=rng.uniform(0.0, 1.0, (cols, heads)).astype(F32),
                col_indptr=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))


@pytest.mark.parametrize("dk,dv", [(16, 16), (32, 24), (64, 64), (128, 128), (64, 5)])
@pytest.mark.parametrize("lens", [(1,), (8,), (3, 0, 5, 1), (32,)], ids=["decode", "verify", "ragged", "prompt"])
def test_delta_walk_equals_its_reference_bitwise(rng, dk, dv, lens):
    """With 1, 2 and 3 threads (the (session, head) pairs split across them)."""
    heads = 3
    for checkpoints, threads in ((False, 1), (True, 1), (False, 2), (True, 2), (True, 3)):
        args = walk_inputs(rng, lens, heads, dk, dv)
        cols = int(sum(lens))
        want = {"S": args["S"].copy(), "out": poison(np, (cols, heads, dv), F32),
                "ckpt": poison(np, (cols, heads, dv, dk), F32) if checkpoints else None}
        got = {"S": args["S"].copy(), "out": poison(np, (cols, heads, dv), F32),
               "ckpt": poison(np, (cols, heads, dv, dk), F32) if checkpoints else None}
        rest = {k: v for k, v in args.items() if k != "S"}
        gdn.delta_walk_ref(want["S"], **rest, out=want["out"], state_ckpt=want["ckpt"])
        host.delta_walk(got["S"], **rest, out=got["out"], state_ckpt=got["ckpt"], threads=threads)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name],
                                          err_msg=f"{name}, checkpoints={checkpoints}, {threads} threads")


def test_delta_walk_writes_through_strided_outputs(rng):
    args = walk_inputs(rng, (2, 3), 2, 16, 8)
    S = args.pop("S")
    want_S, want_out = S.copy(), np.zeros((5, 2, 8), F32)
    gdn.delta_walk_ref(want_S, **args, out=want_out)
    out = np.zeros((5, 2, 16), F32)[..., ::2]  # not contiguous: written through a copy
    host.delta_walk(S, **args, out=out)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(S, want_S)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 8), (5, 100), (4, 128), (3, 129), (2, 5, 1000), (6, 4096)])
def test_rmsnorm_equals_its_reference_bitwise(rng, shape):
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 100)).astype(F32)
    w = rng.standard_normal(shape[-1]).astype(F32)
    for eps in (1e-6, 1e-5):
        np.testing.assert_array_equal(host.rmsnorm(x, w, eps), norm.rmsnorm_numpy(x, w, eps))
    np.testing.assert_array_equal(host.rmsnorm(x[..., ::-1], w, 1e-6), norm.rmsnorm_numpy(x[..., ::-1], w, 1e-6))


def test_the_numpy_backend_runs_them(numpy_backend, rng, monkeypatch):
    """gdn_scan and rmsnorm on the numpy backend go through the native paths (and give the
    reference's bits: the row-invariance tests hold them to that)."""
    calls = []
    for name in ("delta_walk", "rmsnorm"):
        fn = getattr(host, name)
        monkeypatch.setattr(host, name, lambda *a, _fn=fn, _n=name, **k: (calls.append(_n), _fn(*a, **k))[1])
    x = rng.standard_normal((3, 64)).astype(F32)
    w = rng.standard_normal(64).astype(F32)
    np.testing.assert_array_equal(norm.rmsnorm(numpy_backend, x, w, 1e-6), norm.rmsnorm_numpy(x, w, 1e-6))
    heads, dk, dv = 2, 16, 16
    C = gdn.channels(heads, dk, dv)
    states, windows = [np.zeros((heads, dv, dk), F32)], [np.zeros((C, 3), F32)]
    gdn.gdn_scan(numpy_backend, rng.standard_normal((2, C)).astype(F32), rng.standard_normal((2, heads)).astype(F32),
                 rng.standard_normal((2, heads)).astype(F32), rng.standard_normal((C, 4)).astype(F32),
                 np.zeros(heads, F32), np.zeros(heads, F32), states, windows, np.array([0, 2], np.int32),
                 heads=heads, dk=dk, dv=dv)
    assert calls == ["rmsnorm", "delta_walk"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("mode", ["causal", "block"])
def test_attention_on_the_numpy_backend_equals_the_numpy_reference(numpy_backend, rng, dtype, mode):
    """The op's native products (dspark.ops.host.attention_products) give attention_ref's bits with
    its NumPy products, at every head dim, across tiles and splits."""
    from dspark.ops.attention import SplitRule, attention, attention_ref
    from tests.kernels.test_attention import make_case
    for d in (64, 128, 256):
        case = make_case(rng, dtype, d, 4, 2, [3, 1, 6], [300, 0, 70], mode=mode, window=90 if mode == "block" else 0)
        split = SplitRule(64, 2, 128)  # several splits within the context
        want = attention_ref(*case.args(), mode=mode, window=case.window, split=split).astype(dtype)
        got = attention(numpy_backend, *case.args(), mode=mode, window=case.window, split=split)
        np.testing.assert_array_equal(got, want, err_msg=f"d={d}")


def test_without_the_native_module_the_twins_give_the_same_bits(numpy_backend, rng, monkeypatch):
    """A tree without dspark._cpu (a GPU machine with no host compiler, where the numpy backend is
    the sanitizer steps' oracle) runs the NumPy twins: a whole trunk pass gives the native bits."""
    from dspark.models.presets import tiny_pair
    from dspark.ops import product
    trunk, _ = tiny_pair(numpy_backend, seed=3)
    config = trunk.config
    prompt = rng.integers(0, config.vocab, 11).astype(np.int32)

    def logits():
        cache = trunk.new_cache()
        try:
            tp = trunk.prefill(cache, prompt)
            return np.asarray(tp.logits).copy(), np.asarray(trunk.decode([cache], [int(prompt[0])]).logits).copy()
        finally:
            cache.free()

    native = logits()
    for mod in (product, host):
        monkeypatch.setattr(mod, "NATIVE", False)
    monkeypatch.setattr(product, "_cpu", None)
    twins = logits()
    for a, b in zip(native, twins):
        np.testing.assert_array_equal(a, b)
    assert "NumPy twins" in product.native_status()
