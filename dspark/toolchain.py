"""Compile the kernel sources for a GPU without one: nvcc (-cubin) and NVRTC, with ptxas reports.

Used by the compile tests (every .cu, sm_80 and sm_90, no spills) and by
profiling/ptxas_report.py. NVRTC is loaded from the `nvidia-cuda-nvrtc-cu12` wheel or from the
CUDA toolkit, through ctypes, so no GPU, driver or CuPy is needed.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .kernel_sources import csrc_dir

ARCHS = ("sm_80", "sm_90")
NVCC_FLAGS = ("-std=c++17",)


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
    found = []
    try:
        import nvidia.cuda_nvrtc as pkg
        for d in pkg.__path__:
            found += sorted(glob.glob(os.path.join(d, "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    return [f for f in found if "builtins" not in f and ".alt." not in f]


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

    def compile(self, source: Path, arch: str) -> tuple[bytes, str]:
        """(cubin, log) for `source` at `arch`; raises RuntimeError with the log on failure."""
        prog = ctypes.c_void_p()
        code = source.read_bytes()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), code, source.name.encode(), 0, None, None),
                    "create")
        try:
            opts = [f"--gpu-architecture={arch}", "-std=c++17", f"-I{csrc_dir()}", "--ptxas-options=-v"]
            arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            status = self.lib.nvrtcCompileProgram(prog, len(opts), arr)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            if status:
                raise RuntimeError(f"NVRTC failed to compile {source.name} for {arch}:\n{log}")
            self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, cubin), "get cubin")
            return cubin.raw, log
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
