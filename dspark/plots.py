"""Pictures of a speculative run (`dspark demo --plot FILE`, `dspark generate --plot FILE`).

The data come from the run's own records: acceptance by draft position from its `SpecStats`, and
tokens per round along the text from its `RoundTrace`, fresh and repetition rounds apart. The
series are built by `run_series` (pure, tested against what the command prints); matplotlib, from
the `plots` extra, only draws them.
"""

from __future__ import annotations

from .errors import DsparkError
from .stats import RoundTrace, SpecStats

INSTALL = "pip install 'dspark[plots]'"


class PlotUnavailable(DsparkError):
    """matplotlib is not installed: the one line the command line prints."""


def pyplot():
    """matplotlib.pyplot on a file-only backend, or PlotUnavailable saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def run_series(stats: SpecStats, trace: RoundTrace) -> dict:
    """What the run's picture shows: acceptance by draft position (1-based), and each round's
    start in the text and tokens emitted, fresh and repetition rounds apart, with their means."""
    out = {"position": list(range(1, len(stats.acceptance_by_position) + 1)),
           "acceptance": list(stats.acceptance_by_position),
           "mean_accepted_length": stats.mean_accepted_length}
    for name, repeat in (("fresh", False), ("repeat", True)):
        rows = [(s, t) for s, t, r in zip(trace.starts, trace.tokens, trace.repeat) if r == repeat]
        out[name] = {"start": [s for s, _ in rows], "tokens": [t for _, t in rows],
                     "mean_accepted_length": trace.stats(repeat).mean_accepted_length}
    return out


def draw_run(series: dict, path, title: str) -> None:
    """Two panels: acceptance by draft position, and tokens per round along the text."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 1.6]})
    left.bar(series["position"], series["acceptance"], color="#3b7dd8")
    left.set(xlabel="draft position", ylabel="accepted when verified", ylim=(0, 1.05),
             title=f"acceptance by position (mean accepted length {series['mean_accepted_length']:.2f})")
    left.set_xticks(series["position"])
    for name, colour, label in (("fresh", "#3b7dd8", "fresh text"), ("repeat", "#e07b39", "inside a repetition")):
        part = series[name]
        right.scatter(part["start"], part["tokens"], s=14, color=colour,
                      label=f"{label}: {len(part['start'])} rounds, {part['mean_accepted_length']:.2f} a round")
    right.set(xlabel="tokens emitted before the round", ylabel="tokens emitted by the round",
              title="tokens per round along the text")
    right.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_run(path, stats: SpecStats, trace: RoundTrace, title: str) -> dict:
    """Draw the run into `path` (any format matplotlib writes: .png, .svg, .pdf); returns the series."""
    series = run_series(stats, trace)
    draw_run(series, path, title)
    return series
