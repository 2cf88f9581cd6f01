"""`dspark generate` under the gain policy against `--no-spec` and `--policy always`, timed in one
process, interleaved.

    python profiling/bench_policy.py [--backend numpy] [--repeat 9] [--max-new-tokens 256] [--only 0 1]

Fresh processes of `dspark generate` vary too much to decide a 0.95x line (one code path printed
161-253 tokens/s between processes on an idle machine), so the modes are timed in one process:
the pair is loaded once, and each run is `dspark.cli.generate`, the function `dspark generate`
calls (its warm-up included), with the command line's options and single-threaded BLAS. Before
every run the process-wide state a fresh process would not have is dropped: the backend's cost
model, the drafter's memory of earlier sessions' acceptance and the host's memo of noise rows; so
each run decides as a fresh `dspark generate` does. Every mode is run once untimed first, then the
three modes `--repeat` times in a rotating order. Tokens/s is the command's own figure (decode
only, after the prompt and the warm-up). Printed per mode: the median tokens/s and the spread (min
- max) over the repeats; the ratios are a mode's median over `--no-spec`'s, then the median of
the ratios of the runs paired by repeat (the three runs of a repeat are adjacent in time, so a
pair's ratio cancels the machine's slower drifts; two modes that both run plain differ by up to
10 % in the first figure on a shared machine), with their range. The last column is what the
gain policy did: in how many runs it ran plain, speculative to the end or demoted, and what it
printed in the last run. Then each case's line (the gain policy's ratio of medians at least
`LINES`' figure; T 0.3 speculative in every run), "met" or "MISSED", and the exit status is 1
where one is missed. The load average is printed before and after.

Cases: temperature 0.8, top-p 0.95 on code (the coupled sampler accepts ~2.4 a round there);
temperature 0.3 on code (it accepts ~3.5); greedy on prompts whose mean accepted length is under 3
(a held-out prompt and a list of numbers). The seeded and greedy streams are the same tokens in
every mode (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dspark  # noqa: E402
from dspark import cli  # noqa: E402
from dspark.byte_vocab import encode  # noqa: E402
from dspark.models import load_default  # noqa: E402
from dspark.ops.sampling import GUMBEL_ROWS  # noqa: E402
from dspark.params import SamplingParams  # noqa: E402
from dspark.session import SpecParams  # noqa: E402

NUMBERS = "x = [0.9134, 0.2207, 0.7781, 0.0452, 0.6619, 0.3308, "


def heldout(i: int) -> str:
    hexes = json.loads((ROOT / "tests" / "session" / "heldout_prompts.json").read_text())["prompts"]
    return bytes.fromhex(hexes[i]).decode("latin-1")


CASES = [
    ("T 0.8 top-p 0.95, code", cli.DEMO_PROMPT, SamplingParams(temperature=0.8, top_p=0.95, seed=1)),
    ("T 0.3, code", cli.DEMO_PROMPT, SamplingParams(temperature=0.3, seed=1)),
    ("greedy, held-out #10", None, SamplingParams()),
    ("greedy, numbers", NUMBERS, SamplingParams()),
]
MODES = ("--no-spec", "gain", "always")
# The lines, by case: the gain policy's ratio of medians at least this, and whether every
# run must stay speculative (so that "sampled means plain" does not pass).
LINES = {"T 0.8 top-p 0.95, code": (0.95, False), "T 0.3, code": (1.3, True),
         "greedy, held-out #10": (0.95, False), "greedy, numbers": (0.95, False)}


def fresh(be, drafter) -> None:
    """Drop what a fresh `dspark generate` process would not have: the cost model, the drafter's
    memory of earlier sessions, the memo of noise rows."""
    be.cost = None
    drafter.acceptance.clear()
    GUMBEL_ROWS.clear()


def params_of(sampling: SamplingParams, mode: str, max_new: int) -> SpecParams:
    """SpecParams as `dspark generate` builds them from its default options."""
    return SpecParams(max_new_tokens=max_new, verify="auto", tau=cli.DEMO_TAU, max_verify=cli.DEMO_MAX_VERIFY,
                      capture=False, sampling=sampling, sampler="coupled",
                      policy="always" if mode == "always" else "gain")


def run_once(be, trunk, drafter, prompt, sampling, mode: str, max_new: int):
    """One `dspark generate` run of `mode` -> (tokens/s, tokens, what ran and why)."""
    fresh(be, drafter)
    out, dt, _, note = cli.generate(trunk, drafter, prompt, params_of(sampling, mode, max_new),
                                    no_spec=mode == "--no-spec")
    return len(out) / dt, out, note


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--only", nargs="*", help="case numbers to run (default: all)")
    args = ap.parse_args(argv)
    be = dspark.get_backend(args.backend)
    trunk, drafter = load_default(be)
    print(f"dspark generate in one process, embedded pair on {be.name}, {args.max_new_tokens} new tokens, "
          f"{args.repeat} interleaved runs per mode; load average {load()}")
    print(f"{'case':>24} | {'no-spec tok/s':>19} | {'gain / no-spec (paired)':>26} | "
          f"{'always / no-spec (paired)':>26} | "
          "what the gain policy did (runs; the last one)")
    verdicts = []
    with threadpool_limits(limits=1, user_api="blas"):
        for i, (name, text, sampling) in enumerate(CASES):
            if args.only and str(i) not in args.only:
                continue
            prompt = encode(text if text is not None else heldout(10))
            for mode in MODES:  # untimed: every path warm before the first timed run
                run_once(be, trunk, drafter, prompt, sampling, mode, args.max_new_tokens)
            tps = {m: [] for m in MODES}
            streams, note, ran = set(), "", []
            for r in range(args.repeat):
                for mode in MODES[r % 3:] + MODES[: r % 3]:
                    t, out, what = run_once(be, trunk, drafter, prompt, sampling, mode, args.max_new_tokens)
                    tps[mode].append(t)
                    streams.add(tuple(out))
                    if mode == "gain":
                        note = what
                        ran.append("demoted" if "demoted" in what else what.split(":")[0].split(",")[0])
            base = np.array(tps["--no-spec"])
            cols = [f"{np.median(base):6.1f} ({base.min():5.1f}-{base.max():5.1f})"]
            for mode in MODES[1:]:
                v = np.array(tps[mode])
                pair = v / base
                cols.append(f"{np.median(v) / np.median(base):5.2f}x {np.median(pair):4.2f}x ({pair.min():4.2f}-{pair.max():4.2f})")
            same = "" if len(streams) == 1 else " STREAMS DIFFER"
            runs = ", ".join(f"{k} {ran.count(k)}/{len(ran)}" for k in dict.fromkeys(ran))
            print(f"{name:>24} | {cols[0]:>19} | {cols[1]:>26} | {cols[2]:>26} | [{runs}] {note}{same}", flush=True)
            floor, speculative = LINES[name]
            ratio = np.median(tps["gain"]) / np.median(base)
            ok = ratio >= floor and not same and (not speculative or ran.count("spec") == len(ran))
            verdicts.append(f"{name:>24}: gain {ratio:.2f}x, line >= {floor:g}x"
                            f"{', speculative in every run' if speculative else ''}: {'met' if ok else 'MISSED'}")
    print("\n".join(verdicts))
    print(f"load average {load()}")
    return 0 if all(v.endswith("met") for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
