"""The typed errors of onnx-offload. The C++ core raises these classes too.

Where ORT raises one of its own types for the same fault (a missing model file, bytes
that are not a model, a model its loader refuses), the error is also of that type, so
that code written for InferenceSession catches it (see ``with_ort_type``).
"""
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_errors


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
    committed bytes and allowance. ``device_full``: the budget had room and the device
    did not (memory outside the budget took it: another process, or what ORT and the
    CUDA libraries hold). ``smallest_budget``: for a budget too small to plan the session,
    the smallest that plans it with this configuration (0 when not known), and ``reason``
    why the one given does not.
    """

    zone: str = ""
    requested: int = 0
    device_full: bool = False
    smallest_budget: int = 0
    reason: str = ""


class CorruptModel(OffloadError, ValueError):
    """The model file cannot be parsed or does not validate."""


class UnsupportedModel(OffloadError, ValueError):
    """A valid model that this use of the package cannot run, with the reason."""


class HostComputeRefused(UnsupportedModel):
    """Weights named for host compute that the graph rewrite cannot take (read by a node
    other than a MatMul or an int4 MatMulNBits of initializers, not initializers, ...):
    ``names`` lists them and the message says why for each. The model is left unchanged."""

    def __init__(self, message: str = "", names=()):
        super().__init__(message)
        self.names = tuple(names)

    def __reduce__(self):
        return type(self), (str(self), self.names)


class HostComputeFailed(OffloadError):
    """A host-computed MatMul did not give its result in a replay of the step's graph: the
    host kernel refused its job (the message says why) or the job has not run. ``matmul``
    names the MatMul; the step's outputs are not to be used."""

    def __init__(self, message: str = "", matmul: str = ""):
        super().__init__(message)
        self.matmul = matmul

    def __reduce__(self):
        return type(self), (str(self), self.matmul)


class CacheNotMarked(OffloadError):
    """`onnx-offload cache clear` was given a folder that is not marked as the package's
    cache (it has no CACHEDIR.TAG) and holds what the package did not make: nothing was
    removed."""


class OffloadWarning(RuntimeWarning):
    """A cleanup step failed (an unmap, a release, a slot dropped): the core kept going."""


class ModelNotFound(FileNotFoundError, _ort_errors.NoSuchFile):
    """The model file does not exist (also ORT's NoSuchFile)."""


class ModelRunError(RuntimeError):
    """A failure inside the model while it runs: a RuntimeError, as ORT's IOBinding run
    raises it, and also the typed error ORT's run() raises (Fail, InvalidArgument, ...)."""


_WITH_ORT_TYPE: dict = {}


def _rebuild(cls: type, ort_name: str, args: tuple) -> BaseException:
    return with_ort_type(cls, getattr(_ort_errors, ort_name)())(*args)


def with_ort_type(cls: type, error: BaseException) -> type:
    """`cls`, made also an instance of the ORT exception type of `error` when ORT raised
    it (InvalidProtobuf, InvalidGraph, Fail, ...), so that an except clause for either
    catches it (`error` may also be that type itself). Instances pickle (multiprocessing
    sends exceptions between processes)."""
    t = error if isinstance(error, type) else type(error)
    if t.__module__ != _ort_errors.__name__ or issubclass(cls, t):
        return cls
    if (cls, t) not in _WITH_ORT_TYPE:
        def __reduce__(self):
            args = self.args
            if isinstance(self, OSError) and self.filename is not None:  # not among an OSError's args
                args = (self.errno, self.strerror, self.filename)
            return _rebuild, (cls, t.__name__, args)

        _WITH_ORT_TYPE[(cls, t)] = type(cls.__name__, (cls, t), {
            "__module__": cls.__module__, "__doc__": cls.__doc__, "__reduce__": __reduce__})
    return _WITH_ORT_TYPE[(cls, t)]


def invalid_protobuf(message: str) -> BaseException:
    """A CorruptModel for bytes that do not parse as ONNX: also ORT's InvalidProtobuf."""
    return with_ort_type(CorruptModel, _ort_errors.InvalidProtobuf())(message)
