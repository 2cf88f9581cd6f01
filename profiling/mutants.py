"""Mutation testing: the regular suite must kill every realistic mutant in profiling/mutants.toml.

    python profiling/mutants.py [--only ID ...] [--jobs N] [--list]

Greedy output stays exact whatever the drafter proposes, so a whole class of bugs keeps an
exactness-only suite green. Each mutant here is such a bug (or a kernel bug), written as data:
the file, an exact snippet and its replacement, what it breaks, and the tests that must kill it.
For each mutant the runner

* checks that the snippet occurs exactly once in the file: a stale mutant (the code moved on) is
  an error, never a kill;
* applies it to a private copy of the tree (never in place) and runs its `kill` tests there with
  `pytest -x`, PYTHONPATH pointing at the copy. A kernel mutant is rebuilt for simt as a private
  build of its family alone (or its families: `family` may name several, space-separated)
  (dspark.backends.simt_build, DSPARK_SIMT_MODULE); the same tests
  first pass on an unmutated build of that family, so a kill is the mutant's doing. A native
  mutant (class "native", csrc/cpu) rebuilds the copy's dspark._cpu, restored afterwards;
* counts it killed when a kill test fails, survived when they all pass, and an error otherwise
  (a collection error, no test selected, a build failure, a timeout).

Prints one line per mutant, then `mutants killed: K/N`; exit code 0 only if all N were killed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = Path(__file__).with_name("mutants.toml")
FIELDS = {"id", "class", "file", "original", "replacement", "breaks", "kill"}
CLASSES = {"session", "sampling", "kernel", "native", "op", "tooling"}  # tooling: the model, the GPU check, interop
SKIP = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache",
                              ".hypothesis", "*.egg-info")


@dataclass(frozen=True)
class Mutant:
    id: str
    cls: str
    file: str
    original: str
    replacement: str
    breaks: str
    kill: tuple[str, ...]
    family: str | None = None


def load_table(path: Path = TABLE) -> list[Mutant]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    rows = tomllib.loads(path.read_text())["mutant"]
    out, seen = [], set()
    for i, row in enumerate(rows):
        missing, extra = FIELDS - set(row), set(row) - FIELDS - {"family"}
        if missing or extra:
            raise ValueError(f"{path.name} entry {i} ({row.get('id')}): missing {sorted(missing)}, unknown {sorted(extra)}")
        m = Mutant(row["id"], row["class"], row["file"], row["original"], row["replacement"], row["breaks"],
                   tuple(row["kill"]), row.get("family"))
        if m.id in seen:
            raise ValueError(f"{path.name}: mutant id {m.id!r} appears twice")
        seen.add(m.id)
        if m.cls not in CLASSES:
            raise ValueError(f"{m.id}: class={m.cls!r}, expected one of {sorted(CLASSES)}")
        if (m.cls == "kernel") != (m.family is not None):
            raise ValueError(f"{m.id}: kernel mutants (and only they) name their family")
        if not m.kill or not all(k.startswith("tests/") for k in m.kill):
            raise ValueError(f"{m.id}: kill must name tests of the regular suite (tests/...), got {m.kill}")
        if m.original == m.replacement:
            raise ValueError(f"{m.id}: the replacement equals the original")
        out.append(m)
    return out


def stale_reason(m: Mutant, root: Path = ROOT) -> str | None:
    """Why the mutant cannot be applied to the tree at `root` (None: it can)."""
    path = root / m.file
    if not path.is_file():
        return f"{m.file} does not exist"
    n = path.read_text().count(m.original)
    if n != 1:
        return f"its snippet occurs {n} times in {m.file} (expected exactly once): re-target it"
    return kill_test_reason(m, root)


def kill_test_reason(m: Mutant, root: Path = ROOT) -> str | None:
    """Why the mutant's kill tests cannot run (None: their files and functions exist)."""
    for k in m.kill:
        test_file = root / k.split("::")[0]
        if not test_file.is_file():
            return f"kill test file {k.split('::')[0]} does not exist"
        name = k.split("::")[1].split("[")[0] if "::" in k else None
        if name and not re.search(rf"^def {re.escape(name)}\(", test_file.read_text(), re.M):
            return f"kill test {name} is not in {k.split('::')[0]}"
    return None


# ---- the copy -----------------------------------------------------------------------------------
def installed(module: str = "_simt") -> Path | None:
    """The compiled dspark.<module> this interpreter imports (an editable or in-place build)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(f"dspark.{module}")
    except ModuleNotFoundError:  # dspark itself is not installed: an in-place build is in the tree
        return None
    return Path(spec.origin) if spec and spec.origin else None


def make_copy(dest: Path) -> Path:
    """The source tree (no VCS, venv or caches) with the compiled modules (dspark._simt and its
    signature table, dspark._cpu), which an editable install may keep outside the tree."""
    tree = dest / "tree"
    shutil.copytree(ROOT, tree, ignore=SKIP)
    simt = installed("_simt")
    if simt and not any((tree / "dspark").glob("_simt*")):
        shutil.copy2(simt, tree / "dspark" / simt.name)
        if (simt.parent / "_kernels.json").exists() and not (tree / "dspark" / "_kernels.json").exists():
            shutil.copy2(simt.parent / "_kernels.json", tree / "dspark" / "_kernels.json")
    native = installed("_cpu")
    if native and not any((tree / "dspark").glob("_cpu*")):
        shutil.copy2(native, tree / "dspark" / native.name)
    return tree


def seed_cubins(cache: Path) -> None:
    """The run's cache starts with the cubins the suite already compiled ($DSPARK_CACHE/cubin or
    ~/.cache/dspark/cubin): each is keyed by the bytes of its source and headers (dspark.toolchain.
    cubin_key), so a mutated kernel never finds an unmutated cubin, and the performance model's
    first mutant does not recompile every family (about two minutes)."""
    from dspark.kernel_sources import cache_dir
    src = cache_dir() / "cubin"
    if src.is_dir() and src.resolve() != (cache / "cubin").resolve():
        shutil.copytree(src, cache / "cubin", dirs_exist_ok=True)


def child_env(tree: Path, cache: Path, module: str | None = None) -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", DSPARK_CACHE=str(cache))
    env.pop("DSPARK_SIMT_MODULE", None)
    if module:
        env["DSPARK_SIMT_MODULE"] = module
    return env


def check_copy_is_imported(tree: Path, cache: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import dspark; print(dspark.__file__)"], cwd=tree,
                         env=child_env(tree, cache), capture_output=True, text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the copy's tests would import dspark from {out}, not from the copy {tree}")


# ---- runs ---------------------------------------------------------------------------------------
@dataclass
class Outcome:
    verdict: str      # KILLED, SURVIVED, ERROR, STALE
    detail: str
    seconds: float = 0.0


def pytest_run(tree: Path, env: dict, tests: tuple[str, ...], timeout: int) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-rfE", *tests]
    try:
        r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout}s"
    return r.returncode, r.stdout + r.stderr


def first_failure(output: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return m.group(1) if m else "?"


def build_family(tree: Path, cache: Path, family: str) -> str:
    """A private simt build of one kernel family (or several, space-separated: a test that runs a
    second family's kernel beside the mutated one) from the copy's csrc/; returns its path."""
    r = subprocess.run([sys.executable, "-m", "dspark.backends.simt_build", "--families", *family.split()], cwd=tree,
                       env=child_env(tree, cache), capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"simt build of {family} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return r.stdout.strip().split("=", 1)[1]


class Workspace:
    """One private copy of the tree per worker thread; mutants are applied and reverted in it."""

    def __init__(self, base: Path, cache: Path, index: int):
        self.tree = make_copy(base / f"w{index}")
        self.cache = cache
        check_copy_is_imported(self.tree, cache)

    def run(self, m: Mutant, timeout: int, baseline_module: str | None) -> Outcome:
        t0 = time.perf_counter()
        reason = stale_reason(m, self.tree)
        if reason:
            return Outcome("STALE", reason)
        path = self.tree / m.file
        text = path.read_text()
        path.write_text(text.replace(m.original, m.replacement))
        native = next((self.tree / "dspark").glob("_cpu.*"), None) if m.cls == "native" else None
        saved = native.read_bytes() if native else None
        try:
            module = None
            if m.cls == "native":
                try:  # the copy's own build helper, compiling the copy's csrc/cpu
                    r = subprocess.run([sys.executable, "-c", "from dspark.kernel_sources import build_cpu; build_cpu()"],
                                       cwd=self.tree, env=child_env(self.tree, self.cache), capture_output=True,
                                       text=True)
                    if r.returncode:
                        raise RuntimeError((r.stdout + r.stderr)[-3000:])
                except RuntimeError as e:
                    return Outcome("ERROR", f"the mutant does not compile (not a realistic mutant): {e}")
            if m.cls == "kernel":
                try:
                    module = build_family(self.tree, self.cache, m.family)
                except RuntimeError as e:
                    return Outcome("ERROR", f"the mutant does not compile (not a realistic mutant): {e}")
                if module == baseline_module:
                    return Outcome("ERROR", "the mutated build equals the unmutated one")
            rc, out = pytest_run(self.tree, child_env(self.tree, self.cache, module), m.kill, timeout)
        finally:
            path.write_text(text)
            if saved is not None:
                native.write_bytes(saved)
        dt = time.perf_counter() - t0
        if rc == 1:
            return Outcome("KILLED", f"by {first_failure(out)}", dt)
        if rc == 0:
            return Outcome("SURVIVED", f"{', '.join(m.kill)} all passed", dt)
        return Outcome("ERROR", f"pytest exit code {rc}:\n{out[-3000:]}", dt)

    def baseline(self, family: str, tests: tuple[str, ...], timeout: int) -> tuple[str | None, str | None]:
        """(module, None) when the family's kill tests pass on its unmutated private build, else
        (None, why)."""
        try:
            module = build_family(self.tree, self.cache, family)
        except RuntimeError as e:
            return None, str(e)
        rc, out = pytest_run(self.tree, child_env(self.tree, self.cache, module), tests, timeout)
        if rc != 0:
            return None, f"the kill tests fail on the unmutated {family} build (exit {rc}): {first_failure(out)}\n" \
                         f"{out[-2000:]}"
        return module, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="mutant ids to run (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    ap.add_argument("--cache", default=None, help="folder for the private simt builds (default: a temporary one)")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    args = ap.parse_args(argv)
    table = load_table()
    if args.list:
        for m in table:
            print(f"{m.id:45s} {m.cls:8s} {m.file:24s} {m.breaks}")
        return 0
    unknown = set(args.only or ()) - {m.id for m in table}
    if unknown:
        print(f"mutants.py: unknown mutant ids {sorted(unknown)}", file=sys.stderr)
        return 2
    todo = [m for m in table if not args.only or m.id in args.only]
    results: dict[str, Outcome] = {}
    for m in todo:  # stale entries fail loudly before anything runs
        reason = stale_reason(m)
        if reason:
            results[m.id] = Outcome("STALE", reason)
    runnable = [m for m in todo if m.id not in results]
    t_start = time.perf_counter()
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="dspark-mutants-") as tmp:
        base = Path(tmp)
        cache = Path(args.cache).resolve() if args.cache else base / "cache"
        seed_cubins(cache)
        jobs = max(1, min(args.jobs, len(runnable) or 1))
        spaces = [Workspace(base, cache, i) for i in range(jobs)]
        free = list(spaces)

        baselines: dict[str, tuple[str | None, str | None]] = {}
        families = sorted({m.family for m in runnable if m.family})
        for fam in families:  # the union of the family's kill tests, on its unmutated build
            tests = tuple(dict.fromkeys(k for m in runnable if m.family == fam for k in m.kill))
            baselines[fam] = spaces[0].baseline(fam, tests, args.timeout)
            print(f"baseline {fam}: {'ok' if baselines[fam][0] else 'FAILED'}", flush=True)

        def run_one(m: Mutant) -> None:
            with lock:
                space = free.pop()
            try:
                if m.family and baselines[m.family][0] is None:
                    out = Outcome("ERROR", f"no valid baseline: {baselines[m.family][1]}")
                else:
                    out = space.run(m, args.timeout, baselines[m.family][0] if m.family else None)
            finally:
                with lock:
                    free.append(space)
            with lock:
                results[m.id] = out
                print(f"{out.verdict:8s} {m.id:45s} {out.seconds:6.1f}s  {out.detail.splitlines()[0] if out.detail else ''}",
                      flush=True)
                if out.verdict == "ERROR" and "\n" in out.detail:
                    print(out.detail, flush=True)

        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(run_one, runnable))
    for m in todo:
        if results[m.id].verdict == "STALE":
            print(f"STALE    {m.id:45s} {results[m.id].detail}")
    killed = sum(r.verdict == "KILLED" for r in results.values())
    for verdict in ("SURVIVED", "ERROR", "STALE"):
        ids = [m.id for m in todo if results[m.id].verdict == verdict]
        if ids:
            print(f"{verdict.lower()}: {', '.join(ids)}")
    print(f"mutants killed: {killed}/{len(todo)} in {time.perf_counter() - t_start:.0f}s")
    return 0 if killed == len(todo) else 1


if __name__ == "__main__":
    sys.exit(main())
