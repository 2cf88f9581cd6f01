"""Progress bars for what a user waits on: a checkpoint's tensors reaching the device (a 27B
target takes minutes) and the demo's two streams. They are tqdm's, as transformers shows its
loads, on stderr.

`enabled`: None (the default everywhere) shows a bar while stderr is a terminal (tqdm's rule, so
captured or piped output stays clean) unless the environment sets DSPARK_PROGRESS=0; True shows
one wherever stderr goes; False never does.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

ENV = "DSPARK_PROGRESS"


def bar(total: int, desc: str, unit: str, enabled: bool | None = None) -> tqdm:
    """A bar of `total` units (bytes: unit "B", shown scaled) on stderr, closed by the caller."""
    if enabled is None and os.environ.get(ENV, "1") == "0":
        enabled = False
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                leave=False, file=sys.stderr, dynamic_ncols=True, disable=None if enabled is None else not enabled)


class TensorProgress:
    """A load's progress by checkpoint bytes, tensor by tensor: `done(name)` once a tensor is on
    the device; the bar names the shard being read."""

    def __init__(self, tensors: dict, names, desc: str, enabled: bool | None = None):
        self._tensors, self._shard = tensors, None
        self.bar = bar(sum(tensors[n].end - tensors[n].start for n in set(names)), desc, "B", enabled)

    def done(self, name: str) -> None:
        info = self._tensors[name]
        if info.file.name != self._shard:
            self._shard = info.file.name
            self.bar.set_postfix_str(self._shard, refresh=False)
        self.bar.update(info.end - info.start)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
