"""NVTX ranges around the round phases, and counters of what a round costs the host.

NVTX: `phase(name)` marks one phase (PHASES: prime, draft, propose, verify, accept, commit, rollback,
ingest) for Nsight Systems timelines. It costs nothing when no profiler is attached:
`phase()` then returns one shared no-op context manager. A profiler that injects NVTX (Nsight
Systems / Compute set NVTX_INJECTION64_PATH) turns the ranges on, as does DSPARK_NVTX=1. The
`nvtx` package is optional: without it the ranges go through CuPy's own NVTX binding when CuPy is
there, and are no-ops otherwise (`nvtx_status()` says which).

Counters: `counting()` collects the events the executors and the CuPy contract stand-in report
(dspark.backends.contract) while it is open:

    with profile.counting() as c:
        session.round()
    c.launches, c.syncs, c.d2h, c.h2d, c.array_ops, c.by_name, c.sites, c.bytes

Both kernel executors (simt and cuda) report every kernel launch. The ops that move recurrent
state and K/V rows report the bytes their launches move, by kind (`moved`): "state" (the scans'
reads and writes of the live gdn state and conv window), "checkpoints" (per-column checkpoints a
verify writes), "rollback" (checkpoint select and snapshot copies, read and written) and
"kv_commit" (accepted K/V rows, read and written); profiling/perf_model.py predicts the same
numbers from a model's shapes. A MoE layer's router reports the distinct experts the pass routed
to (`experts`): what its grouped products read, one expert's weights each, so the cost of a verify
follows it; `Counts.distinct_experts()` lists them per layer, pass by pass. Copies, synchronisations and
CuPy array operations are reported by the CuPy contract stand-in, which sees every one of them
and names the dspark line that caused each device->host copy and synchronisation; on a real GPU,
Nsight Systems counts them (profiling/nsys_session.sh, its cuda_api_sum report).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

DOMAIN = "dspark"
_NULL = contextlib.nullcontext()

# The NVTX range names, in the order a request meets them (docs/profiling.md is generated from this).
PHASES = {
    "prime": "the prompt pass of a speculative session: trunk cache, draft KV, the first anchor",
    "draft": "the drafter's block pass over [anchor, MASK x (b-1)]; a recorded round (launches graph or eager) "
             "runs its whole draft pass here, the proposal and the first wait included",
    "propose": "the Markov chain fixing each slot, the confidences, and the first wait on the device (the drafts "
               "read back in one copy)",
    "verify": "the trunk's pass over the candidate columns (and any plain rows riding the round); a recorded "
              "round's verify pass includes the accept and the second wait",
    "accept": "the accept rule (greedy, coupled or rejection) and the second wait: (m, next) and the NaN flags",
    "commit": "the accepted K/V rows copied from the verify scratch into the caches; a recorded round's commit "
              "pass includes the rollback and the ingest",
    "rollback": "the recurrent state moved on by exactly the kept columns (checkpoint select or replay)",
    "ingest": "the kept rows' taps written into the draft KV",
}


# ---- NVTX ------------------------------------------------------------------------------------------
class _CupyRange:
    """A range through CuPy's own NVTX binding (no domain), for images without the nvtx package."""

    def __init__(self, nvtx, name: str):
        self._nvtx, self._name = nvtx, name

    def __enter__(self):
        self._nvtx.RangePush(f"{DOMAIN}:{self._name}")

    def __exit__(self, *exc):
        self._nvtx.RangePop()


@functools.lru_cache(maxsize=None)
def _emitter():
    """(kind, module): the nvtx package, else CuPy's NVTX binding, else (None, None)."""
    try:
        import nvtx
        return "nvtx", nvtx
    except ImportError:
        pass
    try:
        from cupy.cuda import nvtx as cupy_nvtx
        if cupy_nvtx.available:
            return "cupy", cupy_nvtx
    except Exception:  # no CuPy, or a CuPy whose NVTX library failed to load: ranges stay off
        pass
    return None, None


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
    if os.environ.get("DSPARK_NVTX") == "0" or _emitter()[0] is None:
        return False
    return bool(os.environ.get("NVTX_INJECTION64_PATH") or os.environ.get("DSPARK_NVTX") == "1")


def nvtx_status() -> str:
    """One line for reports: whether NVTX ranges are emitted, through what, and why not."""
    kind = _emitter()[0]
    if kind is None:
        return "off (neither the nvtx package nor CuPy's NVTX binding is available: ranges are no-ops)"
    via = "the nvtx package" if kind == "nvtx" else "CuPy's NVTX binding (ranges named 'dspark:<phase>')"
    return f"on, through {via}" if enabled() else f"off (no profiler attached; DSPARK_NVTX=1 forces it); {via}"


def phase(name: str):
    """A context manager marking one round phase, a name of PHASES (and timing it inside
    `phase_times()`)."""
    if _clocks:
        return _Timed(name)
    if not enabled():
        return _NULL
    kind, mod = _emitter()
    if kind == "nvtx":
        return mod.annotate(name, domain=DOMAIN)
    return _CupyRange(mod, name)


class _Timed:
    """A phase timed by every open phase_times() on its own clock."""

    def __init__(self, name: str):
        self._name = name

    def __enter__(self):
        self._start = [clock() for clock, _ in _clocks]

    def __exit__(self, *exc):
        for (clock, times), t in zip(_clocks, self._start):
            times[self._name] += clock() - t


_clocks: list = []  # (clock, Counter of name -> time) of each open phase_times()


@contextlib.contextmanager
def phase_times(clock):
    """Time every phase() entered while the block runs on `clock()` (any monotonic count: the host
    benchmark passes one that leaves out the CuPy stand-in's own time); yields name -> total."""
    entry = (clock, Counter())
    _clocks.append(entry)
    try:
        yield entry[1]
    finally:
        _clocks.remove(entry)


# ---- counters --------------------------------------------------------------------------------------
KINDS = ("launch", "array_op", "d2h", "h2d", "sync", "graph", "bytes")
BYTE_KINDS = ("state", "checkpoints", "rollback", "kv_commit")


@dataclass
class Counts:
    """Events seen while a `counting()` block was open.

    launches: dspark kernel launches (RawKernel calls); array_ops: CuPy array operations (each
    launches at least one kernel or cuBLAS call on a GPU); d2h / h2d: copies between device and
    host; syncs: host waits on the device (every blocking device->host copy and every explicit
    synchronize); graphs: CUDA graph launches (each replays a captured pass), whose kernels count
    as launches too (graph_nodes of them: the host issued launches - graph_nodes). by_name: launches
    per kernel name. sites: for d2h and sync events, the dspark
    source line (file:line function) that caused them, with counts. bytes: bytes moved by kind
    (BYTE_KINDS)."""
    launches: int = 0
    array_ops: int = 0
    d2h: int = 0
    h2d: int = 0
    syncs: int = 0
    graphs: int = 0
    graph_nodes: int = 0
    by_name: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    experts: list = field(default_factory=list)   # (layer, distinct experts: an int or a device count)
    routing: tuple | None = None                  # (experts, top_k) of the MoE layers reported
    xp: object = None                             # the device array module of their device counts

    def distinct_experts(self) -> list[tuple[int, int]]:
        """(layer, distinct experts its grouped products read) for every MoE layer of every pass
        counted, in order. A count left on the device is read now (on cuda: a copy; read it after
        the pass, before the next pass over the same workspace rewrites it)."""
        return [(layer, n if isinstance(n, int) else int(n.get().reshape(-1)[0]) if hasattr(n, "get")
                 else int(n.reshape(-1)[0])) for layer, n in self.experts]

    def add(self, kind: str, name: str | None, site: str | None, amount: int = 1) -> None:
        if kind == "bytes":
            self.bytes[name] += amount
        elif kind == "launch":
            self.launches += 1
            self.by_name[name] += 1
        elif kind == "array_op":
            self.array_ops += 1
        elif kind == "h2d":
            self.h2d += 1
        elif kind == "graph":
            self.graphs += 1
            self.graph_nodes += amount
        elif kind in ("d2h", "sync"):
            if kind == "d2h":
                self.d2h += 1
            self.syncs += 1  # a device->host copy on the stream waits for everything before it
            if site:
                self.sites[f"{kind} {site}"] += 1
        else:
            raise ValueError(f"kind={kind!r}: expected one of {KINDS}")

    def per(self, n: int) -> dict[str, float]:
        """The totals divided by n (rounds), for printing."""
        return {k: getattr(self, k) / n for k in ("syncs", "d2h", "h2d", "launches", "array_ops", "graphs")}

    def line(self, n: int = 1) -> str:
        p = self.per(n)
        return (f"syncs {p['syncs']:.2f}, device->host copies {p['d2h']:.2f}, host->device copies {p['h2d']:.2f}, "
                f"dspark kernel launches {p['launches']:.2f}, CuPy array ops {p['array_ops']:.2f}"
                + (f" ({self.graph_nodes / n:.2f} of them in {p['graphs']:.2f} graph launches)" if self.graphs else ""))

    def bytes_line(self, n: int = 1) -> str:
        """Bytes moved per round by kind (the state and K/V traffic the ops report)."""
        return ", ".join(f"{k} {self.bytes[k] / n:,.0f}" for k in BYTE_KINDS) + \
            f" (total {sum(self.bytes.values()) / n:,.0f}) bytes"


_active: list[Counts] = []
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def counting_now() -> bool:
    return bool(_active)


def caller_site(skip_prefixes: tuple[str, ...] = ()) -> str | None:
    """The innermost dspark frame outside `skip_prefixes` (paths): 'dspark/x.py:12 fn'."""
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_PACKAGE) and not path.startswith(skip_prefixes) and path != __file__:
            rel = os.path.relpath(path, os.path.dirname(_PACKAGE))
            return f"{rel}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return None


def record(kind: str, name: str | None = None, site: str | None = None, amount: int = 1) -> None:
    """Report one event to every open counter (nothing happens when none is open)."""
    for c in _active:
        c.add(kind, name, site, amount)


def experts(layer: int, distinct, routing: tuple[int, int] | None = None, xp=None) -> None:
    """Report the distinct experts a MoE layer's pass routed to: an int (the host knows it), or the
    one-int array the router wrote on the device, a slot of its own layer (read when the counts
    are, never now: no sync). `routing`: (experts, top_k) of the layer; `xp`: the device array
    module of a device count."""
    for c in _active:
        c.experts.append((int(layer), distinct if isinstance(distinct, int) else distinct[:1]))
        c.routing, c.xp = routing or c.routing, xp if xp is not None else c.xp
    for sink in _expert_sinks:
        sink.layers.append((int(layer), distinct if isinstance(distinct, int) else distinct[:1]))
        sink.routing, sink.xp = routing or sink.routing, xp if xp is not None else sink.xp


def listening_experts() -> bool:
    """Whether anything collects the MoE layers' reports (`experts`): a counter or an ExpertSink."""
    return bool(_active or _expert_sinks)


def timing_experts() -> bool:
    """Whether an open ExpertSink wants the expert products' seconds (`expert_seconds`)."""
    return bool(_expert_sinks)


def expert_seconds(seconds: float) -> None:
    """Report the wall time of one MoE layer's expert products (the CPU backends, which run each
    launch to its end: dspark.models.moe times them while an ExpertSink is open)."""
    for sink in _expert_sinks:
        sink.seconds = (sink.seconds or 0.0) + float(seconds)


@dataclass(eq=False)  # open sinks are told apart by identity (their counts are device arrays)
class ExpertSink:
    """What the MoE layers of the passes inside `expert_sink()` reported: (layer, distinct experts)
    per layer and pass, and the seconds their expert products took (None where none were timed:
    on cuda, whose launches return before they run)."""
    layers: list = field(default_factory=list)
    seconds: float | None = None
    routing: tuple[int, int] | None = None  # (experts, top_k) of the layers reported
    xp: object = None                       # the device array module of device counts
    _frozen: object = None

    def freeze(self) -> None:
        """Copy the device counts into one array of their own, now (stream-ordered after the passes,
        no wait): every pass rewrites a layer's count, and the cost model may read them after later
        passes ran. The host's counts need none."""
        if self.xp is not None and any(not isinstance(n, int) for _, n in self.layers):
            self._frozen = self.xp.concatenate([self.xp.asarray(n).reshape(-1)[:1] for _, n in self.layers])

    def distinct(self) -> list[int]:
        """The distinct experts per layer, in report order: device counts read now, in one copy
        (call it once the passes have run)."""
        if self._frozen is not None:
            return [int(v) for v in self._frozen.get()]
        return [n if isinstance(n, int) else int(n.get().reshape(-1)[0]) if hasattr(n, "get")
                else int(n.reshape(-1)[0]) for _, n in self.layers]


_expert_sinks: list[ExpertSink] = []


@contextlib.contextmanager
def expert_sink():
    """Collect the MoE layers' reports of the passes run inside the block (dspark.cost.CostModel.timed:
    a pass's cost beside the experts it read). Always on, unlike `counting`: it costs a list append
    per MoE layer."""
    sink = ExpertSink()
    _expert_sinks.append(sink)
    try:
        yield sink
    finally:
        _expert_sinks.remove(sink)


def moved(kind: str, nbytes: int) -> None:
    """Report `nbytes` moved by a launch, of a kind in BYTE_KINDS."""
    if _active:
        if kind not in BYTE_KINDS:
            raise ValueError(f"kind={kind!r}: expected one of {BYTE_KINDS}")
        record("bytes", kind, amount=int(nbytes))


@contextlib.contextmanager
def counting():
    """Count the events reported while the block runs; yields the Counts (filled in place)."""
    c = Counts()
    _active.append(c)
    try:
        yield c
    finally:
        _active.remove(c)
