"""Hugging Face checkpoints: targets, tokenizers and released drafters.

    from dspark.models.hf import load_drafter, load_target, load_tokenizer
    trunk = load_target("Qwen/Qwen3.5-27B", backend)   # a directory, or a hub id in the local cache
    tok = load_tokenizer("Qwen/Qwen3.5-27B")
    drafter = load_drafter("path/to/drafter", trunk)    # DeepSpec DSpark, z-lab DFlash, speculators

Targets: target.py (qwen3, qwen3_5, qwen3_5_text; one mapping table onto the one trunk), and
quantization.py (their block-scaled FP8 releases, kept e4m3 on the backend; every other scheme refused).
Tokenizers: tokenizer.py (tokenizer.json through the `tokenizers` package).
Drafters: drafters.py (checks against the target) and drafter_formats.py (one mapping per format
onto the one drafter). Both kinds of checkpoint are read by checkpoint.py.
"""

from .checkpoint import CheckpointError
from .drafters import load_drafter
from .target import LoadReport, load_target
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["CheckpointError", "LoadReport", "Tokenizer", "load_drafter", "load_target", "load_tokenizer"]
