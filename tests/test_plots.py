"""The pictures' data: what `--plot` and profiling/plots.py draw is what the run's SpecStats and the
performance model print for the same run; without matplotlib, one line and exit code 2."""

from __future__ import annotations

import re
import sys

import pytest

from dspark import cli, plots
from tests.scripts import load_script


@pytest.fixture
def drawn(monkeypatch):
    """The series each draw was given, drawing nothing."""
    seen = []
    monkeypatch.setattr(plots, "draw_run", lambda series, path, title: seen.append(series))
    return seen


def printed(text: str, label: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith(label)]
    return line.strip()[len(label):].split()


def check_against_print(series: dict, text: str) -> None:
    """The series against the acceptance lines the command printed (print_acceptance)."""
    assert [f"{a:.2f}" for a in series["acceptance"]] == printed(text, "acceptance by position")
    mean, _, _, _, rounds = printed(text, "mean accepted length")[:5]
    assert f"{series['mean_accepted_length']:.2f}" == mean
    assert len(series["fresh"]["start"]) + len(series["repeat"]["start"]) == int(rounds.strip("("))
    for name, label in (("fresh", "on fresh text"), ("repeat", "inside a repetition")):
        if label in text:
            mean, rounds = printed(text, label)[:2]
            assert f"{series[name]['mean_accepted_length']:.2f}" == mean
            assert len(series[name]["start"]) == int(rounds.strip("("))
    for part in ("fresh", "repeat"):
        starts = series[part]["start"]
        assert starts == sorted(starts) and all(1 <= t <= 8 for t in series[part]["tokens"])


def test_demo_plot_draws_what_the_demo_prints(capsys, drawn, tmp_path):
    assert cli.main(["demo", "--no-progress", "--max-new-tokens", "160", "--plot", str(tmp_path / "d.png")]) == 0
    out = capsys.readouterr().out
    (series,) = drawn
    check_against_print(series, out)
    assert series["repeat"]["start"] and series["fresh"]["start"]  # this prompt's text repeats itself
    # tokens per round along the text: the rounds tile the stream from its first token
    rounds = sorted(zip(series["fresh"]["start"] + series["repeat"]["start"],
                        series["fresh"]["tokens"] + series["repeat"]["tokens"]))
    assert rounds[0][0] == 0 and all(a + t == b for (a, t), (b, _) in zip(rounds, rounds[1:]))


def test_generate_plot_draws_what_generate_prints(capsys, drawn, tmp_path):
    argv = ["generate", "def parse(", "--no-progress", "--max-new-tokens", "48", "--policy", "always"]
    assert cli.main([*argv, "--plot", str(tmp_path / "g.png")]) == 0
    (series,) = drawn
    check_against_print(series, capsys.readouterr().err)


def test_plot_without_matplotlib_is_one_line_and_exit_code_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    for argv in (["demo"], ["generate", "def f("]):
        assert cli.main([*argv, "--plot", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "pip install 'dspark[plots]'" in err
    pm_plots = load_script("plots")
    with pytest.raises(SystemExit) as e:
        pm_plots.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "pip install 'dspark[plots]'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def summary_table(text: str) -> list[dict[str, str]]:
    """perf_model.py's summary table (its first): each row's cells by column name."""
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("shape ") and "speedup" in ln)
    names = re.split(r"\s{2,}", lines[head].strip())
    rows = []
    for ln in lines[head + 1:]:
        cells = re.split(r"\s{2,}", ln.strip())
        if len(cells) != len(names):
            break
        rows.append(dict(zip(names, cells)))
    return rows


def test_performance_pictures_draw_what_the_model_prints(capsys):
    plots_script = load_script("plots")
    pm = plots_script.pm
    assert pm.main([]) == 0  # the default table: every shape, B = 1, 32k, 8 columns
    table = summary_table(capsys.readouterr().out)
    series = plots_script.composition_series()
    assert [s["shape"] for s in series] == [row["shape"] for row in table]
    for s, row in zip(series, table):
        assert pm.us(s["round_us"] / 1e6) == row["round us"] and pm.us(s["floor_us"] / 1e6) == row["round floor us"]
        assert [pm.us(s["parts_us"][k] / 1e6) for k in plots_script.PARTS] == [row[f"{k} us"] for k in plots_script.PARTS]
    contexts = (8192, 32768)
    speedups = plots_script.speedup_series(4.97, contexts)
    assert pm.main(["--model", "qwen3-8b", "qwen3.5-27b", "--context", *map(str, contexts)]) == 0
    printed_speedups = {(row["shape"], int(row["context"])): row["speedup"] for row in summary_table(capsys.readouterr().out)}
    for label in ("Qwen3-8B", "Qwen3.5-27B"):
        for ctx, x in speedups[label]:
            assert printed_speedups[label, ctx] == f"{x:.2f}x"
    assert set(speedups) == {"Qwen3-8B", "Qwen3.5-27B", "Qwen3.8-27B + DFlash2", "Qwen3.8-27B + DSpark",
                             "Qwen3.5-27B-FP8", "Qwen3.8-27B-FP8 + DFlash2", "Qwen3.8-27B-FP8 + DSpark", "Qwen3.5-35B-A3B",
                             "Qwen3.5-35B-A3B-FP8"}
    assert [c for c, _ in speedups["Qwen3-8B"]] == [8192, 32768]


def test_predicted_against_measured_reads_the_results_files_or_says_none_ran(tmp_path):
    plots_script = load_script("plots")
    assert plots_script.measured_rows(tmp_path / "none") == []
    (tmp_path / "h200.json").write_text('{"device": "H200", "date": "2027-01-01", "command": "c", "rows": '
                                        '[{"kernel": "k", "shape": "s", "measured_s": 2e-6, "expected_s": 1e-6, '
                                        '"floor_s": 5e-7}]}')
    (row,) = plots_script.measured_rows(tmp_path)
    assert row["device"] == "H200" and row["measured_s"] == 2e-6 and row["file"] == "h200.json"
    pytest.importorskip("matplotlib")
    plots_script.draw_predicted_measured([], tmp_path / "none.png")
    plots_script.draw_predicted_measured([row], tmp_path / "one.png")
    assert (tmp_path / "none.png").stat().st_size > 5_000 and (tmp_path / "one.png").stat().st_size > 5_000
