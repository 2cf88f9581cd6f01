"""How profiling/perf_model.py prices one kernel launch: from the launch's `Work` (what its op's
plan says each CTA moves and computes) and the code as compiled, the time each limiter alone
needs, the floor (the largest of them) and the expected time (docs/performance.md: "How a kernel
is priced"). A new kernel (an FP8 GEMM, say) slots in by building its Work from its own plan.

Limiters: those of an SM (smem, tensor, issue, latency) are makespans: every CTA's amount at its
slot's share of the SM's rate (SMs x the CTAs resident per SM, fewer CTAs than SMs an SM each), CTAs
longest first onto the slot that frees first, so waves and imbalance show; those of the device
(dram, l2) are the launch's bytes at the whole rate (the expected time gives each CTA its slot's
share of it, as the SM's limiters do):
  dram     bytes from and to DRAM at the copy bandwidth
  l2       bytes the CTAs load and store through L2 (re-reads of what L2 holds included)
  smem     shared-memory wavefronts, bank conflicts included, at one per SM clock: counted by simt
           where the kernel runs (profiling/wavefronts.json, profiling/wavefronts.py) and scaled
           by the launch's units (CTAs, key tiles, merges, mma.sync, bytes)
  tensor   mma.sync m16n8k16 instructions (whole tiles, as executed) at the mma.sync ceiling
  issue    warp-instructions at four per SM clock: the main loop's SASS per iteration
           (profiling/sass.py: the shortest path through one iteration that issues all its MMAs;
           a loop written for more m-tiles than the launch runs, that share of it) times the loop's
           iterations; kernels whose loop trips the model does not know: their f32 arithmetic as
           the PTX has it (a floor: loads, integer and control instructions not counted)
  latency  where one CTA per SM leaves nothing to overlap: a DRAM round trip per wave, and each
           barrier's drain per main-loop iteration
The floor is the largest limiter. The expected time schedules each CTA's expected time: its SM
side is the largest of tensor, smem and issue where another warp on the same scheduler can issue
while one waits, and, where each scheduler holds one warp, tensor and smem as the pipes overlap
plus the instructions issued outside the MMA stretches of the loop (softmax, conversions,
addressing between barriers: in series with the MMAs); its memory side (dram, l2) overlaps the SM
side where the loads are asynchronous (cp.async in the loop, or more than one CTA per SM) and adds
to it where they are not; the memory side is the device's, the larger of the launch's bytes at the
DRAM or L2 rate and its largest CTA's bytes at what one SM can pull alone; plus the latency. So the
expected time is never below the floor.

Every constant of Device names its source: a data sheet, a RESULTS entry, or "assumed".
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import json
import math
import re
from pathlib import Path

import numpy as np

from dspark.kernel_sources import includes, kernel_files
from dspark.toolchain import default_nvrtc, family_cubin, find_nvrtc

WAVEFRONTS = Path(__file__).with_name("wavefronts.json")
MMA_FLOPS = 2 * 16 * 8 * 16   # one mma.sync m16n8k16
LIMITERS = ("dram", "l2", "smem", "tensor", "issue", "latency")


@dataclasses.dataclass(frozen=True)
class Device:
    name: str = "H200"
    # data sheet: H200 SXM, HBM3e 4.8 TB/s. The copy bandwidth the model prices DRAM at: assumed 90 % of it
    # (no RESULTS entry measures it; the GPU check's copy ceiling will)
    dram_peak: float = 4.8e12
    bw: float = 4.3e12
    # assumed: L2 bandwidth is on no data sheet; microbenchmarks of H100 report 5.5-7 TB/s for reads
    l2_bw: float = 5.5e12
    # data sheet: H200 SXM bf16 dense 989 TFLOP/s (wgmma). The model's sustained wgmma rate: assumed 80 % of it
    mma_peak: float = 989e12
    mma: float = 790e12
    # assumed: mma.sync m16n8k16 (what dspark's kernels issue) reaches about two thirds of the wgmma rate on
    # Hopper; the GPU check measures it
    mma_sync_share: float = 2 / 3
    clock: float = 1.98e9          # data sheet: H100 / H200 SXM boost clock, Hz
    sms: int = 132                 # data sheet
    issue_per_sm: int = 4          # data sheet (Hopper SM: four schedulers, one warp-instruction a clock each)
    fp32_lanes: int = 128          # data sheet: FP32 lanes per SM
    # assumed: one 128-byte wavefront per SM clock (32 banks of 4 bytes, CUDA programming guide)
    smem_wavefronts_per_clock: int = 1
    # assumed: a barrier after MMA and shared-memory work waits for their results (about 30 cycles each,
    # Hopper microbenchmarks) and takes some 20 itself
    barrier_cycles: int = 60
    dram_latency: float = 0.8e-6   # assumed: a DRAM round trip on Hopper is 0.5-0.8 us (microbenchmarks)
    l2_latency: float = 0.25e-6    # assumed: an L2 hit is some 260-500 cycles away (microbenchmarks; far partition)
    # assumed: the DRAM bandwidth one SM can pull alone: some 80 KB of loads in flight over that round trip
    sm_bw: float = 100e9
    # Host time of one launch, s: RESULTS "The launch host cost, measured" (CPU, 2 cores, `python
    # profiling/launch_cost.py`: 111-117 us); a GPU machine's host is assumed the same until the GPU check
    launch: float = 114e-6
    sync: float = 10e-6            # assumed: one device->host wait (a copy of a few bytes), s
    # assumed: CuPy's own host cost per call (its Cython and the driver), s, until the GPU check measures them
    # (profiling/gpu_check.py): a RawKernel call with its cuLaunchKernel; an elementwise op with its output
    # from the pool (CuPy's own benchmark, cupy/cupy#3298: 11 us of CPU per call on small arrays); a small
    # host<->device copy; a Graph.launch (cudaGraphLaunch)
    cupy_launch: float = 5e-6
    cupy_array_op: float = 10e-6
    cupy_copy: float = 8e-6
    graph_launch: float = 4e-6
    # dspark's own host time: RESULTS "Host time per round" (CPU, 2 cores, `python profiling/host_round.py`,
    # the null executor at Qwen3.5-27B's shapes, B = 1, 32k; assumed the same on a GPU machine's host): per
    # launch issued from a recorded pass (launches "eager"), and per round of replayed graphs ("graph")
    host_eager: float = 2.6e-6
    host_graph_round: float = 346e-6
    # assumed: the GPU's own cost of a replayed graph, per kernel node (launch latency between nodes, ~1.5-6 us
    # published; the GPU check measures it), and per wave of CTAs that leave at once (a grid sized for a
    # horizon past the live context)
    graph_node: float = 3e-6
    idle_wave: float = 1e-6
    smem: int = 228 * 1024         # data sheet: shared memory per SM, bytes
    smem_reserved: int = 1024      # CUDA programming guide: shared memory the runtime keeps per CTA (sm_80+)
    regs: int = 65536              # data sheet: registers per SM
    reg_unit: int = 256            # CUDA occupancy calculator: registers are allocated per warp in units of this
    threads: int = 2048            # data sheet
    ctas: int = 32                 # data sheet
    l2: int = 50 * 10**6           # data sheet: 50 MB L2
    arch: str = "sm_90"
    nvrtc: int = 13                # the NVRTC major of the device image (CUDA 13.0)

    @property
    def f32_issue(self) -> float:
        """f32 lane-instructions/s: SMs x FP32 lanes x clock (33.5 T on an H200)."""
        return self.sms * self.fp32_lanes * self.clock

    @property
    def f32(self) -> float:
        """f32 FLOP/s when every instruction is an FMA (the data sheet's 67 TFLOP/s)."""
        return 2 * self.f32_issue

    @property
    def mma_sync(self) -> float:
        """bf16 FLOP/s of mma.sync m16n8k16 with f32 accumulation: about 527 TFLOP/s on an H200."""
        return self.mma_sync_share * self.mma

    @property
    def issue_rate(self) -> float:
        """warp-instructions/s of the whole device."""
        return self.sms * self.issue_per_sm * self.clock

    @property
    def smem_rate(self) -> float:
        """shared-memory wavefronts/s of the whole device."""
        return self.sms * self.smem_wavefronts_per_clock * self.clock


H200 = Device()


# ---- the code as compiled ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Compiled:
    """One entry point as ptxas built it: registers, static shared memory, f32 instruction mix."""
    entry: str
    registers: int
    static_smem: int
    fma: int                # fma.rn.f32 in its PTX: 2 flops each
    mul_add: int            # mul / add / sub .f32: 1 flop each

    @property
    def flops_per_instruction(self) -> float:
        n = self.fma + self.mul_add
        return (2 * self.fma + self.mul_add) / n if n else 1.0


_F32_OP = re.compile(r"^\s*(fma|mul|add|sub)(?:\.r[nzmp])?(?:\.ftz)?(?:\.sat)?\.f32\s", re.M)


@functools.lru_cache(maxsize=64)
def _entry_bodies(ptx: str) -> tuple[str, ...]:
    return tuple(re.split(r"^\.(?:visible|weak)\s+\.entry\s+", ptx, flags=re.M)[1:])


def f32_mix(ptx: str, entry: str) -> tuple[int, int]:
    """(fma, mul + add + sub) f32 instructions in the body of `entry` in PTX text (device
    functions are inlined into it)."""
    body = next((b for b in _entry_bodies(ptx) if b.startswith(entry + "(")), None)
    if body is None:
        raise LookupError(f"no entry {entry} in the PTX")
    ops = _F32_OP.findall(body)
    return ops.count("fma"), len(ops) - ops.count("fma")


@functools.lru_cache(maxsize=None)
def compiled_kernels(arch: str, nvrtc_major: int) -> tuple[str, dict[str, Compiled]]:
    """(NVRTC used, entry -> Compiled) over every kernel family, from dspark's own cubins."""
    try:
        nv = find_nvrtc(nvrtc_major)
    except OSError:
        nv = default_nvrtc()  # the header says which NVRTC's code was priced
    out = {}
    for source in kernel_files():
        cubin = family_cubin(source, arch, nv)
        ptx = cubin.ptx()
        for name, r in cubin.resources().items():
            out[name] = Compiled(name, r.registers, r.smem, *f32_mix(ptx, name))
    return f"NVRTC {nv.version[0]}.{nv.version[1]}", out


def compiled(entry: str, dev: Device) -> Compiled:
    table = compiled_kernels(dev.arch, dev.nvrtc)[1]
    if entry not in table:
        raise LookupError(f"no kernel entry {entry!r} in csrc/ (the model names what the ops launch)")
    return table[entry]


def resident(threads: int, smem: int, regs: int, dev: Device) -> int:
    """CTAs of a kernel resident on one SM: threads, registers (per warp, in units of
    dev.reg_unit) and shared memory (plus what the runtime reserves per CTA) each cap it."""
    warps = -(-max(threads, 1) // 32)
    n = min(dev.ctas, dev.threads // max(threads, 1))
    if regs:
        per_warp = -(-regs * 32 // dev.reg_unit) * dev.reg_unit
        n = min(n, (dev.regs // per_warp) // warps)
    if smem:
        n = min(n, dev.smem // (smem + dev.smem_reserved))
    if n < 1:
        raise ValueError(f"a CTA of {threads} threads, {regs} registers and {smem} bytes of shared memory "
                         f"does not fit on an SM")
    return n


# ---- shared-memory wavefronts, counted by simt ---------------------------------------------------------
def sources_digest() -> str:
    """sha256 over every kernel source and header: the counts are stale when it changes."""
    h = hashlib.sha256()
    files = sorted({f for s in kernel_files() for f in (s, *includes(s))}, key=lambda f: f.name)
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def wavefront_table() -> dict:
    return json.loads(WAVEFRONTS.read_text()) if WAVEFRONTS.is_file() else {"entries": {}}


def counted_entry(entry: str) -> dict | None:
    """The simt counts behind `entry` (an f16 entry shares its bf16 twin's code and counts)."""
    entries = wavefront_table()["entries"]
    return entries.get(entry) or entries.get(entry.replace("_f16", "_bf16"))


def smem_per_cta(entry: str, units: dict[str, np.ndarray], ctas: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(wavefronts, wavefronts without bank conflicts) per CTA from the counts' coefficients per
    unit, and whether the entry was counted at all."""
    e = counted_entry(entry)
    zero = np.zeros(ctas)
    if e is None:
        return zero, zero, False
    wf, ideal = zero.copy(), zero.copy()
    for unit, per, per_ideal in zip(e["units"], e["wavefronts"], e["ideal"]):
        u = np.broadcast_to(np.asarray(units.get(unit, 0.0), np.float64), (ctas,))
        wf += per * u
        ideal += per_ideal * u
    return np.maximum(wf, 0.0), np.maximum(ideal, 0.0), True


def cp_async_per_cta(entry: str, units: dict[str, np.ndarray], ctas: int) -> np.ndarray:
    """cp.async warp-instructions per CTA, from the same counts."""
    e = counted_entry(entry)
    out = np.zeros(ctas)
    if e is not None:
        for unit, per in zip(e["units"], e.get("cp_async", [0.0] * len(e["units"]))):
            out += per * np.broadcast_to(np.asarray(units.get(unit, 0.0), np.float64), (ctas,))
    return np.maximum(out, 0.0)


# ---- one launch ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Work:
    """What one launch does, from its op's own plan: per CTA (arrays of the working CTAs, or one
    value for all) its DRAM bytes, L2 bytes (default: its DRAM bytes), mma.sync instructions and
    f32 flops on CUDA cores, its main loop's iterations (0: the model does not know them), and the
    units its shared-memory counts scale by (profiling/wavefronts.py)."""
    entry: str
    threads: int
    smem: int                       # dynamic shared memory, bytes
    dram: np.ndarray
    l2: np.ndarray | None = None
    mma: np.ndarray | float = 0.0
    f32_flops: np.ndarray | float = 0.0
    iterations: np.ndarray | float = 0.0
    units: dict = dataclasses.field(default_factory=dict)
    chain: float = 0.0              # seconds of a dependent chain per CTA that only other CTAs can hide


def makespan(per_cta: np.ndarray, slots: int) -> float:
    """Seconds to run CTAs of per_cta seconds each (at their slot's rate) on `slots` slots, longest
    first onto the slot that frees first (for many CTAs, wave by wave in a snake order, which is
    what that greedy order gives for sorted CTAs within a CTA's time)."""
    loads = np.sort(np.asarray(per_cta, np.float64))[::-1]
    if loads.size == 0:
        return 0.0
    if loads.size <= slots:
        return float(loads[0])
    if loads[0] == loads[-1]:
        return float(loads[0]) * math.ceil(loads.size / slots)
    if loads.size > 16 * slots:
        waves = -(-loads.size // slots)
        grid = np.zeros(waves * slots)
        grid[:loads.size] = loads
        grid = grid.reshape(waves, slots)
        grid[1::2] = grid[1::2, ::-1]
        return float(grid.sum(axis=0).max())
    heap = [0.0] * slots
    for t in loads:
        heapq.heappush(heap, heapq.heappop(heap) + float(t))
    return max(heap)


@dataclasses.dataclass(frozen=True)
class Priced:
    limits: dict            # limiter -> seconds alone
    expected: float
    waves: int
    per_sm: int
    f32_instr: float        # f32 lane-instructions (the PTX floor)
    instructions: float     # warp-instructions the issue limiter counts
    wavefronts: float
    ideal_wavefronts: float
    smem_counted: bool

    @property
    def floor(self) -> float:
        return max(self.limits.values())

    @property
    def bound(self) -> str:
        return max(self.limits, key=self.limits.get)


def price(w: Work, dev: Device) -> Priced:
    """Every limiter, the floor and the expected time of one launch (module doc)."""
    import sass
    code = compiled(w.entry, dev)
    dram = np.asarray(w.dram, np.float64).ravel()
    n = dram.size
    per_sm = resident(w.threads, w.smem + code.static_smem, code.registers, dev)
    if n == 0:
        return Priced(dict.fromkeys(LIMITERS, 0.0), 0.0, 0, per_sm, 0.0, 0.0, 0.0, 0.0, True)
    full = lambda x: np.broadcast_to(np.asarray(x, np.float64), (n,)).astype(np.float64)  # noqa: E731
    l2, mma, f32_flops, iters = full(dram if w.l2 is None else w.l2), full(w.mma), full(w.f32_flops), full(w.iterations)
    waves = math.ceil(n / (dev.sms * per_sm))
    share = min(per_sm, math.ceil(n / dev.sms))   # a few CTAs spread one per SM, each with its SM's rate
    slots = dev.sms * share
    warps = -(-w.threads // 32)
    wf, ideal, counted = smem_per_cta(w.entry, w.units, n)
    f32_instr = f32_flops / code.flops_per_instruction          # lane-instructions per CTA
    try:  # the main loop's SASS (profiling/sass.py), per warp; without cuobjdump, the f32 floor alone
        s = sass.issue(w.entry) if iters.any() else None
    except FileNotFoundError:
        s = None
    if s is not None:
        copies = cp_async_per_cta(w.entry, w.units, n) / warps / np.maximum(iters, 1)  # per warp per iteration
        # a loop written for more m-tiles than the launch runs (a decode's attention: one of four) issues
        # that share of its path: the MMAs the plan counts over those the loop holds
        used = np.clip(mma / warps / np.maximum(iters, 1) / s.mmas, 0.0, 1.0) if s.mmas else np.ones(n)
        per_iter = s.path * used + np.maximum(copies - s.path_copies, 0.0) * s.per_copy
        floor_instr = warps * iters * s.floor_path * used
        instr = warps * (iters * per_iter + s.outside_path)
        serial = iters * np.maximum(per_iter - s.in_mma_stretches * used, 0.0) / dev.clock   # one warp per scheduler
        drains = iters * s.barriers * dev.barrier_cycles / dev.clock
        asynchronous = s.copies > 0
    else:
        floor_instr = instr = f32_instr / 32
        serial = drains = np.zeros(n)
        asynchronous = False
    rate = lambda r: r / slots  # noqa: E731  a CTA's share of a device-wide rate
    t = {"dram": dram / rate(dev.bw), "l2": l2 / rate(dev.l2_bw), "smem": wf / rate(dev.smem_rate),
         "tensor": mma * MMA_FLOPS / rate(dev.mma_sync), "issue": floor_instr / rate(dev.issue_rate)}
    alone = share == 1   # one CTA per SM: no other CTA overlaps its phases, its DRAM round trip or its barriers
    lat = (dev.dram_latency + drains + w.chain) if alone else np.full(n, w.chain / share)
    once = 0.0 if alone else dev.dram_latency
    limits = {k: makespan(v, slots) for k, v in t.items()}
    # DRAM and L2 are the device's, not an SM's: their floors are the bytes at the whole rate (a few CTAs
    # may pull more than their SMs' share); the expected time keeps each CTA at its slot's share
    limits["dram"], limits["l2"] = float(dram.sum()) / dev.bw, float(l2.sum()) / dev.l2_bw
    limits["latency"] = makespan(lat, slots) + once
    issue_t = instr / rate(dev.issue_rate)
    if alone and warps <= dev.issue_per_sm:   # each scheduler holds one warp: what is not in an MMA stretch waits
        sm = np.maximum(np.maximum(t["tensor"], t["smem"]) + serial, issue_t)
    else:
        sm = np.maximum.reduce([t["tensor"], t["smem"], issue_t])
    # the memory side, the device's: the launch's bytes at the whole rate, or the bytes of the SM that
    # holds the most (its CTAs longest first onto the SMs) at what one SM can pull, whichever is longer
    # (a few CTAs on idle SMs are not held to their fair share; two on one SM share its rate)
    mem = max(limits["dram"], limits["l2"], makespan(dram / dev.sm_bw, dev.sms))
    sm_side = makespan(sm, slots)
    expected = (max(sm_side, mem) if (not alone or asynchronous) else sm_side + mem) + makespan(lat, slots) + once
    expected = max(expected, max(limits.values()))
    return Priced(limits, expected, waves, per_sm, float(f32_instr.sum()), float(np.sum(instr)), float(wf.sum()),
                  float(ideal.sum()), counted)
