"""Every csrc/*.cu compiles with nvcc and NVRTC (12 and 13) for sm_80 and sm_90, with dspark's
options and no spills, and every extern "C" entry point comes out of every compiler under its own
name. The NVRTC cubin is the one binary: the one the cuda backend loads and
profiling/ptxas_report.md describes; the cubins of both NVRTC majors load through the CuPy
contract stand-in."""

import os
import sys
from pathlib import Path

import pytest

from dspark.kernel_sources import includes, kernel_files, scan
from dspark.toolchain import (ARCHS, NVCC_FLAGS, NVRTC_OPTIONS, cubin_key, family_cubin, find_nvrtc, nvcc, nvcc_cubin,
                              parse_ptxas)
from tests.scripts import load_script

IN_CI = os.environ.get("CI") == "true"
FILES = kernel_files()
SIGNATURES = scan()
NVRTC_MAJORS = (12, 13)  # the test extra installs both wheels: CUDA 12's and the device image's 13


def require(found, what):
    if not found:
        if IN_CI:
            pytest.fail(f"{what} is required in CI")
        pytest.skip(f"{what} is not installed here")


@pytest.fixture(scope="module", params=NVRTC_MAJORS, ids=[f"nvrtc{m}" for m in NVRTC_MAJORS])
def nvrtc(request):
    try:
        return find_nvrtc(request.param)
    except OSError as e:
        require(False, f"NVRTC {request.param} ({e})")


def entries_of(path):
    return {n for n, s in SIGNATURES.items() if s.source == path.name}


def check_report(report, path, arch):
    missing = entries_of(path) - set(report)
    assert not missing, f"{path.name} ({arch}): no ptxas entry for {sorted(missing)}"
    spills = {n: (r.spill_stores, r.spill_loads) for n, r in report.items() if r.spill_stores or r.spill_loads}
    assert not spills, f"{path.name} ({arch}) spills: {spills}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_nvcc_compiles_without_spills(path, arch):
    require(nvcc(), "nvcc")
    check_report(nvcc_cubin(path, arch), path, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_nvrtc_compiles_without_spills(nvrtc, path, arch):
    cubin = family_cubin(path, arch, nvrtc)
    assert cubin.read()[:4] == b"\x7fELF" and cubin.nvrtc_version == nvrtc.version
    check_report(cubin.resources(), path, arch)
    assert f".target {arch}" in cubin.ptx(), "the PTX kept beside the cubin is the one it was assembled from"


def test_cubins_load_through_the_contract_stand_in(nvrtc):
    """Every family's cubin of this NVRTC major loads by path through the stand-in's RawModule and
    yields every entry point by name; an op then runs on it."""
    from dspark.backends import contract
    from dspark.ops.argmax import argmax_rows
    import numpy as np
    be = contract.backend("sm_90", nvrtc=nvrtc)
    lines = load_script("load_cubins").load_all(be.kernels)
    assert len(lines) == len(FILES)
    assert {c.nvrtc_version for c in be.kernels.cubins.values()} == {nvrtc.version}
    x = np.random.default_rng(0).standard_normal((3, 300)).astype(np.float32)
    got = be.to_host(argmax_rows(be, be.asarray(x)))
    np.testing.assert_array_equal(got, x.argmax(axis=1))


def test_floating_point_policy_is_one_for_every_compiler():
    """No contraction, no flush to zero, IEEE division and sqrt: NVRTC and nvcc alike."""
    for flag in ("-fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true"):
        assert flag in NVRTC_OPTIONS and f"-{flag}" in NVCC_FLAGS


def test_fmad_false_keeps_multiply_and_add_apart(nvrtc, tmp_path):
    """What the policy buys: a * b + c stays two roundings (mul.rn and add.rn, which ptxas may not
    fuse); fmaf() stays one fma.rn. With -fmad=true the same source contracts."""
    src = tmp_path / "contract.cu"
    src.write_text('extern "C" __global__ void k(const float* a, float* o) { o[0] = a[0] * a[1] + a[2]; }\n'
                   'extern "C" __global__ void f(const float* a, float* o) { o[0] = fmaf(a[0], a[1], a[2]); }\n')

    def body(options, kernel):
        ptx = nvrtc.compile(src, "compute_90", options, ptx=True)[0].decode(errors="replace")
        return ptx.split(f".entry {kernel}(")[1].split(".entry")[0]
    k, f = body(NVRTC_OPTIONS, "k"), body(NVRTC_OPTIONS, "f")
    assert "mul.rn.f32" in k and "add.rn.f32" in k and "fma" not in k, k
    assert "fma.rn.f32" in f, f
    contracted = body(tuple(o for o in NVRTC_OPTIONS if o != "-fmad=false"), "k")
    assert "fma.rn.f32" in contracted, "the default (-fmad=true) would have fused it"


def test_cubin_key_covers_every_included_header(tmp_path):
    """Editing a header a family includes changes its key (CuPy's own cache would not notice)."""
    import shutil
    root = tmp_path / "csrc"
    shutil.copytree(FILES[0].parent, root, ignore=shutil.ignore_patterns("simt", "bindings"))
    src = root / "argmax.cu"
    deep = [h for h in includes(src) if h.name == "common.cuh"]
    assert deep, "argmax.cu reaches common.cuh (through rowsplit.cuh too)"
    before = cubin_key(src, "sm_90", (12, 9))
    deep[0].write_text(deep[0].read_text() + "\n// edited\n")
    assert cubin_key(src, "sm_90", (12, 9)) != before
    assert cubin_key(src, "sm_90", (12, 8)) != cubin_key(src, "sm_90", (12, 9))
    assert cubin_key(src, "sm_80", (12, 9)) != cubin_key(src, "sm_90", (12, 9))


def test_the_report_and_the_runtime_load_the_same_cubin_bytes(tmp_path, monkeypatch):
    """The cuda backend (on the CuPy contract stand-in, sm_90) loads each family's cubin with
    RawModule(path=...); profiling/ptxas_report.py reads the same file. A fresh compile in an
    empty cache gives the same bytes again, so the cache hides nothing."""
    from dspark.backends import contract
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "profiling"))
    import ptxas_report
    be = contract.backend(arch="sm_90")
    for path in FILES:
        be.kernels.module(path.name)
        loaded = be.xp.loaded[str(be.kernels.cubins[path.name].path)]
        described = {c.arch: c for c in ptxas_report.cubins(path)}["sm_90"]
        assert described.read() == loaded, path.name
        assert set(described.resources()) == entries_of(path)
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    fresh = family_cubin(FILES[0], "sm_90")
    assert fresh.path.parent == tmp_path / "cubin"
    assert fresh.read() == be.xp.loaded[str(be.kernels.cubins[FILES[0].name].path)]


def test_ptxas_parser():
    log = """ptxas info    : Compiling entry function 'k_f32' for 'sm_90'
ptxas info    : Function properties for k_f32
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 512 bytes smem, 380 bytes cmem[0]"""
    r = parse_ptxas(log)["k_f32"]
    assert (r.registers, r.smem, r.stack, r.spill_stores, r.spill_loads) == (40, 512, 8, 4, 4)


def test_ptxas_report_lists_every_kernel():
    """profiling/ptxas_report.md is regenerated whenever an entry point is added."""
    from pathlib import Path
    report = (Path(__file__).resolve().parents[2] / "profiling" / "ptxas_report.md").read_text()
    missing = [n for n in SIGNATURES if report.count(f"`{n}`") < len(NVRTC_MAJORS)]
    assert not missing, f"rerun python profiling/ptxas_report.py: {missing} not in the report"
