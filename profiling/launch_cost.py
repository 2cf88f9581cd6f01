"""What one kernel launch costs the host: the ops' own host path (validation, launch plan, typed
arguments, the launch checks, CuPy's argument packing), timed on the CuPy contract stand-in with
kernel execution switched off (dspark.backends.contract.executing(False)), so only the host side
is measured. profiling/perf_model.py's `Device.launch` default is this command's result.

    python profiling/launch_cost.py [--reps 30]

Every benchmark call of profiling/bench_kernels.py at its CPU sizes (the host path does not depend
on the sizes) is timed `reps` times in this thread's CPU time (time.thread_time: waiting for a
shared CPU does not count); a family's cost per launch is the median over its calls of (seconds
per call / launches per call). With nothing executed an op's NaN flags hold whatever the memory
held: a NonFiniteError at its final check ends the call where it would have returned, and only
the launches it made count. The figure the model takes is their mean weighted by the
launches of each family in a Qwen3.5-27B round (B = 1, 32k context, 8 columns) as the model counts
them.

Not in it: the driver's own cuLaunchKernel (no GPU here) and CuPy's elementwise kernels (the
model's "array ops", priced at the same figure). The stand-in's argument packing is Python where
CuPy's is Cython. The number is this machine's CPU's: it is a measured default until a GPU
machine's benchmark of a whole round replaces it.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts
import bench_kernels
import perf_model as pm
from dspark import profile
from dspark.backends import contract
from dspark.errors import NonFiniteError
from dspark.kernel_sources import scan
from timing import table


def family_costs(reps: int) -> dict[str, list[float]]:
    """family -> seconds per launch of each benchmark call, host path only."""
    be = contract.backend()
    out: dict[str, list[float]] = {}
    for family, make in bench_kernels.FAMILIES.items():
        for bench in make(be, bench_kernels.CPU):
            bench.op(be)  # loads the module: not a per-launch cost
            per_launch = []
            with contract.executing(False):
                for _ in range(reps):
                    with profile.counting() as c:
                        t = time.thread_time()
                        try:
                            bench.op(be)
                        except NonFiniteError:  # the flags of kernels that did not run
                            pass
                        dt = time.thread_time() - t
                    if not c.launches:
                        raise RuntimeError(f"{family} {bench.case}: the op launched nothing")
                    per_launch.append(dt / c.launches)
            out.setdefault(family, []).append(statistics.median(per_launch))
    return out


def round_mix() -> Counter:
    """Launches per kernel family in the model's Qwen3.5-27B round (B = 1, 32k, 8 columns)."""
    entries = scan()
    r = pm.spec_round(pm.shapes()["qwen3.5-27b"], 1, 32768, 8)
    mix: Counter = Counter()
    for k in r.kernels:
        if k.entry:
            mix[Path(entries[k.entry].source).stem] += k.launches
    return mix


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    costs = family_costs(a.reps)
    mix = round_mix()
    per_family = {f: statistics.median(v) for f, v in costs.items()}
    missing = set(mix) - set(per_family)
    if missing:
        raise RuntimeError(f"no benchmark call for the round's kernel families {sorted(missing)}")
    weighted = sum(per_family[f] * n for f, n in mix.items()) / sum(mix.values())
    print(f"host path per launch on the CuPy {contract.CUPY_VERSION} contract stand-in, execution off, "
          f"{a.reps} calls each; {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    rows = [(f, str(len(costs[f])), f"{per_family[f] * 1e6:.1f}", str(mix.get(f, 0))) for f in sorted(per_family)]
    print(table(("family", "calls", "us per launch (median)", "launches in a Qwen3.5-27B round"), rows))
    print(f"per launch, weighted by the round's launches: {weighted * 1e6:.1f} us "
          f"(perf_model.Device.launch is {pm.H200.launch * 1e6:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
