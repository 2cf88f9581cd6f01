"""Row-split launch geometry (csrc/rowsplit.cuh): how a vocabulary row is cut across CTAs, the
zero-at-rest scratch its last-CTA merges count on, and launch plans a performance model can read.

A row of V entries is cut into slices of SLICE entries, one CTA each: S = ceil(V / SLICE) CTAs
per row, a function of V alone, so a row's result never depends on its batch. Partials are
integers (argmax keys, fixed-point masses) and the last CTA of a row to arrive merges them, so
the merge is exact in any arrival order.

Plans are pure: `Plan` lists the launches an op makes for given shapes (grid, block, shared
memory, passes over the rows) and the bytes they move, without touching a device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SLICE = 8192            # kSliceElems: entries per CTA
MAX_THREADS = 256       # kSplitThreads
PART_WORDS = 4          # kPartWords: uint64 words per CTA partial (key, mass, mass2, flags)
RADIX_BINS = 2048       # kRadixBins: a row's global histogram in sampling (uint64 words)
OWNER = "rowsplit scratch"


def splits(vocab: int) -> int:
    """CTAs per row: ceil(V / SLICE), at least 1."""
    return max(1, -(-int(vocab) // SLICE))


def threads(vocab: int) -> int:
    """Threads per CTA: a warp per 1024 entries of a slice, 1 to 8 warps."""
    return 32 * min(MAX_THREADS // 32, max(1, -(-min(int(vocab), SLICE) // 1024)))


@dataclass(frozen=True)
class Launch:
    """One kernel launch: `ctas` CTAs of `threads` threads, reading `passes` times over its rows.
    `kernel` is the entry point without its dtype suffix."""
    kernel: str
    ctas: int
    threads: int
    shared_mem: int = 0
    passes: float = 1.0     # reads of the rows it covers (a walk of one slice per row counts 1 / S)


@dataclass(frozen=True)
class Plan:
    """The launches of one op call and the bytes they move.

    `bytes_read` counts every launch's own reads (each pass reads its rows again: after the first
    they mostly come from L2 when the rows fit); `bytes_written` the outputs and partials;
    `min_bytes` what any implementation must move (inputs once, outputs once)."""
    op: str
    rows: int
    vocab: int
    splits: int
    launches: tuple[Launch, ...]
    bytes_read: int
    bytes_written: int
    min_bytes: int
    notes: dict = field(default_factory=dict)

    @property
    def ctas(self) -> int:
        return sum(launch.ctas for launch in self.launches)

    @property
    def passes(self) -> float:
        """Reads of each row over the whole op (the bytes a row is read, over its size)."""
        return sum(launch.passes for launch in self.launches)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


# ---- zero-at-rest scratch -------------------------------------------------------------------------
@dataclass
class _Pool:
    alloc: object            # the allocator its arrays come from (held: its id keys the pool)
    tickets: object = None   # uint32: one counter per row (or session) of a launch
    hist: object = None      # uint64: RADIX_BINS words per row of a sampling launch


_POOLS: dict[int, _Pool] = {}  # id(backend allocator) -> its pool (two backends of one name keep two)


def _grown(alloc, arr, n: int, dtype):
    if arr is not None and arr.shape[0] >= n:
        return arr
    if arr is not None:
        alloc.free(arr)
    size = max(n, 2 * (arr.shape[0] if arr is not None else 0), 64)
    return alloc.zeros(size, dtype, OWNER)


def scratch(be, tickets: int, hist_rows: int = 0, ws=None):
    """(tickets uint32 [>= tickets], hist uint64 [>= hist_rows * RADIX_BINS] or None): zeroed
    once when allocated; every kernel puts back to 0 what it used (the last CTA resets them), so
    they stay zero between launches and a recorded launch can be replayed. One pool per backend
    (per allocator): its launches must not overlap (they share one stream). With a workspace
    (dspark.ops.workspace) they are its own, of exactly these sizes: a recorded pass keeps them."""
    if ws is not None:
        t = ws.fixed(f"rowsplit.tickets.{max(1, tickets)}", (max(1, tickets),), np.uint32, zero=True)
        h = ws.fixed(f"rowsplit.hist.{hist_rows}", (hist_rows * RADIX_BINS,), np.uint64, zero=True) if hist_rows else None
        return t, h
    pool = _POOLS.setdefault(id(be.alloc), _Pool(be.alloc))
    pool.tickets = _grown(pool.alloc, pool.tickets, max(1, tickets), np.uint32)
    if hist_rows:
        pool.hist = _grown(pool.alloc, pool.hist, hist_rows * RADIX_BINS, np.uint64)
    return pool.tickets, (pool.hist if hist_rows else None)


def launch(be, kernel: str, grid: int, block: int, args: tuple, shared_mem: int = 0) -> None:
    """Launch one row-split kernel. A launch that fails part-way may leave tickets or histograms
    counted up: the pool is dropped, so the next call starts from fresh zeros."""
    try:
        be.kernels.get_function(kernel)((grid,), (block,), args, shared_mem=shared_mem)
    except BaseException:
        pool = _POOLS.pop(id(be.alloc), None)
        for arr in (pool.tickets, pool.hist) if pool else ():
            if arr is not None:
                pool.alloc.free(arr)
        raise
