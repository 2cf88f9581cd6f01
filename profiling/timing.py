"""One place for benchmark timing, the ceilings it is compared against, and table printing.

Kernel launches are recorded once through the op (which validates, plans and uploads) and then
replayed alone, so a time is the kernel's, not the op's host-side work:

    launches = record(be, lambda b: argmax_rows(b, logits, out=out))
    clock = clock_for(be)
    seconds = clock.median(replay(launches))

* GPU (`GpuClock`): CUDA events around the replay on the current stream, after warm-up; before
  every repeat a buffer larger than L2 is rewritten so no repeat reads what the last one left in
  L2; the median of the repeats.
* CPU (`CpuClock`): time.perf_counter around the replay, median. On the simt backend every CUDA
  thread is a CPU fiber, so these times only show that the benchmarks run.

Ceilings are measured in the same run (`measure_ceilings`): device-to-device copy bandwidth (bytes
read + written per second) and a large GEMM per dtype (cupy.matmul, 2 M N K flops); on the CPU a
NumPy copy and a NumPy f32 GEMM. `Ceilings.roofline` turns a kernel's bytes and flops into the
shortest time those ceilings allow.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

import numpy as np


# ---- recording and replaying launches ----------------------------------------------------------
@dataclasses.dataclass
class Launch:
    """One kernel launch as the op made it; calling it launches it again (the arrays it holds stay
    alive as long as the Launch does)."""
    name: str
    fn: Callable
    grid: tuple
    block: tuple
    args: tuple
    shared_mem: int

    def __call__(self) -> None:
        self.fn(self.grid, self.block, self.args, shared_mem=self.shared_mem)


class Recorder:
    """An executor wrapper: forwards every launch and keeps it."""

    def __init__(self, kernels):
        self.kernels, self.launches = kernels, []

    def get_function(self, name):
        fn = self.kernels.get_function(name)

        def launch(grid, block, args, shared_mem=0):
            self.launches.append(Launch(name, fn, grid, block, tuple(args), shared_mem))
            fn(grid, block, args, shared_mem=shared_mem)
        return launch


def record(be, op: Callable) -> list[Launch]:
    """Run op(backend) once on a backend whose executor records; return the launches it made."""
    rec = Recorder(be.kernels)
    op(dataclasses.replace(be, kernels=rec))
    return rec.launches


def replay(launches: Sequence[Launch]) -> Callable[[], None]:
    def run() -> None:
        for launch in launches:
            launch()
    return run


# ---- clocks -------------------------------------------------------------------------------------
class CpuClock:
    name = "cpu"

    def __init__(self, reps: int = 3, warmup: int = 0):
        self.reps, self.warmup = reps, warmup

    def median(self, fn: Callable[[], None], reps: int | None = None) -> float:
        """Median wall time of fn() in seconds."""
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(reps or self.reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return float(np.median(times))


class GpuClock:
    """Besides evicting L2, the flush keeps the GPU busy for tens of microseconds while the host
    enqueues the start event, the launch (with its argument checks) and the end event, so host
    launch overhead does not show up between the events."""
    name = "gpu"
    MIN_FLUSH = 256 << 20

    def __init__(self, cp, reps: int = 20, warmup: int = 3):
        self.cp, self.reps, self.warmup = cp, reps, warmup
        l2 = int(cp.cuda.Device().attributes.get("L2CacheSize", 0))
        self.flush = cp.empty(max(self.MIN_FLUSH, 4 * l2), cp.uint8)  # rewritten before each repeat
        self.start, self.end = cp.cuda.Event(), cp.cuda.Event()

    def median(self, fn: Callable[[], None], reps: int | None = None) -> float:
        """Median time of fn()'s GPU work in seconds, between events on the current stream."""
        times = []
        for i in range(self.warmup + (reps or self.reps)):
            self.flush.fill(i & 0xFF)  # enqueued before the start event: not timed
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            if i >= self.warmup:
                times.append(self.cp.cuda.get_elapsed_time(self.start, self.end) * 1e-3)
        return float(np.median(times))


def gpu_module(be):
    """CuPy when `be` runs on a GPU, else None."""
    if be.name != "cuda":
        return None
    import cupy
    return cupy


def device_rng(be):
    """cupy.random where the arrays live on a GPU (gigabytes of inputs are generated there), None
    on the host backends and on the CuPy contract stand-in, which models no RNG (inputs come from
    the host there)."""
    if be.xp is np:
        return None
    try:
        return be.xp.random
    except NotImplementedError:  # the stand-in: CuPy has it, the stand-in does not model it
        return None


def clock_for(be, reps: int | None = None):
    cp = gpu_module(be)
    if cp is not None:
        return GpuClock(cp, **({"reps": reps} if reps else {}))
    return CpuClock(**({"reps": reps} if reps else {}))


def supports(xp, dtype) -> bool:
    """Whether the array module can hold `dtype` (CuPy builds without bfloat16 cannot)."""
    try:
        xp.zeros(1, np.float32).astype(dtype)
        return True
    except Exception:  # TypeError or ValueError, depending on the CuPy version
        return False


# ---- ceilings -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Ceilings:
    where: str
    copy_bw: float                                      # bytes read + written per second
    gemm: dict[str, float] = dataclasses.field(default_factory=dict)  # dtype name -> flop/s

    def roofline(self, nbytes: int, flops: int, math_dtype: str = "float32") -> tuple[float, str]:
        """(shortest time in seconds, "mem" or "math": the ceiling that sets it)."""
        t_mem = nbytes / self.copy_bw
        t_math = flops / self.gemm[math_dtype] if flops else 0.0
        return (t_math, "math") if t_math > t_mem else (t_mem, "mem")

    def lines(self) -> list[str]:
        out = [f"{self.where} copy bandwidth: {self.copy_bw / 1e9:,.0f} GB/s (bytes read + written)"]
        out += [f"{self.where} GEMM {name}: {rate / 1e12:,.2f} TFLOP/s" for name, rate in self.gemm.items()]
        return out


def copy_bandwidth(xp, clock, nbytes: int) -> float:
    src = xp.ones(nbytes // 4, np.float32)
    dst = xp.empty_like(src)
    t = clock.median(lambda: xp.copyto(dst, src))
    return 2 * src.nbytes / t


def gemm_rate(xp, clock, n: int, dtype) -> float:
    """flop/s of an [n, n] x [n, n] product: 2 n^3 flops."""
    a = xp.ones((n, n), np.float32).astype(dtype)
    b = xp.ones((n, n), np.float32).astype(dtype)
    t = clock.median(lambda: xp.matmul(a, b))
    return 2 * n**3 / t


def measure_ceilings(be, clock) -> Ceilings:
    """On a GPU: a 1 GiB device copy and 8192^3 GEMMs in f16, bf16 (when CuPy has it) and f32
    (cuBLAS SGEMM: CUDA cores, as the kernels' f32 math; TF32 stays off unless CUPY_TF32=1). On
    the CPU: a 64 MiB NumPy copy and a 1024^3 f32 GEMM."""
    cp = gpu_module(be)
    if cp is None:
        return Ceilings("CPU", copy_bandwidth(np, clock, 64 << 20), {"float32": gemm_rate(np, clock, 1024, np.float32)})
    import ml_dtypes
    out = Ceilings("GPU", copy_bandwidth(cp, clock, 1 << 30))
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        try:
            out.gemm[np.dtype(dtype).name] = gemm_rate(cp, clock, 8192, dtype)
        except Exception as e:  # a CuPy without bfloat16 arrays or matmul: leave that ceiling out
            print(f"GEMM {np.dtype(dtype).name}: not measured ({type(e).__name__}: {e})")
    cp.get_default_memory_pool().free_all_blocks()
    return out


# ---- printing -----------------------------------------------------------------------------------
def seconds(t: float) -> str:
    """A time with a unit that keeps 3-4 significant digits: 12.3us, 4.56ms, 1.20s."""
    if not math.isfinite(t):
        return "-"
    for scale, unit in ((1e-6, "us"), (1e-3, "ms")):
        if t < 1000 * scale:
            return f"{t / scale:.1f}{unit}" if t >= 10 * scale else f"{t / scale:.2f}{unit}"
    return f"{t:.2f}s"


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] in "-+.")


def table(headers: Sequence[str], rows: Sequence[Sequence], right: Sequence[bool] | None = None) -> str:
    """Rows of cells as aligned text columns. A column is right-aligned when every cell in it
    reads as a number ("12.3us", "45%", "-"), or as `right` says."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    if right is None:
        right = [bool(rows) and all(_numeric(r[i]) for r in cells[1:]) for i in range(len(headers))]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(r, widths, right)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
