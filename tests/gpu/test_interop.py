"""Arrays from any framework, without copies (dspark.arrays).

On the CPU backends every op gives bit-identical results for torch CPU tensors (DLPack) and
NumPy arrays, writes its outputs into the caller's tensors, and refuses an output whose array
interface is read-only. On the cuda backend (the CuPy contract stand-in here), ops take foreign
device arrays exposing __cuda_array_interface__ (Numba, torch) or DLPack, with no host->device
copy, and the session takes a device prompt. torch is in the test extra: these tests never skip.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dspark
from dspark import arrays, profile
from dspark.dtypes import BF16
from dspark.errors import DTypeError, KernelArgumentError
from dspark.ops.argmax import argmax_rows
from tests.gpu.op_cases import CASES, OPS, run_case


class HostArray:
    """A host array that exposes only __array_interface__ (any buffer-owning library)."""

    def __init__(self, a: np.ndarray, readonly: bool = False):
        self._a = a
        self.__array_interface__ = dict(a.__array_interface__, data=(a.__array_interface__["data"][0], readonly))


class DeviceArray:
    """A foreign device array that exposes only __cuda_array_interface__ (as Numba's do)."""

    def __init__(self, dev, readonly: bool = False):
        self._dev = dev
        iface = dict(dev.__cuda_array_interface__)
        iface["data"] = (iface["data"][0], readonly)
        self.__cuda_array_interface__ = iface


def torch_of(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


def host_of(x):
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def test_cases_cover_every_op():
    import dspark.ops as ops_pkg
    import importlib
    public = set()
    for mod in ("argmax", "linear", "attention", "kv_commit", "gdn", "snapshot", "sampling", "coupled", "norm",
                "activation", "rope", "heads"):
        m = importlib.import_module(f"{ops_pkg.__name__}.{mod}")
        public |= {n for n, f in vars(m).items() if callable(f) and getattr(f, "__module__", "") == m.__name__
                   and not n.startswith("_") and n + "_ref" in vars(m)}
    assert public <= OPS, f"ops without an interop case: {sorted(public - OPS)}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("backend", ["numpy", "simt"])
def test_torch_cpu_tensors_give_identical_results(case, backend, simt, rng):
    be = dspark.get_backend(backend)
    inputs = case.build(rng)
    want = run_case(case, be, inputs, lambda a: a, host_of)
    got = run_case(case, be, inputs, torch_of, host_of)
    assert len(got) == len(want) and got, case.name
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{case.name} on {backend}: result {i} ({w[0]} {w[1]}) differs for torch tensors"


@pytest.mark.parametrize("backend", ["numpy", "simt"])
def test_outputs_land_in_the_callers_tensor(backend, simt, rng):
    be = dspark.get_backend(backend)
    x = rng.standard_normal((4, 99)).astype(np.float32)
    out = torch.full((4,), -7, dtype=torch.int32)
    ret = argmax_rows(be, torch.from_numpy(x), out=out)
    assert np.shares_memory(ret, out.numpy())  # no copy: the op wrote the tensor itself
    np.testing.assert_array_equal(out.numpy(), x.argmax(axis=1))


@pytest.mark.parametrize("backend", ["numpy", "simt"])
def test_array_interface_objects_and_read_only_outputs(backend, simt, rng):
    be = dspark.get_backend(backend)
    x = rng.standard_normal((3, 40)).astype(np.float32)
    out = np.full(3, -7, np.int32)
    argmax_rows(be, HostArray(x), out=HostArray(out))
    np.testing.assert_array_equal(out, x.argmax(axis=1))
    with pytest.raises(KernelArgumentError, match="out is read-only"):
        argmax_rows(be, x, out=HostArray(np.zeros(3, np.int32), readonly=True))
    frozen = np.zeros(3, np.int32)
    frozen.flags.writeable = False  # NumPy's flag shows in its interface
    with pytest.raises(KernelArgumentError, match="out is read-only"):
        argmax_rows(be, x, out=frozen)
    assert not frozen.any()


def test_read_only_dlpack_export_is_refused_as_an_output():
    ro = np.zeros(3, np.int32)
    ro.flags.writeable = False
    assert arrays._dlpack_readonly(ro)  # NumPy exports the read-only bit in DLPack 1.x
    assert not arrays._dlpack_readonly(np.zeros(3, np.int32))


def test_device_arrays_are_refused_on_a_cpu_backend(rng):
    from dspark.backends import contract
    dev = contract.backend()
    with pytest.raises(DTypeError, match="logits is a .* in GPU memory: the numpy backend takes host arrays"):
        argmax_rows(dspark.get_backend("numpy"), dev.asarray(rng.standard_normal((2, 5)).astype(np.float32)))


def test_session_accepts_a_torch_prompt(rng):
    from dspark.models.presets import tiny_pair
    from dspark.session import DsparkSpecSession, SpecParams
    trunk, drafter = tiny_pair(dspark.get_backend("numpy"), 2)
    p = rng.integers(0, 256, 13).astype(np.int32)
    runs = []
    for prompt in (p, torch.from_numpy(p.copy()), HostArray(p.copy())):
        s = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=10))
        while not s.finished():
            s.burst()
        runs.append(s.emitted)
    assert runs[0] == runs[1] == runs[2]


# ---- cuda: foreign device arrays, on the contract stand-in --------------------------------------
@pytest.fixture(scope="module")
def dev():
    from dspark.backends import contract
    return contract.backend()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cuda_takes_foreign_device_arrays_without_copies(case, dev, rng):
    """Every op on the cuda backend with its arrays as foreign __cuda_array_interface__ objects:
    the same bytes as with CuPy arrays, and no more host->device copies."""
    inputs = case.build(rng)
    with profile.counting() as native:
        want = run_case(case, dev, inputs, dev.asarray, dev.to_host)
    with profile.counting() as foreign:
        got = run_case(case, dev, inputs, lambda a: DeviceArray(dev.asarray(a)),
                       lambda x: dev.to_host(x if not isinstance(x, DeviceArray) else x._dev))
    assert got == want, case.name
    assert foreign.h2d == native.h2d, f"{case.name}: a foreign array was copied ({foreign.h2d} vs {native.h2d})"


def test_cuda_refuses_a_read_only_device_output(dev, rng):
    x = dev.asarray(rng.standard_normal((3, 40)).astype(np.float32))
    with pytest.raises(KernelArgumentError, match="out is read-only"):
        argmax_rows(dev, x, out=DeviceArray(dev.xp.zeros(3, np.int32), readonly=True))
    out = DeviceArray(dev.xp.zeros(3, np.int32))
    argmax_rows(dev, DeviceArray(x), out=out)
    np.testing.assert_array_equal(dev.to_host(out._dev), dev.to_host(x).argmax(axis=1))


def test_cuda_session_takes_a_device_prompt(dev, rng):
    from dspark.models.presets import tiny_pair
    from dspark.session import DsparkSpecSession, SpecParams
    trunk, drafter = tiny_pair(dev, 4)
    p = rng.integers(0, 256, 9).astype(np.int32)
    a = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=6))
    b = DsparkSpecSession.prime(trunk, drafter, DeviceArray(dev.asarray(p)), SpecParams(max_new_tokens=6))
    for s in (a, b):
        while not s.finished():
            s.burst()
    assert a.emitted == b.emitted


# ---- dtypes that an array interface cannot name: bfloat16 through DLPack, "<V2" by producer --------------
def bf16_logits(rng, rows=4, vocab=300) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32)).to(torch.bfloat16)


def widened(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["numpy", "simt"])
def test_torch_16_bit_tensors_keep_their_dtype_on_the_host(backend, dtype, simt, rng):
    """A torch bf16 CPU tensor comes through DLPack (NumPy alone cannot import it) as bfloat16,
    sharing its memory; f16 as float16. The op then reads what the tensor holds."""
    be = dspark.get_backend(backend)
    t = bf16_logits(rng).to(dtype)
    a = arrays.as_array(be, t, "logits")
    assert a.dtype == {torch.bfloat16: BF16, torch.float16: np.float16}[dtype]
    assert a.__array_interface__["data"][0] == t.data_ptr(), "a copy was made"
    np.testing.assert_array_equal(a.astype(np.float32), widened(t))
    np.testing.assert_array_equal(argmax_rows(be, t), widened(t).argmax(axis=1))
    strided = t[:, ::3]  # DLPack strides are in elements: read as bytes here
    np.testing.assert_array_equal(arrays.as_array(be, strided, "x").astype(np.float32), widened(strided))


class TorchOnDevice:
    """A torch tensor as a CUDA build exports it: DLPack on a CUDA device and a
    __cuda_array_interface__ whose typestr for bfloat16 is "<V2" (torch/_tensor.py). The stand-in's
    device memory is host memory, so a CPU tensor stands for it."""

    def __init__(self, t: torch.Tensor, dlpack: bool = True):
        self._t = t
        if dlpack:
            self.__dlpack__ = t.__dlpack__
            self.__dlpack_device__ = lambda: (2, 0)
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": "<V2" if t.dtype == torch.bfloat16 else "<f4",
            "strides": None, "data": (t.data_ptr(), False), "version": 2}


TorchOnDevice.__module__ = "torch"  # what type(tensor).__module__ says for a real tensor


class ForeignV2(TorchOnDevice):
    """The same interface from a library not known to mean bfloat16 by "<V2"."""


ForeignV2.__module__ = "somelib.arrays"


def test_cuda_takes_bf16_by_dlpack_and_v2_only_from_known_producers(dev, rng):
    t = bf16_logits(rng)
    want = widened(t).argmax(axis=1)
    for obj in (TorchOnDevice(t), TorchOnDevice(t, dlpack=False)):  # DLPack first; else "<V2" from torch
        a = arrays.as_array(dev, obj, "logits")
        assert a.dtype == BF16 and a.data.ptr == t.data_ptr()
        np.testing.assert_array_equal(dev.to_host(argmax_rows(dev, obj)), want)
    with pytest.raises(DTypeError, match=r"logits is a somelib\.arrays\.ForeignV2 whose array interface says "
                                         r"typestr '<V2'.*DLPack"):
        argmax_rows(dev, ForeignV2(t, dlpack=False))
    assert arrays.as_array(dev, ForeignV2(t), "logits").dtype == BF16  # its DLPack names the type


def test_host_v2_interface_from_an_unknown_producer_is_refused(rng):
    x = bf16_logits(rng).view(torch.int16).numpy()

    class Foreign:
        __array_interface__ = dict(x.__array_interface__, typestr="<V2", descr=[("", "<V2")])
    with pytest.raises(DTypeError, match="logits is a .*Foreign whose array interface says typestr '<V2'"):
        argmax_rows(dspark.get_backend("numpy"), Foreign())
