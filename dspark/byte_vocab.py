"""The byte-level vocabulary of the embedded models: ids 0-255 are bytes, then EOS and MASK."""

from __future__ import annotations

import numpy as np

BYTES = 256


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def decode(tokens) -> str:
    """Bytes to text (EOS, MASK and any other special id dropped; bad UTF-8 replaced)."""
    return bytes(int(t) for t in tokens if 0 <= int(t) < BYTES).decode("utf-8", errors="replace")
