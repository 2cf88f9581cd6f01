"""The kernel sources in csrc/ and the signatures of their extern "C" entry points.

Standard library only: setup.py loads this file by path to generate the simt registration units
and `dspark/_kernels.json` before the package exists. Entry points may be stamped out by macros
(one per dtype), so signatures are read from the preprocessed source, not the raw text.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SIGNATURES_JSON = PACKAGE_DIR / "_kernels.json"


def csrc_dir() -> Path:
    """The kernel sources: shipped inside the package, or beside it in a source checkout."""
    for d in (PACKAGE_DIR / "_csrc", PACKAGE_DIR.parent / "csrc"):
        if (d / "common.cuh").is_file():
            return d
    raise FileNotFoundError("dspark kernel sources (csrc/) not found next to the package")


def cache_dir() -> Path:
    """Where builds are cached (simt modules, cubins): $DSPARK_CACHE or ~/.cache/dspark."""
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def includes(source: Path) -> list[Path]:
    """Every header `source` reaches through #include "..." (transitively, whatever the #if
    around it), sorted: what a build of it depends on besides itself."""
    seen: dict[Path, None] = {}
    todo = [source]
    while todo:
        f = todo.pop()
        for name in _INCLUDE.findall(f.read_text()):
            dep = (f.parent / name).resolve()
            if not dep.is_file():
                dep = (source.parent / name).resolve()
            if dep.is_file() and dep not in seen and dep != source.resolve():
                seen[dep] = None
                todo.append(dep)
    return sorted(seen)


def kernel_files(root: Path | None = None) -> list[Path]:
    """Every kernel family source, `csrc/*.cu`, sorted."""
    return sorted((root or csrc_dir()).glob("*.cu"))


# C parameter type (after dropping const/__restrict__) -> (kind, NumPy dtype code or pointee size)
SCALAR_CODES = {
    "int": "<i4", "int32_t": "<i4", "unsigned": "<u4", "unsigned int": "<u4", "uint32_t": "<u4",
    "long long": "<i8", "int64_t": "<i8", "unsigned long long": "<u8", "uint64_t": "<u8",
    "float": "<f4", "double": "<f8",
}
POINTEE_SIZES = {
    "void": 0, "float": 4, "double": 8, "int": 4, "int32_t": 4, "unsigned": 4, "unsigned int": 4,
    "uint32_t": 4, "long long": 8, "int64_t": 8, "unsigned long long": 8, "uint64_t": 8,
    "short": 2, "int16_t": 2, "uint16_t": 2, "unsigned short": 2, "f16_t": 2, "bf16_t": 2,
    "char": 1, "int8_t": 1, "uint8_t": 1, "unsigned char": 1,
}


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str       # as written, normalised: "const float*", "int"
    code: str        # "ptr" or a NumPy dtype string such as "<i4"
    elem: int        # pointee size for pointers (0 = any), scalar size otherwise
    is_const: bool   # pointers: pointee is const


@dataclass(frozen=True)
class Signature:
    name: str
    source: str      # file name in csrc/
    params: tuple[Param, ...]


_ENTRY = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)', re.S)


def parse_param(text: str) -> Param:
    text = " ".join(text.replace("__restrict__", " ").split())
    m = re.match(r"^(.*?)(\w+)$", text)
    if not m:
        raise ValueError(f"cannot parse kernel parameter {text!r}")
    ctype, name = m.group(1).strip(), m.group(2)
    stars = ctype.count("*")
    # For pointers what matters is the pointee's const: "const float*", "const float* const".
    is_const = "const" in ctype.split("*")[0].split() if stars else True
    base = " ".join(w for w in ctype.replace("*", " ").split() if w != "const")
    if stars >= 2:
        return Param(name, ctype, "ptr", 8, is_const)  # pointer table: 8-byte addresses
    if stars == 1:
        if base not in POINTEE_SIZES:
            raise ValueError(f"kernel parameter {name}: unknown pointee type {base!r}")
        return Param(name, ctype, "ptr", POINTEE_SIZES[base], is_const)
    if base not in SCALAR_CODES:
        raise ValueError(f"kernel parameter {name}: unsupported scalar type {base!r}")
    return Param(name, ctype, SCALAR_CODES[base], int(SCALAR_CODES[base][-1]), True)


def preprocess(path: Path, compiler: str | None = None) -> str:
    """The source as NVRTC would see it (no simt prelude), so `__global__` survives."""
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "cpp"
    cmd = [cxx, "-E", "-P", "-x", "c++", "-D__CUDACC_RTC__", "-I", str(path.parent), str(path)]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def parse_signatures(path: Path) -> list[Signature]:
    text = preprocess(path)
    out = []
    for m in _ENTRY.finditer(text):
        params = tuple(parse_param(p) for p in m.group(2).split(",") if p.strip())
        out.append(Signature(m.group(1), path.name, params))
    return out


def scan(root: Path | None = None, files: list[Path] | None = None) -> dict[str, Signature]:
    """name -> Signature over csrc/*.cu (or `files`); a duplicated entry name is an error."""
    sigs: dict[str, Signature] = {}
    for f in files if files is not None else kernel_files(root):
        for s in parse_signatures(f):
            if s.name in sigs:
                raise ValueError(f"kernel {s.name} is defined in both {sigs[s.name].source} and {s.source}")
            sigs[s.name] = s
    return sigs


def write_json(sigs: dict[str, Signature], path: Path = SIGNATURES_JSON) -> None:
    path.write_text(json.dumps({n: asdict(s) for n, s in sorted(sigs.items())}, indent=1) + "\n")


def load_json(path: Path = SIGNATURES_JSON) -> dict[str, Signature]:
    raw = json.loads(path.read_text())
    return {n: Signature(d["name"], d["source"], tuple(Param(**p) for p in d["params"])) for n, d in raw.items()}


SIMT_CXXFLAGS = ["-std=c++17", "-O2", "-DDSPARK_SIMT", "-ffp-contract=off", "-fvisibility=hidden"]
# dspark._cpu, the numpy backend's native code (csrc/cpu): its translation units and flags (no
# contracted multiply-add: the NumPy references reproduce every bit).
CPU_SOURCES = ["cpu/module.cpp", "cpu/product_avx2.cpp", "cpu/product_base.cpp", "cpu/host_ops.cpp"]
CPU_CXXFLAGS = ["-O2", "-ffp-contract=off", "-Wno-psabi"]


def build_cpu(root: Path | None = None) -> Path:
    """Compile dspark._cpu in place under `root` (default: this tree) with setup.py's sources and
    flags, without setuptools (which would rebuild dspark._simt too): for a copy of the tree whose
    native code changed (the mutation runner, profiling/bench_embedded.py). Returns its path."""
    import importlib.machinery
    import os
    import subprocess
    import sysconfig

    import pybind11
    root = Path(root) if root else PACKAGE_DIR.parent
    target = root / "dspark" / f"_cpu{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", *CPU_CXXFLAGS,
           "-I", pybind11.get_include(), "-I", sysconfig.get_paths()["include"],
           *(str(root / "csrc" / f) for f in CPU_SOURCES), "-o", str(target)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"build of dspark._cpu failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return target


def write_registration_units(gen_dir: Path, files: list[Path]) -> list[Path]:
    """Write one registration unit per kernel family into gen_dir; return their paths."""
    gen_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        unit = gen_dir / (f.stem + "_simt.cpp")
        text = registration_unit(f, parse_signatures(f))
        if not unit.exists() or unit.read_text() != text:
            unit.write_text(text)
        out.append(unit)
    return out


def simt_sources(gen_dir: Path, root: Path | None = None, files: list[Path] | None = None) -> list[Path]:
    """Every host translation unit of the dspark._simt module (all families, or `files`)."""
    root = root or csrc_dir()
    return [root / "simt" / "runtime.cpp", root / "bindings" / "simt_module.cpp",
            *write_registration_units(gen_dir, files if files is not None else kernel_files(root))]


def registration_unit(source: Path, sigs: list[Signature]) -> str:
    """A host translation unit that compiles one .cu and registers its entry points."""
    lines = [
        "// generated by dspark/kernel_sources.py: do not edit",
        '#include "simt/registry.h"',
        f'#include "{source.name}"',
        "namespace {",
    ]
    lines += [f'simt::Registration reg_{s.name}("{s.name}", &{s.name});' for s in sigs]
    lines.append("}  // namespace")
    return "\n".join(lines) + "\n"
