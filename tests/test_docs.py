"""The documentation: README's and the getting-started page's code runs as written, the site builds in
strict mode and fails on a broken link or an API name without its reference, and what it generates
(option tables, NVTX range names, the API index, pictures) comes from the code."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

try:
    import mkdocs  # noqa: F401
except ImportError:  # CI installs the docs extra: a skip there would hide a broken site
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("the docs extra (pip install -e '.[docs]') is not installed", allow_module_level=True)


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), re.S)


def commands(block: str) -> list[str]:
    """The commands of a bash block, comments dropped."""
    out = []
    for line in block.splitlines():
        cmd = line.split(" #")[0].strip()
        if cmd and not cmd.startswith("#"):
            out.append(cmd)
    return out


def canonical(cmd: str) -> list[str]:
    """A command as its words, `python -m pip` as `pip` and pip's -q dropped: how .ci/run and the
    docs may each write the same install."""
    words = shlex.split(cmd)
    while words and re.fullmatch(r"[A-Z_0-9]+=\S*", words[0]):  # an environment setting before the command
        words = words[1:]
    if words[:3] == ["python", "-m", "pip"]:
        words = ["pip", *words[3:]]
    return [w for w in words if w != "-q"] if words[:1] == ["pip"] else words


CI_COMMANDS = [canonical(c) for c in commands((ROOT / ".ci" / "run").read_text())]
SUITE = ["python", "-m", "pytest", "-q", "-n", "2", "tests"]


def run_shell(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    words = shlex.split(cmd)
    if words[0] == "dspark":  # the console script of this environment
        words = [sys.executable, "-m", "dspark", *words[1:]]
    return subprocess.run(words, cwd=cwd, capture_output=True, text=True, timeout=300)


def check_commands(path: Path, tmp_path: Path) -> None:
    """Every command of the page's bash blocks: the install, test and docs-build lines are the ones
    .ci/run runs (CI runs them in the venv it builds, this suite included); every other one runs here."""
    for block in blocks(path, "bash"):
        for cmd in commands(block):
            words = canonical(cmd)
            if words[:1] in (["pip"], ["mkdocs"]) or words == SUITE:
                assert words in CI_COMMANDS, f"{path.name}: {cmd!r} is not a command .ci/run runs"
                continue
            r = run_shell(cmd, tmp_path)
            assert r.returncode == 0, f"{path.name}: {cmd!r} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def test_readme_example_and_commands_run_as_written(tmp_path):
    (example,) = blocks(ROOT / "README.md", "python")
    r = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "mean accepted length" in r.stdout
    check_commands(ROOT / "README.md", tmp_path)
    assert SUITE in CI_COMMANDS  # README's test command is what CI calls


def test_getting_started_runs_as_written(tmp_path):
    page = DOCS / "getting-started.md"
    code = "\n".join(blocks(page, "python"))  # one session: later blocks use earlier names
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    check_commands(page, tmp_path)
    assert (tmp_path / "demo.png").stat().st_size > 10_000 and (tmp_path / "generate.png").stat().st_size > 10_000


# ---- the site ---------------------------------------------------------------------------------------
def site_copy(tmp: Path) -> Path:
    """mkdocs.yml and docs/ copied to `tmp`, the hook and the package read from this tree."""
    shutil.copytree(DOCS, tmp / "docs", ignore=shutil.ignore_patterns("hooks.py"))
    cfg = (ROOT / "mkdocs.yml").read_text()
    cfg = cfg.replace("  - docs/hooks.py", f"  - {DOCS / 'hooks.py'}").replace("paths: [.]", f"paths: [{ROOT}]")
    (tmp / "mkdocs.yml").write_text(cfg)
    return tmp


def build(tmp: Path, pictures: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSPARK_DOCS_PICTURES": str(pictures), "NO_MKDOCS_2_WARNING": "1"}
    # No -q: it drops the warnings before strict mode counts them, and a broken link would pass.
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    return tmp_path_factory.mktemp("pictures")


@pytest.fixture(scope="module")
def site(tmp_path_factory, pictures):
    tmp = site_copy(tmp_path_factory.mktemp("site"))
    r = build(tmp, pictures)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "site"


def text_of(html: Path) -> str:
    return re.sub(r"<[^>]+>", " ", html.read_text())


def test_site_builds_strict_with_generated_options_ranges_api_and_pictures(site, pictures):
    from dspark.cli import build_parser
    from dspark.profile import PHASES
    sys.path.insert(0, str(DOCS))
    import hooks
    cli = text_of(site / "cli" / "index.html")
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        for act in parser._actions:
            if act.dest == "help":  # every command's -h, --help: not a row of its table
                continue
            for opt in act.option_strings:
                assert opt in cli, f"dspark {name} {opt} is missing from the command line page"
    nvtx = text_of(site / "profiling" / "index.html")
    assert all(f"dspark:{p}" in nvtx for p in PHASES)
    api = (site / "api" / "index.html").read_text()
    for name in hooks.API_NAMES:  # each a resolved cross-reference: a link to its entry's anchor
        assert re.search(rf'href="[^"]*#dspark[.\w]*"[^>]*>\s*<code>{re.escape(name)}</code>', api), name
    for name in hooks.PICTURES:
        assert (site / "img" / name).read_bytes()[:4] == b"\x89PNG", name
    assert "Results" in text_of(site / "results" / "index.html")


def test_a_broken_link_fails_the_build(tmp_path, site, pictures):
    tmp = site_copy(tmp_path)
    page = tmp / "docs" / "concepts" / "round.md"
    page.write_text(page.read_text().replace("(demotion.md)", "(demotions.md)", 1))
    r = build(tmp, pictures)
    assert r.returncode != 0 and "demotions.md" in r.stderr


def test_an_api_name_without_its_reference_fails_the_build(tmp_path, site, pictures):
    tmp = site_copy(tmp_path)
    page = tmp / "docs" / "api" / "worker.md"
    page.write_text(page.read_text().replace("::: dspark.worker.GateConfig\n", ""))
    r = build(tmp, pictures)
    assert r.returncode != 0 and "dspark.worker.GateConfig" in r.stderr


def test_nvtx_range_names_are_the_ones_the_code_opens():
    from dspark.profile import PHASES
    used = set()
    for f in (ROOT / "dspark").rglob("*.py"):
        used |= set(re.findall(r'phase\("([a-z_]+)"\)', f.read_text()))
    assert used == set(PHASES)
