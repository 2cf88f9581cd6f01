"""The GPU check: one command for a lent GPU machine, within a time budget (470 s by default,
GPU_CHECK_BUDGET), no package registry there. Standard library only: it runs before any wheel is
installed. `bash profiling/gpu_check.sh` runs it.

    python profiling/gpu_check.py OUTDIR                 on the GPU machine: OUTDIR/gpu_report.md, step by step
    python profiling/gpu_check.py --dry-run [OUTDIR]     anywhere: every step that needs no GPU (CI runs it)
    python profiling/gpu_check.py --only bench,gate OUTDIR   some steps (a rerun)

The steps, in order: what the run is for comes first. wheels (pip --no-index from profiling/wheels),
info, cubins (every family compiled by dspark's NVRTC options and loaded), bench (the kernel
benchmarks at Qwen3.5-27B's shapes, each row measured beside profiling/perf_model.py's floor and
expected time, written to OUTDIR/kernels.json; a kernel faster than its floor or outside +-25 % of
its expected time is a model error: the step is FAILED and names it), gate (the exactness gate on cuda), perf_model (the model's rounds, and with --prompt
its time to first token, plain batched decode and memory tables), rounds (a Qwen3.5-27B round and
plain decode step op by op, from recordings and as CUDA graphs, beside the model, and CuPy's own
per-call costs: profiling/graph_rounds.py); then Nsight
Systems (the session workload's NVTX phases) and Nsight Compute (the verify attention kernel);
then compute-sanitizer memcheck, racecheck and synccheck over tests/gpu/test_cuda_ops.py (every op
once against the numpy backend, one cudaMalloc per array: they need only the cuda backend); last
the cuda tests (the per-family kernel tests' cuda cases, the model-size checks and the cuBLAS row
probe). No step needs the simt build or a host compiler.

Each step has a nominal limit; the limits add up to the budget, and a step may also use what the
steps before it left unused (never what a later step is owed). A step's status is one of
  ok                 it ran and its check passed: tests passed, rows measured, a report written
  FAILED             it ran nothing or measured nothing (zero tests collected, every test skipped,
                     an empty table), or what it ran failed
  TIMEOUT            it did not finish in its limit; the report says what it did finish
  unavailable here   the tool is not installed, or refuses this machine's GPU (compute-sanitizer,
                     ncu and nsys do on some runtimes): not a failure of dspark
  not run            a dry run's GPU step, or a step --only left out
The exit code is 1 when a step FAILED or timed out.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import glob
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
IMAGE = Path(__file__).with_name("gpu_image.toml")
WHEELS = Path(__file__).with_name("wheels")
BUDGET = 470
GRACE = 5  # seconds between SIGTERM and SIGKILL of a step that ran out of time

# What the pytest steps run: the cuda cases of the kernel tests (each against its NumPy reference),
# the model-size checks, the cuBLAS row probe, and the small per-op cases the sanitizers run.
CUDA_TESTS = ["tests/kernels", "tests/gpu/test_cuda_kernels.py", "tests/gpu/test_cuda_ops.py",
              "tests/gpu/test_gemm_rows.py", "-k", "cuda or cublas"]
SANITIZER_TESTS = ["tests/gpu/test_cuda_ops.py::test_cuda_op_matches_the_reference"]


@dataclasses.dataclass
class Outcome:
    status: str     # ok | FAILED | TIMEOUT | unavailable here | not run
    summary: str

    @property
    def failed(self) -> bool:
        return self.status in ("FAILED", "TIMEOUT")


@dataclasses.dataclass
class Step:
    """One step: a command (or an in-process function) with a nominal time limit, and the check
    that reads its log. `why_not`: the step is not run, and why (status `not_run_status`)."""
    name: str
    limit: int
    cmd: list[str] | None = None
    check: Callable[[str, int], Outcome] | None = None
    fn: Callable[[], tuple[str, Outcome]] | None = None
    env: dict = dataclasses.field(default_factory=dict)
    unavailable: tuple[str, ...] = ()   # log patterns meaning the tool refused this machine
    why_not: str = ""
    not_run_status: str = "not run"
    tail: int = 30


# ---- checks: what a log must show ---------------------------------------------------------------------
_PYTEST_LINE = re.compile(r"(\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b"
                          r"|\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\s+(\S+::\S+)")
_PYTEST_SUMMARY = re.compile(r"^=+ (.*?) in [\d.]+s(?: \([\d:]+\))? =+$", re.M)


def pytest_counts(log: str) -> dict[str, int]:
    """passed / failed / skipped / error / xfailed / xpassed / deselected: pytest's closing summary
    line when there is one, else the per-test lines of -v (a run cut short has no summary)."""
    found = _PYTEST_SUMMARY.findall(log)
    if found:
        counts = {}
        for n, what in re.findall(r"(\d+) (\w+)", found[-1]):
            counts[{"errors": "error", "warnings": "warning"}.get(what, what)] = int(n)
        return counts
    last: dict[str, str] = {}
    for m in _PYTEST_LINE.finditer(log):
        node, status = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        last[node] = status
    counts: dict[str, int] = {}
    for status in last.values():
        key = {"XFAIL": "xfailed", "XPASS": "xpassed"}.get(status, status.lower())
        counts[key] = counts.get(key, 0) + 1
    return counts


def pytest_check(log: str, rc: int) -> Outcome:
    """ok only when at least one test passed and none failed: zero collected, every test skipped
    or deselected, and a failure are all FAILED."""
    c = pytest_counts(log)
    ran = {k: c[k] for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed") if c.get(k)}
    text = ", ".join(f"{v} {k}" for k, v in ran.items()) or "no test ran"
    reason = re.search(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", log)
    if rc == 5 or not ran:
        return Outcome("FAILED", f"collected no test ({text})")
    if not c.get("passed"):
        return Outcome("FAILED", f"no test passed ({text}{'; skipped: ' + reason.group(1) if reason else ''})")
    if rc != 0 or c.get("failed") or c.get("error"):
        return Outcome("FAILED", text)
    return Outcome("ok", text)


def collected_check(log: str, rc: int) -> Outcome:
    """pytest --collect-only: at least one test collected, no collection error."""
    m = re.search(r"^(\d+)(?:/\d+)? tests? collected", log, re.M)
    n = int(m.group(1)) if m else 0
    if rc != 0 or not n:
        errors = re.findall(r"^ERROR (\S+)", log, re.M)
        return Outcome("FAILED", f"{n} tests collected" + (f"; collection errors in {', '.join(errors)}" if errors else ""))
    return Outcome("ok", f"{n} tests collected")


def sanitizer_check(log: str, rc: int) -> Outcome:
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", log)
    tests = pytest_check(log, 0 if rc == 3 else rc)
    if rc == 3 or any(int(e) for e in errors):
        return Outcome("FAILED", f"compute-sanitizer found {sum(map(int, errors))} errors; tests: {tests.summary}")
    if not errors and tests.status == "ok":
        return Outcome("FAILED", f"no compute-sanitizer summary; tests: {tests.summary}")
    return tests


def rows_check(pattern: str, what: str, least: int = 1) -> Callable[[str, int], Outcome]:
    """At least `least` lines match `pattern` (each a row measured, a family loaded, ...)."""
    rx = re.compile(pattern, re.M)

    def check(log: str, rc: int) -> Outcome:
        n = len(rx.findall(log))
        if n < least:
            return Outcome("FAILED", f"{n} {what}: {'measured nothing' if not n else f'expected {least}'}")
        if rc != 0:
            return Outcome("FAILED", f"exit {rc} after {n} {what}")
        return Outcome("ok", f"{n} {what}")
    return check


def all_of(*checks: Callable[[str, int], Outcome]) -> Callable[[str, int], Outcome]:
    """Every check passes (the first that fails says why)."""
    def check(log: str, rc: int) -> Outcome:
        outcomes = [c(log, rc) for c in checks]
        return next((o for o in outcomes if o.status != "ok"), Outcome("ok", "; ".join(o.summary for o in outcomes)))
    return check


def text_check(needle: str, what: str) -> Callable[[str, int], Outcome]:
    def check(log: str, rc: int) -> Outcome:
        if rc == 0 and needle in log:
            return Outcome("ok", what)
        return Outcome("FAILED", f"exit {rc}; no {needle!r} in the output")
    return check


def gate_check(log: str, rc: int) -> Outcome:
    cases = len(re.findall(r"^(?:EXACT|MISMATCH)  ", log, re.M))
    if rc == 0 and cases and "ALL EXACT" in log:
        return Outcome("ok", f"{cases} cases, ALL EXACT")
    return Outcome("FAILED", f"{cases} cases checked, {len(re.findall(r'^MISMATCH', log, re.M))} mismatched")


# ---- the model check: measured kernels against profiling/perf_model.py ---------------------------------
MODEL_TOLERANCE = 0.25   # a kernel's measured time within +-25 % of its expected time, and never under its floor


def model_errors(rows: list[dict], tolerance: float = MODEL_TOLERANCE) -> list[str]:
    """The rows (profiling/bench_kernels.py --json) whose measurement refutes the model: faster than
    the floor (a limiter priced too high, or one that does not bind), or outside +-tolerance of the
    expected time. Each names its kernel, case and shape."""
    out = []
    for r in rows:
        measured, floor, expected = r["measured_s"], r["floor_s"], r["expected_s"]
        what = f"{r['kernel']} ({r['family']} {r['case']}, " + " ".join(f"{k}={v}" for k, v in r["shape"].items()) + ")"
        if measured < floor:
            out.append(f"{what}: measured {measured * 1e6:.1f} us is faster than its floor {floor * 1e6:.1f} us")
        elif abs(measured - expected) > tolerance * expected:
            out.append(f"{what}: measured {measured * 1e6:.1f} us is {measured / expected:.2f}x its expected "
                       f"{expected * 1e6:.1f} us (outside +-{tolerance:.0%})")
    return out


def model_verdict(rows: list[dict], tolerance: float = MODEL_TOLERANCE) -> Outcome:
    """ok when every measured kernel lies in its band; FAILED (a model error) naming each that does not."""
    if not rows:
        return Outcome("FAILED", "no kernel measured")
    errors = model_errors(rows, tolerance)
    if errors:
        return Outcome("FAILED", f"model error in {len(errors)} of {len(rows)} kernels: " + "; ".join(errors))
    return Outcome("ok", f"{len(rows)} kernels within +-{tolerance:.0%} of the model's expected time, none under "
                         "its floor")


def model_check(path: Path) -> Callable[[str, int], Outcome]:
    """The bench step's verdict from the JSON rows it wrote."""
    def check(log: str, rc: int) -> Outcome:
        if not path.is_file():
            return Outcome("FAILED", f"exit {rc}; no {path.name} written")
        import json
        return model_verdict(json.loads(path.read_text())["rows"])
    return check


def families() -> int:
    return len(glob.glob(str(ROOT / "csrc" / "*.cu")))


# ---- the carried wheels and the imports the check makes --------------------------------------------------
def image() -> dict:
    return tomllib.loads(IMAGE.read_text())


def wheel_problems(wheels: list[Path], spec: dict) -> list[str]:
    """Each carried wheel installs on the image's Python (cpXY or py3 / abi3, its platforms or any),
    and every package to carry has one."""
    py = "cp" + spec["python"].replace(".", "")
    out, names = [], set()
    for w in wheels:
        parts = w.name[:-4].split("-")
        if len(parts) < 5:
            out.append(f"{w.name}: not a wheel file name")
            continue
        names.add(parts[0].lower().replace("_", "-"))
        pys, abis, plats = (set(p.split(".")) for p in parts[-3:])
        if not (py in pys or pys & {"py3", "py2.py3"} or (abis & {"abi3"} and any(p <= py for p in pys))):
            out.append(f"{w.name}: built for {'/'.join(sorted(pys))}, not {py}")
        if "any" not in plats and not plats & set(spec["platforms"]):
            out.append(f"{w.name}: platform {'/'.join(sorted(plats))}, not one of {', '.join(spec['platforms'])}")
    out += [f"{p}: to be carried, but profiling/wheels has no wheel of it" for p in spec["carry"] if p not in names]
    return out


# import name -> distribution name, where they differ
IMPORT_DIST = {"cupy": "cupy-cuda13x", "ml_dtypes": "ml-dtypes", "yaml": "pyyaml", "PIL": "pillow",
               "sklearn": "scikit-learn", "_pytest": "pytest", "xdist": "pytest-xdist", "cuda": "cuda-pathfinder",
               "huggingface_hub": "huggingface-hub", "google": "protobuf", "nvidia": "nvidia-cuda-nvrtc",
               "pkg_resources": "setuptools"}


def _guarded(node, parents) -> bool:
    """An import inside `try: ... except ImportError` (an optional dependency)."""
    for p in parents:
        if isinstance(p, ast.Try) and any(
                h.type is None or any(n in ast.unparse(h.type) for n in ("ImportError", "ModuleNotFoundError",
                                                                           "Exception"))
                for h in p.handlers) and any(node is b or any(node is x for x in ast.walk(b)) for b in p.body):
            return True
    return False


def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def third_party_imports(entries: list[Path]) -> dict[str, set[str]]:
    """top-level import name -> the files importing it, over `entries` and every local module they
    reach (dspark, tests, sibling profiling scripts; the parents of an imported package too),
    imports inside functions included, those guarded by `except ImportError` left out."""
    local_roots = {"dspark", "tests"}
    todo, seen, out = list(entries), set(), {}
    while todo:
        f = todo.pop()
        if f in seen or not f.is_file():
            continue
        seen.add(f)
        package = list(f.relative_to(ROOT).parts[:-1])  # a module's package, or an __init__'s own
        tree = ast.parse(f.read_text(), str(f))
        parents: dict = {}
        for p in ast.walk(tree):
            for c in ast.iter_child_nodes(p):
                parents[c] = p

        def chain(n):
            while n in parents:
                n = parents[n]
                yield n
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or _guarded(node, list(chain(node))):
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
                names = [".".join(base + [a.name]) for a in node.names] + [".".join(base)]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                names = [a.name for a in node.names]
            for name in names:
                top = name.split(".")[0]
                if top in local_roots:
                    parts = name.split(".")
                    for i in range(1, len(parts) + 1):  # the package's parents run on import too
                        mf = _module_file(".".join(parts[:i]))
                        if mf:
                            todo.append(mf)
                elif (ROOT / "profiling" / f"{top}.py").is_file():  # a sibling script (tests put profiling/ on sys.path)
                    todo.append(ROOT / "profiling" / f"{top}.py")
                elif top not in sys.stdlib_module_names and top != "__future__":
                    out.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return out


def check_entries(steps: list[Step]) -> list[Path]:
    """The files the real run's steps execute: their scripts, the test files they collect (every
    .py of a tests folder they name) and tests/conftest.py."""
    files = {ROOT / "tests" / "conftest.py"}
    for s in steps:
        words = [w for arg in s.cmd or () for w in (arg.split() if " " in arg else [arg])]  # bash -c "..." too
        for module in (w for prev, w in zip(words, words[1:]) if prev == "-m"):
            f = _module_file(module)
            if f is not None:  # python -m dspark: its __main__ and what that imports
                files |= {f, *(x for x in [f.parent / "__main__.py"] if f.name == "__init__.py" and x.is_file())}
        for arg in words:
            p = ROOT / arg.split("::")[0]
            if p.suffix == ".py" and p.is_file():
                files.add(p)
            elif p.is_dir() and arg.startswith("tests"):
                files |= set(p.rglob("*.py"))
            elif p.suffix == ".sh" and p.is_file():
                files |= {ROOT / m for m in re.findall(r"profiling/\w+\.py", p.read_text())}
    return sorted(files)


def import_problems(steps: list[Step], spec: dict) -> tuple[list[str], list[str]]:
    """(lines: each import and where it comes from, problems: imports neither the image nor a
    carried wheel provides)."""
    have = {n.lower() for n in spec["packages"]} | {n.lower() for n in spec["carry"]}
    found = third_party_imports(check_entries(steps))
    if any("-n" in (s.cmd or ()) for s in steps):
        found.setdefault("xdist", set()).add("pytest -n")
    lines, problems = [], []
    for name in sorted(found):
        dist = IMPORT_DIST.get(name, name.replace("_", "-")).lower()
        where = "carried" if dist in {c.lower() for c in spec["carry"]} else "image" if dist in have else "MISSING"
        lines.append(f"{name:20s} {dist:22s} {where:8s} {', '.join(sorted(found[name])[:3])}")
        if where == "MISSING":
            problems.append(f"{name} ({dist}), imported by {', '.join(sorted(found[name]))}")
    return lines, problems


# ---- the steps -------------------------------------------------------------------------------------------
def find_tool(env: str, name: str, patterns: list[str]) -> str | None:
    """$env, else `name` on PATH, else the newest match of the install-folder patterns."""
    for c in [os.environ.get(env), shutil.which(name), *(h for p in patterns for h in sorted(glob.glob(p), reverse=True))]:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def which(script: str) -> tuple[str | None, str]:
    """(path, message) of the tool profiling/<script> --which finds."""
    r = subprocess.run(["bash", str(ROOT / "profiling" / script), "--which"], capture_output=True, text=True)
    return (r.stdout.strip(), "") if r.returncode == 0 else (None, (r.stdout + r.stderr).strip())


def simt_built() -> bool:
    """Whether this tree has its simt extension (a GPU image without a host compiler does not)."""
    return any((ROOT / "dspark").glob("_simt*.so"))


def plan(dry: bool, out: Path, py: str) -> list[Step]:
    """The steps in order, each with its nominal limit (they add up to BUDGET)."""
    spec = image()
    wheels = sorted(WHEELS.glob("*.whl"))
    xdist = ["-n", "8"] if not dry and subprocess.run([py, "-c", "import xdist"], capture_output=True).returncode == 0 \
        else []
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider"]
    gpu = "not run (dry run: needs a GPU)"
    steps: list[Step] = []

    def wheels_step() -> tuple[str, Outcome]:
        problems = wheel_problems(wheels, spec)
        log = "\n".join([f"carried: {w.name}" for w in wheels] + [f"problem: {p}" for p in problems])
        if problems:
            return log, Outcome("FAILED", "; ".join(problems))
        if dry:
            return log, Outcome("ok", f"{len(wheels)} wheels for Python {spec['python']}, every one to carry present")
        r = subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *map(str, wheels)],
                           capture_output=True, text=True)
        log += "\n" + r.stdout + r.stderr
        return log, Outcome("ok" if r.returncode == 0 else "FAILED", f"{len(wheels)} wheels installed"
                            if r.returncode == 0 else f"pip exit {r.returncode}")
    if wheels:
        steps.append(Step("wheels", 15, fn=wheels_step))
    else:
        steps.append(Step("wheels", 15, why_not="no profiling/wheels/*.whl here (bash profiling/gpu_wheels.sh "
                          "fetches them where a registry is reachable)",
                          not_run_status="not run" if dry else "FAILED"))
    steps.append(Step("info", 15, ["bash", "-c", f"{py} -m dspark info && {py} -c 'from dspark import profile; "
                                   "print(\"NVTX:\", profile.nvtx_status())'"],
                      text_check("backends:", "dspark info") if dry else text_check(", cuda", "cuda is available")))
    loaded = rows_check(r"^\s+\S+\.cu: \d+ kernels", "kernel families loaded", families())
    steps.append(Step("cubins", 45, [py, "profiling/load_cubins.py", "--jobs", "8", *(["--contract"] if dry else [])],
                      loaded))
    if dry:
        steps.append(Step("bench", 100, [py, "profiling/bench_kernels.py", "--dry-run"],
                          rows_check(r"^\w+\s+.*\s(?:[\d.]+(?:us|ms|s)|nan)\s+(?:[\d.]+(?:us|ms|s)|nan)\s+\S+_\w+",
                                     "benchmarks planned with their H200 floor and expected time"), tail=60))
        steps.append(Step("gate", 45, [py, "profiling/e2e_gate.py", "--help"], text_check("usage:", "the gate's usage")))
    else:
        steps.append(Step("bench", 100, [py, "profiling/bench_kernels.py", "--json", str(out / "kernels.json")],
                          all_of(rows_check(r"\s\d+\.\d\dx\s+(?:ok|MODEL ERROR)\s*$",
                                            "rows measured beside the model's floor and expected time"),
                                 model_check(out / "kernels.json")), tail=200))
        steps.append(Step("gate", 45, [py, "profiling/e2e_gate.py", "--backend", "cuda", "--quick"], gate_check))
    steps.append(Step("perf_model", 10, ["bash", "-c", f"{py} profiling/perf_model.py --model qwen3.5-27b --batch 1 2 32 "
                                         f"--context 4096 32768 && {py} profiling/perf_model.py --prompt"],
                      all_of(rows_check(r"^Qwen3\.5-27B\s+\d+\s+\d+\s+\d+\s", "rounds predicted", 6),
                             rows_check(r"^Qwen3\.5-27B\s+\d+(?:\s+[\d,.]+){14}\s+\d+%$",
                                        "prompts priced (time to first token)", 2)), tail=60))
    rounds = rows_check(r"^\S.*\s(?:plain|eager|graph)\s+[\d,]+\s+[\d,.]+\s+[\d,]+", "rounds measured beside predicted")
    if dry and not simt_built():  # the stand-in runs its kernels on simt
        steps.append(Step("rounds", 35, [py, "profiling/graph_rounds.py", "--help"],
                          text_check("usage:", "the rounds script's usage (no simt build to run the stand-in)")))
    elif dry:
        steps.append(Step("rounds", 35, [py, "profiling/graph_rounds.py", "--backend", "contract", "--rounds", "1",
                                         "--calls", "20", "--context", "100"], rounds, tail=40))
    else:
        steps.append(Step("rounds", 35, [py, "profiling/graph_rounds.py"], rounds, tail=40))
    # Nsight Systems and Nsight Compute
    nsys, nsys_why = which("nsys_session.sh")
    nsys_refused = (r"\.qdstrm", r"Failed to create a report", r"QdstrmImporter")
    if dry:
        steps.append(Step("nsys", 30, [py, "profiling/session_workload.py", "--backend", "numpy", "--model", "tiny",
                                       "--requests", "2", "--tokens", "16", "--nvtx"],
                          text_check("tokens/s", "the workload nsys captures, on numpy")))
    elif nsys is None:
        steps.append(Step("nsys", 30, why_not=nsys_why, not_run_status="unavailable here"))
    else:
        steps.append(Step("nsys", 30, ["bash", "profiling/nsys_session.sh", str(out / "nsys"), "--requests", "4",
                                       "--tokens", "64"],
                          rows_check(r"^\s*[\d.]+\s+.*:?(?:prime|draft|propose|verify|accept|commit|rollback|ingest)\b",
                                     "NVTX phase rows"), unavailable=nsys_refused, tail=80))
    ncu, ncu_why = which("ncu_kernels.sh")
    ncu_refused = (r"Failed to initialize the profiler", r"LibraryNotLoaded", r"ERR_NVGPUCTRPERM",
                   r"[Dd]evice not supported")
    if dry:
        steps.append(Step("ncu", 35, [py, "profiling/verify_launch.py", "--backend", "numpy", "--ctx", "70", "--rows",
                                      "4", "--heads", "4", "2", "64"],
                          text_check("verify attention on numpy", "the launch ncu profiles, on numpy")))
    elif ncu is None:
        steps.append(Step("ncu", 35, why_not=ncu_why, not_run_status="unavailable here"))
    else:
        steps.append(Step("ncu", 35, ["bash", "profiling/ncu_kernels.sh", "--verify", str(out / "ncu")],
                          rows_check(r"attention_(?:f32|f16|bf16)_d\d+", "report lines of the verify kernel"),
                          unavailable=ncu_refused, tail=60))
    # compute-sanitizer over the per-op cases, against the numpy backend (no simt build needed)
    sanitizer = None if dry else find_tool("COMPUTE_SANITIZER", "compute-sanitizer", [
        "/usr/local/cuda*/bin/compute-sanitizer", "/usr/local/cuda*/compute-sanitizer/compute-sanitizer"])
    for tool in ("memcheck", "racecheck", "synccheck"):
        name = f"sanitizer_{tool}"
        if dry:
            steps.append(Step(name, 30, [*pytest, "-q", "--collect-only", *SANITIZER_TESTS], collected_check))
        elif sanitizer is None:
            steps.append(Step(name, 30, why_not="compute-sanitizer not found (PATH, /usr/local/cuda*, "
                                               "COMPUTE_SANITIZER=)", not_run_status="unavailable here"))
        else:
            steps.append(Step(name, 30, [sanitizer, "--tool", tool, "--error-exitcode", "3", "--target-processes", "all",
                                         *pytest, "-v", "-rs", "-x", *SANITIZER_TESTS], sanitizer_check,
                              env={"DSPARK_CUDA_POOL": "0"},
                              unavailable=(r"[Dd]evice not supported", r"not supported on this (?:device|platform)")))
    if dry:
        steps.append(Step("cuda_tests", 50, [*pytest, "-q", "--collect-only", *CUDA_TESTS], collected_check))
    else:
        steps.append(Step("cuda_tests", 50, [*pytest, *xdist, "-v", "-rs", *CUDA_TESTS], pytest_check, tail=60))
    if dry:  # what the real run would import, against the image and the carried wheels
        real = plan_for_imports(out, py)
        steps.insert(1, Step("imports", 0, fn=lambda: imports_step(real, spec)))
    if sum(s.limit for s in steps) != BUDGET:
        raise AssertionError(f"step limits add up to {sum(s.limit for s in steps)}, not {BUDGET}")
    return steps


def plan_for_imports(out: Path, py: str) -> list[Step]:
    """The real run's commands (tools assumed present), for the import check of a dry run."""
    return [Step("info", 0, [py, "-m", "dspark", "info"]),
            Step("bench", 0, [py, "profiling/bench_kernels.py"]), Step("gate", 0, [py, "profiling/e2e_gate.py"]),
            Step("cubins", 0, [py, "profiling/load_cubins.py"]), Step("perf_model", 0, [py, "profiling/perf_model.py"]),
            Step("rounds", 0, [py, "profiling/graph_rounds.py"]),
            Step("nsys", 0, ["bash", "profiling/nsys_session.sh"]), Step("ncu", 0, ["bash", "profiling/ncu_kernels.sh"]),
            Step("cuda_tests", 0, [py, "-m", "pytest", "-n", "8", *CUDA_TESTS, *SANITIZER_TESTS])]


def imports_step(real: list[Step], spec: dict) -> tuple[str, Outcome]:
    lines, problems = import_problems(real, spec)
    log = "\n".join(lines)
    if problems:
        return log, Outcome("FAILED", "neither the image nor a carried wheel has " + "; ".join(problems))
    return log, Outcome("ok", f"{len(lines)} third-party imports, each in the image or carried")


# ---- running -----------------------------------------------------------------------------------------
def run_step(step: Step, limit: float, out: Path) -> tuple[Outcome, float, str]:
    """(outcome, seconds, log) of one step under `limit` seconds."""
    log_path = out / f"{step.name}.log"
    t0 = time.monotonic()
    if step.why_not:
        log_path.write_text(step.why_not + "\n")
        return Outcome(step.not_run_status, step.why_not), 0.0, step.why_not
    if step.fn is not None:
        log, outcome = step.fn()
        log_path.write_text(log + "\n")
        return outcome, time.monotonic() - t0, log
    if limit < 1:
        log_path.write_text("")
        return Outcome("TIMEOUT", "not started: the time budget is spent"), 0.0, ""
    env = dict(os.environ, **step.env)
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(step.cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, wait in ((signal.SIGTERM, GRACE), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode if proc.returncode is not None else -9
    seconds = time.monotonic() - t0
    log = log_path.read_text(errors="replace")
    if step.unavailable and rc != 0:
        hit = next((m for p in step.unavailable if (m := re.search(rf".*{p}.*", log))), None)
        if hit:
            return Outcome("unavailable here", f"the tool refused this machine: {hit.group(0).strip()[:200]}"), \
                seconds, log
    # cut short, the exit code is the kill's: the check reads only what the log shows was finished
    rc_seen = 0 if timed_out else rc
    outcome = step.check(log, rc_seen) if step.check else Outcome("ok" if rc_seen == 0 else "FAILED", f"exit {rc}")
    if timed_out:
        return Outcome("TIMEOUT", f"cut at {limit:.0f}s; it had finished: {outcome.summary}"), seconds, log
    return outcome, seconds, log


def run(steps: list[Step], out: Path, budget: float = BUDGET, only: set[str] | None = None,
        report_head: str = "") -> list[tuple[Step, Outcome, float]]:
    """Run the steps in order; each may use its nominal limit plus what earlier steps left unused,
    never what a later step is owed. Writes OUTDIR/gpu_report.md as it goes."""
    report = out / "gpu_report.md"
    with open(report, "w") as f:
        f.write(report_head)
    scale = budget / max(1, sum(s.limit for s in steps))  # GPU_CHECK_BUDGET scales every nominal limit alike
    start = time.monotonic()
    done = []
    for i, step in enumerate(steps):
        if only is not None and step.name not in only:
            step = dataclasses.replace(step, why_not="not run (--only)", not_run_status="not run")
        owed = scale * sum(s.limit for s in steps[i + 1:] if only is None or s.name in only)
        limit = max(0.0, budget - (time.monotonic() - start) - owed)
        print(f"== {step.name} (limit {limit:.0f}s)", flush=True)
        outcome, seconds, log = run_step(step, limit, out)
        print(f"   {step.name}: {outcome.status}: {outcome.summary}", flush=True)
        tail = "\n".join(log.splitlines()[-step.tail:])
        with open(report, "a") as f:
            f.write(f"## {step.name}: {outcome.status} ({seconds:.0f}s of {step.limit}s nominal, {limit:.0f}s given)\n\n"
                    f"{outcome.summary}\n\n" + (f"`{' '.join(step.cmd)}`\n\n" if step.cmd else "")
                    + (f"```\n{tail}\n```\n\n" if tail.strip() else ""))
        done.append((step, outcome, seconds))
    total = time.monotonic() - start
    failed = [s.name for s, o, _ in done if o.failed]
    with open(report, "a") as f:
        f.write(f"Total: {total:.0f}s of a {budget:.0f}s budget; "
                + ("every step that ran passed" if not failed else f"FAILED: {', '.join(failed)}") + ".\n")
    return done


def head(dry: bool, steps: list[Step], py: str) -> str:
    def cmd(c):
        try:
            r = subprocess.run(c, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None
    gpu = cmd(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]) or "none"
    cupy = cmd([py, "-c", "import cupy; print(cupy.__version__)"]) or "not importable"
    limits = " + ".join(f"{s.name} {s.limit}" for s in steps if s.limit)
    return (f"# GPU check {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}"
            f"{' (dry run: no GPU)' if dry else ''}\n\n```\nGPU: {gpu}\npython {platform.python_version()} "
            f"{platform.machine()}, cupy {cupy}\nstep limits: {limits} = {sum(s.limit for s in steps)}s\n```\n\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="every step that needs no GPU")
    ap.add_argument("--only", help="comma-separated step names: run those, report the rest as not run")
    ap.add_argument("outdir", nargs="?", help="where gpu_report.md and the logs go (a dry run: a temp folder)")
    a = ap.parse_args(argv)
    if not a.dry_run and not a.outdir:
        ap.error("OUTDIR is required (or --dry-run)")
    out = Path(a.outdir or __import__("tempfile").mkdtemp(prefix="gpu_check_")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = os.environ.get("PYTHON", sys.executable)
    os.environ["PYTHONUNBUFFERED"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if not a.dry_run:
        os.environ["DSPARK_REQUIRE_CUDA"] = "1"  # a cuda test that skips would hide a failure
    steps = plan(a.dry_run, out, py)
    only = set(a.only.split(",")) if a.only else None
    if only and only - {s.name for s in steps}:
        ap.error(f"--only: no step {', '.join(sorted(only - {s.name for s in steps}))}")
    done = run(steps, out, float(os.environ.get("GPU_CHECK_BUDGET", BUDGET)), only, head(a.dry_run, steps, py))
    failed = any(o.failed for _, o, _ in done)
    print(f"wrote {out / 'gpu_report.md'}")
    if a.dry_run and not failed:
        print("dry run OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
