"""profiling/gpu_check.py, the one run a lent GPU gets: its dry run passes here; a step that ran no
test or measured nothing is FAILED (zero collected, every test skipped, an empty table); a tool that
refuses the machine is "unavailable here"; a step cut short says what it finished; the limits add
up to the budget, the measured-beside-predicted steps first; the sanitizer cases need only the cuda
backend; the carried wheels and the imports the check makes are checked against the image."""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
from pathlib import Path

import pytest

from tests.gpu.op_cases import CASES
from tests.profiling.test_bench import ROOT, ok, script
from tests.scripts import load_script

gc = load_script("gpu_check")


def statuses(report: str) -> dict[str, str]:
    return dict(re.findall(r"^## (\w+): (.+?) \(", report, re.M))


def test_dry_run_passes_and_reports_every_step(tmp_path):
    out = ok(script("bash", "profiling/gpu_check.sh", "--dry-run", str(tmp_path), timeout=600)[0])
    assert "dry run OK" in out
    report = (tmp_path / "gpu_report.md").read_text()
    got = statuses(report)
    names = [s.name for s in gc.plan(False, tmp_path, sys.executable)]
    assert set(names) <= set(got), f"steps missing from the report: {set(names) - set(got)}\n{report}"
    for name in set(got) - {"wheels"}:  # the wheels are fetched apart (profiling/gpu_wheels.sh)
        assert got[name] == "ok", f"{name}: {got[name]}\n{report}"
    assert re.search(r"step limits: wheels 15 .* = 470s", report)
    assert re.search(rf"^{len(CASES)} tests collected", report, re.M)  # the sanitizer cases: every op once
    assert "Qwen3.5-27B" in report and f"{gc.families()} kernel families loaded" in report and gc.families() == 16


def run_pytest_step(tmp_path, body: str, check=gc.pytest_check, wrapper: list[str] = ()):
    test = tmp_path / "test_cases.py"
    test.write_text(textwrap.dedent(body))
    step = gc.Step("probe", 60, [*wrapper, sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
                                 str(test)], check)
    return gc.run_step(step, 60, tmp_path)[0]


def test_a_pytest_step_that_ran_nothing_is_failed(tmp_path):
    skipped = run_pytest_step(tmp_path, """
        import pytest
        @pytest.mark.parametrize("i", [1, 2])
        def test_x(i):
            pytest.skip("no CUDA device")
        """)
    assert skipped.status == "FAILED" and "no test passed (2 skipped; skipped: no CUDA device)" in skipped.summary
    empty = run_pytest_step(tmp_path, "x = 1\n")
    assert empty.status == "FAILED" and "collected no test" in empty.summary
    failing = run_pytest_step(tmp_path, "def test_a(): pass\ndef test_b(): assert 0\n")
    assert failing.status == "FAILED" and failing.summary == "1 passed, 1 failed"
    passing = run_pytest_step(tmp_path, "import pytest\ndef test_a(): pass\ndef test_b(): pytest.skip('bf16')\n")
    assert passing.status == "ok" and passing.summary == "1 passed, 1 skipped"


def test_an_all_skipped_sanitizer_step_is_failed(tmp_path, monkeypatch):
    """The real run's sanitizer step, its compute-sanitizer a stand-in that runs the tests it is
    given and reports no error, on a machine where every case skips (here: no GPU, the cuda
    fixture allowed to skip): the step is FAILED, not ok."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/usr/bin/env bash\n"
                    "while [[ $1 == --* ]]; do shift 2; done\n"
                    "DSPARK_REQUIRE_CUDA=0 \"$@\"; rc=$?\necho '========= ERROR SUMMARY: 0 errors'\nexit $rc\n")
    fake.chmod(0o755)
    monkeypatch.setenv("COMPUTE_SANITIZER", str(fake))
    (step,) = [s for s in gc.plan(False, tmp_path, sys.executable) if s.name == "sanitizer_memcheck"]
    assert step.cmd[0] == str(fake) and step.cmd[-1] == gc.SANITIZER_TESTS[-1]
    outcome = gc.run_step(step, 120, tmp_path)[0]
    assert outcome.status == "FAILED" and f"no test passed ({len(CASES)} skipped" in outcome.summary, outcome


def test_the_sanitizer_cases_need_only_the_cuda_backend():
    from tests.gpu import test_cuda_ops
    (target,) = gc.SANITIZER_TESTS
    fn = getattr(test_cuda_ops, target.split("::")[1])
    assert set(inspect.signature(fn).parameters) == {"case", "cuda", "numpy_backend", "rng"}


def test_a_tool_that_refuses_the_device_is_unavailable_here(tmp_path):
    refusing = gc.Step("sanitizer_memcheck", 30, [sys.executable, "-c", "print('========= Error: Device not "
                                                  "supported'); raise SystemExit(1)"], gc.sanitizer_check,
                       unavailable=(r"[Dd]evice not supported",))
    outcome = gc.run_step(refusing, 30, tmp_path)[0]
    assert outcome.status == "unavailable here" and "Device not supported" in outcome.summary
    assert not outcome.failed
    broken = gc.Step("x", 30, [sys.executable, "-c", "raise SystemExit(2)"], gc.sanitizer_check,
                     unavailable=(r"[Dd]evice not supported",))
    assert gc.run_step(broken, 30, tmp_path)[0].status == "FAILED"


def test_a_step_cut_short_reports_what_it_finished(tmp_path):
    slow = gc.Step("bench", 2, [sys.executable, "-c", "import time\n"
                                "for i in range(3): print(f'row {i}   1.00x', flush=True)\ntime.sleep(60)"],
                   gc.rows_check(r"\s\d+\.\d\dx\s*$", "rows measured beside predicted"))
    outcome, seconds, _ = gc.run_step(slow, 2, tmp_path)
    assert outcome.status == "TIMEOUT" and outcome.failed and seconds < 30
    assert "cut at 2s; it had finished: 3 rows measured beside predicted" in outcome.summary


def test_an_empty_table_is_failed():
    check = gc.rows_check(r"\s\d+\.\d\dx\s*$", "rows measured beside predicted")
    assert check("== argmax\ncase  shape  time\n", 0) == gc.Outcome(
        "FAILED", "0 rows measured beside predicted: measured nothing")
    assert gc.gate_check("8 cases on cuda in 1.0s\nALL EXACT\n", 0).status == "FAILED"  # no case line
    assert gc.collected_check("no tests collected in 0.1s\n", 5).status == "FAILED"


def test_the_order_and_the_budget(tmp_path):
    steps = gc.plan(False, tmp_path, sys.executable)
    names = [s.name for s in steps]
    assert sum(s.limit for s in steps) == gc.BUDGET
    assert names.index("bench") < names.index("nsys") < names.index("sanitizer_memcheck")
    assert names.index("gate") < names.index("ncu") < names.index("sanitizer_synccheck") < names.index("cuda_tests")
    assert "build" not in names  # nothing needs the simt build on the GPU machine
    # a step may use what earlier steps left, never what later ones are owed
    quick = [gc.Step(n, 10, [sys.executable, "-c", "print('ok')"]) for n in "abc"]
    done = gc.run(quick, tmp_path, budget=30)
    report = (tmp_path / "gpu_report.md").read_text()
    given = [float(g) for g in re.findall(r"nominal, (\d+)s given", report)]
    assert [o.status for _, o, _ in done] == ["ok"] * 3 and given[0] == pytest.approx(10, abs=1)
    assert given[2] > given[1] > 10 and given[2] <= 30


def test_wheels_must_fit_the_image_and_cover_what_it_lacks():
    spec = {"python": "3.12", "platforms": ["manylinux_2_17_x86_64"], "carry": ["nvtx", "tqdm"]}
    good = [Path("nvtx-0.2.17-cp312-cp312-manylinux_2_17_x86_64.whl"), Path("tqdm-4.67.1-py3-none-any.whl")]
    assert gc.wheel_problems(good, spec) == []
    bad = [Path("nvtx-0.2.17-cp311-cp311-manylinux_2_17_x86_64.whl"), Path("tqdm-4.67.1-py3-none-macosx_11_0_arm64.whl")]
    problems = gc.wheel_problems(bad, spec)
    assert any("built for cp311, not cp312" in p for p in problems)
    assert any("platform macosx_11_0_arm64" in p for p in problems)
    assert gc.wheel_problems(good[:1], spec) == ["tqdm: to be carried, but profiling/wheels has no wheel of it"]


def test_imports_the_image_lacks_must_be_carried():
    spec = gc.image()
    lines, problems = gc.import_problems(gc.plan_for_imports(ROOT, sys.executable), spec)
    assert not problems and any(line.startswith("cupy ") for line in lines)
    assert any(line.startswith("xdist ") for line in lines)  # the cuda tests run with pytest -n
    lacking = dict(spec, packages={k: v for k, v in spec["packages"].items() if k != "scipy"})
    _, problems = gc.import_problems(gc.plan_for_imports(ROOT, sys.executable), lacking)
    assert problems == ["scipy (scipy), imported by tests/kernels/test_sampling.py"]


def _row(kernel: str, measured: float, floor: float, expected: float) -> dict:
    return {"family": "linear", "case": "prompt", "kernel": kernel, "shape": {"rows": 8192}, "measured_s": measured,
            "floor_s": floor, "expected_s": expected, "device": "NVIDIA H200", "date": "2026-12-03"}


def test_a_kernel_outside_its_band_or_under_its_floor_is_a_model_error():
    """gpu_check's model verdict (pure): a kernel within +-25 % of its expected time and above its
    floor passes; one faster than its floor, or 26 % off its expected time either way, is FAILED as a
    model error that names the kernel; an empty measurement is FAILED too."""
    inside = [_row("linear_mma_bf16_m128", 1.2e-3, 0.8e-3, 1.0e-3), _row("argmax_rows_f32", 0.76e-3, 0.5e-3, 1.0e-3)]
    assert gc.model_verdict(inside).status == "ok" and gc.model_errors(inside) == []
    under = gc.model_verdict(inside + [_row("attention_prompt_bf16_d256", 0.9e-3, 1.0e-3, 1.1e-3)])
    assert under.status == "FAILED" and "attention_prompt_bf16_d256" in under.summary
    assert "faster than its floor" in under.summary and "model error in 1 of 3" in under.summary
    for measured in (1.26e-3, 0.74e-3):
        slow = gc.model_verdict([_row("gdn_chunk_state_bf16_dk128", measured, 0.1e-3, 1.0e-3)])
        assert slow.status == "FAILED" and "gdn_chunk_state_bf16_dk128" in slow.summary and "outside +-25%" in slow.summary
    assert gc.model_verdict([]).status == "FAILED"


def test_the_bench_step_checks_the_model_from_its_json(tmp_path):
    """On a GPU the bench step writes its rows as JSON (bench_kernels --json) and fails on a model
    error, naming the kernel; the bench script's own verdict is the same rule."""
    import json
    bench = load_script("bench_kernels")
    (step,) = [s for s in gc.plan(False, tmp_path, sys.executable) if s.name == "bench"]
    assert step.cmd[-2:] == ["--json", str(tmp_path / "kernels.json")]
    rows = [_row("linear_mma_bf16_m16", 2.0e-3, 0.5e-3, 1.0e-3)]
    (tmp_path / "kernels.json").write_text(json.dumps({"rows": rows}))
    log = "decode  B=1  1.00  2.00  2.0ms  1  1  memory  50%  0.5ms  1.0ms  2.00x  MODEL ERROR\n"
    outcome = step.check(log, 0)
    assert outcome.status == "FAILED" and "linear_mma_bf16_m16" in outcome.summary
    assert bench.model_error(2.0e-3, 0.5e-3, 1.0e-3) and bench.model_error(0.4e-3, 0.5e-3, 1.0e-3)
    assert not bench.model_error(1.1e-3, 0.5e-3, 1.0e-3)
