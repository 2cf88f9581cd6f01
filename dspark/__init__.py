"""dspark: DSpark-style block-drafter speculative decoding for hybrid language models."""

from . import backends  # callable: dspark.backends() lists the available backends
from .backends import Backend, get_backend
from .ops.product import get_num_threads, set_num_threads  # the numpy backend's native code

__version__ = "0.1.0"
__all__ = ["Backend", "backends", "get_backend", "get_num_threads", "set_num_threads", "__version__"]
