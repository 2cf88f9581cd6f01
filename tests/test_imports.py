"""The package's import graph, read from the sources (every import statement, those inside
functions included): no cycle, and the layers below the session (the backends, the CuPy
contract stand-in among them, and the ops) import nothing from the session, the worker or the
models. A profiling command that needs a session lives in profiling/, not in a backend."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dspark"
LOW_LAYERS = ("dspark.backends", "dspark.ops")
ABOVE = ("dspark.session", "dspark.worker", "dspark.models")


def modules() -> dict[str, Path | None]:
    """dotted name -> source file (None for a compiled extension, which imports nothing of ours)."""
    out: dict[str, Path | None] = {}
    for f in PACKAGE.rglob("*"):
        if f.suffix not in (".py", ".so", ".pyd") or "_csrc" in f.parts:
            continue
        parts = [*f.relative_to(PACKAGE.parent).parent.parts, f.name.split(".")[0]]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f if f.suffix == ".py" else None
    return out


def _known(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, mods) -> set[str]:
    """The dspark modules `name` imports anywhere in its source: `from X import y` counts as X.y
    when that is a module, else as X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {_known(a.name, mods) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else _known(base, mods) for a in node.names}
    return {m for m in out if m and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: (imports_of(m, p, mods) if p else set()) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], 0
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    scc = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        scc.append(w)
                        if w == v:
                            break
                    if len(scc) > 1:
                        out.append(sorted(scc))
    return out


def test_the_graph_is_read_from_every_import_statement():
    """The reader sees imports inside functions and relative ones: cuda.py imports the launch checks
    at the top, the backends package imports its executors inside functions."""
    g = graph()
    assert "dspark.backends.launch" in g["dspark.backends.cuda"]
    assert {"dspark.backends.simt", "dspark.backends.cuda"} <= g["dspark.backends"]
    assert "dspark.backends" in g["dspark.backends.contract"]


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "modules that import each other in a circle: " + "; ".join(" <-> ".join(c) for c in found)


def test_backends_and_ops_import_nothing_above_them():
    bad = {m: sorted(d for d in deps if d.startswith(ABOVE))
           for m, deps in graph().items() if m.startswith(LOW_LAYERS)}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"the backends and ops must not import the session, the worker or the models: {bad}"


def test_a_cycle_and_a_reach_upwards_are_found(tmp_path):
    """The checks themselves, on a graph with a hidden function-level import."""
    g = {"dspark.backends.contract": {"dspark.session"}, "dspark.session": {"dspark.backends.contract"}}
    assert cycles(g) == [["dspark.backends.contract", "dspark.session"]]
    src = tmp_path / "contract.py"
    src.write_text("def f():\n    from ..session import spec_round\n")
    mods = {"dspark.backends.contract": src, "dspark.session": None, "dspark.backends": None}
    assert imports_of("dspark.backends.contract", src, mods) == {"dspark.session"}
