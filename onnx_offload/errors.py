"""The typed errors of onnx-offload. The C++ core raises these classes too."""


class OffloadError(RuntimeError):
    """Base of every error onnx-offload raises on purpose."""


class CudaUnavailable(OffloadError):
    """No usable CUDA driver or device: the message says why."""


class CudaDriverError(OffloadError):
    """A CUDA driver call failed; ``code`` and ``error_name`` name the CUresult."""

    code: int = 0
    error_name: str = ""


class StateError(OffloadError):
    """An operation illegal in the current state (of a slot, a span, a session)."""


class BudgetExceeded(MemoryError, OffloadError):
    """A zone or the device budget cannot take the requested committed bytes.

    ``zone`` and ``requested`` say what was asked; the message lists every zone's
    committed bytes and allowance.
    """

    zone: str = ""
    requested: int = 0


class CorruptModel(OffloadError, ValueError):
    """The model file cannot be parsed or does not validate."""


class UnsupportedModel(OffloadError, ValueError):
    """A valid model that this use of the package cannot run, with the reason."""


class OffloadWarning(RuntimeWarning):
    """A cleanup step failed (an unmap, a release, a slot dropped): the core kept going."""
