"""Hugging Face checkpoints: targets and tokenizers (and, beside them, the drafter formats).

    from dspark.models.hf import load_target, load_tokenizer
    trunk = load_target("Qwen/Qwen3.5-27B", backend)   # a directory, or a hub id in the local cache
    tok = load_tokenizer("Qwen/Qwen3.5-27B")

Targets: target.py (qwen3, qwen3_5, qwen3_5_text; one mapping table onto the one trunk).
Tokenizers: tokenizer.py (tokenizer.json through the `tokenizers` package).
Drafter formats (DSpark, DFlash, speculators) live in their own modules of this package and are
re-exported here as `load_drafter`.
"""

from .checkpoint import CheckpointError
from .target import LoadReport, load_target
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["CheckpointError", "LoadReport", "Tokenizer", "load_target", "load_tokenizer"]
