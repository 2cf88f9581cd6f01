"""Every csrc/*.cu compiles with nvcc and NVRTC for sm_80 and sm_90, with no spills, and every
extern "C" entry point comes out of both compilers under its own name."""

import os

import pytest

from dspark.kernel_sources import kernel_files, load_json
from dspark.toolchain import ARCHS, Nvrtc, nvcc, nvcc_cubin, parse_ptxas

IN_CI = os.environ.get("CI") == "true"
FILES = kernel_files()


def require(found, what):
    if not found:
        if IN_CI:
            pytest.fail(f"{what} is required in CI")
        pytest.skip(f"{what} is not installed here")


@pytest.fixture(scope="module")
def nvrtc():
    try:
        return Nvrtc()
    except OSError as e:
        require(False, f"NVRTC ({e})")


def entries_of(path):
    return {n for n, s in load_json().items() if s.source == path.name}


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
    cubin, log = nvrtc.compile(path, arch)
    assert cubin[:4] == b"\x7fELF"
    check_report(parse_ptxas(log), path, arch)


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
    missing = [n for n in load_json() if f"`{n}`" not in report]
    assert not missing, f"rerun python profiling/ptxas_report.py: {missing} not in the report"
