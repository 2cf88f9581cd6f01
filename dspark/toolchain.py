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

NVRTC (12 or 13) is loaded through ctypes wherever CuPy would find it (`nvrtc_places`: the pip
wheels, conda, CUDA toolkits, the dynamic loader's path, cuda-pathfinder), so no GPU, driver or CuPy
is needed to build; a missing NVRTC is an error naming every place looked. Each cubin's cache key
holds the NVRTC version, so cubins of both majors sit side by side.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
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


# ---- NVRTC: wherever CuPy would find it ----------------------------------------------------------------
NVRTC_SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
# pip wheels, relative to a site directory: nvidia-cuda-nvrtc (CUDA 13's one folder per major) and
# nvidia-cuda-nvrtc-cu12 (one folder per library)
NVRTC_WHEEL_DIRS = ("nvidia/cu13/lib", "nvidia/cu13/lib64", "nvidia/cuda_nvrtc/lib")


@dataclass(frozen=True)
class Place:
    """One place NVRTC is looked for: what it is, and the files (or loader names) it offers."""
    what: str
    found: tuple[str, ...]
    note: str = ""      # why it offers nothing (unset, absent, not installed)


def _libs_in(d: str) -> tuple[str, ...]:
    return tuple(f for f in sorted(glob.glob(os.path.join(d, "libnvrtc.so*")), reverse=True)
                 if "builtins" not in f and ".alt." not in f)


def _toolkit_roots() -> list[tuple[str, str]]:
    """(label, root) of CUDA toolkits: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda and every versioned
    /usr/local/cuda-X.Y (newest first), /opt/cuda."""
    roots = [("$CUDA_HOME", os.environ.get("CUDA_HOME")), ("$CUDA_PATH", os.environ.get("CUDA_PATH")),
             ("/usr/local/cuda", "/usr/local/cuda")]
    versioned = sorted(glob.glob("/usr/local/cuda-*"), key=lambda d: [int(x) if x.isdigit() else -1 for x in
                                                                     re.split(r"[-.]", d)], reverse=True)
    roots += [(d, d) for d in versioned] + [("/opt/cuda", "/opt/cuda")]
    return roots


def nvrtc_places() -> list[Place]:
    """Every place NVRTC is looked for, in order: $DSPARK_NVRTC; the pip wheels in every site
    directory on sys.path; conda ($CONDA_PREFIX); CUDA toolkits ($CUDA_HOME, $CUDA_PATH,
    /usr/local/cuda, /usr/local/cuda-X.Y, /opt/cuda; lib64, lib and targets/*/lib); the dynamic
    loader's own search (LD_LIBRARY_PATH, the ldconfig cache, the system folders) by soname; and
    cuda-pathfinder, the library CuPy itself finds NVRTC with."""
    places = []
    env = os.environ.get("DSPARK_NVRTC")
    places.append(Place("$DSPARK_NVRTC", (env,) if env else (), "" if env else "unset"))
    for entry in dict.fromkeys(p for p in sys.path if p and os.path.isdir(p)):
        for rel in NVRTC_WHEEL_DIRS:
            d = os.path.join(entry, rel)
            if os.path.isdir(d):
                places.append(Place(f"pip wheel {d}", _libs_in(d)))
    if not any(p.what.startswith("pip wheel") for p in places):
        places.append(Place("pip wheels (" + ", ".join(NVRTC_WHEEL_DIRS) + " under sys.path)", (), "none installed"))
    conda = os.environ.get("CONDA_PREFIX")
    dirs = [os.path.join(conda, "lib"), *glob.glob(os.path.join(conda, "targets", "*", "lib"))] if conda else []
    places.append(Place("conda $CONDA_PREFIX", tuple(f for d in dirs for f in _libs_in(d)), "" if conda else "unset"))
    for label, root in _toolkit_roots():
        if not root:
            places.append(Place(label, (), "unset"))
            continue
        dirs = [os.path.join(root, "lib64"), os.path.join(root, "lib"), *glob.glob(os.path.join(root, "targets", "*", "lib"))]
        found = tuple(dict.fromkeys(os.path.realpath(f) for d in dirs for f in _libs_in(d)))
        places.append(Place(f"CUDA toolkit {label} ({root})", found, "" if os.path.isdir(root) else "absent"))
    ld = os.environ.get("LD_LIBRARY_PATH", "")
    places.append(Place(f"the dynamic loader (LD_LIBRARY_PATH={ld or 'unset'}, ldconfig cache, system folders)",
                        NVRTC_SONAMES))
    try:
        from cuda.pathfinder import DynamicLibNotFoundError, load_nvidia_dynamic_lib
    except ImportError:
        places.append(Place("cuda-pathfinder", (), "not installed"))
    else:
        try:
            places.append(Place("cuda-pathfinder", (load_nvidia_dynamic_lib("nvrtc").abs_path,)))
        except (DynamicLibNotFoundError, RuntimeError, OSError) as e:
            places.append(Place("cuda-pathfinder", (), str(e).splitlines()[0]))
    return places


def _major_of_cupy() -> int | None:
    """The CUDA major of the installed CuPy wheel (cupy-cuda12x, cupy-cuda13x), read from its
    metadata so CuPy is not imported: dspark compiles with the NVRTC of CuPy's CUDA when it can."""
    from importlib import metadata
    for major in (13, 12):
        try:
            metadata.version(f"cupy-cuda{major}x")
            return major
        except metadata.PackageNotFoundError:
            continue
    return None


def _load(spec: str):
    """(lib, version) of one libnvrtc, or None when it does not load."""
    try:
        lib = ctypes.CDLL(spec)
        major, minor = ctypes.c_int(), ctypes.c_int()
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)):
            return None
        return lib, (major.value, minor.value)
    except (OSError, AttributeError):
        return None


def nvrtc_libraries() -> dict[int, "Nvrtc"]:
    """major -> the first NVRTC of that major found (nvrtc_places order): every NVRTC here."""
    out: dict[int, Nvrtc] = {}
    for place in nvrtc_places():
        for spec in place.found:
            got = _load(spec)
            if got and got[1][0] not in out:
                out[got[1][0]] = Nvrtc._of(spec, *got, place.what)
    return out


def not_found(places: list[Place], wanted: str) -> OSError:
    looked = "\n".join(f"  {p.what}: " + (", ".join(p.found) + " (did not load)" if p.found else p.note or "nothing")
                        for p in places)
    return OSError(f"{wanted} not found. Looked in:\n{looked}\nInstall nvidia-cuda-nvrtc (CUDA 13) or "
                   "nvidia-cuda-nvrtc-cu12 (CUDA 12), or point DSPARK_NVRTC at a libnvrtc.so")


def find_nvrtc(major: int | None = None) -> "Nvrtc":
    """The NVRTC to compile with: $DSPARK_NVRTC when set; else, of those found, the one of `major`
    (default: the CUDA major of the installed CuPy, else the first found). OSError naming every
    place looked when there is none."""
    places = nvrtc_places()
    env = os.environ.get("DSPARK_NVRTC")
    if env and major is None:
        got = _load(env)
        if got is None:
            raise OSError(f"DSPARK_NVRTC={env} does not load as libnvrtc")
        return Nvrtc._of(env, *got, "$DSPARK_NVRTC")
    want = major or _major_of_cupy()
    first = None
    for place in places:
        for spec in place.found:
            got = _load(spec)
            if got is None:
                continue
            if want is None or got[1][0] == want:
                return Nvrtc._of(spec, *got, place.what)
            first = first or Nvrtc._of(spec, *got, place.what)
    if first is not None and major is None:
        return first  # not CuPy's CUDA major, but an NVRTC: cubins carry no runtime dependency on it
    raise not_found(places, f"libnvrtc{f' (CUDA {major})' if major else ''}")


class Nvrtc:
    """The few NVRTC calls needed to compile a source to a cubin and read its log."""

    def __init__(self, path: str | None = None):
        """`path`: a libnvrtc file or soname; default find_nvrtc()'s choice."""
        if path is None:
            found = find_nvrtc()
            path, self.lib, self.version, self.where = found.path, found.lib, found.version, found.where
        else:
            got = _load(path)
            if got is None:
                raise OSError(f"{path} does not load as libnvrtc")
            self.lib, self.version = got
            self.where = "given"
        self.path = path

    @classmethod
    def _of(cls, path: str, lib, version: tuple[int, int], where: str) -> "Nvrtc":
        nv = cls.__new__(cls)
        nv.path, nv.lib, nv.version, nv.where = path, lib, version, where
        return nv

    def _check(self, status: int, what: str) -> None:
        if status:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"NVRTC {what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def compile(self, source: Path, arch: str, options: tuple[str, ...] = NVRTC_OPTIONS,
                ptx: bool = False) -> tuple[bytes, str]:
        """(cubin, log) for `source` at `arch` (PTX text instead of the cubin with ptx=True, for a
        `compute_XY` arch); raises RuntimeError with the log on failure."""
        out, log = self.build(source, arch, options, ("PTX",) if ptx else ("CUBIN",))
        return out[0], log

    def build(self, source: Path, arch: str, options: tuple[str, ...] = NVRTC_OPTIONS,
              outputs: tuple[str, ...] = ("CUBIN", "PTX")) -> tuple[list[bytes], str]:
        """([each of `outputs`], log) of one compile: "CUBIN" (an sm_XY arch) and "PTX" (the PTX
        that cubin was assembled from); raises RuntimeError with the log on failure."""
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
                raise RuntimeError(f"NVRTC {self.version[0]}.{self.version[1]} failed to compile {source.name} for "
                                   f"{arch}:\n{log}")
            got = []
            for what in outputs:
                self._check(getattr(self.lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(size)), f"get {what} size")
                out = ctypes.create_string_buffer(size.value)
                self._check(getattr(self.lib, f"nvrtcGet{what}")(prog, out), f"get {what}")
                got.append(out.raw if what == "CUBIN" else out.value)
            return got, log
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

    def ptx(self) -> str:
        """The PTX the cubin was assembled from (ptxas keeps its mul.rn / add.rn / fma.rn apart)."""
        return self.path.with_suffix(".ptx").read_text()


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
    built once per key into the cache ($DSPARK_CACHE/cubin), with its ptxas log and the PTX it was
    assembled from, then read from there."""
    nvrtc = nvrtc or default_nvrtc()
    source = Path(source)
    key = cubin_key(source, arch, nvrtc.version)
    out = cache_dir() / "cubin"
    path = out / f"{source.stem}-{arch}-{key[:24]}.cubin"
    log_path, ptx_path = path.with_suffix(".log"), path.with_suffix(".ptx")
    if not (path.is_file() and log_path.is_file() and ptx_path.is_file()):
        (cubin, ptx), log = nvrtc.build(source, arch)
        out.mkdir(parents=True, exist_ok=True)
        # the cubin last: it marks completion
        for dst, data in ((log_path, log.encode()), (ptx_path, ptx), (path, cubin)):
            tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
    return Cubin(source, arch, path, log_path.read_text(), key, nvrtc.version)
