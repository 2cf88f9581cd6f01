"""Explicit memory: every long-lived buffer has an owner, and freeing is a call.

The allocator hands out arrays of its array module and counts live bytes per owner, so a test
can show that demotion really dropped the draft KV, snapshots and scratch. On `cuda` the bytes
return to CuPy's pool once the caller drops its last reference. Arrays are indexed by owner, so
freeing one owner costs its own arrays, not every live one (a worker holds many sessions).
"""

from __future__ import annotations

from collections import defaultdict


class Allocator:
    def __init__(self, xp):
        self._xp = xp
        self._live: dict[int, tuple[str, int, object]] = {}  # id -> (owner, nbytes, array)
        self._of: dict[str, set[int]] = defaultdict(set)     # owner -> ids of its live arrays
        self._bytes: dict[str, int] = defaultdict(int)

    def empty(self, shape, dtype, owner: str):
        arr = self._xp.empty(shape, dtype=dtype)
        self._track(arr, owner)
        return arr

    def zeros(self, shape, dtype, owner: str):
        arr = self._xp.zeros(shape, dtype=dtype)
        self._track(arr, owner)
        return arr

    def adopt(self, arr, owner: str):
        """Count an array made elsewhere (a copy, a loaded weight) under `owner`."""
        self._track(arr, owner)
        return arr

    def _track(self, arr, owner: str) -> None:
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner={owner!r}: expected a non-empty string")
        if id(arr) in self._live:
            raise ValueError("this array is already owned")
        self._live[id(arr)] = (owner, int(arr.nbytes), arr)
        self._of[owner].add(id(arr))
        self._bytes[owner] += int(arr.nbytes)

    def free(self, arr) -> int:
        """Forget one array; returns the bytes released from its owner's count."""
        entry = self._live.pop(id(arr), None)
        if entry is None:
            raise ValueError("this array was not allocated by this allocator (or is already freed)")
        owner, nbytes, _ = entry
        ids = self._of[owner]
        ids.discard(id(arr))
        if not ids:
            del self._of[owner]
        self._bytes[owner] -= nbytes
        if not self._bytes[owner]:
            del self._bytes[owner]
        return nbytes

    def free_owner(self, owner: str) -> int:
        """Forget every array of `owner`; returns the bytes released."""
        for i in self._of.pop(owner, ()):
            del self._live[i]
        return self._bytes.pop(owner, 0)

    def bytes(self, owner: str | None = None) -> int:
        if owner is None:
            return sum(self._bytes.values())
        return self._bytes.get(owner, 0)

    def owners(self) -> dict[str, int]:
        """owner -> live bytes, for every owner that holds any."""
        return dict(self._bytes)
