"""Rounds as a user waits for them, op by op, issued from their recordings, and replayed as CUDA
graphs, on a GPU; and CuPy's own per-call costs, which the CPU measurements price as constants.

    python profiling/graph_rounds.py                      # on the GPU: Qwen3.5-27B, B = 1 and 2, 32k
    python profiling/graph_rounds.py --backend contract   # anywhere: the tiny pair on the CuPy stand-in
    python profiling/graph_rounds.py --temperature 0.8    # coupled sampled rounds and sampled steps

A round's time is its wall time from the first launch to the end of its last pass (a device
synchronisation after it: the commit pass is asynchronous), median over --rounds rounds after two
warm-up rounds (the recordings and captures), for each SpecParams.launches mode; beside it the
round profiling/perf_model.py predicts for that mode, and the plain decode step likewise. The
weights are placeholders (zeros: HybridTrunk.placeholder), the sessions are moved to --context
committed rows: every kernel runs at the real shapes, and what they compute does not matter.

CuPy's costs (host time per call, median of 5 runs of --calls calls): a RawKernel launch, a
Graph.launch, a small upload (`ndarray.set`), and the GPU time per node of a replayed graph of
--calls kernels (CUDA events): perf_model.Device's cupy_launch, graph_launch, cupy_copy, graph_node.
On the stand-in every figure is the CPU's: the run only shows that each step runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts
import host_round
import perf_model as pm
from dspark.session import spec_round
from dspark.decode import PlainBatch
from timing import table

MODES = ("plain", "eager", "graph")


def backend_of(name: str):
    if name == "contract":
        from dspark.backends import contract
        return contract.backend()
    import dspark
    return dspark.get_backend("cuda")


def pair(be, shape: pm.Shape):
    from dspark.dtypes import BF16
    from dspark.models.drafter import DsparkDrafter
    from dspark.models.trunk import HybridTrunk
    trunk = HybridTrunk.placeholder(shape.trunk, be, BF16 if shape.weight_bytes == 2 else np.float32)
    return trunk, DsparkDrafter.placeholder(shape.drafter, trunk)


def seconds(be, run, reps: int) -> list[float]:
    """Wall seconds of each of `reps` calls of run(), each followed by a device synchronisation."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        be.synchronize()
        out.append(time.perf_counter() - t)
    return out


def rounds(be, trunk, drafter, batch: int, context: int, width: int, reps: int, temperature: float = 0.0) -> dict:
    """mode -> (median seconds of a spec round, of a plain decode step): greedy, or coupled sampled
    rounds and sampled decode steps at `temperature`."""
    out = {}
    for mode in MODES:
        sessions = host_round.sessions_at(trunk, drafter, batch, context, width, mode, temperature)
        samplings = [s.params.sampling if temperature else None for s in sessions]
        for _ in range(2):
            spec_round(sessions)
        spec = statistics.median(seconds(be, lambda: spec_round(sessions), reps))
        caches = [s.into_demoted()[0] for s in sessions]
        plain = PlainBatch(trunk, mode)
        for c, sp in zip(caches, samplings):
            plain.join(c, 0, 1 << 30, sampling=sp)
        for _ in range(2):
            plain.step()
        step = statistics.median(seconds(be, plain.step, reps))
        for c in caches:
            c.free()
        out[mode] = (spec, step)
    return out


def cupy_costs(be, calls: int, gpu: bool) -> dict[str, float]:
    """CuPy's own costs: seconds per RawKernel launch, Graph.launch and small upload (host), and
    per node of a replayed graph (device)."""
    xp = be.xp
    fn = be.kernels.get_function("sigmoid_bias_f32")
    x, bias, y = xp.zeros(1, np.float32), xp.zeros(1, np.float32), xp.zeros(1, np.float32)
    args = (x, bias, np.int32(1), y)
    raw = fn._raw
    stream = xp.cuda.Stream(non_blocking=True)

    def host(run) -> float:
        runs = []
        for _ in range(5):
            be.synchronize()
            t = time.perf_counter()
            run()
            runs.append((time.perf_counter() - t) / calls)
            be.synchronize()
        return statistics.median(runs)

    def launches():
        for _ in range(calls):
            raw((1,), (256,), args, shared_mem=0)
    with stream:
        stream.begin_capture()
        raw((1,), (256,), args, shared_mem=0)
        one = stream.end_capture()
        stream.begin_capture()
        launches()
        many = stream.end_capture()
    host_buf, dev = np.zeros(64, np.uint8), xp.zeros(64, np.uint8)
    out = {"cupy_launch": host(launches), "graph_launch": host(lambda: [one.launch(stream) for _ in range(calls)]),
           "cupy_copy": host(lambda: [dev.set(host_buf) for _ in range(calls)])}
    if gpu:
        start, end = xp.cuda.Event(), xp.cuda.Event()
        times = []
        for _ in range(5):
            start.record(stream)
            many.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(xp.cuda.get_elapsed_time(start, end) * 1e-3 / calls)
        out["graph_node"] = statistics.median(times)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("cuda", "contract"), default="cuda")
    ap.add_argument("--model", default=None, help="a perf_model shape (default: qwen3.5-27b on cuda, embedded on the stand-in)")
    ap.add_argument("--batch", nargs="+", type=int, default=None)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; > 0: coupled sampled rounds and sampled decode steps (top-k 50)")
    a = ap.parse_args(argv)
    on_gpu = a.backend == "cuda"
    model = a.model or ("qwen3.5-27b" if on_gpu else "embedded")
    batches = a.batch or ([1, 2] if on_gpu else [1])
    context = a.context or (32768 if on_gpu else 200)
    be = backend_of(a.backend)
    shape = pm.shapes()[model]
    trunk, drafter = pair(be, shape)
    rows = []
    for B in batches:
        got = rounds(be, trunk, drafter, B, context, a.width, a.rounds, a.temperature)
        for mode in MODES:
            r = pm.spec_round(shape, B, context, a.width, mode=mode)
            spec, step = got[mode]
            rows.append([shape.label, str(B), str(context), mode, f"{step * 1e6:,.0f}", pm.us(r.plain_time()),
                         f"{spec * 1e6:,.0f}", pm.us(r.time()), f"{step / spec:.2f}"])
    where = "the GPU" if on_gpu else "the CuPy stand-in (CPU: not the GPU's figures)"
    rule = f"coupled sampled at T = {a.temperature:g}" if a.temperature else "greedy"
    print(f"rounds on {where} ({rule}): wall time per plain decode step and per speculative round, median of "
          f"{a.rounds}, beside profiling/perf_model.py's prediction for the same mode (a greedy one)")
    print(table(["shape", "B", "context", "mode", "step us", "model step us", "round us", "model round us",
                 "step / round"], rows))
    costs = cupy_costs(be, a.calls, on_gpu)
    dev = pm.H200
    print(f"\nCuPy's own costs on {where}, median of 5 runs of {a.calls} calls, beside the model's constants:")
    print(table(["cost", "measured us", "perf_model us"],
                [[k, f"{v * 1e6:.2f}", f"{getattr(dev, k) * 1e6:.2f}"] for k, v in costs.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
