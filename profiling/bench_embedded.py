"""The embedded pair's `dspark demo` workload on the numpy backend, this tree beside an earlier
commit's, in one run: plain and speculative greedy decode, tokens/s of each, interleaved.

    python profiling/bench_embedded.py --base REV [--repeats 5] [--max-new-tokens 256]

The earlier tree is `git archive REV` unpacked into a temporary directory (a tree from before
csrc/cpu needs no build; a later one gets its dspark._cpu built there; this tree's must be built:
pip install -e . or python setup.py build_ext --inplace). Each tree runs in its own child process (one dspark per interpreter) that loads the
pair once and then serves requests; the parent asks them in turn, so only one computes at a time,
and alternates which goes first. Each request is the demo's: its prompt, greedy, its verify policy,
tau and verify width (dspark.cli), one plain and one speculative generation, single-threaded BLAS
as the command line sets it. Prints the median tokens/s, this tree's speed over the earlier one's
for each, each tree's spec/plain ratio, and whether all four streams are the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
from dataclasses import replace
from threadpoolctl import threadpool_limits
import dspark
from dspark import cli
from dspark.byte_vocab import encode
from dspark.models import load_default
from dspark.session import SpecParams

be = dspark.get_backend("numpy")
trunk, drafter = load_default(be)
prompt = encode(cli.DEMO_PROMPT)
print(json.dumps({"ready": dspark.__file__}), flush=True)
with threadpool_limits(limits=1, user_api="blas"):
    for line in sys.stdin:
        req = json.loads(line)
        params = SpecParams(max_new_tokens=req["n"], verify="auto", tau=cli.DEMO_TAU, max_verify=cli.DEMO_MAX_VERIFY,
                            capture=False)
        if req["what"] == "spec":
            out, seconds, stats, _ = cli.run_spec(trunk, drafter, prompt, params)
        else:
            out, seconds, _ = cli.run_plain(trunk, prompt, req["n"])
        print(json.dumps({"tokens": [int(t) for t in out], "seconds": seconds}), flush=True)
"""


class Tree:
    """A child interpreter importing dspark from `root`."""

    def __init__(self, name: str, root: Path):
        env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=root, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        ready = json.loads(self.proc.stdout.readline())
        if not Path(ready["ready"]).resolve().is_relative_to(root.resolve()):
            raise RuntimeError(f"{name}: imported dspark from {ready['ready']}, not from {root}")

    def ask(self, what: str, n: int) -> dict:
        self.proc.stdin.write(json.dumps({"what": what, "n": n}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def unpack(rev: str, dest: Path) -> Path:
    """The tree at `rev`, its dspark._cpu built when it has one (with its own build helper)."""
    archive = dest / "base.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), rev], cwd=ROOT, check=True)
    tree = dest / "tree"
    with tarfile.open(archive) as t:
        t.extractall(tree, filter="data")
    if (tree / "csrc" / "cpu").is_dir():
        built = sorted((ROOT / "dspark").glob("_cpu.*"))
        if built and same_files(tree / "csrc" / "cpu", ROOT / "csrc" / "cpu"):  # this tree's build serves
            shutil.copy2(built[0], tree / "dspark" / built[0].name)
        else:
            subprocess.run([sys.executable, "-c", "from dspark.kernel_sources import build_cpu; build_cpu()"],
                           cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)), check=True)
    return tree


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all((a / n).read_bytes() == (b / n).read_bytes()
                                                                 for n in names)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        trees = [Tree(f"before ({rev})", unpack(args.base, Path(tmp))), Tree(f"this tree ({head})", ROOT)]
        try:
            seconds = {(t.name, w): [] for t in trees for w in ("plain", "spec")}
            streams = set()
            for r in range(args.repeats):
                for what in ("plain", "spec"):
                    for t in (trees if r % 2 == 0 else trees[::-1]):
                        got = t.ask(what, args.max_new_tokens)
                        seconds[(t.name, what)].append(got["seconds"])
                        streams.add(tuple(got["tokens"]))
                        n = len(got["tokens"])
        finally:
            for t in trees:
                t.close()
    print(f"embedded pair, numpy backend, the demo's workload ({n} new tokens, greedy), {args.repeats} runs each, "
          f"interleaved; medians")
    print(f"{'':24s} {'plain tok/s':>12s} {'spec tok/s':>12s} {'spec/plain':>11s}")
    tps = {}
    for t in trees:
        tps[t.name] = {w: n / float(np.median(seconds[(t.name, w)])) for w in ("plain", "spec")}
        p, s = tps[t.name]["plain"], tps[t.name]["spec"]
        print(f"{t.name:24s} {p:12.1f} {s:12.1f} {s / p:10.2f}x")
    before, after = (tps[t.name] for t in trees)
    print(f"{'this tree / before':24s} {after['plain'] / before['plain']:11.2f}x {after['spec'] / before['spec']:11.2f}x")
    same = len(streams) == 1
    print(f"all streams the same tokens: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
