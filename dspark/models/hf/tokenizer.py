"""Tokenizers of Hugging Face checkpoints: tokenizer.json through the `tokenizers` package.

The embedded pair keeps its byte vocabulary (dspark.byte_vocab); both offer `encode(text) ->
int32 ids` and `decode(ids) -> text`, so the command line takes either.
"""

from __future__ import annotations

import numpy as np

from .checkpoint import CheckpointError, locate


class Tokenizer:
    """A tokenizer.json: encode without added special tokens (a prompt is text; Qwen adds none
    anyway), decode without special tokens (EOS and the like are not text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included (the model's vocab may be larger)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer.json of a model directory (or a hub id in the local cache)."""
    d = locate(path)
    f = d / "tokenizer.json"
    if not f.is_file():
        raise CheckpointError(f"tokenizer.json is missing from {d}")
    try:
        from tokenizers import Tokenizer as HfTokenizer
    except ImportError:
        raise CheckpointError("load_tokenizer needs the `tokenizers` package: pip install tokenizers") from None
    try:
        return Tokenizer(HfTokenizer.from_file(str(f)))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise CheckpointError(f"{f}: not a tokenizer.json the tokenizers package can read ({e})") from None
