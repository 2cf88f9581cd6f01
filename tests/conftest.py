"""Shared fixtures: backends, fresh random inputs, and output poisoning."""

from __future__ import annotations

import os

import numpy as np
import pytest

import dspark
from dspark.backends import cuda_available

NO_GPU = "no CUDA device (CuPy with a working GPU) on this machine"


def pytest_collection_modifyitems(config, items):
    """bf16 cases on cuda skip, with the reason, where this CuPy has no bfloat16 arrays (CuPy 13):
    the capability is asked of CuPy itself (dspark.dtypes.dtype_supported)."""
    if not cuda_available():
        return  # every cuda case skips (or fails under DSPARK_REQUIRE_CUDA) at its fixture anyway
    import cupy

    from dspark.dtypes import dtype_supported
    from dspark.dtypes import BF16
    if dtype_supported(cupy, BF16):
        return
    skip = pytest.mark.skip(reason=f"CuPy {cupy.__version__} has no bfloat16 arrays")

    def is_bf16(v):
        if isinstance(v, (tuple, list)):
            return any(is_bf16(x) for x in v)
        try:
            return np.dtype(v) == BF16
        except TypeError:
            return False
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        on_cuda = "cuda" in item.fixturenames or any(v == "cuda" for v in params.values() if isinstance(v, str))
        if on_cuda and any(is_bf16(v) for v in params.values()):
            item.add_marker(skip)


SHARED_BACKENDS = []  # the session's backends, each with its process-wide cost model (dspark.cost)


@pytest.fixture(scope="session")
def simt():
    if "simt" not in dspark.backends():
        if os.environ.get("CI") == "true":
            pytest.fail("the simt backend must be built in CI")
        pytest.skip("dspark._simt is not built")
    SHARED_BACKENDS.append(dspark.get_backend("simt"))
    return SHARED_BACKENDS[-1]


@pytest.fixture(scope="session")
def numpy_backend():
    SHARED_BACKENDS.append(dspark.get_backend("numpy"))
    return SHARED_BACKENDS[-1]


@pytest.fixture(autouse=True)
def experts_stay_with_their_test():
    """A shared backend's cost model that timed a MoE trunk's passes learned its experts, and would
    price the next test's dense pair with them (one cost model per backend, as in a process serving
    one pair): it is dropped after the test."""
    yield
    for be in SHARED_BACKENDS:
        if be.cost is not None and be.cost.routing[1]:
            be.cost = None


@pytest.fixture(scope="session")
def cuda():
    if not cuda_available():
        if os.environ.get("DSPARK_REQUIRE_CUDA") == "1":  # the GPU check: a skip would hide a failure
            pytest.fail("DSPARK_REQUIRE_CUDA=1 but no CUDA device works")
        pytest.skip(NO_GPU)
    return dspark.get_backend("cuda")


@pytest.fixture(params=["simt", "cuda"])
def kernel_backend(request):
    """Every backend that executes the csrc/ kernels: simt always, cuda when a GPU works."""
    return request.getfixturevalue(request.param)


@pytest.fixture(params=["numpy", "simt", "cuda"])
def any_backend(request):
    """All three backends: the NumPy reference and both kernel executors."""
    name = {"numpy": "numpy_backend"}.get(request.param, request.param)
    return request.getfixturevalue(name)


@pytest.fixture
def rng(request):
    """Fresh random inputs per test, reproducible from the printed seed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"rng seed {seed} for {request.node.name}")
    return np.random.default_rng(seed)


def poison(xp, shape, dtype):
    """An output buffer whose unwritten elements show: NaN for floats, 0xA5A5.. for ints."""
    dtype = np.dtype(dtype)
    a = xp.empty(shape, dtype=dtype)
    if dtype.kind == "f" or dtype.name == "bfloat16":
        a[...] = np.nan
    else:
        a.view(np.uint8)[...] = 0xA5
    return a
