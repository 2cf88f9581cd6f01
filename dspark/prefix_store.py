"""PrefixStore: prompt-end captures published by the worker, for restore instead of prime.

Entries are keyed by (namespace, exact prompt tokens). A lookup never crosses namespaces; None (the
worker's requests without a namespace) is one of its own.
Publishing an equal key again keeps the existing entry (dedupe) and frees the new one. All
entries share one byte budget; the least recently used are evicted to make room.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .errors import CapacityError
from .session import SpecBoundaryCapture


@dataclass
class StoreStats:
    published: int = 0
    deduped: int = 0
    evicted: int = 0
    hits: int = 0
    misses: int = 0
    refused: int = 0


class PrefixStore:
    """Published prompt-end captures, by namespace and prompt: deduplicated, under one LRU byte budget."""

    def __init__(self, budget_bytes: int):
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes!r}: expected an int >= 0")
        self.budget = budget_bytes
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], SpecBoundaryCapture] = OrderedDict()
        self.bytes = 0
        self.peak_bytes = 0
        self.stats = StoreStats()

    @staticmethod
    def _key(namespace, prompt) -> tuple[str | None, tuple[int, ...]]:
        if namespace is not None and not isinstance(namespace, str):  # None: requests without a namespace
            raise TypeError(f"namespace={namespace!r}: expected a str or None, got {type(namespace).__name__}")
        return namespace, tuple(int(t) for t in prompt)

    def publish(self, namespace: str, capture: SpecBoundaryCapture) -> bool:
        """Store `capture` under (namespace, capture.prompt); the store owns it from here on
        (freed on dedupe or eviction). Returns True if it was stored. A capture larger than the
        whole budget raises CapacityError and is left to the caller."""
        key = self._key(namespace, capture.prompt)
        size = capture.nbytes
        if size > self.budget:
            self.stats.refused += 1
            raise CapacityError(f"capture of {size} bytes exceeds the store's whole budget of {self.budget} bytes")
        if key in self._entries:
            self._entries.move_to_end(key)
            capture.free()
            self.stats.deduped += 1
            return False
        while self.bytes + size > self.budget:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            old.free()
            self.stats.evicted += 1
        self._entries[key] = capture
        self.bytes += size
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.stats.published += 1
        return True

    def lookup(self, namespace: str, prompt) -> SpecBoundaryCapture | None:
        """The entry for exactly this prompt in this namespace (marked recently used), or None.
        The store keeps ownership: restore copies from it."""
        key = self._key(namespace, prompt)
        cap = self._entries.get(key)
        if cap is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return cap

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        for cap in self._entries.values():
            cap.free()
        self._entries.clear()
        self.bytes = 0
