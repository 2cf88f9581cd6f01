"""The trunk's per-sequence state: attention K/V rows and gdn recurrent state, plus `pos`."""

from __future__ import annotations

import itertools

import numpy as np

from ..dtypes import BF16
from .batch_tables import VersionedBuffers
from .config import TrunkConfig

_ids = itertools.count()


class Cache(VersionedBuffers):
    """Full-attention K/V per attention layer ([Hkv, capacity, D], rows by absolute position)
    and, per gdn layer, the delta-rule state [H, dv, dk] (f32) and conv window [C, 3] (f32).
    `pos` counts the committed rows. Every buffer is owned by `owner` in the allocator.

    The buffer lists are tuples, and `version` changes whenever one is replaced or the cache is
    freed: the trunk keeps pointer tables per batch under the versions of its caches
    (dspark.models.batch_tables), so a table of other buffers can never be used."""
    BUFFERS = ("k", "v", "state", "conv")

    def __init__(self, be, config: TrunkConfig, capacity: int | None = None, owner: str | None = None):
        c = config
        self.be, self.config = be, c
        self.capacity = int(capacity or c.max_ctx)
        self.owner = owner or f"cache/{next(_ids)}"
        kv_dtype = BF16 if c.kv_dtype == "bfloat16" else np.dtype(c.kv_dtype)
        a = be.alloc
        n_attn = c.layers.count("attn")
        n_gdn = c.layers.count("gdn")
        shape = (c.attn_kv_heads, self.capacity, c.head_dim)
        self.k = [a.zeros(shape, kv_dtype, self.owner) for _ in range(n_attn)]
        self.v = [a.zeros(shape, kv_dtype, self.owner) for _ in range(n_attn)]
        self.state = [a.zeros((c.gdn_heads, c.gdn_dv, c.gdn_dk), np.float32, self.owner) for _ in range(n_gdn)]
        self.conv = [a.zeros((c.gdn_channels, c.conv_kernel - 1), np.float32, self.owner) for _ in range(n_gdn)]
        self.pos = 0

    def recurrent(self) -> list:
        """Every recurrent tensor, in a fixed order (what snapshots copy)."""
        return (*self.state, *self.conv)

    def copy(self, owner: str | None = None) -> "Cache":
        """A deep copy under a new owner (prefix publication and restore)."""
        new = Cache(self.be, self.config, self.capacity, owner)
        for dst, src in zip(new.k + new.v + new.recurrent(), self.k + self.v + self.recurrent()):
            dst[...] = src
        new.pos = self.pos
        return new

    def nbytes(self) -> int:
        return sum(int(x.nbytes) for x in self.k + self.v + self.recurrent())

    def free(self) -> int:
        """Release every buffer; the cache is unusable afterwards."""
        n = self.be.alloc.free_owner(self.owner)
        self.k = self.v = self.state = self.conv = ()
        return n
