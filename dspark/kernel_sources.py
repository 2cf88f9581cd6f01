"""The kernel sources in csrc/ and the signatures of their extern "C" entry points.

Standard library only: setup.py loads this file by path to generate the simt registration units
and `dspark/_kernels.json` before the package exists. Entry points may be stamped out by macros
(one per dtype), so signatures are read from the preprocessed source, not the raw text; the
preprocessing is done here, in Python (`Preprocessor`), so reading the signatures needs no host
compiler: a GPU machine without one runs the `cuda` backend from the sources alone.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SIGNATURES_JSON = PACKAGE_DIR / "_kernels.json"


def csrc_dir() -> Path:
    """The kernel sources: shipped inside the package, or beside it in a source checkout."""
    for d in (PACKAGE_DIR / "_csrc", PACKAGE_DIR.parent / "csrc"):
        if (d / "common.cuh").is_file():
            return d
    raise FileNotFoundError("dspark kernel sources (csrc/) not found next to the package")


def cache_dir() -> Path:
    """Where builds are cached (simt modules, cubins): $DSPARK_CACHE or ~/.cache/dspark."""
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def includes(source: Path) -> list[Path]:
    """Every header `source` reaches through #include "..." (transitively, whatever the #if
    around it), sorted: what a build of it depends on besides itself."""
    seen: dict[Path, None] = {}
    todo = [source]
    while todo:
        f = todo.pop()
        for name in _INCLUDE.findall(f.read_text()):
            dep = (f.parent / name).resolve()
            if not dep.is_file():
                dep = (source.parent / name).resolve()
            if dep.is_file() and dep not in seen and dep != source.resolve():
                seen[dep] = None
                todo.append(dep)
    return sorted(seen)


def kernel_files(root: Path | None = None) -> list[Path]:
    """Every kernel family source, `csrc/*.cu`, sorted."""
    return sorted((root or csrc_dir()).glob("*.cu"))


# C parameter type (after dropping const/__restrict__) -> (kind, NumPy dtype code or pointee size)
SCALAR_CODES = {
    "int": "<i4", "int32_t": "<i4", "unsigned": "<u4", "unsigned int": "<u4", "uint32_t": "<u4",
    "long long": "<i8", "int64_t": "<i8", "unsigned long long": "<u8", "uint64_t": "<u8",
    "float": "<f4", "double": "<f8",
}
POINTEE_SIZES = {
    "void": 0, "float": 4, "double": 8, "int": 4, "int32_t": 4, "unsigned": 4, "unsigned int": 4,
    "uint32_t": 4, "long long": 8, "int64_t": 8, "unsigned long long": 8, "uint64_t": 8,
    "short": 2, "int16_t": 2, "uint16_t": 2, "unsigned short": 2, "f16_t": 2, "bf16_t": 2,
    "char": 1, "int8_t": 1, "uint8_t": 1, "unsigned char": 1,
}


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str       # as written, normalised: "const float*", "int"
    code: str        # "ptr" or a NumPy dtype string such as "<i4"
    elem: int        # pointee size for pointers (0 = any), scalar size otherwise
    is_const: bool   # pointers: pointee is const


@dataclass(frozen=True)
class Signature:
    name: str
    source: str      # file name in csrc/
    params: tuple[Param, ...]


_ENTRY = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)', re.S)


def parse_param(text: str) -> Param:
    text = " ".join(text.replace("__restrict__", " ").split())
    m = re.match(r"^(.*?)(\w+)$", text)
    if not m:
        raise ValueError(f"cannot parse kernel parameter {text!r}")
    ctype, name = re.sub(r"\s*\*\s*", "* ", m.group(1)).strip(), m.group(2)  # "const T *const *" -> "const T* const*"
    stars = ctype.count("*")
    # For pointers what matters is the pointee's const: "const float*", "const float* const".
    is_const = "const" in ctype.split("*")[0].split() if stars else True
    base = " ".join(w for w in ctype.replace("*", " ").split() if w != "const")
    if stars >= 2:
        return Param(name, ctype, "ptr", 8, is_const)  # pointer table: 8-byte addresses
    if stars == 1:
        if base not in POINTEE_SIZES:
            raise ValueError(f"kernel parameter {name}: unknown pointee type {base!r}")
        return Param(name, ctype, "ptr", POINTEE_SIZES[base], is_const)
    if base not in SCALAR_CODES:
        raise ValueError(f"kernel parameter {name}: unsupported scalar type {base!r}")
    return Param(name, ctype, SCALAR_CODES[base], int(SCALAR_CODES[base][-1]), True)


# ---- the preprocessor: what NVRTC sees, without a host compiler ---------------------------------------
# Enough of C's preprocessor for csrc/: #include "..." (each #pragma once header once), object- and
# function-like #define with # and ## (Prosser's hide-set expansion), #undef, and #if / #ifdef /
# #ifndef / #elif / #else / #endif over integer expressions with defined(). <system> includes are
# skipped (NVRTC builds include none). tests/kernels/test_kernel_sources.py checks the signatures it
# yields against a host compiler's `-E` wherever one is installed (CI).
_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r\f\v]+)
  | (?P<str>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
  | (?P<id>[A-Za-z_]\w*)
  | (?P<num>\.?\d(?:[eEpP][+-]|[\w.])*)
  | (?P<punct>\#\#|&&|\|\||==|!=|<=|>=|<<|>>|->|::|\.\.\.|[^\s])
""", re.X)
NVRTC_DEFINES = {"__CUDACC_RTC__": "1", "__CUDACC__": "1"}


class PreprocessorError(ValueError):
    pass


@dataclass
class _Tok:
    text: str
    hide: frozenset = frozenset()
    space: bool = False     # whitespace before it (for # stringizing and the joined output)


@dataclass
class _Macro:
    params: tuple[str, ...] | None   # None: object-like
    body: list
    variadic: bool = False


def _tokens(text: str) -> list[_Tok]:
    out, space = [], False
    for m in _TOKEN.finditer(text):
        if m.lastgroup == "ws":
            space = True
            continue
        out.append(_Tok(m.group(), frozenset(), space))
        space = False
    return out


def _strip_comments(text: str) -> str:
    """Comments out, line continuations joined; newlines kept so lines stay lines."""
    text = text.replace("\\\n", "")
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise PreprocessorError("unterminated comment")
            out.append(" " + "\n" * text.count("\n", i, j))
            i = j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


class Preprocessor:
    def __init__(self, defines: dict[str, str] | None = None, include_dirs: tuple[Path, ...] = ()):
        self.macros: dict[str, _Macro] = {}
        for name, value in (defines or {}).items():
            self.macros[name] = _Macro(None, _tokens(value))
        self.include_dirs = include_dirs
        self.once: set[Path] = set()

    # -- files and directives
    def run(self, path: Path) -> str:
        out: list[str] = []
        self._file(Path(path).resolve(), out)
        return "\n".join(out) + "\n"

    def _file(self, path: Path, out: list[str]) -> None:
        if path in self.once:
            return
        lines = _strip_comments(path.read_text()).split("\n")
        stack: list[list[bool]] = []   # per open #if: [this branch live, some branch taken]
        block: list[str] = []

        def live() -> bool:
            return all(s[0] for s in stack)

        def flush():
            if block:
                out.append(self._join(self.expand(_tokens("\n".join(block)))))
                block.clear()
        for number, line in enumerate(lines, 1):
            m = re.match(r"\s*#\s*(\w*)(.*)$", line)
            if not m:
                if live() and line.strip():
                    block.append(line)
                continue
            flush()
            word, rest = m.group(1), m.group(2).strip()
            where = f"{path.name}:{number}"
            if word in ("if", "ifdef", "ifndef"):
                if not live():
                    stack.append([False, True])
                    continue
                if word == "if":
                    ok = self.evaluate(rest, where)
                else:
                    ok = (rest.split()[0] in self.macros) == (word == "ifdef")
                stack.append([ok, ok])
            elif word == "elif":
                if not stack:
                    raise PreprocessorError(f"{where}: #elif without #if")
                top = stack[-1]
                outer = all(s[0] for s in stack[:-1])
                ok = outer and not top[1] and self.evaluate(rest, where)
                top[0], top[1] = ok, top[1] or ok
            elif word == "else":
                if not stack:
                    raise PreprocessorError(f"{where}: #else without #if")
                top = stack[-1]
                top[0], top[1] = not top[1], True
            elif word == "endif":
                if not stack:
                    raise PreprocessorError(f"{where}: #endif without #if")
                stack.pop()
            elif not live():
                continue
            elif word == "include":
                inc = re.match(r'"([^"]+)"', rest)
                if inc:
                    self._file(self._find(inc.group(1), path, where), out)
            elif word == "define":
                self._define(rest, where)
            elif word == "undef":
                self.macros.pop(rest.split()[0], None)
            elif word == "pragma" and rest.split()[:1] == ["once"]:
                self.once.add(path)
            elif word == "error":
                raise PreprocessorError(f"{where}: #error {rest}")
            elif word not in ("pragma", "warning", "line", ""):
                raise PreprocessorError(f"{where}: #{word} is not a directive dspark's preprocessor knows")
        flush()
        if stack:
            raise PreprocessorError(f"{path.name}: #if without #endif")

    def _find(self, name: str, including: Path, where: str) -> Path:
        for d in (including.parent, *self.include_dirs):
            if (d / name).is_file():
                return (d / name).resolve()
        raise PreprocessorError(f"{where}: #include \"{name}\" not found")

    def _define(self, rest: str, where: str) -> None:
        m = re.match(r"([A-Za-z_]\w*)(\(([^)]*)\))?(.*)$", rest)
        if not m:
            raise PreprocessorError(f"{where}: cannot parse #define {rest}")
        name, params, body = m.group(1), m.group(3), m.group(4)
        if m.group(2) is None:
            self.macros[name] = _Macro(None, _tokens(body))
            return
        names = [p.strip() for p in params.split(",") if p.strip()]
        variadic = bool(names) and names[-1] == "..."
        if variadic:
            names[-1] = "__VA_ARGS__"
        self.macros[name] = _Macro(tuple(names), _tokens(body), variadic)

    # -- #if expressions
    def evaluate(self, expr: str, where: str) -> bool:
        toks = _tokens(expr)
        resolved: list[_Tok] = []
        i = 0
        while i < len(toks):  # defined X / defined(X) before any expansion
            if toks[i].text == "defined":
                if i + 1 < len(toks) and toks[i + 1].text == "(":
                    name, i = toks[i + 2].text, i + 4
                else:
                    name, i = toks[i + 1].text, i + 2
                resolved.append(_Tok("1" if name in self.macros else "0"))
            else:
                resolved.append(toks[i])
                i += 1
        words = []
        for t in self.expand(resolved):
            x = t.text
            if re.match(r"[A-Za-z_]", x):
                x = "0"  # an identifier left after expansion is 0
            elif re.match(r"\d", x):
                x = str(int(x.rstrip("uUlL"), 0))
            else:
                x = {"&&": " and ", "||": " or ", "!": " not ", "/": "//"}.get(x, x)
            words.append(x)
        try:
            return bool(eval(" ".join(words), {"__builtins__": {}}, {}))  # noqa: S307 (integers and operators only)
        except Exception as e:
            raise PreprocessorError(f"{where}: cannot evaluate #if {expr}") from e

    # -- macro expansion (Prosser's algorithm: a token's hide set names the macros it came from)
    def expand(self, toks: list[_Tok]) -> list[_Tok]:
        out: list[_Tok] = []
        todo = list(reversed(toks))   # a stack: the next token is todo[-1]
        while todo:
            t = todo.pop()
            m = self.macros.get(t.text)
            if m is None or t.text in t.hide:
                out.append(t)
                continue
            if m.params is None:
                body = self._substitute(m, {}, t.hide | {t.text})
            else:
                if not todo or todo[-1].text != "(":
                    out.append(t)
                    continue
                args, close = self._arguments(todo, t.text)
                body = self._substitute(m, self._bind(m, args, t.text), (t.hide & close.hide) | {t.text})
            if body:
                body[0] = _Tok(body[0].text, body[0].hide, t.space)
            todo.extend(reversed(body))
        return out

    @staticmethod
    def _arguments(todo: list[_Tok], name: str) -> tuple[list[list[_Tok]], _Tok]:
        todo.pop()  # "("
        args, cur, depth = [], [], 0
        while todo:
            t = todo.pop()
            if t.text == "(":
                depth += 1
            elif t.text == ")":
                if depth == 0:
                    args.append(cur)
                    return args, t
                depth -= 1
            elif t.text == "," and depth == 0:
                args.append(cur)
                cur = []
                continue
            cur.append(t)
        raise PreprocessorError(f"unterminated call of macro {name}")

    @staticmethod
    def _bind(m: _Macro, args: list[list[_Tok]], name: str) -> dict[str, list[_Tok]]:
        if m.params == () and args == [[]]:
            args = []
        if m.variadic:
            fixed = len(m.params) - 1
            if len(args) < fixed:
                raise PreprocessorError(f"macro {name} needs at least {fixed} arguments")
            rest = args[fixed:]
            va = [tok for i, a in enumerate(rest) for tok in ([_Tok(",")] if i else []) + a]
            args = args[:fixed] + [va]
        if len(args) != len(m.params):
            raise PreprocessorError(f"macro {name} takes {len(m.params)} arguments, got {len(args)}")
        return dict(zip(m.params, args))

    def _substitute(self, m: _Macro, actual: dict[str, list[_Tok]], hide: frozenset) -> list[_Tok]:
        body, out, i = m.body, [], 0
        while i < len(body):
            t = body[i]
            if t.text == "#" and m.params is not None and i + 1 < len(body) and body[i + 1].text in actual:
                arg = actual[body[i + 1].text]
                text = "".join((" " if k and a.space else "") + a.text for k, a in enumerate(arg))
                out.append(_Tok('"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"', frozenset(), t.space))
                i += 2
                continue
            if t.text == "##" and out and i + 1 < len(body):
                nxt = body[i + 1]
                rhs = actual[nxt.text] if nxt.text in actual else [nxt]
                if rhs:
                    text = out[-1].text + rhs[0].text  # "" is a placemarker: an empty argument
                    glued = _tokens(text)
                    if text and len(glued) != 1:
                        raise PreprocessorError(f"## of {out[-1].text!r} and {rhs[0].text!r} is not one token")
                    out[-1] = _Tok(text, frozenset(), out[-1].space)
                    out += [_Tok(x.text, x.hide, x.space) for x in rhs[1:]]
                i += 2
                continue
            if t.text in actual:
                pasted = i + 1 < len(body) and body[i + 1].text == "##"
                arg = actual[t.text] if pasted else self.expand([_Tok(a.text, a.hide, a.space) for a in actual[t.text]])
                if arg:
                    out.append(_Tok(arg[0].text, arg[0].hide, t.space))
                    out += [_Tok(a.text, a.hide, a.space) for a in arg[1:]]
                elif pasted:
                    out.append(_Tok("", frozenset(), t.space))
                i += 1
                continue
            out.append(_Tok(t.text, t.hide, t.space))
            i += 1
        return [_Tok(t.text, t.hide | hide, t.space) for t in out if t.text]

    @staticmethod
    def _join(toks: list[_Tok]) -> str:
        return " ".join(t.text for t in toks)


def preprocess(path: Path) -> str:
    """The source as NVRTC sees it (__CUDACC_RTC__ defined, no simt prelude), so `__global__`
    survives; no host compiler involved."""
    path = Path(path)
    return Preprocessor(NVRTC_DEFINES, (path.parent,)).run(path)


def signatures_in(text: str, source: str) -> list[Signature]:
    """The extern "C" __global__ entry points of preprocessed source text."""
    out = []
    for m in _ENTRY.finditer(text):
        params = tuple(parse_param(p) for p in m.group(2).split(",") if p.strip())
        out.append(Signature(m.group(1), source, params))
    return out


def parse_signatures(path: Path) -> list[Signature]:
    return signatures_in(preprocess(path), Path(path).name)


def scan(root: Path | None = None, files: list[Path] | None = None) -> dict[str, Signature]:
    """name -> Signature over csrc/*.cu (or `files`); a duplicated entry name is an error."""
    sigs: dict[str, Signature] = {}
    for f in files if files is not None else kernel_files(root):
        for s in parse_signatures(f):
            if s.name in sigs:
                raise ValueError(f"kernel {s.name} is defined in both {sigs[s.name].source} and {s.source}")
            sigs[s.name] = s
    return sigs


def write_json(sigs: dict[str, Signature], path: Path = SIGNATURES_JSON) -> None:
    path.write_text(json.dumps({n: asdict(s) for n, s in sorted(sigs.items())}, indent=1) + "\n")


def load_json(path: Path = SIGNATURES_JSON) -> dict[str, Signature]:
    raw = json.loads(path.read_text())
    return {n: Signature(d["name"], d["source"], tuple(Param(**p) for p in d["params"])) for n, d in raw.items()}


SIMT_CXXFLAGS = ["-std=c++17", "-O2", "-DDSPARK_SIMT", "-ffp-contract=off", "-fvisibility=hidden"]
# dspark._cpu, the numpy backend's native code (csrc/cpu): its translation units and flags (no
# contracted multiply-add: the NumPy references reproduce every bit).
CPU_SOURCES = ["cpu/module.cpp", "cpu/product_avx512.cpp", "cpu/product_avx2.cpp", "cpu/product_base.cpp",
               "cpu/host_ops.cpp"]
CPU_CXXFLAGS = ["-O2", "-ffp-contract=off", "-Wno-psabi"]


def build_cpu(root: Path | None = None) -> Path:
    """Compile dspark._cpu in place under `root` (default: this tree) with setup.py's sources and
    flags, without setuptools (which would rebuild dspark._simt too): for a copy of the tree whose
    native code changed (the mutation runner, profiling/bench_embedded.py). Returns its path."""
    import importlib.machinery
    import os
    import subprocess
    import sysconfig

    import pybind11
    root = Path(root) if root else PACKAGE_DIR.parent
    target = root / "dspark" / f"_cpu{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", *CPU_CXXFLAGS,
           "-I", pybind11.get_include(), "-I", sysconfig.get_paths()["include"],
           *(str(root / "csrc" / f) for f in CPU_SOURCES), "-o", str(target)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"build of dspark._cpu failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return target


def write_registration_units(gen_dir: Path, files: list[Path]) -> list[Path]:
    """Write one registration unit per kernel family into gen_dir; return their paths."""
    gen_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        unit = gen_dir / (f.stem + "_simt.cpp")
        text = registration_unit(f, parse_signatures(f))
        if not unit.exists() or unit.read_text() != text:
            unit.write_text(text)
        out.append(unit)
    return out


def simt_sources(gen_dir: Path, root: Path | None = None, files: list[Path] | None = None) -> list[Path]:
    """Every host translation unit of the dspark._simt module (all families, or `files`)."""
    root = root or csrc_dir()
    return [root / "simt" / "runtime.cpp", root / "bindings" / "simt_module.cpp",
            *write_registration_units(gen_dir, files if files is not None else kernel_files(root))]


def registration_unit(source: Path, sigs: list[Signature]) -> str:
    """A host translation unit that compiles one .cu and registers its entry points."""
    lines = [
        "// generated by dspark/kernel_sources.py: do not edit",
        '#include "simt/registry.h"',
        f'#include "{source.name}"',
        "namespace {",
    ]
    lines += [f'simt::Registration reg_{s.name}("{s.name}", &{s.name});' for s in sigs]
    lines.append("}  // namespace")
    return "\n".join(lines) + "\n"
