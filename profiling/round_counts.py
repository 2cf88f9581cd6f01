"""What one speculative round costs the host on the `cuda` path, counted on the CuPy contract
stand-in (dspark.backends.contract): device->host copies, synchronisations (each with the dspark
line that made it), host->device copies, kernel launches by name, CuPy array operations, graph
launches, and the recurrent-state and K/V bytes the round moves.

    python profiling/round_counts.py        # tiny and embedded pairs, greedy and both samplers, B = 1 and 2;
                                            # then Qwen3.5-27B's round on the null executor, per layer

Rounds run as the session runs them by default (SpecParams.launches = "graph": each pass a
recorded CUDA graph after its first round); a recorded pass's kernels count as launches (the
"in N graph launches" part of the line says how many ran inside graphs). The last part records a
Qwen3.5-27B round at its real shapes on the null executor (profiling/host_round.py) and lists each
pass's launches layer by layer.

tests/gpu/test_cupy_contract.py asserts the targets on the same counts (at most two
synchronisations per round); profiling/RESULTS.md records this command's output.
"""

from __future__ import annotations

import numpy as np

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts
from dspark import profile
from dspark.backends import contract
from dspark.models import load_default
from dspark.models.presets import tiny_pair
from dspark.params import SamplingParams, SpecParams
from dspark.session import DsparkSpecSession, spec_round


RULES = ("greedy", "coupled", "rejection")  # a round's accept: SpecParams.accept


def round_counts(rule: str, rounds: int = 4, batch: int = 1, seed: int = 7, pair=None, prompt_len: int = 24):
    """(Counts, rounds run, batch) of `rounds` spec rounds of `batch` sessions on the stand-in,
    after one warm-up round (module loads and the batch's pointer tables are not per-round
    costs). `rule`: "greedy", or a sampled session's sampler ("coupled", "rejection"). `pair`: a
    (trunk, drafter) on the stand-in's backend; default the tiny random pair."""
    trunk, drafter = pair if pair is not None else tiny_pair(contract.backend(), seed)
    rng = np.random.default_rng(seed)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=seed) if rule != "greedy" else SamplingParams()
    params = SpecParams(max_new_tokens=10_000, sampling=sampling, capture=False,
                        sampler=rule if rule != "greedy" else "coupled")
    vocab = min(trunk.config.vocab, 256)
    sessions = [DsparkSpecSession.prime(trunk, drafter, rng.integers(0, vocab, prompt_len).astype(np.int32), params)
                for _ in range(batch)]
    spec_round(sessions)
    with profile.counting() as c:
        for _ in range(rounds):
            spec_round(sessions)
    for s in sessions:
        s.close()
    return c, rounds, batch


def pass_launches(model: str = "qwen3.5-27b", batch: int = 1, context: int = 32768, width: int = 8) -> dict:
    """pass kind -> the kernel names of its recording, in launch order, of a greedy round of
    `model` on the null executor."""
    import host_round
    from dspark import graphs
    shape = host_round.pm.shapes()[model]
    trunk, drafter = host_round.null_pair(shape)
    sessions = host_round.sessions_at(trunk, drafter, batch, context, width, "eager")
    with contract.null_memory(), contract.executing(False):
        spec_round(sessions)
    out = {}
    for (_, extra), entry in graphs.round_graphs(drafter, "eager").store._entries.items():
        out[extra[0]] = [launch[-1] for launch in entry.recording.launches]
    for s in sessions:
        s.close()
    return out, trunk.config


def by_layer(names: list[str], layers) -> list[tuple[str, int, str]]:
    """(part, launches, their names) of a verify or decode recording: what comes before the first
    layer, one layer of each kind (a layer ends with its second add_rmsnorm), what follows."""
    per_layer, cur = [], []
    for n in names[1:]:
        if len(per_layer) == len(layers):
            break
        cur.append(n)
        if n == "add_rmsnorm_f32" and cur.count(n) == 2:
            per_layer.append(cur)
            cur = []
    tail = names[1 + sum(len(x) for x in per_layer):]
    out = [("before the layers", 1, names[0])]
    for kind in dict.fromkeys(layers):
        kinds = [x for x, k in zip(per_layer, layers) if k == kind]
        out.append((f"{kind} layer (x{len(kinds)})", len(kinds[0]), " ".join(kinds[0])))
    out.append(("after the layers", len(tail), " ".join(tail)))
    return out


def embedded_pair():
    """The embedded default pair (dspark.models.load_default) on the stand-in."""
    return load_default(contract.backend())


def main() -> None:
    pairs = {"tiny pair (drafter block 4)": None, "embedded pair (drafter block 8)": embedded_pair()}
    for label, pair in pairs.items():
        print(f"per round on the cuda backend (CuPy {contract.CUPY_VERSION} contract stand-in), {label}:")
        for rule in RULES:
            for batch in (1, 2):
                c, n, b = round_counts(rule, batch=batch, pair=pair)
                print(f"  {rule:9s} B={b}: {c.line(n)}")
                print(f"           bytes moved: {c.bytes_line(n)}")
    c, n, _ = round_counts("greedy")
    print("device->host copies and syncs of one greedy round (B=1, tiny pair), by dspark line:")
    for site, k in sorted(c.sites.items()):
        print(f"  {k / n:.0f}  {site}")
    print("dspark kernel launches of one greedy round (B=1, tiny pair), by kernel:")
    for name, k in sorted(c.by_name.items()):
        print(f"  {k / n:.0f}  {name}")
    passes, config = pass_launches()
    total = sum(len(v) for v in passes.values())
    print(f"Qwen3.5-27B greedy round (B=1, 32k, 8 columns) on the null executor: {total} launches "
          + ", ".join(f"{k} {len(v)}" for k, v in passes.items()))
    for part, count, names in by_layer(passes["verify"], config.layers):
        print(f"  verify, {part}: {count}  ({names})")
    print(f"  draft: {len(passes['draft'])}  ({' '.join(passes['draft'])})")
    print(f"  commit: {len(passes['commit'])}  ({' '.join(passes['commit'])})")


if __name__ == "__main__":
    main()
