"""The `simt` executor: csrc/ kernels compiled for the host, one fiber per CUDA thread.

`get_function(name)` returns a callable with CuPy's RawKernel convention. Run under
`simt_build.asan_env()` to load an AddressSanitizer build, and DSPARK_SIMT_SCHEDULE=<seed> (or `schedule(seed)`) to run a
launch's blocks, and its threads between barriers, in a random order. Under `simt_build.counting_env()` (the counting build), `counting()`
counts each launch's shared-memory wavefronts and mma.sync (LaunchCounts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct
from pathlib import Path

import numpy as np

from .. import profile
from ..errors import KernelArgumentError
from ..kernel_sources import Signature, load_json
from .launch import check_args, check_launch


def load_module():
    """The installed dspark._simt, or the out-of-tree build named by DSPARK_SIMT_MODULE."""
    from .simt_build import MODULE_ENV, load_module_at
    path = os.environ.get(MODULE_ENV)
    if path:
        return load_module_at(path)
    if os.environ.get("DSPARK_SIMT_ASAN") == "1":
        raise ImportError(f"DSPARK_SIMT_ASAN=1 needs {MODULE_ENV}: run the process with simt_build.asan_env()")
    from .. import _simt
    return _simt


def signatures_for(module) -> dict[str, Signature]:
    """The signature table built with this module (a private build carries its own)."""
    beside = Path(module.__file__).with_name("_kernels.json")
    return load_json(beside) if beside.is_file() else load_json()


SMEM_KINDS = ("load", "store", "ldmatrix", "cp_async")


@dataclasses.dataclass(frozen=True)
class Access:
    """Warp-wide shared-memory accesses of one kind in a launch: how many, the wavefronts they take
    with their bank conflicts, and the wavefronts they would take without any."""
    requests: int
    wavefronts: int
    ideal: int


@dataclasses.dataclass(frozen=True)
class LaunchCounts:
    """What the counting build counted in one launch (csrc/simt/simt.h: count_ldmatrix)."""
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    mma: int                        # mma.sync m16n8k16, warp instructions
    access: dict[str, Access]       # SMEM_KINDS -> Access

    @property
    def wavefronts(self) -> int:
        return sum(a.wavefronts for a in self.access.values())

    @property
    def ideal(self) -> int:
        return sum(a.ideal for a in self.access.values())

    @classmethod
    def of(cls, d: dict) -> "LaunchCounts":
        return cls(d["kernel"], tuple(d["grid"]), tuple(d["block"]), d["shared_mem"], d["mma"],
                   {k: Access(*d[k]) for k in SMEM_KINDS})


class SimtKernel:
    def __init__(self, module, sig: Signature):
        self._module = module
        self.signature = sig
        self.name = sig.name

    def __call__(self, grid, block, args, shared_mem=0):
        sig = self.signature
        g, b, smem = check_launch(sig, grid, block, args, shared_mem)
        check_args(sig, args, np.ndarray)
        slots = []
        for p, a in zip(sig.params, args):
            if p.code == "ptr":
                slots.append(struct.pack("<Q", 0 if a is None else a.ctypes.data))
            else:
                slots.append(a.tobytes().ljust(8, b"\0"))
        profile.record("launch", self.name)
        self._module.launch(self.name, g, b, b"".join(slots), smem)


class SimtExecutor:
    name = "simt"

    def __init__(self):
        self._module = load_module()
        self.signatures = signatures_for(self._module)
        self.asan = bool(self._module.asan)
        seed = os.environ.get("DSPARK_SIMT_SCHEDULE")
        if seed:
            self._module.set_schedule(int(seed))
        self._cache: dict[str, SimtKernel] = {}

    def get_function(self, name: str) -> SimtKernel:
        if name not in self._cache:
            if name not in self.signatures:
                raise KernelArgumentError(f"no kernel named {name!r} in csrc/")
            self._cache[name] = SimtKernel(self._module, self.signatures[name])
        return self._cache[name]

    def compiled_kernels(self) -> dict[str, list]:
        """name -> parameter types as the host compiler deduced them."""
        return self._module.kernels()

    @contextlib.contextmanager
    def schedule(self, seed: int):
        """Run each launch's blocks, and the threads between barriers inside a block, in a random order
        (from `seed`)."""
        old = self._module.schedule_seed()
        self._module.set_schedule(int(seed))
        try:
            yield
        finally:
            self._module.set_schedule(old)

    @property
    def counts_shared_accesses(self) -> bool:
        return bool(getattr(self._module, "counts_shared_accesses", False))

    @contextlib.contextmanager
    def counting(self):
        """Count every launch inside: yields a list that holds one LaunchCounts per launch when the
        block ends. Only the counting build counts (simt_build.counting_env); the plain one raises."""
        if not self.counts_shared_accesses:
            raise RuntimeError("this build of dspark._simt does not count shared-memory accesses; run under "
                               "dspark.backends.simt_build.counting_env() (DSPARK_SIMT_MODULE=<counting build>)")
        out: list[LaunchCounts] = []
        self._module.take_counts()
        self._module.set_counting(True)
        try:
            yield out
        finally:
            self._module.set_counting(False)
            out.extend(LaunchCounts.of(d) for d in self._module.take_counts())

    @property
    def fault_type(self):
        return self._module.KernelFault
