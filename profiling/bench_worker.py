"""Worker throughput and per-request latency under three gate settings, in one run:
low/high = 0/1 (never speculate), 2/4 (the default) and 64/65 (always speculate).

    python profiling/bench_worker.py [--backend numpy] [--model default|tiny] [--requests 12]

The same seeded arrival pattern runs under each gate; tokens/s is total emitted tokens over
wall time, latency is each request's submit-to-finish wall time (median and p90). Ratios are
against the 0/1 (plain) row of the same run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits

import dspark
from dspark.models import load_default
from dspark.models.presets import tiny_pair
from dspark.worker import GateConfig, Worker

GATES = [GateConfig(0, 1), GateConfig(2, 4), GateConfig(64, 65)]


def corpus_prompts(rng, n: int, vocab_bytes: bool) -> list[np.ndarray]:
    """Prompts: slices of this file's own source (real code bytes) for a byte-level model."""
    text = open(__file__, "rb").read()
    out = []
    for _ in range(n):
        start = int(rng.integers(0, len(text) - 200))
        out.append(np.frombuffer(text[start : start + int(rng.integers(24, 160))], np.uint8).astype(np.int32))
    return out if vocab_bytes else [p % 200 for p in out]


def run(trunk, drafter, gate: GateConfig, prompts, max_new: int, arrivals_per_step: int) -> dict:
    done_at: dict[int, float] = {}
    w = Worker(trunk, drafter, gate, on_tokens=lambda rid, toks, fin: fin and done_at.setdefault(rid, time.perf_counter()))
    queue = list(prompts)
    submitted: dict[int, float] = {}
    t0 = time.perf_counter()
    while queue or not w.done():
        for _ in range(min(arrivals_per_step, len(queue))):
            submitted[w.submit(queue.pop(0), max_new)] = time.perf_counter()
        w.step()
    wall = time.perf_counter() - t0
    tokens = sum(len(w.result(r)) for r in submitted)
    lat = np.array([done_at[r] - submitted[r] for r in submitted])
    return {"tokens": tokens, "wall": wall, "tps": tokens / wall, "lat_med": float(np.median(lat)),
            "lat_p90": float(np.quantile(lat, 0.9)), "mal": w.stats.mean_accepted_length}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=dspark.backends())
    ap.add_argument("--model", default="default", choices=["default", "tiny"])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--arrivals-per-step", type=int, default=2)
    args = ap.parse_args(argv)
    be = dspark.get_backend(args.backend)
    trunk, drafter = load_default(be) if args.model == "default" else tiny_pair(be, 0)
    prompts = corpus_prompts(np.random.default_rng(0), args.requests, args.model == "default")
    print(f"worker on {be.name}, model {args.model}: {args.requests} requests, {args.max_new} new tokens each, "
          f"{args.arrivals_per_step} arrivals per step")
    blas_one_thread = threadpool_limits(limits=1, user_api="blas")  # as the CLI: tiny GEMMs, steady timings
    print(f"{'gate low/high':>14} | {'tokens':>6} | {'tok/s':>8} | {'vs 0/1':>6} | {'latency med s':>13} | "
          f"{'p90 s':>6} | {'mean acc len':>12}")
    base = None
    for gate in GATES:
        r = run(trunk, drafter, gate, prompts, args.max_new, args.arrivals_per_step)
        base = base or r["tps"]
        print(f"{gate.low:>7}/{gate.high:<6} | {r['tokens']:6d} | {r['tps']:8.1f} | {r['tps'] / base:5.2f}x | "
              f"{r['lat_med']:13.3f} | {r['lat_p90']:6.3f} | {r['mal']:12.2f}")
    blas_one_thread.restore_original_limits()


if __name__ == "__main__":
    main()
