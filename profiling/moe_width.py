"""The verify width by gain on a MoE trunk, its rows routed together and apart, against every fixed width.

    python profiling/moe_width.py [--tokens 96] [--repeat 3] [--hit-rate 0.8]

A tiny MoE trunk on numpy (f32; every layer sparse, 128 experts of width 512, top-4, no shared
expert), built twice, with one router each:
* together: the router's weights zero, so every logit ties and every row takes experts 0..3 (ties go
  to the lower index): a verify of any width reads the same 4 experts a layer;
* apart: a random router, each row's top-4 about independent of the others': 8 rows read about 29
  distinct experts a layer.
The drafter has no confidence head (as DFlash, the one published for Qwen3.5-35B-A3B): a bigram
drafter proposing the trunk's own greedy continuation at `--hit-rate`, block 8. So the width by gain
reads the session's acceptance by draft position and the cost model's price of each width, whose
experts come from the session's own routing (dspark.cost, "Experts").

For each router: greedy generation of `--tokens` tokens at verify="gain" and at each fixed width 2..8
(verify="full", max_verify=w), all under policy "always" (no demotion), interleaved `--repeat` times
in one process on one cost model (warmed by one run of each first). Prints the widths gain chose
(their mean), the distinct experts per layer of its verifies, tokens/s of each (the median run),
gain over the best fixed width, and the noise: the median over the configurations of the spread of
their runs' times, (max - min) / median. Every stream is checked equal to plain decode.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark import cost  # noqa: E402
from dspark.backends import get_backend  # noqa: E402
from dspark.cost import CostModel  # noqa: E402
from dspark.decode import plain_generate  # noqa: E402
from dspark.models.oracle import bigram_drafter, greedy_continuation  # noqa: E402
from dspark.models.presets import TINY_DRAFTER, TINY_TRUNK  # noqa: E402
from dspark.models.trunk import HybridTrunk  # noqa: E402
from dspark.models.weights import random_weights, trunk_spec  # noqa: E402
from dspark.session import DsparkSpecSession, SpecParams, spec_round  # noqa: E402

MOE = replace(TINY_TRUNK, ffn=("moe",) * 4, experts=128, expert_top_k=4, expert_hidden=512, expert_renorm=True,
              max_ctx=256)
DRAFTER = replace(TINY_DRAFTER, block=8, confidence="none")
WIDTHS = tuple(range(2, DRAFTER.drafts + 2))  # anchor + 1 .. every draft
PROMPT = np.arange(5, 80, 5, dtype=np.int32)


def trunk_routed(be, together: bool) -> HybridTrunk:
    w = random_weights(trunk_spec(MOE), 7)
    for i in range(len(MOE.layers)):
        if together:
            w[f"layers.{i}.moe.router"][...] = 0.0
    return HybridTrunk(MOE, w, be)


def generate(trunk, drafter, n: int, verify: str, width: int | None) -> tuple[float, list[int], list, list]:
    """(seconds, tokens, widths verified, distinct experts per layer of each verify)."""
    params = SpecParams(max_new_tokens=n, verify=verify, max_verify=width or 0, policy="always")
    model = cost.cost_model(trunk.be)
    model.experts_log.clear()
    t0 = time.perf_counter()
    s = DsparkSpecSession.prime(trunk, drafter, PROMPT, params)
    while not s.finished():
        spec_round([s])
    sec = time.perf_counter() - t0
    log = [e for kind, *_, e in model.experts_log if kind == "verify"]  # the last EXPERTS_LOG passes
    out = list(s.emitted)
    widths = [w for w, count in s.stats.widths.items() for _ in range(count)]
    s.close()
    return sec, out, widths, log


def run_case(be, together: bool, n: int, repeat: int, hit_rate: float) -> dict:
    trunk = trunk_routed(be, together)
    cont = greedy_continuation(trunk, PROMPT, n + DRAFTER.block)
    drafter = bigram_drafter(trunk, [np.concatenate([[PROMPT[-1]], cont])], hit_rate, 3, config=DRAFTER)
    want = plain_generate(trunk, PROMPT, n, launches="plain")
    secs = {k: [] for k in ("gain", *WIDTHS)}
    chosen, experts = [], []
    with cost.using(be, CostModel()):  # the CPU's own (a fresh one for each router)
        for i in range(repeat + 1):  # the first pass of each warms the cost model and is not kept
            for key in secs:
                sec, out, widths, log = generate(trunk, drafter, n, "gain" if key == "gain" else "full",
                                                 None if key == "gain" else key)
                assert out == want, f"{key}: the stream differs from plain decode"
                if i:
                    secs[key].append(sec)
                    if key == "gain":
                        chosen += widths
                        experts += [float(np.mean(e)) for e in log]
    rate = {k: n / float(np.median(v)) for k, v in secs.items()}
    best = max(WIDTHS, key=lambda w: rate[w])
    spread = float(np.median([(max(v) - min(v)) / np.median(v) for v in secs.values()]))
    return {"rate": rate, "best": best, "widths": chosen, "experts": experts, "spread": spread}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hit-rate", type=float, default=0.8)
    a = ap.parse_args()
    be = get_backend("numpy")
    print(f"tiny MoE trunk, numpy f32: {MOE.experts} experts of width {MOE.expert_hidden}, top-{MOE.expert_top_k}, "
          f"{len(MOE.layers)} MoE layers; drafter block {DRAFTER.block}, no confidence head, hit rate {a.hit_rate}; "
          f"{a.tokens} tokens, median of {a.repeat}")
    print(f"{'routing':9} {'gain widths (mean)':>19} {'experts/layer':>14} {'gain tok/s':>11} "
          + " ".join(f"{'w' + str(w):>7}" for w in WIDTHS) + "  gain / best fixed (noise: the runs' median spread)")
    for together in (True, False):
        r = run_case(be, together, a.tokens, a.repeat, a.hit_rate)
        rate = r["rate"]
        print(f"{'together' if together else 'apart':9} {np.mean(r['widths']):19.2f} {np.mean(r['experts']):14.1f} "
              f"{rate['gain']:11.1f} " + " ".join(f"{rate[w]:7.1f}" for w in WIDTHS)
              + f"  {rate['gain'] / rate[r['best']]:.2f} (best fixed: w{r['best']}; noise {r['spread']:.0%})")


if __name__ == "__main__":
    main()
