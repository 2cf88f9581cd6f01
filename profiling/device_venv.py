"""The GPU check's dry run as the GPU machine would start it: a copy of the working tree without
build outputs (no dspark._simt), in a fresh venv of this Python holding the GPU image's packages
(profiling/gpu_image.toml) at their listed versions where the package index has them for this
Python, and the carried wheels' packages, with no host C++ compiler on PATH. `.ci/run` runs it.

    python profiling/device_venv.py [--venv DIR] [--out DIR]

Which image packages: those the check imports (gpu_check's import analysis: every third-party
import of the scripts and test files it runs, imports inside functions included) and those it
loads without importing (NVRTC, cuda-pathfinder), with their own dependencies. No torch: nothing
the check runs imports it. A listed version the index lacks for this Python is replaced by the
newest one it has, and printed. Then: profiling/gpu_wheels.sh fetches the wheels to carry (for the
image's Python 3.12) where profiling/wheels has none, and `bash profiling/gpu_check.sh --dry-run`
must pass to the end: its `wheels` step checks their tags and that every package to carry has one,
its `imports` step that every import is in the image or carried.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402  (standard library only, like this script)

ROOT = gpu_check.ROOT
LOADED_NOT_IMPORTED = ("nvidia-cuda-nvrtc", "cuda-pathfinder")  # NVRTC through ctypes, found by cuda-pathfinder
COMPILERS = re.compile(r"^(?:.*-)?(?:gcc|g\+\+|cc|c\+\+|cpp|clang|clang\+\+|icx|icpx|nvcc|ld|ld\.\w+)(?:-[\d.]+)?$")


def sh(cmd, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(list(map(str, cmd)), **kw)


def packages(py: str) -> list[str]:
    """The image's distributions the check needs, name==version where the image's is listed."""
    spec = gpu_check.image()
    lines, _ = gpu_check.import_problems(gpu_check.plan_for_imports(ROOT, py), spec)
    names = {line.split()[1] for line in lines if line.split()[2] == "image"} | set(LOADED_NOT_IMPORTED)
    versions = {k.lower(): v for k, v in spec["packages"].items()}
    return sorted(f"{n}=={versions[n]}" if versions.get(n) else n for n in names)


def resolve(pip: list[str], wanted: list[str]) -> tuple[list[str], list[str]]:
    """(installable specs, substitutions): a pinned version the index lacks for this Python gives
    way to the newest it has."""
    specs, notes = [], []
    for want in wanted:
        probe = sh([*pip, "install", "--dry-run", "--no-deps", "--only-binary=:all:", "-q", want],
                   capture_output=True, text=True)
        if probe.returncode == 0 or "==" not in want:
            specs.append(want)
            continue
        name = want.split("==")[0]
        specs.append(name)
        notes.append(f"{want}: not on the index for Python {sys.version_info.major}.{sys.version_info.minor}; "
                     f"the newest there instead")
    return specs, notes


def no_compiler_path(bin_dir: Path, venv_bin: Path) -> str:
    """A PATH of the venv and every executable of this PATH except compilers and linkers."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for f in os.listdir(d):
            src, dst = Path(d) / f, bin_dir / f
            if COMPILERS.match(f) or dst.exists() or not (src.is_file() and os.access(src, os.X_OK)):
                continue
            dst.symlink_to(src)
    return os.pathsep.join([str(venv_bin), str(bin_dir)])


def copy_tree(dst: Path) -> None:
    """The working tree as it reaches the GPU machine: tracked and untracked files git does not
    ignore (no build outputs, no dspark._simt), plus the carried wheels."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    if gpu_check.WHEELS.is_dir():
        shutil.copytree(gpu_check.WHEELS, dst / "profiling" / "wheels", dirs_exist_ok=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, help="where to build the venv (default: a temporary folder)")
    ap.add_argument("--out", type=Path, help="where the dry run's report goes (default: a temporary folder)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="device_venv_"))
    venv = a.venv or work / "venv"
    out = a.out or work / "report"
    if not (venv / "bin" / "python").exists():
        sh([sys.executable, "-m", "venv", venv], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip"]
    sh([*pip, "install", "-q", "--upgrade", "pip"], check=True)
    wanted = packages(py)
    specs, notes = resolve(pip, wanted)
    carry = gpu_check.image()["carry"]
    sh([*pip, "install", "-q", *specs, *carry], check=True)  # the carried packages: this Python's build
    if not list(gpu_check.WHEELS.glob("*.whl")):
        sh(["bash", ROOT / "profiling" / "gpu_wheels.sh"], check=True, env=dict(os.environ, PYTHON=sys.executable))
    tree = work / "tree"
    copy_tree(tree)
    path = no_compiler_path(work / "bin", venv / "bin")
    # as on the GPU machine: no build outputs, no compiler, and not CI (whose rule that every part of
    # dspark is built would refuse the tree the machine has)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CXX", "CC", "CPP", "VIRTUAL_ENV", "CI")}
    env.update(PATH=path, PYTHON=py, VIRTUAL_ENV=str(venv))
    found = [c for c in ("g++", "gcc", "c++", "cc", "cpp", "clang", "nvcc") if shutil.which(c, path=path)]
    if found:
        raise SystemExit(f"a compiler is still on the venv's PATH: {found}")
    print(f"image packages for the check ({len(wanted)}): {' '.join(wanted)}")
    installed = sh([*pip, "list", "--format=freeze"], capture_output=True, text=True).stdout.lower()
    names = {w.split("==")[0].lower() for w in wanted} | {c.lower() for c in carry}
    print("installed: " + " ".join(line for line in installed.split() if line.split("==")[0] in names))
    for n in notes:
        print(f"substituted: {n}")
    r = sh(["bash", "profiling/gpu_check.sh", "--dry-run", out], cwd=tree, env=env)
    report = (out / "gpu_report.md").read_text() if (out / "gpu_report.md").is_file() else ""
    print("\n".join(line for line in report.splitlines() if line.startswith(("## ", "Total", "step limits"))))
    print(f"device venv dry run: {'OK' if r.returncode == 0 else 'FAILED'} in {time.monotonic() - t0:.0f}s "
          f"(report {out / 'gpu_report.md'})")
    if r.returncode == 0:  # keep what was asked for, and everything when it failed
        for made, asked in ((tree, None), (venv, a.venv), (out, a.out)):
            if asked is None:
                shutil.rmtree(made, ignore_errors=True)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
