"""Pictures of the performance model, and of measured kernel times beside it.

    python profiling/plots.py [--out DIR] [--accepted 4.97] [--results profiling/results]

Writes three PNG files into DIR (default profiling/out/plots), each from figures a command prints:

* round-composition.png: where a round's expected time goes, per shape (weights, K/V, state,
  other, overhead), B = 1, 32k context, 8 columns, with the round's floor marked: the parts
  `python profiling/perf_model.py` prints (its "us" columns).
* speedup-context.png: the speedup over plain decode against context length, B = 1, at the mean
  accepted length `--accepted`: `python profiling/perf_model.py --context C --accepted A`.
* predicted-measured.png: each kernel's measured time against the model's expected time, from the
  files `profiling/bench_kernels.py --json` writes on a GPU, kept in profiling/results/ (see
  `measured_rows`). While no GPU has run, the picture says so instead of drawing.

The series are pure functions (`composition_series`, `speedup_series`, `measured_rows`) that the
tests compare with what perf_model.py prints; matplotlib (the `plots` extra) only draws them.
The docs build (docs/hooks.py) runs this to make the pictures of the Performance page.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # perf_model and its sibling modules
sys.path.insert(0, str(HERE.parent))

import perf_model as pm  # noqa: E402

RESULTS = HERE / "results"
CONTEXTS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)
PARTS = (*pm.KINDS, "overhead")
COMPOSITION_SHAPE = dict(B=1, context=32768, vt=8)  # perf_model.py's default table


def composition_series(dev=pm.H200) -> list[dict]:
    """Per shape: the round's expected time and floor (us) and its expected time by part (us), as
    perf_model.py's table prints them."""
    out = []
    for sh in pm.shapes().values():
        r = pm.spec_round(sh, COMPOSITION_SHAPE["B"], COMPOSITION_SHAPE["context"], COMPOSITION_SHAPE["vt"], dev)
        comp = r.composition()
        out.append({"shape": sh.label, "context": r.context, "round_us": r.time() * 1e6, "floor_us": r.floor() * 1e6,
                    "parts_us": {k: comp[k] * 1e6 for k in PARTS}})
    return out


def speedup_series(accepted: float, contexts=CONTEXTS, dev=pm.H200) -> dict[str, list[tuple[int, float]]]:
    """Per shape: (context, speedup at `accepted`) for each context the shape holds (B = 1, 8 columns);
    a context past the shape's max_ctx is left out, not capped."""
    out = {}
    for sh in pm.shapes().values():
        pts = [(c, pm.spec_round(sh, 1, c, 8, dev).speedup(accepted)) for c in contexts
               if c + 8 <= sh.trunk.max_ctx]
        if pts:
            out[sh.label] = pts
    return out


def measured_rows(results: Path = RESULTS) -> list[dict]:
    """Rows of every `bench_kernels.py --json` file in `results`: {"device", "date", "command", "rows":
    [{"kernel", "shape", "measured_s", "expected_s", "floor_s"}]}, each row given its file's device."""
    rows = []
    for f in sorted(results.glob("*.json")) if results.is_dir() else []:
        doc = json.loads(f.read_text())
        for r in doc["rows"]:
            rows.append({**r, "device": doc["device"], "date": doc["date"], "file": f.name})
    return rows


def pyplot():
    try:
        import matplotlib
    except ImportError:
        print("plots.py needs matplotlib, which is not installed: pip install 'dspark[plots]'", file=sys.stderr)
        raise SystemExit(2) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


COLOURS = {"weights": "#3b7dd8", "kv": "#e07b39", "state": "#57a05a", "other": "#9b7bc4", "overhead": "#8c8c8c"}


def draw_composition(series, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    labels = [s["shape"] for s in series]
    left = [0.0] * len(series)
    for part in PARTS:
        widths = [s["parts_us"][part] / 1e3 for s in series]
        ax.barh(labels, widths, left=left, color=COLOURS[part], label=part)
        left = [a + b for a, b in zip(left, widths)]
    top = max(s["round_us"] for s in series) / 1e3
    for i, s in enumerate(series):
        ax.plot([s["floor_us"] / 1e3] * 2, [i - 0.4, i + 0.4], color="black", lw=1.5)
        ax.text(s["round_us"] / 1e3 + top * 0.01, i, f"{s['round_us'] / 1e3:.2f} ms (floor {s['floor_us'] / 1e3:.2f})",
                va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlim=(0, top * 1.3), xlabel="ms of the round, expected on an H200 (B = 1, 32k context, 8 columns); "
                                        "black: the floor")
    ax.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.45, 1.18))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_speedup(series, accepted: float, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for label, pts in series.items():
        ax.plot([c for c, _ in pts], [s for _, s in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context (tokens)", ylabel="speedup over plain decode",
           title=f"predicted on an H200, B = 1, 8 columns, mean accepted length {accepted}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_predicted_measured(rows, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5))
    if not rows:
        ax.axis("off")
        ax.text(0.5, 0.5, "No GPU has run dspark's kernel benchmarks yet:\nno measured kernel time to set beside "
                "the model's.\n\n`bash profiling/gpu_check.sh OUTDIR` on a GPU measures them\n"
                "(profiling/bench_kernels.py --json, kept in profiling/results/).",
                ha="center", va="center", fontsize=10, wrap=True)
    else:
        exp = [r["expected_s"] * 1e6 for r in rows]
        meas = [r["measured_s"] * 1e6 for r in rows]
        ax.scatter(exp, meas, s=16)
        lo, hi = min(exp + meas) * 0.8, max(exp + meas) * 1.25
        ax.plot([lo, hi], [lo, hi], color="#8c8c8c", lw=1, label="measured = expected")
        ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="#8c8c8c", alpha=0.15,
                        label="within 25 %")
        ax.set(xscale="log", yscale="log", xlabel="expected (us, the performance model)", ylabel="measured (us)",
               title=f"kernel time on {rows[0]['device']}, {rows[0]['date']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "out" / "plots", help="folder for the pictures")
    ap.add_argument("--accepted", type=float, default=4.97, help="mean accepted length for the speedup")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of bench_kernels.py --json files")
    a = ap.parse_args(argv)
    pyplot()
    a.out.mkdir(parents=True, exist_ok=True)
    draw_composition(composition_series(), a.out / "round-composition.png")
    draw_speedup(speedup_series(a.accepted), a.accepted, a.out / "speedup-context.png")
    rows = measured_rows(a.results)
    draw_predicted_measured(rows, a.out / "predicted-measured.png")
    print(f"wrote round-composition.png, speedup-context.png, predicted-measured.png ({len(rows)} measured kernel "
          f"rows) into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
