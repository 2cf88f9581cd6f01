"""Storage dtypes: f32, f16 and bf16 (ml_dtypes.bfloat16 on the host). Math is always f32."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import DTypeError

BF16 = np.dtype(ml_dtypes.bfloat16)
STORAGE = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", BF16: "bf16"}


def suffix(dtype, what: str) -> str:
    """The kernel-name suffix for a storage dtype; `what` names the argument in the error."""
    s = STORAGE.get(np.dtype(dtype))
    if s is None:
        raise DTypeError(f"{what} has dtype {np.dtype(dtype)}: expected float32, float16 or bfloat16")
    return s


def to_f32(a) -> np.ndarray:
    """Exact widening to f32 (every f16 and bf16 value is representable)."""
    return np.asarray(a).astype(np.float32)


def dtype_supported(cupy, dtype) -> bool:
    """Whether this CuPy can hold arrays of `dtype` (bfloat16 needs CuPy >= 14 with ml_dtypes):
    asked of CuPy's own type table, so no device is needed."""
    try:
        cupy._core._scalar.get_typename(np.dtype(dtype))
        return True
    except (KeyError, ValueError, TypeError):
        return False
    except AttributeError:  # a CuPy without that table: try an allocation
        try:
            cupy.empty(1, dtype)
            return True
        except Exception:  # TypeError or ValueError, depending on the version
            return False
