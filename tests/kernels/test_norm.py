"""rmsnorm: the kernel (simt, and cuda on the CuPy contract stand-in) against its NumPy twin
bitwise, within tolerance of the numpy backend's formula, and row-invariant.

The hazard it removes: an array library's reduction over an axis (CuPy's mean) picks its block
layout, and so a row's summation order, from the whole array's shape, so a row's norm could change
with the number of rows in the call. The kernel's order depends on n alone."""

import numpy as np
import pytest

from dspark.backends import contract
from dspark.errors import DTypeError, ShapeError
from dspark.ops.norm import rmsnorm, rmsnorm_numpy, rmsnorm_ref
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
