"""What a round and a plain step take on the host, greedy and coupled sampled, in one run: the
figures the gain policy's cost model divides (dspark.cost), measured outside it.

    python profiling/round_seconds.py [--backend numpy] [--rounds 40] [--repeat 3] [--proposals] [--widths]
        [--levels]

The embedded pair on the demo's code prompt, one BLAS thread: a greedy session and a coupled
session at temperature 0.3 (seed 1) run `--rounds` rounds each after 3 untimed ones, and plain
decode greedy and sampled runs as many steps from the same prompt, in alternating order,
`--repeat` times. Printed per mode: the median milliseconds of a round or step, tokens per round,
and the round's cost in plain steps of its kind (a coupled round against a sampled plain step).
`--proposals` also times coupled rounds whose proposal runs as the kernels' launch sequence
(`spec_sampling.propose_by_slots`, markov_logits and sample_filtered per slot) in place of the
host reference's chain (`propose_on_host`), interleaved with the others: the same tokens, the
round's time by each. Every mode starts with an empty memo of noise rows. `--widths` also prints
the trunk's verify pass at 1 .. 8 columns over its pass at one column (each width timed in turn,
`--rounds` times, on the primed prompt: a verify moves no state), the shape the cost model's prior
gives a verify (dspark.cost.VERIFY_PER_COLUMN) beside it. `--levels` also prints what the cost
model's level rests on, over `--rounds` greedy rounds, `--repeat` times: a round's own verify pass
over a lone verify of the same width just after it, the same over a lone one-column verify without
the per-column checkpoints (what the cost model's level was once paired with: the prior's verify
shape divides it out), and a plain step right after a round over the plain step after it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits

import dspark
from dspark.byte_vocab import encode
from dspark.cost import Prior
from dspark.cli import DEMO_PROMPT
from dspark.decode import PlainBatch, prefill_anchor
from dspark import spec_sampling
from dspark.models import load_default
from dspark.ops.sampling import GUMBEL_ROWS
from dspark.params import SamplingParams
from dspark.profile import phase_times
from dspark.session import DsparkSpecSession, SpecParams

SAMPLED = SamplingParams(temperature=0.3, seed=1)


def round_ms(trunk, drafter, prompt, sampling, n: int) -> tuple[float, float]:
    """(milliseconds a round, tokens a round) over n rounds after 3 untimed ones."""
    GUMBEL_ROWS.clear()
    s = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=10**6, policy="always",
                                                                   sampling=sampling or SamplingParams(),
                                                                   capture=False))
    for _ in range(3):
        s.round()
    toks, t0 = 0, time.perf_counter()
    for _ in range(n):
        toks += len(s.round())
    dt = time.perf_counter() - t0
    s.close()
    return 1e3 * dt / n, toks / n


def step_ms(trunk, prompt, sampling, n: int) -> float:
    """Milliseconds a plain decode step over n steps after 3 untimed ones."""
    GUMBEL_ROWS.clear()
    cache = trunk.new_cache()
    last, _ = prefill_anchor(trunk, cache, prompt, sampling)
    batch = PlainBatch(trunk)
    batch.join(cache, last, 10**6, sampling=sampling)
    for _ in range(3):
        batch.step()
    t0 = time.perf_counter()
    for _ in range(n):
        batch.step()
    dt = time.perf_counter() - t0
    cache.free()
    return 1e3 * dt / n


def verify_widths(trunk, drafter, prompt, n: int, widths=range(1, 9)) -> dict[int, float]:
    """Median seconds of the trunk's verify pass at each width, the widths timed in turn n times on
    the primed prompt (the verify leaves the cache as it is)."""
    s = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=64, policy="always", capture=False))
    times = {w: [] for w in widths}
    for _ in range(n + 1):  # the first sweep untimed
        for w in widths:
            cand = np.full(w, s.last, np.int32)
            t0 = time.perf_counter()
            trunk.verify([s.cache], [cand], checkpoints=True, taps=drafter.taps)
            times[w].append(time.perf_counter() - t0)
    s.close()
    return {w: float(np.median(t[1:])) for w, t in times.items()}


def verify_levels(trunk, drafter, prompt, n: int) -> tuple[np.ndarray, np.ndarray]:
    """What the cost model's level rests on (dspark.cost), over n greedy rounds after 3 untimed
    ones: each round's own verify pass over a lone verify of the same width on the same cache just
    after it; over a lone one-column verify without checkpoints, divided by the prior's verify shape
    at the round's width; and the first plain step after each round over the second (one after a
    plain step), of a plain sequence of the same prompt stepped beside it."""
    s = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=10**6, policy="always",
                                                                   capture=False))
    cache = trunk.new_cache()
    last, _ = prefill_anchor(trunk, cache, prompt, None)
    batch = PlainBatch(trunk)
    batch.join(cache, last, 10**6)
    verify, one, steps = [], [], []
    prior = Prior()
    for i in range(n + 3):
        with phase_times(time.perf_counter) as phases:
            s.round()
        w = s.recent[-1][1]
        t0 = time.perf_counter()
        trunk.verify([s.cache], [np.full(w, s.last, np.int32)], checkpoints=True, taps=drafter.taps)
        t1 = time.perf_counter()
        trunk.verify([s.cache], [np.array([s.last], np.int32)], taps=drafter.taps)
        t2 = time.perf_counter()
        batch.step()
        t3 = time.perf_counter()
        batch.step()
        t4 = time.perf_counter()
        if i >= 3:
            verify.append(phases["verify"] / (t1 - t0))
            one.append(phases["verify"] / (t2 - t1) / prior.verify(1, w, 0))
            steps.append((t3 - t2) / (t4 - t3))
    s.close()
    cache.free()
    return np.array(verify), np.array(one), np.array(steps)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--proposals", action="store_true",
                    help="also coupled rounds whose proposal is the launches' (propose_by_slots)")
    ap.add_argument("--widths", action="store_true", help="also the verify pass by width over one column")
    ap.add_argument("--levels", action="store_true",
                    help="also a round's verify over a lone verify, and a plain step after a round over one after a step")
    args = ap.parse_args(argv)
    be = dspark.get_backend(args.backend)
    trunk, drafter = load_default(be)
    prompt = encode(DEMO_PROMPT)
    runs = {k: [] for k in ("greedy round", "coupled round", "greedy step", "sampled step", "by slots")}
    tokens = {"greedy round": [], "coupled round": [], "by slots": []}
    with threadpool_limits(limits=1, user_api="blas"):
        for i in range(args.repeat):
            order = [("greedy", None), ("sampled", SAMPLED)]
            for name, sampling in order if i % 2 == 0 else order[::-1]:
                ms, tok = round_ms(trunk, drafter, prompt, sampling, args.rounds)
                kind = "greedy round" if sampling is None else "coupled round"
                runs[kind].append(ms)
                tokens[kind].append(tok)
                runs[f"{name} step"].append(step_ms(trunk, prompt, sampling, args.rounds))
            if args.proposals:
                host, spec_sampling.propose_on_host = spec_sampling.propose_on_host, spec_sampling.propose_by_slots
                try:
                    ms, tok = round_ms(trunk, drafter, prompt, SAMPLED, args.rounds)
                finally:
                    spec_sampling.propose_on_host = host
                runs["by slots"].append(ms)
                tokens["by slots"].append(tok)
    med = {k: float(np.median(v)) for k, v in runs.items() if v}
    print(f"embedded pair on {be.name}, demo prompt, {args.rounds} rounds / steps, median of {args.repeat}")
    for kind, step in (("greedy round", "greedy step"), ("coupled round", "sampled step")):
        print(f"{kind:>14}: {med[kind]:7.2f} ms, {np.mean(tokens[kind]):.2f} tokens a round, "
              f"{med[kind] / med[step]:.2f} plain steps ({step} {med[step]:.2f} ms)")
    if args.proposals:
        pair = np.array(runs["coupled round"]) / np.array(runs["by slots"])
        print(f"{'by slots':>14}: {med['by slots']:7.2f} ms, {np.mean(tokens['by slots']):.2f} tokens a round, "
              f"{med['by slots'] / med['sampled step']:.2f} plain steps; the host chain's round over it: "
              f"{np.median(pair):.2f} (paired {pair.min():.2f}-{pair.max():.2f})")
    if args.widths:
        with threadpool_limits(limits=1, user_api="blas"):
            sec = verify_widths(trunk, drafter, prompt, args.rounds)
        prior = Prior()
        print("verify pass over one column, by width (measured; the cost model's prior):")
        print("  " + "  ".join(f"{w}: {sec[w] / sec[1]:.2f} ({prior.verify(1, w, 0):.2f})" for w in sec))

    if args.levels:
        with threadpool_limits(limits=1, user_api="blas"):
            runs = [verify_levels(trunk, drafter, prompt, args.rounds) for _ in range(args.repeat)]
        for i, what in enumerate(("a round's verify over a lone verify of its width just after",
                                  "the same over a lone one-column verify without checkpoints, over the prior's "
                                  "shape at the round's width",
                                  "a plain step right after a round over the next one")):
            med = [float(np.median(r[i])) for r in runs]
            print(f"{what}: {np.median(med):.2f} (median of {args.rounds}; runs {' '.join(f'{x:.2f}' for x in med)})")


if __name__ == "__main__":
    main()
