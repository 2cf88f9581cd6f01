"""One exception type per kind of mistake. Each also derives from the matching builtin, so
callers can catch `ValueError` / `TypeError` as usual."""

import re


class DsparkError(Exception):
    """Base of every error dspark raises on purpose."""


class ShapeError(DsparkError, ValueError):
    """An array has the wrong rank or extent."""


class DTypeError(DsparkError, TypeError):
    """An array or scalar has the wrong dtype."""


class TokenRangeError(DsparkError, ValueError):
    """A token id is outside the vocabulary."""


class CapacityError(DsparkError, ValueError):
    """A position, length or byte count exceeds what the buffer, context or budget holds."""


class NonFiniteError(DsparkError, ValueError):
    """NaN (or Inf where it is not allowed) in logits or other inputs."""


class NonFiniteRowsError(NonFiniteError):
    """A plain decode step (dspark.decode.PlainBatch.step) in which some sequences' logits were
    not finite: the step committed every row, completed for the others and finished those.
    `failed`: {sequence id: what was wrong}; `emitted`: {sequence id: token emitted} of the step,
    what step() would have returned."""

    def __init__(self, message: str, failed: dict, emitted: dict):
        super().__init__(message)
        self.failed, self.emitted = failed, emitted


class StateError(DsparkError, RuntimeError):
    """The call is not valid in the object's current state (finished, demoted, mid-round...)."""


class KernelArgumentError(DsparkError, TypeError):
    """A kernel launch argument does not match the C++ parameter type, or a bad launch shape."""


class BackendUnavailable(DsparkError, RuntimeError):
    """The requested backend cannot run on this machine."""


class CheckpointError(DsparkError, ValueError):
    """A checkpoint that cannot be found, read or served (config or tensors): the message names the
    field or tensor and what was expected."""


def row_checked(call, *args) -> tuple:
    """(call(*args), "") where the call on one row passes its check, else (None, what the check
    says of the row: "contains NaN", "has no finite logit", ...)."""
    try:
        return call(*args), ""
    except NonFiniteError as e:
        return None, re.sub(r"^.*?row 0 |\s*\(1 rows in all\)$", "", str(e))
