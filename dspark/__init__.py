"""dspark: DSpark-style block-drafter speculative decoding for hybrid language models."""

from . import backends  # callable: dspark.backends() lists the available backends
from .backends import Backend, get_backend

__version__ = "0.1.0"
__all__ = ["Backend", "backends", "get_backend", "__version__"]
