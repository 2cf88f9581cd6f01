"""dspark's own host work per speculative round at real shapes, measured on the CPU.

    python profiling/host_round.py [--model qwen3.5-27b qwen3-8b] [--batch 1 2] [--rounds 8] [--temperature T]
                                   [--rollback checkpoint|replay]

The null executor: the `cuda` code path on the CuPy contract stand-in (dspark.backends.contract)
with kernel execution off, over null memory (every array a shape, a dtype and a pointer of its
own, no memory: contract.null_memory) and placeholder weights (HybridTrunk.placeholder,
DsparkDrafter.placeholder), so Qwen3.5-27B's real weights, caches and per-column checkpoints fit
on this machine. Every launch is validated, packed and counted; nothing runs. Sessions are primed
on a short prompt and moved to `--context` committed rows (the positions the launch plans see);
every round verifies `--width` columns (the model's 8). Sessions are greedy, or with `--temperature`
T > 0 coupled sampled (top-k 50, each session its own seed): their picks' positions, seeds and
filters are inputs-block fields of the recorded passes.

Time: each round's CPU time in this thread (time.thread_time: waiting for a shared core does not
count), less the time the stand-in spends inside CuPy's
own entry points (contract.own_time: its Python stands where CuPy's Cython and the driver would
be), less the timer's own overhead per accounted call. What is left is dspark's own host work.
CuPy's own cost per call cannot be timed without a device: it is priced with the documented
constants of profiling/perf_model.py (Device.cupy_*; the GPU check measures them) and added in
the last columns. Figures are medians over `--rounds` rounds after two warm-up rounds, on the CPU
this runs on (two shared cores in CI).

Modes (`--mode`, SpecParams.launches; dspark.graphs):
* plain: the round op by op, every op validating its inputs and building its launch plan;
* eager: each pass recorded once per batch, then issued by the host launch by launch from the
  recording (plans and checked arguments reused);
* graph: the recordings captured as CUDA graphs and replayed, three graph launches a round.
Before item 2 of issue 22 (the fused kernels, the recordings) the round was the plain one of
that time: its row in profiling/RESULTS.md was measured at that commit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts
import perf_model as pm
from dspark import graphs, profile
from dspark.backends import contract
from dspark.dtypes import BF16
from dspark.models.drafter import DsparkDrafter
from dspark.models.trunk import HybridTrunk
from dspark.params import SamplingParams, SpecParams
from dspark.session import DsparkSpecSession, spec_round
from timing import table

PHASES = ("draft", "propose", "verify", "accept", "commit", "rollback", "ingest")


def null_pair(shape: pm.Shape):
    """(trunk, drafter) of `shape` on the stand-in's null memory, weights stored as the model
    prices them (bf16 for the real shapes)."""
    be = contract.backend()
    with contract.null_memory():
        trunk = HybridTrunk.placeholder(shape.trunk, be, BF16 if shape.weight_bytes == 2 else np.float32)
        drafter = DsparkDrafter.placeholder(shape.drafter, trunk)
    return trunk, drafter


def sessions_at(trunk, drafter, batch: int, context: int, width: int, mode: str = "graph",
                temperature: float = 0.0, rollback: str = "checkpoint") -> list:
    """`batch` sessions, greedy or (temperature > 0) coupled sampled, primed on 8 tokens and moved to
    `context` committed rows."""
    def params(b):
        return SpecParams(max_new_tokens=1 << 30, verify="full", max_verify=width, capture=False, launches=mode,
                          sampling=SamplingParams(temperature=temperature, top_k=50 if temperature else 0, seed=b),
                          rollback=rollback)
    with contract.null_memory(), contract.executing(False):
        sessions = [DsparkSpecSession.prime(trunk, drafter, np.arange(8, dtype=np.int32) + b, params(b))
                    for b in range(batch)]
    for s in sessions:
        s.cache.pos = s.kv.pos = s.prompt_len = context
    return sessions


def cupy_us(c: profile.Counts, dev: pm.Device) -> float:
    """CuPy's own host time of the calls counted in `c`, at the model's documented constants."""
    issued = c.launches - c.graph_nodes  # a graph's kernels cost the host nothing of their own
    return 1e6 * (issued * dev.cupy_launch + c.array_ops * dev.cupy_array_op + (c.h2d + c.d2h) * dev.cupy_copy
                  + c.graphs * dev.graph_launch)


def time_rounds(sessions, rounds: int, warmup: int = 2):
    """(dspark's own seconds per round [rounds], Counts of the timed rounds, phase -> seconds in
    all) of greedy rounds of `sessions` on the null executor."""
    overhead = contract.own_overhead()
    with contract.null_memory(), contract.executing(False):
        for _ in range(warmup):
            spec_round(sessions)
        per_round = []
        with profile.counting() as counts, contract.own_time() as own:
            def clock():  # dspark's own time so far
                return time.thread_time_ns() - own.ns - own.calls * overhead * 1e9
            with profile.phase_times(clock) as phases:
                for _ in range(rounds):
                    t = clock()
                    spec_round(sessions)
                    per_round.append((clock() - t) * 1e-9)
    return per_round, counts, {k: v * 1e-9 for k, v in phases.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["qwen3.5-27b", "qwen3-8b"], choices=list(pm.shapes()))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--mode", nargs="+", default=["plain", "eager", "graph"], choices=["plain", "eager", "graph"])
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy sessions; > 0: coupled sampled sessions at this temperature (top-k 50)")
    ap.add_argument("--rollback", default="checkpoint", choices=["checkpoint", "replay"],
                    help="SpecParams.rollback: what the verify keeps for the commit (per-column states, or inputs)")
    a = ap.parse_args(argv)
    dev = pm.H200
    shapes = pm.shapes()
    rows, where, held = [], [], []
    for name in a.model:
        trunk, drafter = null_pair(shapes[name])
        for b in a.batch:
            for mode in a.mode:
                sessions = sessions_at(trunk, drafter, b, a.context, a.width, mode, a.temperature, a.rollback)
                per_round, c, phases = time_rounds(sessions, a.rounds)
                if mode != "plain":
                    runner = graphs.round_graphs(drafter, mode)
                    held.append([shapes[name].label, str(b), mode, str(len(runner.store)),
                                 f"{runner.workspace_bytes() / 2**20:,.1f}"])
                for s in sessions:
                    s.close()
                own = statistics.median(per_round)
                calls = c.launches - c.graph_nodes + c.array_ops + c.graphs  # the calls the host made
                cupy = cupy_us(c, dev) / a.rounds
                rows.append([shapes[name].label, str(b), mode, f"{c.launches / a.rounds:,.0f}",
                             f"{c.array_ops / a.rounds:,.0f}", f"{(c.h2d + c.d2h) / a.rounds:,.0f}",
                             f"{c.graphs / a.rounds:,.0f}", f"{own * 1e6:,.0f}",
                             f"{own * 1e6 / max(calls / a.rounds, 1):,.1f}", f"{cupy:,.0f}", f"{own * 1e6 + cupy:,.0f}"])
                total = sum(phases.values())
                where.append([shapes[name].label, str(b), mode]
                             + [f"{phases.get(p, 0) / total:.0%}" for p in PHASES])
    rule = (f"coupled sampled sessions (T = {a.temperature:g}, top-k 50)" if a.temperature else "greedy sessions") \
        + f", rollback {a.rollback}"
    print(f"dspark's own host time per round on the null executor (CuPy {contract.CUPY_VERSION} stand-in, execution "
          f"off, null memory), {rule}, context {a.context}, {a.width} verify columns, median of {a.rounds} rounds; CuPy's own "
          f"cost per call priced at launch {dev.cupy_launch * 1e6:.0f} us, array op {dev.cupy_array_op * 1e6:.0f} us, "
          f"copy {dev.cupy_copy * 1e6:.0f} us, graph launch {dev.graph_launch * 1e6:.0f} us (perf_model.Device)")
    print(table(["shape", "B", "mode", "launches", "array ops", "copies", "graphs", "dspark us", "us per call",
                 "CuPy us", "host us"], rows))
    print("\nwhere dspark's own time goes, by round phase (the rest: the session's host logic between phases; a "
          "recorded round's draft phase holds its proposal, its verify its accept, its commit its rollback and ingest):")
    print(table(["shape", "B", "mode", *PHASES], where))
    if held:
        print("\nrecorded passes kept after the run and their workspaces (every output and temporary of a pass, the "
              "verify's per-layer K/V scratch and per-column checkpoints included; one per pass kind and batch size):")
        print(table(["shape", "B", "mode", "recordings", "workspace MiB"], held))
    return 0


if __name__ == "__main__":
    sys.exit(main())
