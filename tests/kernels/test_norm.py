"""rmsnorm: the kernel (simt, and cuda on the CuPy contract stand-in) against its NumPy twin
bitwise, within tolerance of the numpy backend's formula, and row-invariant.

The hazard it removes: an array library's reduction over an axis (CuPy's mean) picks its block
layout, and so a row's summation order, from the whole array's shape, so a row's norm could change
with the number of rows in the call. The kernel's order depends on n alone."""

import numpy as np
import pytest

from dspark.backends import contract
from dspark.errors import DTypeError, ShapeError
from dspark.ops.norm import rmsnorm, rmsnorm_gated, rmsnorm_gated_ref, rmsnorm_numpy, rmsnorm_ref
from tests.conftest import poison

SHAPES = [(1, 64), (7, 1), (5, 33), (13, 192), (3, 4, 256), (2, 6, 1000), (9, 5120)]


@pytest.fixture(params=["simt", "contract"])
def norm_backend(request, simt):
    return simt if request.param == "simt" else contract.backend()


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_kernel_equals_its_twin_bitwise(norm_backend, rng, shape):
    be = norm_backend
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 30)).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    out = poison(be.xp, shape, np.float32)
    rmsnorm(be, be.asarray(x), be.asarray(w), 1e-6, out=out)
    got = be.to_host(out)
    np.testing.assert_array_equal(got, rmsnorm_ref(x, w, 1e-6))
    np.testing.assert_allclose(got, rmsnorm_numpy(x, w, np.float32(1e-6)), rtol=2e-6, atol=1e-6)


def test_a_row_is_the_same_alone_and_among_many(norm_backend, rng):
    be = norm_backend
    x = rng.standard_normal((300, 160)).astype(np.float32)
    w = rng.standard_normal(160).astype(np.float32)
    full = be.to_host(rmsnorm(be, be.asarray(x), be.asarray(w), 1e-5))
    for rows in (slice(0, 1), slice(7, 8), slice(5, 22), slice(299, 300)):
        part = be.to_host(rmsnorm(be, be.asarray(x[rows]), be.asarray(w), 1e-5))
        np.testing.assert_array_equal(part, full[rows])


def test_bad_input_is_refused(simt, rng):
    x = rng.standard_normal((3, 8)).astype(np.float32)
    with pytest.raises(ShapeError, match=r"weight has shape \(7,\): expected \(8,\)"):
        rmsnorm(simt, x, np.ones(7, np.float32), 1e-6)
    with pytest.raises(DTypeError, match="x has dtype float64: expected float32"):
        rmsnorm(simt, x.astype(np.float64), np.ones(8, np.float32), 1e-6)


# ---- the gdn's gated output norm of a prompt ---------------------------------------------------------------
def gated_inputs(rng, tokens, heads, n, column=5, spare=7):
    """o [tokens, heads, n], and a projection holding its gates z from `column` (rows `spare` wider)."""
    o = (rng.standard_normal((tokens, heads, n)) * rng.uniform(0.01, 30)).astype(np.float32)
    proj = (rng.standard_normal((tokens, column + heads * n + spare)) * 3).astype(np.float32)
    proj[0, column : column + 4] = [0.0, -np.inf, np.inf, -100.0][:n]   # SiLU exact at 0 and +-inf, its far tail
    return o, proj, proj[:, column : column + heads * n].reshape(tokens, heads, n)


@pytest.mark.parametrize("tokens,heads,n", [(1, 1, 32), (5, 3, 33), (17, 4, 128), (2, 48, 128)])
def test_gated_norm_is_the_norm_times_silu_of_its_gates(norm_backend, rng, tokens, heads, n):
    """rmsnorm_gated: rmsnorm_f32's rows times SiLU(z), z read where the projection holds it (a token
    stride past its heads), within the last bit of exp (the host's libm against expf) of its twin;
    bitwise at gates whose exp is exact (0, -inf, +inf, and -100, whose exp overflows)."""
    be = norm_backend
    o, proj, z = gated_inputs(rng, tokens, heads, n)
    w = rng.standard_normal(n).astype(np.float32)
    out = poison(be.xp, o.shape, np.float32)
    rmsnorm_gated(be, be.asarray(o), be.asarray(proj), be.asarray(w), 1e-6, out=out, column=5)
    got, want = be.to_host(out), rmsnorm_gated_ref(o, z, w, 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    specials = got.reshape(-1)[: min(4, n)], want.reshape(-1)[: min(4, n)]
    np.testing.assert_array_equal(specials[0].view(np.uint32), specials[1].view(np.uint32))


def test_gated_norm_is_the_decode_scans_bitwise(simt, rng):
    """A prompt's gated norm and the decode scan's (gdn_scan.cu, D) are one expression
    (activation.cuh's silu_gate after rmsnorm_f32's sum): the scan's o, normed and gated by
    rmsnorm_gated, is bitwise the scan's own gated output."""
    from tests.kernels.test_gdn import fused_call, make_layer
    from dspark.ops.gdn import gdn_proj
    heads, dk, dv = 4, 32, 64
    layer = make_layer(rng, heads, dk, dv, 2)
    init = layer.fresh_state(rng)
    mixed, a, b = layer.stream(rng, 5)
    z = (rng.standard_normal((5, heads * dv)) * 3).astype(np.float32)
    proj, o_norm = gdn_proj(mixed, a, b, z), rng.standard_normal(dv).astype(np.float32)
    indptr = np.array([0, 5], np.int32)
    outs = []
    for norm in (None, o_norm):
        out = poison(np, (5, heads, dv), np.float32)
        fused_call(simt, layer, proj, [init[0].copy()], [init[1].copy()], indptr, o_norm=norm, out=out)
        outs.append(out)
    o, gated = outs
    np.testing.assert_array_equal(proj[:, layer.C : layer.C + heads * dv], z)   # the packed layout: z after mixed
    got = rmsnorm_gated(simt, o, proj, o_norm, 1e-6, column=layer.C)
    np.testing.assert_array_equal(got.view(np.uint32), gated.view(np.uint32))


def test_gated_norm_refuses_bad_input_and_leaves_out(simt, rng):
    o, proj, _ = gated_inputs(rng, 3, 2, 8, column=5, spare=0)   # proj [3, 21]
    w = np.ones(8, np.float32)
    out = poison(np, o.shape, np.float32)
    cases = [
        (ShapeError, r"x has shape \(6, 8\): expected 3 dims \[tokens, heads, n\]", dict(x=o.reshape(6, 8))),
        (ShapeError, r"gates has shape \(3, 21\): expected 3 rows holding 2 x 8 gates from column 6", dict(column=6)),
        (ShapeError, r"gates has shape \(2, 21\): expected 3 rows", dict(gates=proj[:2])),
        (DTypeError, "gates has dtype float64: expected float32", dict(gates=proj.astype(np.float64))),
        (ShapeError, r"weight has shape \(7,\): expected \(8,\)", dict(w=w[:7])),
        (ShapeError, r"out has shape \(3, 2, 8\): expected \(3, 1, 8\)", dict(x=o[:, :1].copy())),
    ]
    for err, msg, kw in cases:
        args = dict(x=o, gates=proj, w=w, column=5) | kw
        with pytest.raises(err, match=msg):
            rmsnorm_gated(simt, args["x"], args["gates"], args["w"], 1e-6, out=out, column=args["column"])
        assert np.isnan(out).all()
