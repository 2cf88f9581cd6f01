"""The allocator counts bytes per owner and frees an owner's arrays without visiting others'."""

import numpy as np
import pytest

from dspark.backends.allocator import Allocator


def test_owners_are_counted_and_freed_apart():
    a = Allocator(np)
    arrays = {f"spec/{i}": [a.empty((i + 1, 4), np.float32, f"spec/{i}") for _ in range(3)] for i in range(50)}
    assert a.bytes() == sum(3 * (i + 1) * 16 for i in range(50))
    assert a.free_owner("spec/7") == 3 * 8 * 16 and a.bytes("spec/7") == 0
    assert a.free(arrays["spec/9"][0]) == 10 * 16 and a.bytes("spec/9") == 2 * 10 * 16
    assert a.free_owner("spec/9") == 2 * 10 * 16
    assert set(a.owners()) == {f"spec/{i}" for i in range(50)} - {"spec/7", "spec/9"}
    with pytest.raises(ValueError, match="already freed"):
        a.free(arrays["spec/7"][0])
    assert a.free_owner("spec/7") == 0


def test_freeing_one_owner_does_not_scan_the_others():
    """The index by owner: free_owner touches its own arrays only (a worker holds many sessions)."""
    a = Allocator(np)
    for i in range(200):
        a.zeros(4, np.float32, f"cache/{i}")
    seen = []

    class Spy(dict):
        def items(self):
            seen.append("scan")
            return super().items()

    a._live = Spy(a._live)
    assert a.free_owner("cache/3") == 16
    assert seen == [] and len(a._live) == 199
