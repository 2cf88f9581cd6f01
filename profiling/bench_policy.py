"""`dspark generate` under the gain policy against `--no-spec` and `--policy always`, in one run.

    python profiling/bench_policy.py [--backend numpy] [--repeat 3] [--max-new-tokens 256]

Each case runs the command line itself (`python -m dspark generate`, a fresh process per run, as a
user runs it) with the default options, alternating the three modes `--repeat` times; tokens/s is
the command's own figure (decode only, after the prompt), the ratio is the median over the runs of
a mode against the median of `--no-spec`. The last column is what the gain policy printed: whether
the session ran plain or speculative, and why, or when and why it was demoted.

Cases: temperature 0.8, top-p 0.95 on code (the coupled sampler accepts ~2.4 a round there);
temperature 0.3 on code (it accepts ~4); greedy on prompts whose mean accepted length is under 3
(a held-out prompt and a list of numbers).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dspark.cli import DEMO_PROMPT  # noqa: E402

NUMBERS = "x = [0.9134, 0.2207, 0.7781, 0.0452, 0.6619, 0.3308, "


def heldout(i: int) -> str:
    hexes = json.loads((ROOT / "tests" / "session" / "heldout_prompts.json").read_text())["prompts"]
    return bytes.fromhex(hexes[i]).decode("latin-1")


CASES = [
    ("T 0.8 top-p 0.95, code", DEMO_PROMPT, ["--temperature", "0.8", "--top-p", "0.95", "--seed", "1"]),
    ("T 0.3, code", DEMO_PROMPT, ["--temperature", "0.3", "--seed", "1"]),
    ("greedy, held-out #10", None, []),
    ("greedy, numbers", NUMBERS, []),
]
MODES = [("--no-spec", ["--no-spec"]), ("gain", []), ("always", ["--policy", "always"])]
LINE = re.compile(r"^\[(\d+) tokens in [0-9.]+s, ([0-9.]+) tokens/s, (.*); stopped: .*\]$", re.M)


def generate(prompt: str, extra: list[str], args) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "dspark", "generate", prompt, "--no-progress", "--max-new-tokens",
           str(args.max_new_tokens), *(["--backend", args.backend] if args.backend else []), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
    m = LINE.search(r.stderr)
    if m is None:
        raise RuntimeError(f"no summary line in: {r.stderr}")
    return float(m.group(2)), m.group(3)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--only", nargs="*", help="case numbers to run (default: all)")
    args = ap.parse_args(argv)
    print(f"dspark generate, embedded pair, {args.max_new_tokens} new tokens, median of {args.repeat} "
          "interleaved runs per mode")
    print(f"{'case':>24} | {'no-spec tok/s':>13} | {'gain':>6} | {'always':>6} | what the gain policy did (last run)")
    for i, (name, prompt, extra) in enumerate(CASES):
        if args.only and str(i) not in args.only:
            continue
        prompt = prompt if prompt is not None else heldout(10)
        tps = {mode: [] for mode, _ in MODES}
        note = ""
        for _ in range(args.repeat):
            for mode, flags in MODES:
                t, what = generate(prompt, extra + flags, args)
                tps[mode].append(t)
                note = what if mode == "gain" else note
        med = {mode: float(np.median(v)) for mode, v in tps.items()}
        base = med["--no-spec"]
        print(f"{name:>24} | {base:13.1f} | {med['gain'] / base:5.2f}x | {med['always'] / base:5.2f}x | {note}")


if __name__ == "__main__":
    main()
