"""Reference models: the hybrid trunk and the DSpark drafter."""

from .cache import Cache
from .config import TrunkConfig
from .drafter_config import DrafterConfig
from .drafter import DraftKV, DsparkDrafter
from .trunk import HybridTrunk, TrunkPass

__all__ = ["Cache", "DrafterConfig", "DraftKV", "DsparkDrafter", "HybridTrunk", "TrunkConfig", "TrunkPass",
           "load_default"]


def load_default(backend=None):
    """The embedded (trunk, drafter) pair shipped with the package."""
    from .default import load_default as _load
    return _load(backend)
