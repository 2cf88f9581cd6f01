"""Kernel signatures are read from csrc/ by dspark's own preprocessor (dspark.kernel_sources), so
the `cuda` path needs no host compiler: the signatures equal what a host compiler's `-E` yields,
for every family, and the cuda backend loads and runs through the CuPy contract stand-in with no
compiler on PATH and no simt signature table."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark import kernel_sources as ks
from dspark.kernel_sources import NVRTC_DEFINES, PreprocessorError, Preprocessor, kernel_files

ROOT = Path(__file__).resolve().parents[2]
FILES = kernel_files()
HOST_CXX = shutil.which("g++") or shutil.which("c++")


def host_signatures(path: Path) -> list[ks.Signature]:
    """What the host compiler's preprocessor yields, parsed the same way."""
    if not HOST_CXX:
        if os.environ.get("CI") == "true":
            pytest.fail("a host C++ compiler is required in CI (it builds dspark._simt)")
        pytest.skip("no host C++ compiler here to compare with")
    defines = [f"-D{k}={v}" for k, v in NVRTC_DEFINES.items()]
    text = subprocess.run([HOST_CXX, "-E", "-P", "-x", "c++", *defines, "-I", str(path.parent), str(path)],
                          check=True, capture_output=True, text=True).stdout
    return ks.signatures_in(text, path.name)


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_signatures_equal_the_host_preprocessors(path):
    ours = ks.parse_signatures(path)
    assert ours, f"{path.name}: no entry point found"
    assert ours == host_signatures(path)


def expand(tmp_path, text: str, **defines) -> str:
    src = tmp_path / "k.cu"
    src.write_text(text)
    return " ".join(Preprocessor({**NVRTC_DEFINES, **defines}, (tmp_path,)).run(src).split())


def test_the_preprocessor_on_what_csrc_uses(tmp_path):
    (tmp_path / "h.cuh").write_text("#pragma once\n#define TWICE(x) x x\nint from_header;\n")
    text = r'''
#include "h.cuh"
#include "h.cuh"
#include <stdint.h>
#define CAT(a, b) a##b
#define STR(a) #a
#define ENTRY(SUF, T) void k_##SUF(const T* p, \
                                 int n) { }
#define SELF SELF + 1
#define VA(fmt, ...) f(fmt, __VA_ARGS__)
#if defined(DSPARK_SIMT)
int simt_only;
#elif defined(__CUDACC_RTC__) && LEVEL >= 2
int rtc_level2;
#else
int other;
#endif
/* a comment ENTRY(x, y) */ ENTRY(f16, f16_t) // ENTRY(no, no)
CAT(ab, cd) STR(a + b) TWICE(z) SELF VA(1, 2, 3)
#ifndef LEVEL
int no_level;
#endif
'''
    out = expand(tmp_path, text, LEVEL="2")
    assert out == ('int from_header ; int rtc_level2 ; void k_f16 ( const f16_t * p , int n ) { } '
                   'abcd "a + b" z z SELF + 1 f ( 1 , 2 , 3 )'), out
    assert "int other ;" in expand(tmp_path, text, LEVEL="1") and "no_level" not in expand(tmp_path, text, LEVEL="1")


def test_preprocessor_errors_name_the_place(tmp_path):
    with pytest.raises(PreprocessorError, match="k.cu:1: #include \"nope.cuh\" not found"):
        expand(tmp_path, '#include "nope.cuh"\n')
    with pytest.raises(PreprocessorError, match="k.cu:2: #error stop"):
        expand(tmp_path, "#if 1\n#error stop\n#endif\n")
    with pytest.raises(PreprocessorError, match="#if without #endif"):
        expand(tmp_path, "#if 1\nint x;\n")
    with pytest.raises(PreprocessorError, match="macro F takes 2 arguments, got 1"):
        expand(tmp_path, "#define F(a, b) a b\nF(1)\n")
    with pytest.raises(PreprocessorError, match="k.cu:1: #embed is not a directive"):
        expand(tmp_path, "#embed \"x.bin\"\n")


def test_the_cuda_path_runs_with_no_host_compiler(tmp_path):
    """A checkout of the package without dspark/_kernels.json (the simt build's table), a fresh
    cache (no signatures kept from an earlier run) and a PATH with no compiler on it: the cuda
    backend (on the CuPy stand-in) reads the signatures from the sources, loads its cubins and
    runs an op. The cubins come from the usual cache: NVRTC is not what is under test here."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "dspark", tree / "dspark",
                    ignore=shutil.ignore_patterns("_kernels.json", "__pycache__", "_csrc", "train"))
    shutil.copytree(ROOT / "csrc", tree / "csrc", ignore=shutil.ignore_patterns("bindings", "simt"))
    (tree / "dspark" / "train").mkdir()
    (tree / "dspark" / "train" / "__init__.py").write_text("")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "cubin").symlink_to(ks.cache_dir() / "cubin", target_is_directory=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = (
        "import shutil, numpy as np\n"
        "assert not any(shutil.which(c) for c in ('g++', 'c++', 'gcc', 'cc', 'cpp', 'clang')), 'a compiler on PATH'\n"
        "from dspark.backends import contract\n"
        "from dspark.ops.argmax import argmax_rows\n"
        "be = contract.backend()\n"
        "x = np.random.default_rng(1).standard_normal((4, 500)).astype(np.float32)\n"
        "assert (be.to_host(argmax_rows(be, be.asarray(x))) == x.argmax(axis=1)).all()\n"
        "print('ok', len(be.kernels.signatures))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC", "CPP")}
    env.update(PATH=str(bin_dir), PYTHONPATH=str(tree), DSPARK_CACHE=str(cache))
    r = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stdout + r.stderr
    assert not (tree / "dspark" / "_kernels.json").exists()

