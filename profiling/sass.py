"""The kernels as compiled to SASS: each entry point's instructions, its loops and what one
iteration of a loop issues, read from dspark's own cubins (dspark.toolchain.family_cubin) with
cuobjdump (the `nvidia-cuda-cuobjdump` wheel, in the test extra; the toolkit's own where it is on
PATH or CUDA_HOME).

    python profiling/sass.py attention_prompt_bf16_d256 linear_mma_bf16_m128   # the loops of each

A loop is a backward branch (a branch to a lower address, not to itself) whose range holds no EXIT
(the divergent slow paths ptxas places after the exit jump back into a loop body: not loops). What
an iteration of a loop issues is every instruction in its range but the NOPs, inner loops' bodies
counted once (their trip counts are not in the SASS: a floor for them, named where it matters).
Instructions are classed by opcode for the limiters of profiling/perf_model.py: `mma` (HMMA: one
mma.sync m16n8k16 each), `ldsm` and `lds` / `sts` (shared memory), `ldgsts` (cp.async), `bar`
(barriers), `mufu` (exp, rcp), `shfl`, `fp32`, and the rest as `other`.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CLASSES = {"HMMA": "mma", "LDSM": "ldsm", "LDS": "lds", "STS": "sts", "LDGSTS": "ldgsts", "BAR": "bar",
           "MUFU": "mufu", "SHFL": "shfl", "FFMA": "fp32", "FADD": "fp32", "FMUL": "fp32", "FMNMX": "fp32",
           "FSETP": "fp32", "FSEL": "fp32", "LDG": "global", "STG": "global"}
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?\s*([^;]*);")
_FUNCTION = re.compile(r"^\s*Function : (\S+)", re.M)
_TARGET = re.compile(r"0x([0-9a-f]+)")


def cuobjdump() -> str:
    """cuobjdump: on PATH, in CUDA_HOME, or the nvidia-cuda-cuobjdump wheel's (nvidia/cu*/bin)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    places = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]
    try:
        import nvidia
        for root in nvidia.__path__:
            places += sorted(glob.glob(os.path.join(root, "cu*", "bin", "cuobjdump")), reverse=True)
            places += glob.glob(os.path.join(root, "cuda_cuobjdump", "bin", "cuobjdump"))
    except ImportError:
        pass
    for p in places:
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    raise FileNotFoundError("no cuobjdump: pip install nvidia-cuda-cuobjdump (the test extra), or put the CUDA "
                            "toolkit's on PATH")


@dataclasses.dataclass(frozen=True)
class Instr:
    addr: int
    opcode: str          # HMMA, LDSM, BRA, ...
    target: int | None   # a branch's target address
    predicated: bool = False

    @property
    def kind(self) -> str:
        return CLASSES.get(self.opcode, "other")


@dataclasses.dataclass(frozen=True)
class Loop:
    start: int
    end: int             # the backward branch's address
    issued: Counter      # class -> instructions in [start, end], inner loops once, NOPs left out
    depth: int           # 0: outermost
    shortest: int = 0    # instructions on the shortest path from start to the back edge (inner loops once)

    @property
    def instructions(self) -> int:
        return sum(self.issued.values())


def _steps(body: list[Instr], index: dict, skip: dict, end: int, n: int) -> list[tuple[int, int]]:
    """(where to, the last instruction issued on the way) of each way on from body[n] in one
    iteration of the loop ending at `end`: an inner loop entered at n runs once and is left after
    its back edge; the loop's own back edge ends the iteration (len(body)); a forward branch inside
    the loop may go to its target; anything but an unconditional branch or an exit falls through."""
    if n in skip:
        return [(skip[n] + 1, skip[n])]
    ins = body[n]
    if ins.addr == end:
        return [(len(body), n)]
    out = []
    if ins.target is not None and ins.target > ins.addr and ins.target in index:
        out.append((index[ins.target], n))
    if (ins.target is None or ins.predicated or ins.opcode != "BRA") and ins.opcode != "EXIT":
        out.append((n + 1, n))
    return out


def _loop_body(instrs: list[Instr], start: int, end: int, inner: list[tuple[int, int]]):
    body = [i for i in instrs if start <= i.addr <= end]
    index = {i.addr: n for n, i in enumerate(body)}
    cost = [0 if i.opcode == "NOP" else 1 for i in body]
    skip = {index[s]: index[e] for s, e in inner if s in index and e in index}
    return body, index, cost, skip


def shortest_path(instrs: list[Instr], start: int, end: int, inner: list[tuple[int, int]],
                  must: frozenset = frozenset()) -> tuple[int, list[int]]:
    """(instructions, their addresses) on a path of one iteration of the loop [start, end] (_steps;
    paths that leave the loop do not count). Of the paths that issue the most instructions at
    addresses in `must` (the work the iteration does), the one that issues the fewest instructions
    (NOPs not counted): guards of work are passed, alternatives without it skipped, of two
    alternatives with as much work the shorter taken."""
    body, index, cost, skip = _loop_body(instrs, start, end, inner)
    work = [1 if i.addr in must else 0 for i in body]
    none = (-1, 0)
    best, prev = [none] * (len(body) + 1), [-1] * (len(body) + 1)   # (work covered, -instructions)
    best[0] = (0, 0)
    for n in range(len(body)):
        if best[n] == none:
            continue
        for dst, last in _steps(body, index, skip, end, n):
            value = (best[n][0] + sum(work[n:last + 1]), best[n][1] - sum(cost[n:last + 1]))
            if value > best[dst]:
                best[dst], prev[dst] = value, n
    if best[-1] == none:
        return sum(cost), [i.addr for i in body]
    path, n = [], len(body)
    while n > 0 and prev[n] >= 0:
        n = prev[n]
        path.append(n)
    on = set()
    for n in path:
        on.update(range(n, skip[n] + 1) if n in skip else (n,))
    return -best[-1][1], sorted(body[n].addr for n in on if cost[n])


def shortest_floor(instrs: list[Instr], start: int, end: int, inner: list[tuple[int, int]],
                   must: frozenset) -> int:
    """Instructions on the shortest path of one iteration that issues every instruction in `must`
    (a floor of what an iteration that does that work issues); without such a path, the shortest."""
    body, index, cost, skip = _loop_body(instrs, start, end, inner)
    req = sorted(index[a] for a in must if a in index)
    for required in (req, []):
        inf = float("inf")
        best = [inf] * (len(body) + 1)
        best[0] = 0
        for n in range(len(body)):
            if best[n] == inf:
                continue
            for dst, last in _steps(body, index, skip, end, n):
                c = best[n] + sum(cost[n:last + 1])
                if c < best[dst] and not any(n < r < dst for r in required):
                    best[dst] = c
        if best[-1] != inf:
            return int(best[-1])
    return sum(cost)


def parse(text: str) -> dict[str, list[Instr]]:
    """cuobjdump -sass text -> entry -> its instructions in address order."""
    out = {}
    parts = _FUNCTION.split(text)
    for name, body in zip(parts[1::2], parts[2::2]):
        instrs = []
        for m in _LINE.finditer(body):
            addr, pred, op, operands = int(m.group(1), 16), m.group(2), m.group(3), m.group(5)
            target = None
            if op in ("BRA", "BRX", "JMP"):
                t = _TARGET.search(operands)
                target = int(t.group(1), 16) if t else None
            instrs.append(Instr(addr, op, target, bool(pred) or (m.group(4) or "").startswith(".DIV")))
        out[name] = instrs
    return out


def loops(instrs: list[Instr]) -> list[Loop]:
    """The loops of one entry point, outermost first."""
    exits = [i.addr for i in instrs if i.opcode == "EXIT"]
    spans = sorted({(i.target, i.addr) for i in instrs if i.target is not None and i.target < i.addr
                    and not any(i.target <= e <= i.addr for e in exits)}, key=lambda s: (s[0], -s[1]))
    out = []
    for start, end in spans:
        depth = sum(1 for s, e in spans if s <= start and end <= e and (s, e) != (start, end))
        inner = [(s, e) for s, e in spans if start <= s and e <= end and (s, e) != (start, end)]
        outer_inner = [(s, e) for s, e in inner if not any(s2 <= s and e <= e2 and (s2, e2) != (s, e) for s2, e2 in inner)]
        out.append(Loop(start, end, Counter(i.kind for i in instrs if start <= i.addr <= end and i.opcode != "NOP"),
                        depth, shortest_path(instrs, start, end, outer_inner)[0]))
    return out


@functools.lru_cache(maxsize=None)
def family_sass(cubin_path: str) -> dict[str, list[Instr]]:
    """Every entry's instructions of one cubin, disassembled once and kept beside it (`.sass.json`)."""
    import json
    cached = Path(cubin_path).with_suffix(".sass.json")
    if cached.is_file():
        return {e: [Instr(*i) for i in instrs] for e, instrs in json.loads(cached.read_text()).items()}
    r = subprocess.run([cuobjdump(), "-sass", cubin_path], capture_output=True, text=True, check=True)
    out = parse(r.stdout)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({e: [dataclasses.astuple(i) for i in instrs] for e, instrs in out.items()}))
    os.replace(tmp, cached)
    return out


@functools.lru_cache(maxsize=None)
def entry_sass(entry: str, arch: str = "sm_90") -> list[Instr]:
    """The SASS of one entry point, from its family's cubin as dspark builds it."""
    from dspark.kernel_sources import kernel_files, load_json
    from dspark.toolchain import family_cubin
    table = load_json()   # the signature table the build wrote (a test keeps it equal to the sources)
    if entry not in table:
        raise LookupError(f"no kernel entry {entry!r} in csrc/")
    source = next(f for f in kernel_files() if f.name == table[entry].source)
    return family_sass(str(family_cubin(source, arch).path))[entry]


@dataclasses.dataclass(frozen=True)
class Issue:
    """What one iteration of an entry point's main loop issues, per warp. The main loop: the one
    that holds the most of its anchor class (mma where the kernel has HMMA, else fp32), the inner
    one where a loop wraps another holding all its anchors. `path`:
    the shortest path through an iteration that issues every anchor instruction of it (inner
    loops once); `path_copies` the cp.async (LDGSTS) on it; `per_copy` the instructions per LDGSTS
    of the loop's inner loops that issue them (their trips are not in the SASS: the model runs
    them as often as simt counts their copies); `in_mma_stretches` the path's instructions that lie
    between two HMMA at most STRETCH apart (issued while the tensor pipe works); `outside` the
    instructions outside the loop, counted once."""
    entry: str
    anchor: str
    path: int
    floor_path: int       # the shortest path that issues every anchor instruction: a floor
    path_copies: int
    per_copy: float
    copies: int
    in_mma_stretches: int
    outside_path: int
    barriers: int
    static: int           # every instruction of the loop, inner loops once (both sides of each branch)
    mmas: int = 0         # HMMA on the path: all the loop has (m-tiles a launch may leave out included)


STRETCH = 24
WORK = ("mma", "fp32", "mufu", "shfl", "ldsm", "lds")  # the arithmetic and operand loads a path must issue where it can


@functools.lru_cache(maxsize=None)
def issue(entry: str, arch: str = "sm_90") -> Issue:
    instrs = entry_sass(entry, arch)
    body = [i for i in instrs if i.opcode != "NOP"]
    anchor = "mma" if any(i.kind == "mma" for i in body) else "fp32"
    ls = loops(instrs)
    if not ls:
        n = len(body)
        return Issue(entry, anchor, n, n, 0, 0.0, 0, 0, 0, sum(i.opcode == "BAR" for i in body), n)
    main = max(ls, key=lambda lp: (lp.issued[anchor], lp.instructions if lp.depth == 0 else 0, -lp.depth))
    # a loop that only wraps an inner one holding all its anchors (a GEMM's chunks around their tiles): the inner
    while inner_main := next((lp for lp in ls if main.start <= lp.start and lp.end <= main.end and lp != main
                              and lp.depth == main.depth + 1 and lp.issued[anchor] == main.issued[anchor] > 0), None):
        main = inner_main
    inner = [(lp.start, lp.end) for lp in ls if main.start <= lp.start and lp.end <= main.end and lp != main]
    outer_inner = [(s, e) for s, e in inner if not any(s2 <= s and e <= e2 and (s2, e2) != (s, e) for s2, e2 in inner)]
    in_inner = lambda a: any(s <= a <= e for s, e in outer_inner)  # noqa: E731
    loop = [i for i in body if main.start <= i.addr <= main.end]
    must = frozenset(i.addr for i in loop if i.kind in WORK and not in_inner(i.addr))
    n, path = shortest_path(instrs, main.start, main.end, outer_inner, must)
    kinds = {i.addr: i.kind for i in loop}
    anchors = frozenset(a for a in must if kinds[a] == anchor)
    floor = min(n, shortest_floor(instrs, main.start, main.end, outer_inner, anchors))
    on = set(path)
    copy_loops = [(s, e) for s, e in outer_inner if any(s <= i.addr <= e and i.kind == "ldgsts" for i in loop)]
    per_copy = (sum(sum(1 for i in loop if s <= i.addr <= e) for s, e in copy_loops)
                / max(1, sum(sum(1 for i in loop if s <= i.addr <= e and i.kind == "ldgsts") for s, e in copy_loops))
                ) if copy_loops else 1.0
    mmas = [a for a in path if kinds[a] == "mma"]
    stretch = 0
    ordered = [a for a in sorted(on)]
    pos = {a: k for k, a in enumerate(ordered)}
    for a, b in zip(mmas, mmas[1:]):
        if pos[b] - pos[a] <= STRETCH:
            stretch += pos[b] - pos[a]
    stretch += len(mmas) > 0
    outside = sum(1 for i in body if not main.start <= i.addr <= main.end)
    return Issue(entry, anchor, n, floor, sum(1 for a in path if kinds[a] == "ldgsts"), per_copy,
                 sum(1 for i in loop if i.kind == "ldgsts"), stretch, outside,
                 sum(1 for a in path if kinds[a] == "bar"), main.instructions, len(mmas))


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("entries", nargs="+")
    a = ap.parse_args(argv)
    for e in a.entries:
        instrs = entry_sass(e)
        print(f"{e}: {len(instrs)} instructions")
        for lp in loops(instrs):
            print(f"  {'  ' * lp.depth}loop {lp.start:#x}-{lp.end:#x}: {lp.instructions} issued, "
                  f"{lp.shortest} on the shortest path; "
                  + " ".join(f"{k} {v}" for k, v in sorted(lp.issued.items())))
        s = issue(e)
        print(f"  main loop (anchor {s.anchor}): {s.static} instructions, {s.path} on the path of its work, "
              f"{s.floor_path} on the shortest that issues every {s.anchor}, {s.in_mma_stretches} in MMA stretches, {s.path_copies} cp.async on it, "
              f"{s.per_copy:.1f} instructions per cp.async of its issue loops, barriers {s.barriers}; "
              f"outside it {s.outside_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
