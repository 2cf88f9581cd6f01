"""MkDocs hooks of dspark's site (mkdocs.yml `hooks:`). What a page must not copy by hand is made here,
at build time, from the code and the records it describes:

* `<!-- dspark-options CMD -->`: the options of `dspark CMD`, from `dspark.cli.build_parser()`;
* `<!-- dspark-nvtx-ranges -->`: the NVTX range names, from `dspark.profile.PHASES`;
* `<!-- dspark-api-index -->`: the public names of the Python API (API_NAMES, DESIGN section 7),
  each a cross-reference to its entry in the API pages, so a name without its reference fails the
  strict build (mkdocs-autorefs reports it unresolved);
* `results.md`: profiling/RESULTS.md, as it is;
* the pictures under `img/`: the performance model's (profiling/plots.py) and a run of the demo's
  request (dspark.plots), drawn for this build. None is committed.

DSPARK_DOCS_PICTURES=DIR keeps the pictures in DIR: those already there are reused, the others
drawn there (the docs tests build the site more than once).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]

# DESIGN section 7 (and section 9's loaders): the names a user imports. Each must have an entry in
# the API pages; the index page links every one.
API_NAMES = (
    "dspark.backends.backends",
    "dspark.backends.get_backend",
    "dspark.philox.philox4x32",
    "dspark.models.load_default",
    "dspark.models.hf.load_target",
    "dspark.models.hf.load_drafter",
    "dspark.session.DsparkSpecSession",
    "dspark.session.DsparkSpecSession.prime",
    "dspark.session.DsparkSpecSession.burst",
    "dspark.session.DsparkSpecSession.round",
    "dspark.session.DsparkSpecSession.cache",
    "dspark.session.DsparkSpecSession.rounds",
    "dspark.session.DsparkSpecSession.emitted",
    "dspark.session.DsparkSpecSession.stats",
    "dspark.session.DsparkSpecSession.cache_max_ctx",
    "dspark.session.DsparkSpecSession.finished",
    "dspark.session.DsparkSpecSession.pos",
    "dspark.session.DsparkSpecSession.take_prefix_capture",
    "dspark.session.DsparkSpecSession.into_demoted",
    "dspark.session.SpecParams",
    "dspark.session.SamplingParams",
    "dspark.session.SpecBoundaryCapture",
    "dspark.stats.SpecStats",
    "dspark.decode.plain_generate",
    "dspark.decode.PlainBatch",
    "dspark.worker.Worker",
    "dspark.worker.GateConfig",
    "dspark.worker.PrefixStore",
)

PICTURES = ("round-composition.png", "speedup-context.png", "predicted-measured.png", "demo-acceptance.png")
MARKER = re.compile(r"<!-- dspark-([a-z-]+)(?: ([a-z]+))? -->")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# ---- generated tables -------------------------------------------------------------------------------
def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def options_table(command: str) -> str:
    """The options of `dspark COMMAND` as a Markdown table, read from the parser itself."""
    from dspark.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    if command not in sub.choices:
        raise PluginError(f"<!-- dspark-options {command} -->: dspark has no command {command!r}")
    rows = ["| option | value | default | what it does |", "|---|---|---|---|"]
    for act in sub.choices[command]._actions:
        if act.dest == "help":
            continue
        names = ", ".join(f"`{o}`" for o in act.option_strings) or f"`{act.dest}` (positional)"
        if act.choices:
            value = " \\| ".join(f"`{c}`" for c in act.choices)
        elif act.nargs == 0:
            value = "flag"
        else:
            value = f"`{act.metavar or act.dest.upper()}`" if act.option_strings else "text"
        default = "" if act.default in (None, False) or not act.option_strings else f"`{act.default}`"
        rows.append(f"| {names} | {value} | {default} | {cell(act.help or '')} |")
    return "\n".join(rows)


def nvtx_table() -> str:
    from dspark.profile import DOMAIN, PHASES
    rows = ["| range | what it covers |", "|---|---|"]
    rows += [f"| `{DOMAIN}:{name}` | {cell(what)} |" for name, what in PHASES.items()]
    return "\n".join(rows)


def first_sentence(doc: str) -> str:
    para = " ".join(doc.split("\n\n")[0].split())
    return para.split(". ")[0].rstrip(".") + "." if para else ""


def api_index() -> str:
    """One row per name of API_NAMES: its cross-reference and the first sentence of its docstring,
    read statically by griffe as mkdocstrings reads it (attribute docstrings included)."""
    import griffe
    package = griffe.load("dspark", search_paths=[str(ROOT)])
    rows = ["| name | what it is |", "|---|---|"]
    for name in API_NAMES:
        try:
            obj = package[name.split(".", 1)[1]]
        except KeyError:
            raise PluginError(f"API_NAMES: {name} is not in the package") from None
        what = first_sentence(obj.docstring.value) if obj.docstring else ""
        if not what:
            raise PluginError(f"API_NAMES: {name} has no docstring to say what it is")
        rows.append(f"| [`{name}`][{name}] | {cell(what)} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files, **_):
    def expand(m):
        kind, arg = m.group(1), m.group(2)
        if kind == "options" and arg:
            return options_table(arg)
        if kind == "nvtx-ranges":
            return nvtx_table()
        if kind == "api-index":
            return api_index()
        raise PluginError(f"{page.file.src_uri}: unknown marker {m.group(0)}")
    return MARKER.sub(expand, markdown)


# ---- generated files: the results page and the pictures ----------------------------------------------
def draw_pictures(out: Path) -> None:
    """Draw the pictures missing from `out`."""
    missing = [p for p in PICTURES if not (out / p).is_file()]
    if not missing:
        return
    plots = _load("dspark_docs_plots", ROOT / "profiling" / "plots.py")
    if "round-composition.png" in missing:
        plots.draw_composition(plots.composition_series(), out / "round-composition.png")
    if "speedup-context.png" in missing:
        plots.draw_speedup(plots.speedup_series(4.97), 4.97, out / "speedup-context.png")
    if "predicted-measured.png" in missing:
        plots.draw_predicted_measured(plots.measured_rows(), out / "predicted-measured.png")
    if "demo-acceptance.png" in missing:
        demo_picture(out / "demo-acceptance.png")


def demo_picture(path: Path) -> None:
    """The demo's speculative request on the embedded pair (numpy backend), drawn as `--plot` draws it."""
    from dspark import get_backend
    from dspark.byte_vocab import encode
    from dspark.cli import DEMO_MAX_VERIFY, DEMO_PROMPT, DEMO_TAU, run_spec
    from dspark.models import load_default
    from dspark.plots import plot_run
    from dspark.session import SpecParams
    from dspark.stats import RoundTrace
    trunk, drafter = load_default(get_backend("numpy"))
    trace = RoundTrace()
    params = SpecParams(max_new_tokens=256, tau=DEMO_TAU, max_verify=DEMO_MAX_VERIFY, capture=False)
    out, _, stats, _ = run_spec(trunk, drafter, encode(DEMO_PROMPT), params, trace=trace)
    plot_run(path, stats, trace, f"dspark demo: embedded pair, {len(out)} tokens, greedy")


def on_files(files, config, **_):
    files.append(File.generated(config, "results.md",
                                content=(ROOT / "profiling" / "RESULTS.md").read_text(encoding="utf-8")))
    keep = os.environ.get("DSPARK_DOCS_PICTURES")
    out = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="dspark-docs-"))
    out.mkdir(parents=True, exist_ok=True)
    draw_pictures(out)
    for name in PICTURES:
        files.append(File.generated(config, f"img/{name}", abs_src_path=str(out / name)))
    return files
