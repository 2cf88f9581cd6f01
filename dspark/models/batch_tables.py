"""The pointer tables of one batch, made once and reused while the batch stays the same.

A trunk pass reaches every session's K/V caches, gdn states and conv windows through pointer
tables (dspark.ops.tables), and a drafter pass every session's draft-KV rings. Built per call
they cost an upload per table per layer and a validation of every buffer; a round of a burst
runs the same batch again and again, so the tables are kept per batch.

The key is the batch's buffer versions, in order: every Cache and DraftKV takes a fresh version
when it is made and whenever its buffer lists are replaced or freed (their lists are tuples, so
an entry cannot be swapped in place). A table made for other buffers therefore never matches, a
session joining, leaving or changing place in the batch makes a new key, and `forget` drops
every entry of a freed version at once, with the arrays its tables held.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from typing import Callable

_versions = itertools.count(1)
_stores: "weakref.WeakSet" = weakref.WeakSet()  # TableStores and dspark.graphs.PassStores


def next_version() -> int:
    """A version never handed out before (buffers made or replaced)."""
    return next(_versions)


class VersionedBuffers:
    """Buffer lists (named by the subclass's BUFFERS) held as tuples, with a `version` that
    changes whenever one of them is replaced or freed; the old version's tables are dropped."""
    BUFFERS: tuple[str, ...] = ()

    def __setattr__(self, name, value):
        if name in self.BUFFERS:
            value = tuple(value)
            old = self.__dict__.get("version")
            if old is not None:
                forget(old)
            object.__setattr__(self, "version", next_version())
        object.__setattr__(self, name, value)


class TableStore:
    """Batch key (a tuple of buffer versions) -> the tables built for it, least recently used
    dropped past `size` entries."""

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: OrderedDict[tuple, object] = OrderedDict()
        self.builds = 0  # tables built (a test counts reuses against it)
        _stores.add(self)

    def get(self, key: tuple, build: Callable[[], object]):
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit
        made = build()
        self.builds += 1
        self._entries[key] = made
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return made

    def drop(self, version: int) -> None:
        for key in [k for k in self._entries if version in k]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)


def register_store(store) -> None:
    """Make forget() reach `store` too (anything with drop(version): dspark.graphs' recordings)."""
    _stores.add(store)


def forget(version: int) -> None:
    """Drop every batch's tables (and recorded passes) that include buffers of `version` (they are
    being freed or replaced)."""
    for store in list(_stores):
        store.drop(version)
