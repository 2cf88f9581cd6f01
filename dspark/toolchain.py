"""Compile the kernel sources for a GPU without one: NVRTC and nvcc (-cubin), with ptxas reports.

One binary: `family_cubin(source, arch)` is the only way dspark turns a kernel family into device
code. The `cuda` backend loads its file with cupy.RawModule(path=...), profiling/ptxas_report.py
reads the ptxas log of the same compile, and the compile tests check it (every .cu, sm_80 and
sm_90, no spills). The cubin is cached under a key that covers the source, every header it
includes, the options, the architecture and the NVRTC version, so an edited .cuh is rebuilt.

Floating-point policy (NVRTC_OPTIONS): -fmad=false, -ftz=false, -prec-div=true, -prec-sqrt=true.
The compiler never contracts a * b + c into an FMA, so the rounding sequence is the one the
source writes (fmaf() where it wants a fused multiply-add) and cannot differ between two
inlined copies of the same helper: the bitwise row-invariance properties (DESIGN section 3) hold
by construction, not by the luck of contraction. Denormals are kept and division and square root
are IEEE, as on the host: the simt build is compiled with -ffp-contract=off and the same
semantics, so the two executors take the same arithmetic order (only libm-style functions such
as expf differ in their last bit between device and host). CuPy's own compile path would add
-ftz=true; dspark does not use it.

NVRTC is loaded through ctypes from the `nvidia-cuda-nvrtc` wheels or the CUDA toolkit, so no
GPU, driver or CuPy is needed to build.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .kernel_sources import cache_dir, csrc_dir, includes

ARCHS = ("sm_80", "sm_90")
FP_POLICY = ("-fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")
NVRTC_OPTIONS = ("-std=c++17", *FP_POLICY)
NVCC_FLAGS = ("-std=c++17", *(f"-{o}" for o in FP_POLICY))  # nvcc spells them --fmad=false, ...


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    smem: int          # static shared memory, bytes
    stack: int         # stack frame, bytes
    spill_stores: int
    spill_loads: int


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, KernelResources]:
    """name -> resources, from `ptxas -v` output (nvcc -Xptxas -v or NVRTC --ptxas-options=-v)."""
    out: dict[str, KernelResources] = {}
    name, frame = None, (0, 0, 0)
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            name, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME.search(line)) and name:
            frame = tuple(int(v) for v in m.groups())
        elif (m := _USED.search(line)) and name:
            out[name] = KernelResources(name, int(m.group(1)), int(m.group(2) or 0), *frame)
            name = None
    return out


def nvcc() -> str | None:
    cand = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    return cand if os.path.isfile(cand) else None


def nvcc_cubin(source: Path, arch: str) -> dict[str, KernelResources]:
    """Compile one .cu to a cubin with nvcc; raises CalledProcessError with the log on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc(), "-cubin", f"-arch={arch}", *NVCC_FLAGS, "-Xptxas", "-v", "-I", str(csrc_dir()),
               str(source), "-o", os.path.join(tmp, "k.cubin")]
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout, r.stderr)
    return parse_ptxas(r.stdout + r.stderr)


def _nvrtc_candidates() -> list[str]:
    """libnvrtc.so paths: $DSPARK_NVRTC, the pip wheels (CUDA 12 and 13 layouts), the toolkit."""
    found = [os.environ["DSPARK_NVRTC"]] if os.environ.get("DSPARK_NVRTC") else []
    for mod, sub in (("nvidia.cuda_nvrtc", "lib"), ("nvidia.cu13", "lib"), ("nvidia.cu13", "lib64")):
        try:
            pkg = __import__(mod, fromlist=["__path__"])
        except ImportError:
            continue
        for d in pkg.__path__:
            found += sorted(glob.glob(os.path.join(d, sub, "libnvrtc.so*")))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
            found += sorted(glob.glob(os.path.join(home, "lib", "libnvrtc.so*")))
    return [f for f in dict.fromkeys(found) if "builtins" not in f and ".alt." not in f]


class Nvrtc:
    """The few NVRTC calls needed to compile a source to a cubin and read its log."""

    def __init__(self, path: str | None = None):
        cands = [path] if path else _nvrtc_candidates()
        if not cands:
            raise OSError("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12")
        self.path = cands[0]
        self.lib = ctypes.CDLL(self.path)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = (major.value, minor.value)

    def _check(self, status: int, what: str) -> None:
        if status:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"NVRTC {what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def compile(self, source: Path, arch: str, options: tuple[str, ...] = NVRTC_OPTIONS,
                ptx: bool = False) -> tuple[bytes, str]:
        """(cubin, log) for `source` at `arch` (PTX text instead of the cubin with ptx=True, for a
        `compute_XY` arch); raises RuntimeError with the log on failure."""
        prog = ctypes.c_void_p()
        code = source.read_bytes()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), code, source.name.encode(), 0, None, None),
                    "create")
        try:
            opts = [f"--gpu-architecture={arch}", *options, f"-I{source.parent}", "--ptxas-options=-v"]
            arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            status = self.lib.nvrtcCompileProgram(prog, len(opts), arr)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            if status:
                raise RuntimeError(f"NVRTC failed to compile {source.name} for {arch}:\n{log}")
            what = "PTX" if ptx else "CUBIN"
            self._check(getattr(self.lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(size)), f"get {what} size")
            out = ctypes.create_string_buffer(size.value)
            self._check(getattr(self.lib, f"nvrtcGet{what}")(prog, out), f"get {what}")
            return out.raw, log
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


# ---- one binary ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cubin:
    """A kernel family compiled for one architecture: the cached file and its ptxas log."""
    source: Path
    arch: str
    path: Path
    log: str
    key: str
    nvrtc_version: tuple[int, int]

    def read(self) -> bytes:
        return self.path.read_bytes()

    def resources(self) -> dict[str, KernelResources]:
        return parse_ptxas(self.log)


def cubin_key(source: Path, arch: str, nvrtc_version, options=NVRTC_OPTIONS) -> str:
    """sha256 over the options, the architecture, the NVRTC version and the bytes of the source
    and of every header it includes."""
    h = hashlib.sha256(repr((tuple(options), arch, tuple(nvrtc_version))).encode())
    for f in [source, *includes(source)]:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


_NVRTC: list[Nvrtc] = []


def default_nvrtc() -> Nvrtc:
    if not _NVRTC:
        _NVRTC.append(Nvrtc())
    return _NVRTC[0]


def family_cubin(source: Path, arch: str, nvrtc: Nvrtc | None = None) -> Cubin:
    """The cubin of one kernel family (csrc/<family>.cu) for `arch` with dspark's NVRTC options:
    built once per key into the cache ($DSPARK_CACHE/cubin), then read from there."""
    nvrtc = nvrtc or default_nvrtc()
    source = Path(source)
    key = cubin_key(source, arch, nvrtc.version)
    out = cache_dir() / "cubin"
    path = out / f"{source.stem}-{arch}-{key[:24]}.cubin"
    log_path = path.with_suffix(".log")
    if not (path.is_file() and log_path.is_file()):
        cubin, log = nvrtc.compile(source, arch)
        out.mkdir(parents=True, exist_ok=True)
        for dst, data in ((log_path, log.encode()), (path, cubin)):  # the cubin last: it marks completion
            tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
    return Cubin(source, arch, path, log_path.read_text(), key, nvrtc.version)
