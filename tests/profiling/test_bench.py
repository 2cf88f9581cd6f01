"""The profiling scripts: bench_kernels (--dry-run and a CPU run through simt), the session
workload on numpy, and the timing helpers they share (gpu_check: tests/profiling/test_gpu_check.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dspark.ops.argmax import argmax_rows, argmax_rows_ref
from tests.conftest import poison
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
PROFILING = ROOT / "profiling"
FAMILIES = ("argmax", "attention", "kv_commit", "gdn_scan", "snapshot", "sampling", "norm", "activation", "rope", "heads",
            "linear", "linear_fp8", "moe")

sys.path.insert(0, str(PROFILING))  # the scripts import each other as siblings, not as a package
import timing  # noqa: E402


def script(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """Run a profiling script (or command) from the repository root; (result, seconds)."""
    cmd = list(args) if args[0] == "bash" else [sys.executable, *args]
    env = dict(os.environ, PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return r, time.perf_counter() - t


def ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


# ---- bench_kernels ----------------------------------------------------------------------------------
def test_bench_kernels_dry_run_lists_every_family():
    r, _ = script("profiling/bench_kernels.py", "--dry-run")
    out = ok(r)
    assert "error:" not in out
    for fam in FAMILIES:
        assert re.search(rf"^{fam}\s", out, re.M), f"family {fam} missing from the plan\n{out}"


def test_bench_kernels_runs_under_the_cli():
    """`dspark bench kernels` runs the script with runpy: its sibling imports must still resolve."""
    out = ok(script("-m", "dspark", "bench", "kernels", "--dry-run")[0])
    assert "benchmarks in 14 families" in out  # every csrc/*.cu but selftest and fp8 (bench_kernels.NOT_BENCHMARKED)


def test_ncu_regexes_pick_the_verify_kernel_and_every_family():
    """--verify profiles the split attention kernel, never its combine nor the prompt kernel; the
    session run every family."""
    import bench_kernels
    from dspark.kernel_sources import scan
    verify, session = (re.compile(r) for r in bench_kernels.ncu_regexes())
    names = scan()
    attention = [n for n in names if n.startswith("attention_") and "_probe" not in n]
    assert {n for n in attention if verify.search(n)} == {n for n in attention
                                                          if "combine" not in n and "prompt" not in n and "_d" in n}
    assert not any(verify.search(n) for n in names if n.startswith("attention_combine_"))
    assert bench_kernels.ncu_misses(names) == [], "the session regex skips a kernel family"


def test_attention_bench_lists_the_combine_kernel_of_a_split_plan(numpy_backend):
    """A plan that splits the keys launches the combine too: the benchmark must name both (a real
    run checks the op launched exactly the kernels named)."""
    import dataclasses

    import bench_kernels
    sizes = dataclasses.replace(bench_kernels.CPU, contexts=(700,), batches=(1,))
    benches = [b for b in bench_kernels.attention_benches(numpy_backend, sizes) if b.case != "prompt"]
    assert benches and all(len(b.kernels) == 2 and b.kernels[1].startswith("attention_combine_") for b in benches)
    assert all(b.predicted > 0 for b in benches)


def test_bench_kernels_cpu_run_times_every_family(simt):
    r, _ = script("profiling/bench_kernels.py", "--cpu")
    out = ok(r)
    # A row is skipped ("not built") only for a kernel this simt build lacks (a private build of
    # some families); every other row has a time.
    for listed in re.findall(r"^note: \w+ .*: skipped, (.*) not in this build$", out, re.M):
        for name in listed.split(", "):
            assert name not in simt.kernels.signatures, f"{name} is built but was skipped"
    sections = dict(zip(*[iter(re.split(r"^== (.+)\n", out, flags=re.M)[1:])] * 2))
    for fam in FAMILIES:
        block = sections[fam].split("\n\n")[0]  # the table and its notes
        rows = [r for r in block.splitlines()[1:] if not r.startswith("note:")]
        timed = [r for r in rows if re.search(r"\s\d[\d.]*(us|ms|s)\s", r)]
        assert rows and all(r in timed or "not built" in r for r in rows), sections[fam]
        assert timed or fam != "argmax", "every simt build has the argmax kernels"
    assert "ratios (this run)" in sections and "of roof" in out


def test_bench_attention_cpu_run(simt):
    out = ok(script("profiling/bench_attention.py", "--cpu")[0])
    rows = [line.split() for line in out.splitlines() if line.startswith(("decode", "verify"))]
    assert len(rows) == 8 and {r[0] for r in rows} == {"decode", "verify"}


# ---- session_workload ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [[], ["--temperature", "0.8", "--top-p", "0.9"]], ids=["greedy", "sampled"])
def test_session_workload_on_numpy_with_nvtx_on(mode):
    out = ok(script("profiling/session_workload.py", "--backend", "numpy", "--model", "tiny", "--requests", "3",
                    "--tokens", "12", "--nvtx", *mode)[0])
    assert "NVTX on" in out and ("sampled (T=0.8" in out) == bool(mode)
    m = re.search(r"decode: (\d+) tokens in [\d.]+ s = ([\d,.]+) tokens/s", out)
    assert m and int(m.group(1)) == 3 * 12, out
    assert re.search(r"mean accepted length \d+\.\d\d", out), out


def test_session_workload_refuses_a_context_overflow():
    r, _ = script("profiling/session_workload.py", "--backend", "numpy", "--model", "tiny", "--tokens", "1000")
    assert r.returncode != 0 and "more than the tiny trunk's context of 256" in r.stderr


# ---- timing helpers ---------------------------------------------------------------------------------------
def test_recorded_launch_replays_the_kernel_alone(simt, rng):
    """record() keeps the launch the op made; replaying it rewrites the output without the op."""
    x = rng.standard_normal((5, 333)).astype(np.float32)
    out = poison(np, 5, np.int32)
    launches = timing.record(simt, lambda be: argmax_rows(be, x, out=out))
    assert [launch.name for launch in launches] == ["argmax_rows_f32"]
    out[...] = -7
    timing.replay(launches)()
    np.testing.assert_array_equal(out, argmax_rows_ref(x)[0])


def test_roofline_and_table():
    c = timing.Ceilings("test", copy_bw=1e9, gemm={"float32": 1e10})
    assert c.roofline(2e9, 1e9) == (2.0, "mem")
    assert c.roofline(1e9, 3e10) == (3.0, "math")
    text = timing.table(("case", "time"), [("decode", "1.5ms"), ("verify", "12.25ms")])
    assert text.splitlines() == ["case       time", "decode    1.5ms", "verify  12.25ms"]
    assert [timing.seconds(t) for t in (3.2e-6, 4.56e-3, 12.0)] == ["3.20us", "4.56ms", "12.00s"]


def test_bench_worker_prints_every_gate():
    r, _ = script("profiling/bench_worker.py", "--model", "tiny", "--requests", "4", "--max-new", "8")
    out = ok(r)
    for gate in ("0/1", "2/4", "64/65"):
        assert re.search(rf"\s{gate.split('/')[0]}/{gate.split('/')[1]}\s", out), out
    assert "tok/s" in out and "latency" in out


def test_bench_worker_mixed_prints_every_policy_and_its_decisions():
    r, _ = script("profiling/bench_worker.py", "--model", "tiny", "--requests", "4", "--max-new", "8",
                  "--workload", "mixed", "--repeat", "1")
    out = ok(r)
    for row in ("all plain", "all spec", "gain 64/65", "gain 2/4", "gain apart"):
        assert re.search(rf"^\s*{row} \|", out, re.M), out
    assert re.search(r"gain 64/65 .*\| spec \d+ gain.*, plain .*, demoted .*; \d+ rounds carried plain rows, \d+ plain "
                     r"steps alone", out), out
    assert re.search(r"gain apart .*; 0 rounds carried plain rows", out), out
    assert re.search(r"load average before: [\d.]+ [\d.]+ [\d.]+", out), out


def test_bench_worker_poisoned_prints_every_sequence_and_row():
    r, _ = script("profiling/bench_worker.py", "--model", "tiny", "--requests", "1", "--max-new", "8",
                  "--workload", "poisoned", "--repeat", "1")
    out = ok(r)
    for seq in ("poor, then code", "poor elsewhere", "poor only"):
        for row in ("all plain", "all spec", "gain", "gain, memory before", "gain, no exploring"):
            assert re.search(rf"^\s*{seq} \|\s+{row} \|", out, re.M), (seq, row, out)
    assert re.search(r"gain, memory before \|.*\| spec \d+, plain \d+, demoted \d+ over 1 runs", out), out
    assert re.search(r"poor only: 1 random strings drafted at under 2 tokens a round, of \d+ tried", out), out


def test_bench_coupled_prints_both_samplers_and_checks_equality(capsys):
    """One prompt, one seed, a few tokens: each row has both samplers and the coupled text equals
    plain sampled decode's."""
    from tests.scripts import load_script
    bench = load_script("bench_coupled")
    rc = bench.main(["--pairs", "embedded", "--prompts", "1", "--seeds", "1", "--tokens", "12", "--temperatures", "0.8"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0 and "coupled == plain sampled decode in every run" in out
    assert re.search(r"T=0.8 +coupled +\| mean accepted length", out) and re.search(r"T=0.8 +rejection", out)


def test_bench_cpu_runs_beside_transformers():
    """profiling/bench_cpu.py on its tiny size: both architectures at two prompt lengths, the ratio
    table, greedy tokens identical (its exit code), and the peer's torch fallback for Qwen3.5's
    Gated-DeltaNet named (no fla on a CPU) where the dense rows have none."""
    from tests.peers import peer
    peer("torch"), peer("transformers")
    bench_cpu = load_script("bench_cpu")
    r, _ = script("profiling/bench_cpu.py", "--size", "tiny", "--threads", "1", "--repeats", "1", "--steps", "2",
                  "--prompt", "8", "40", timeout=300)
    out = ok(r)
    for arch, peer_path in (("qwen3_5", "torch fallback"), ("qwen3", "its CPU path")):
        for n in (8, 40):
            assert re.search(rf"^\| {arch} \| 1 \| {n} \| prompt pass of {n} \|.*\| {peer_path} \|$", out, re.M), out
            assert f"{arch}, 1 thread(s), prompt {n}: greedy tokens identical: yes" in out
    assert bench_cpu.peer_fallbacks("qwen3") == []
    if bench_cpu.peer_fallbacks("qwen3_5"):
        assert "qwen3_5: the peer runs a torch fallback for kernels it has on a GPU: chunk_gated_delta_rule" in out


def test_bench_product_prints_each_row_count_against_one_row():
    """profiling/bench_product.py at a small size: both shapes, every instruction set asked for,
    the time over one row's."""
    from tests.peers import peer
    isas = peer("dspark._cpu").isas
    r, _ = script("profiling/bench_product.py", "--k", "64", "--n", "256", "--rows", "1", "8", "--repeats", "1",
                  "--isa", *isas)
    out = ok(r)
    for shape in ("memory", "cache"):
        assert re.search(rf"^{shape}: w f32", out, re.M), out
    for isa in isas:
        assert re.search(rf"^{isa} +1 .* 1\.00$", out, re.M) and re.search(rf"^{isa} +8 ", out, re.M), out


def test_bench_embedded_runs_beside_an_earlier_tree():
    """profiling/bench_embedded.py against this commit itself: two child interpreters, the table,
    and the same tokens from both."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    r, _ = script("profiling/bench_embedded.py", "--base", "HEAD", "--repeats", "1", "--max-new-tokens", "12",
                  timeout=300)
    out = ok(r)
    assert "this tree / before" in out and "all streams the same tokens: yes" in out


def test_accept_by_round_prints_the_spans_of_the_first_rounds():
    """profiling/accept_by_round.py on two held-out prompts: the spans a session's rounds reach,
    each over the prompts that reached it, and the spread across prompts; the same figures twice
    (no timing)."""
    args = ("profiling/accept_by_round.py", "--backend", "numpy", "--prompts", "2", "--max-new-tokens", "48")
    out = ok(script(*args)[0])
    assert re.search(r"^  rounds   0-8  : \d+\.\d\d a round \(2 prompts\)$", out, re.M), out
    assert "spread across prompts" in out
    assert ok(script(*args)[0]) == out


def test_round_seconds_prints_rounds_widths_and_levels():
    """profiling/round_seconds.py at its smallest: a round in plain steps of each kind, the verify
    by width beside the prior's shape, and what the cost model's level rests on."""
    r, _ = script("profiling/round_seconds.py", "--rounds", "2", "--repeat", "1", "--widths", "--levels")
    out = ok(r)
    assert re.search(r"^  greedy round: .* plain steps", out, re.M) and re.search(r"^ coupled round: ", out, re.M), out
    assert re.search(r"^  1: 1\.00 \(1\.00\)", out, re.M), out
    for what in ("a round's verify over a lone verify of its width just after: ",
                 "a plain step right after a round over the next one: "):
        assert re.search("^" + re.escape(what) + r"\d+\.\d\d \(median of 2; runs", out, re.M), out


def test_bench_policy_prints_each_case_and_its_line():
    """profiling/bench_policy.py at its smallest: the case's row and its line's verdict; the exit
    status is the verdict's (timing decides it, so either is accepted here)."""
    r, _ = script("profiling/bench_policy.py", "--backend", "numpy", "--repeat", "1", "--only", "3",
                  "--max-new-tokens", "8", timeout=300)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    verdict = re.search(r"^ +greedy, numbers: gain (\d+\.\d\d)x, line >= 0\.95x: (met|MISSED)$", r.stdout, re.M)
    assert verdict and (r.returncode == 0) == (verdict[2] == "met"), r.stdout
    assert "STREAMS DIFFER" not in r.stdout


def test_moe_width_prints_both_routings_and_checks_every_stream():
    """profiling/moe_width.py at its smallest: a row per routing, rows routed together reading the
    top-k experts a layer whatever the width, rows routed apart more; every stream was checked equal
    to plain decode (the script asserts it)."""
    out = ok(script("profiling/moe_width.py", "--tokens", "12", "--repeat", "1", timeout=300)[0])
    rows = {m[1]: m for m in re.finditer(r"^(together|apart) +(\d+\.\d\d) +(\d+\.\d) ", out, re.M)}
    assert set(rows) == {"together", "apart"}, out
    assert float(rows["together"][3]) == 4.0 and float(rows["apart"][3]) > 4.0, out
    assert re.search(r"gain / best fixed", out) and out.count("best fixed: w") == 2, out
