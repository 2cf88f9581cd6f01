"""The trunk's per-sequence state: attention K/V rows and gdn recurrent state, plus `pos`."""

from __future__ import annotations

import itertools

import numpy as np

from ..dtypes import BF16
from .batch_tables import VersionedBuffers
from ..errors import CapacityError
from ..ops.gdn_chunk import CHUNK
from .config import TrunkConfig

_ids = itertools.count()


def cache_bytes(config: TrunkConfig, capacity: int, chunk_tails: bool = False) -> dict[str, int]:
    """Bytes of one session's cache by kind: "kv" (K and V of every attention layer at full
    capacity, in kv_dtype), "state" (the gdn states and conv windows, f32) and "chunk" (the chunk
    states and tails of the chunked prompt pass). Caches are allocated whole: this is what a
    session holds from its first token."""
    c = config
    kv_isz = (BF16 if c.kv_dtype == "bfloat16" else np.dtype(c.kv_dtype)).itemsize
    n_attn, n_gdn = c.layers.count("attn"), c.layers.count("gdn")
    state = c.gdn_heads * c.gdn_dv * c.gdn_dk
    return {"kv": 2 * n_attn * c.attn_kv_heads * int(capacity) * c.head_dim * kv_isz,
            "state": 4 * n_gdn * (state + c.gdn_channels * (c.conv_kernel - 1)),
            "chunk": 4 * n_gdn * (state + CHUNK * (c.gdn_channels + 2 * c.gdn_heads)) if chunk_tails else 0}


def require_room(be, config: TrunkConfig, capacity: int, chunk_tails: bool) -> None:
    """Refuse, before allocating anything, a cache the backend has no room for, naming the numbers."""
    need = cache_bytes(config, capacity, chunk_tails)
    total, free = sum(need.values()), be.free_bytes()
    if total > free:
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        raise CapacityError(
            f"a cache of {capacity} rows needs {gib(total)} (K/V {gib(need['kv'])} in {config.kv_dtype} over "
            f"{config.layers.count('attn')} attention layers, recurrent state {gib(need['state'] + need['chunk'])}), "
            f"more than the {gib(free)} the {be.name} backend has free: lower max_ctx, or store K/V in bfloat16")


class Cache(VersionedBuffers):
    """Full-attention K/V per attention layer ([Hkv, capacity, D], rows by absolute position)
    and, per gdn layer, the delta-rule state [H, dv, dk] (f32) and conv window [C, 3] (f32).
    `pos` counts the committed rows. Every buffer is owned by `owner` in the allocator.

    With `chunk_tails` (the trunk's chunked prompt passes, dspark.ops.gdn_chunk), per gdn layer
    also the state at the start of the 64-token chunk holding pos (`chunk_state`, [H, dv, dk]) and
    that chunk's rows before pos (`tail`, [64, C + 2H]: conv outputs, a, b), which a prompt pass
    resuming inside the chunk recomputes it from. `chunk_len` is pos % 64 while they describe the
    live state (after a prompt pass), -1 once a decode or verify has moved it on.

    The buffer lists are tuples, and `version` changes whenever one is replaced or the cache is
    freed: the trunk keeps pointer tables per batch under the versions of its caches
    (dspark.models.batch_tables), so a table of other buffers can never be used."""
    BUFFERS = ("k", "v", "state", "conv", "chunk_state", "tail")

    def __init__(self, be, config: TrunkConfig, capacity: int | None = None, owner: str | None = None,
                 chunk_tails: bool = False):
        c = config
        self.be, self.config = be, c
        self.capacity = int(capacity or c.max_ctx)
        self.owner = owner or f"cache/{next(_ids)}"
        self.chunk_tails = bool(chunk_tails)
        require_room(be, c, self.capacity, self.chunk_tails)
        kv_dtype = BF16 if c.kv_dtype == "bfloat16" else np.dtype(c.kv_dtype)
        a = be.alloc
        n_attn = c.layers.count("attn")
        n_gdn = c.layers.count("gdn")
        shape = (c.attn_kv_heads, self.capacity, c.head_dim)
        self.k = [a.zeros(shape, kv_dtype, self.owner) for _ in range(n_attn)]
        self.v = [a.zeros(shape, kv_dtype, self.owner) for _ in range(n_attn)]
        self.state = [a.zeros((c.gdn_heads, c.gdn_dv, c.gdn_dk), np.float32, self.owner) for _ in range(n_gdn)]
        self.conv = [a.zeros((c.gdn_channels, c.conv_kernel - 1), np.float32, self.owner) for _ in range(n_gdn)]
        tails = n_gdn if chunk_tails else 0
        self.chunk_state = [a.zeros((c.gdn_heads, c.gdn_dv, c.gdn_dk), np.float32, self.owner) for _ in range(tails)]
        self.tail = [a.zeros((CHUNK, c.gdn_channels + 2 * c.gdn_heads), np.float32, self.owner) for _ in range(tails)]
        self.pos = 0
        self.chunk_len = 0

    def recurrent(self) -> list:
        """Every recurrent tensor, in a fixed order (what snapshots copy)."""
        return (*self.state, *self.conv)

    def copy(self, owner: str | None = None) -> "Cache":
        """A deep copy under a new owner (prefix publication and restore)."""
        new = Cache(self.be, self.config, self.capacity, owner, self.chunk_tails)
        for dst, src in zip(new.buffers(), self.buffers()):
            dst[...] = src
        new.pos, new.chunk_len = self.pos, self.chunk_len
        return new

    def buffers(self) -> tuple:
        """Every buffer, in a fixed order."""
        return (*self.k, *self.v, *self.recurrent(), *self.chunk_state, *self.tail)

    def nbytes(self) -> int:
        return sum(int(x.nbytes) for x in self.buffers())

    def free(self) -> int:
        """Release every buffer; the cache is unusable afterwards."""
        n = self.be.alloc.free_owner(self.owner)
        self.k = self.v = self.state = self.conv = self.chunk_state = self.tail = ()
        return n
