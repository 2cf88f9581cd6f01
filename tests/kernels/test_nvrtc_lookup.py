"""NVRTC is found wherever CuPy would find it (dspark.toolchain.nvrtc_places): here, only on the
dynamic loader's path, in a Python that sees no pip wheel, no toolkit variable and no
cuda-pathfinder; and when it is nowhere, the error names every place looked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark.toolchain import find_nvrtc, nvrtc_libraries

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = ("DSPARK_NVRTC", "CUDA_HOME", "CUDA_PATH", "CONDA_PREFIX", "LD_LIBRARY_PATH", "PYTHONPATH")


def bare_python(tmp_path: Path, program: str, **env) -> subprocess.CompletedProcess:
    """`program` in a Python without its site directory (so no nvidia-* wheel and no
    cuda-pathfinder on sys.path): the repository, NumPy and ml_dtypes (which `import dspark` needs) only."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    packages = Path(np.__file__).parent.parent
    for name in ("numpy", "numpy.libs", "ml_dtypes"):
        if (packages / name).exists() and not (site / name).exists():
            (site / name).symlink_to(packages / name)
    clean = {k: v for k, v in os.environ.items() if k not in HIDDEN}
    clean.update(PYTHONPATH=f"{ROOT}{os.pathsep}{site}", **env)
    return subprocess.run([sys.executable, "-S", "-c", program], cwd=tmp_path, env=clean, capture_output=True,
                          text=True, timeout=120)


def test_nvrtc_only_on_the_loader_path_is_found_and_compiles(tmp_path):
    lib = find_nvrtc()
    loader_dir = tmp_path / "lib"
    loader_dir.mkdir()
    real = Path(lib.path).resolve()
    for f in real.parent.iterdir():  # libnvrtc.so.N and the builtins library it loads beside it
        if f.name.startswith(("libnvrtc.so", "libnvrtc-builtins")):
            (loader_dir / f.name).symlink_to(f)
    program = (
        "import sys\n"
        "from pathlib import Path\n"
        "from dspark.toolchain import find_nvrtc, nvrtc_places\n"
        "assert not any('site-packages' in p for p in sys.path), sys.path\n"
        "nv = find_nvrtc()\n"
        f"cubin, log = nv.compile(Path({str(ROOT / 'csrc' / 'norm.cu')!r}), 'sm_90')\n"
        "assert cubin[:4] == b'\\x7fELF'\n"
        "print(nv.where, nv.version)\n")
    r = bare_python(tmp_path, program, LD_LIBRARY_PATH=str(loader_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("the dynamic loader") and str(lib.version) in r.stdout, r.stdout


def test_no_nvrtc_anywhere_names_every_place_looked(tmp_path):
    r = bare_python(tmp_path, "from dspark.toolchain import find_nvrtc\nfind_nvrtc()\n")
    assert r.returncode != 0
    err = r.stderr.splitlines()[-1] if "Looked in" not in r.stderr else r.stderr
    for place in ("$DSPARK_NVRTC: unset", "pip wheels", "conda $CONDA_PREFIX: unset", "$CUDA_HOME: unset",
                  "$CUDA_PATH: unset", "/usr/local/cuda", "the dynamic loader (LD_LIBRARY_PATH=unset",
                  "cuda-pathfinder: not installed", "Install nvidia-cuda-nvrtc"):
        assert place in err, f"{place!r} not named:\n{err}"


def test_each_major_is_found_and_the_choice_follows_cupy(monkeypatch):
    found = nvrtc_libraries()
    if os.environ.get("CI") == "true":
        assert {12, 13} <= set(found), "the test extra installs NVRTC 12 and 13"
    for major, nv in found.items():
        assert find_nvrtc(major).version == nv.version
    monkeypatch.setattr("dspark.toolchain._major_of_cupy", lambda: 13)
    if 13 in found:
        assert find_nvrtc().version[0] == 13  # the device image's CuPy is cupy-cuda13x
    monkeypatch.setenv("DSPARK_NVRTC", str(tmp := Path(found[min(found)].path)))
    assert find_nvrtc().path == str(tmp) and find_nvrtc().where == "$DSPARK_NVRTC"
    monkeypatch.setenv("DSPARK_NVRTC", "/nonexistent/libnvrtc.so")
    with pytest.raises(OSError, match="DSPARK_NVRTC=/nonexistent/libnvrtc.so does not load"):
        find_nvrtc()
