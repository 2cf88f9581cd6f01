"""Worker throughput and per-request latency under three gate settings, in one run:
low/high = 0/1 (never speculate), 2/4 (the default) and 64/65 (always speculate).

    python profiling/bench_worker.py [--backend numpy] [--model default|tiny] [--requests 12]
    python profiling/bench_worker.py --workload mixed [--requests 12]
    python profiling/bench_worker.py --workload poisoned [--requests 6] [--repeat 3]

The same seeded arrival pattern runs under each gate; tokens/s is total emitted tokens over
wall time, latency is each request's submit-to-finish wall time (median and p90). Ratios are
against the 0/1 (plain) row of the same run.

`--workload mixed`: every other request is greedy on held-out code (the embedded pair accepts it
well), the others sampled at temperature 1.0, top-p 0.95 (coupled sampler: they accept poorly).
`--arrivals-per-step 0` sends each request when the last one is done (one at a time). Rows: all plain (gate 0/1),
all speculative (gate 64/65, SpecParams(policy="always")), and the gain policy (gate 64/65 and
2/4, policy "gain", each with a fresh cost model: its decisions rest on what that run measured
and the prior), and the gain policy at 64/65 with the plain batch a pass of its own
(Worker(mix=False), the worker before plain rows rode the rounds), with the decisions each gain
row made (admitted speculative / plain, demoted, by reason; rounds that carried the plain batch
and plain steps run alone). The ratio of the gain row to the better of the first two is the
figure that matters: the median over `--repeat` interleaved runs, and each run's own ratio (the
rows of one repeat run back to back, each repeat starting at the next row). The load average is printed before and after.

`--workload poisoned`: the gain policy's memory of past sessions (dspark.memory), greedy requests
one at a time. Three sequences: "poor, then code" (a list of numbers, which the embedded pair
drafts at about 2.5 tokens a round, then `--requests` held-out code prompts, all without a
namespace), "poor elsewhere" (the same with the numbers in another namespace) and "poor only"
(`--requests` random printable strings that the pair drafts at under 2 tokens a round in
`--max-new` tokens, screened from a seeded stream of them, sent three times over in one
namespace: what the memory saves by sending them plain and what its exploration costs; the
trunk falls into a repetition on most random text, where the pair drafts 5 or more). Rows: all plain, all speculative,
the gain policy, the gain policy with the memory as it was before it was a prior (its first
session's tokens per round for every later session of its kind, in every namespace) and without
exploration. Printed per sequence and row: the median tokens/s over `--repeat` interleaved runs,
its ratio to all plain, and for the first two sequences the code requests' own tokens/s (their
tokens over their wall time) and ratio; with the gain rows' admissions and demotions over all runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

import dspark
from dspark.models import load_default
from dspark.models.presets import tiny_pair
from dspark.params import SamplingParams, SpecParams
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


def run(trunk, drafter, gate: GateConfig, prompts, max_new: int, arrivals_per_step: int, spec=None,
        samplings=None, mix: bool = True, namespaces=None) -> dict:
    done_at: dict[int, float] = {}
    w = Worker(trunk, drafter, gate, spec=spec, mix=mix,
               on_tokens=lambda rid, toks, fin: fin and done_at.setdefault(rid, time.perf_counter()))
    queue = list(zip(prompts, samplings or [None] * len(prompts), namespaces or [None] * len(prompts)))
    submitted: dict[int, float] = {}
    t0 = time.perf_counter()
    while queue or not w.done():
        arrivals = arrivals_per_step if arrivals_per_step else int(w.done())  # 0: one request at a time
        for _ in range(min(arrivals, len(queue))):
            p, sampling, ns = queue.pop(0)
            submitted[w.submit(p, max_new, sampling, namespace=ns)] = time.perf_counter()
        w.step()
    wall = time.perf_counter() - t0
    tokens = sum(len(w.result(r)) for r in submitted)
    lat = np.array([done_at[r] - submitted[r] for r in submitted])
    return {"tokens": tokens, "wall": wall, "tps": tokens / wall, "lat_med": float(np.median(lat)),
            "lat_p90": float(np.quantile(lat, 0.9)), "mal": w.stats.mean_accepted_length, "metrics": w.metrics(),
            "each": [(len(w.result(r)), float(done_at[r] - submitted[r])) for r in submitted]}


def decisions(metrics: dict) -> str:
    def part(name):
        return "+".join(f"{n} {why}" for why, n in sorted(metrics[f"dspark:spec_{name}"].items())) or "0"
    return (f"spec {part('admitted_spec')}, plain {part('admitted_plain')}, demoted {part('demoted')}; "
            f"{metrics['dspark:mixed_rounds']} rounds carried plain rows, {metrics['dspark:plain_steps']} plain steps alone")


def heldout_code(n: int) -> list[np.ndarray]:
    """The last 96 bytes of the held-out prompts (code the embedded pair never saw, on which it
    accepts well: tests/session/heldout_prompts.json)."""
    path = Path(__file__).resolve().parent.parent / "tests" / "session" / "heldout_prompts.json"
    hexes = json.loads(path.read_text())["prompts"]
    return [np.frombuffer(bytes.fromhex(hexes[i % len(hexes)])[-96:], np.uint8).astype(np.int32) for i in range(n)]


def mixed(trunk, drafter, prompts, args) -> None:
    """Greedy held-out code and hot sampled requests, alternating: all plain, all speculative, by gain."""
    from dspark import cost
    code = [c if args.model == "default" else c % 200 for c in heldout_code(len(prompts))]
    prompts = [code[i] if i % 2 == 0 else p for i, p in enumerate(prompts)]
    samplings = [None if i % 2 == 0 else SamplingParams(temperature=1.0, top_p=0.95, seed=i) for i in range(len(prompts))]
    rows = [("all plain", GateConfig(0, 1), SpecParams(policy="always"), True),
            ("all spec", GateConfig(64, 65), SpecParams(policy="always"), True),
            ("gain 64/65", GateConfig(64, 65), SpecParams(policy="gain"), True),
            ("gain 2/4", GateConfig(2, 4), SpecParams(policy="gain"), True),
            ("gain apart", GateConfig(64, 65), SpecParams(policy="gain"), False)]
    results = {name: [] for name, _, _, _ in rows}
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for i in range(args.repeat):  # rows interleaved, so a slow spell of the machine hits every row, in turn first
        for name, gate, spec, mix in rows[i % len(rows):] + rows[: i % len(rows)]:
            drafter.acceptance.clear()  # each row learns only from its own sessions
            with cost.using(trunk.be, cost.CostModel(cost.clock_for(trunk.be))):
                results[name].append(run(trunk, drafter, gate, prompts, args.max_new, args.arrivals_per_step, spec,
                                         samplings, mix))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"median of {args.repeat} interleaved runs per row; 'gain apart': gain 64/65 with the plain batch a pass "
          "of its own (Worker(mix=False))")
    print(f"{'policy':>10} | {'tokens':>6} | {'tok/s':>8} | {'vs best of plain/spec':>21} | {'each run (all: tok/s)':>22} | "
          f"{'mean acc len':>12} | decisions (last run)")
    med = {name: float(np.median([r["tps"] for r in rs])) for name, rs in results.items()}
    best = max(med["all plain"], med["all spec"])
    for name, rs in results.items():
        r = rs[-1]
        vs = f"{med[name] / best:20.2f}x" if not name.startswith("all") else " " * 21
        each = [x["tps"] / max(p["tps"], s["tps"]) for x, p, s in zip(rs, results["all plain"], results["all spec"])]
        runs = " ".join(f"{e:.2f}" for e in each) if not name.startswith("all") else \
            " ".join(f"{x['tps']:.0f}" for x in rs)
        print(f"{name:>10} | {r['tokens']:6d} | {med[name]:8.1f} | {vs} | {runs:>22} | {r['mal']:12.2f} | "
              f"{decisions(r['metrics']) if 'gain' in name else ''}")


NUMBERS = "x = [0.9134, 0.2207, 0.7781, 0.0452, 0.6619, 0.3308, "  # ~2.5 tokens a round on the embedded pair


def poor_prompts(trunk, drafter, n: int, max_new: int) -> tuple[list[np.ndarray], int]:
    """The first `n` of a seeded stream of random printable strings (80 characters) that the pair
    drafts at under 2 tokens a round over `max_new` tokens, greedy; and how many were tried."""
    import string
    from dspark.byte_vocab import encode
    from dspark.session import DsparkSpecSession
    rng = np.random.default_rng(1)
    chars = list(string.ascii_letters + string.digits + string.punctuation)
    out, tried = [], 0
    while len(out) < n:
        p = encode("".join(rng.choice(chars, 80)))
        tried += 1
        s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=max_new, capture=False))
        while not s.finished():
            s.round()
        s.close()
        if s.stats.mean_accepted_length < 2.0:
            out.append(p)
    return out, tried


@contextlib.contextmanager
def memory_as_before():
    """The gain policy's memory as it was before it was a prior: the first session remembered
    predicts every later one of its kind, whatever its namespace (an average that took its first
    sample as its value)."""
    from dspark import memory

    def remember(self, key, tokens_per_round, tokens):
        self.buckets.setdefault(key[1:], tokens_per_round)

    def predict(self, key, record):
        return self.buckets.get(key[1:], record)
    saved = memory.Memory.remember, memory.Memory.predict, memory.Memory.arrival
    memory.Memory.remember, memory.Memory.predict = remember, predict
    memory.Memory.arrival = lambda self, key, record: (predict(self, key, record), False)
    try:
        yield
    finally:
        memory.Memory.remember, memory.Memory.predict, memory.Memory.arrival = saved


@contextlib.contextmanager
def no_exploration():
    from dspark import memory
    saved, memory.EXPLORE_EVERY = memory.EXPLORE_EVERY, 1 << 30
    try:
        yield
    finally:
        memory.EXPLORE_EVERY = saved


def admissions(runs: list[dict]) -> str:
    """Speculative and plain admissions and demotions, summed over `runs`."""
    def count(name):
        return sum(sum(r["metrics"][f"dspark:spec_{name}"].values()) for r in runs)
    return (f"spec {count('admitted_spec')}, plain {count('admitted_plain')}, demoted {count('demoted')} "
            f"over {len(runs)} runs")


def poisoned(trunk, drafter, args) -> None:
    """The memory of past sessions under poorly drafted requests (module doc)."""
    from dspark import cost
    from dspark.byte_vocab import encode
    code = [c if args.model == "default" else c % 200 for c in heldout_code(args.requests)]
    poor, tried = poor_prompts(trunk, drafter, args.requests, args.max_new)  # also warms the speculative path
    print(f"poor only: {len(poor)} random strings drafted at under 2 tokens a round, of {tried} tried")
    sequences = {"poor, then code": [(encode(NUMBERS), None)] + [(c, None) for c in code],
                 "poor elsewhere": [(encode(NUMBERS), "other")] + [(c, None) for c in code],
                 "poor only": [(p, "a") for p in poor * 3]}
    run(trunk, drafter, GateConfig(0, 1), code[:2], args.max_new, 0)  # warms the plain path, untimed
    rows = [("all plain", GateConfig(0, 1), "always", contextlib.nullcontext),
            ("all spec", GateConfig(64, 65), "always", contextlib.nullcontext),
            ("gain", GateConfig(64, 65), "gain", contextlib.nullcontext),
            ("gain, memory before", GateConfig(64, 65), "gain", memory_as_before),
            ("gain, no exploring", GateConfig(64, 65), "gain", no_exploration)]
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = {(q, r[0]): [] for q in sequences for r in rows}
    for i in range(args.repeat):  # rows interleaved, each repeat starting at the next row
        for name, gate, policy, patch in rows[i % len(rows):] + rows[: i % len(rows)]:
            for q, reqs in sequences.items():
                drafter.acceptance.clear()  # each run learns only from its own sessions
                with patch(), cost.using(trunk.be, cost.CostModel(cost.clock_for(trunk.be))):
                    results[q, name].append(run(trunk, drafter, gate, [p for p, _ in reqs], args.max_new, 0,
                                                SpecParams(policy=policy), namespaces=[ns for _, ns in reqs]))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"greedy requests one at a time, {args.max_new} new tokens each; median of {args.repeat} interleaved runs")
    print(f"{'sequence':>16} | {'row':>19} | {'tok/s':>7} | {'vs plain':>8} | {'code tok/s':>10} | {'vs plain':>8} | "
          "decisions (all runs)")
    for q, reqs in sequences.items():
        base = np.median([r["tps"] for r in results[q, "all plain"]])
        code_rate = {}
        for name, *_ in rows:
            rs = results[q, name]
            tps = float(np.median([r["tps"] for r in rs]))
            code = [sum(t for t, _ in r["each"][1:]) / sum(s for _, s in r["each"][1:]) for r in rs]
            code_rate[name] = float(np.median(code))
            codes = (f"{code_rate[name]:10.1f} | {code_rate[name] / code_rate['all plain']:7.2f}x"
                     if q != "poor only" else f"{'':>10} | {'':>8}")
            print(f"{q:>16} | {name:>19} | {tps:7.1f} | {tps / base:7.2f}x | {codes} | "
                  f"{admissions(rs) if 'gain' in name else ''}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=dspark.backends())
    ap.add_argument("--model", default="default", choices=["default", "tiny"])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--arrivals-per-step", type=int, default=2, help="0: the next request arrives when the last is done")
    ap.add_argument("--workload", default="code", choices=["code", "mixed", "poisoned"])
    ap.add_argument("--repeat", type=int, default=3, help="--workload mixed or poisoned: runs per row, interleaved")
    args = ap.parse_args(argv)
    be = dspark.get_backend(args.backend)
    trunk, drafter = load_default(be) if args.model == "default" else tiny_pair(be, 0)
    prompts = corpus_prompts(np.random.default_rng(0), args.requests, args.model == "default")
    print(f"worker on {be.name}, model {args.model}: {args.requests} requests, {args.max_new} new tokens each, "
          f"{args.arrivals_per_step} arrivals per step")
    blas_one_thread = threadpool_limits(limits=1, user_api="blas")  # as the CLI: tiny GEMMs, steady timings
    if args.workload != "code":
        if args.workload == "mixed":
            mixed(trunk, drafter, prompts, args)
        else:
            poisoned(trunk, drafter, args)
        blas_one_thread.restore_original_limits()
        return
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
