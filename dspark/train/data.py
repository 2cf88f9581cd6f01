"""The corpus: the running Python's own standard library sources, as bytes.

Every machine has it offline and the PSF licence allows training on it. Test suites and
site-packages are left out (test files are mostly boilerplate asserts, site-packages varies per
machine). A file is held out for evaluation when crc32 of its path relative to the stdlib root
falls in bucket 0 of HELDOUT_BUCKETS: fixed across machines and runs, and independent of file
order, so it never leaks into training.
"""

from __future__ import annotations

import sys
import sysconfig
import zlib
from pathlib import Path

import numpy as np

EOS = 256
HELDOUT_BUCKETS = 20          # ~5% of files held out
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    return sys.version.split()[0]


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % HELDOUT_BUCKETS == 0


def corpus_files(root: Path | None = None) -> list[str]:
    """Relative paths of the corpus files, sorted."""
    root = root or stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("test_") for part in rel.parts):
            continue
        out.append(rel.as_posix())
    return sorted(out)


def split(root: Path | None = None) -> tuple[list[str], list[str]]:
    """(train files, held-out files)."""
    files = corpus_files(root)
    return [f for f in files if not is_heldout(f)], [f for f in files if is_heldout(f)]


def byte_stream(files: list[str], root: Path | None = None) -> np.ndarray:
    """All files' bytes, each followed by EOS, as one int16 token stream."""
    root = root or stdlib_root()
    parts = []
    for rel in files:
        data = np.frombuffer((root / rel).read_bytes(), np.uint8).astype(np.int16)
        parts.append(data)
        parts.append(np.array([EOS], np.int16))
    return np.concatenate(parts)


def random_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """[batch, length] int64 windows at uniform random offsets."""
    starts = rng.integers(0, stream.size - length, batch)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)


def code_prompts(files: list[str], count: int, length: int, rng: np.random.Generator,
                 root: Path | None = None) -> np.ndarray:
    """[count, length] prompts cut from the files at random offsets (no EOS inside), for
    greedy continuations and acceptance evaluation."""
    root = root or stdlib_root()
    texts = [np.frombuffer((root / f).read_bytes(), np.uint8) for f in files]
    texts = [t for t in texts if t.size > 4 * length]
    out = np.empty((count, length), np.int64)
    for i in range(count):
        t = texts[rng.integers(len(texts))]
        s = rng.integers(0, t.size - 2 * length)
        out[i] = t[s : s + length]
    return out
