"""onnx-offload: run ONNX Runtime models whose weights exceed their VRAM budget, with
every weight at a stable address (CUDA VMM) under one committed-byte budget owner."""
import importlib.metadata as _metadata
import os as _os
import warnings as _warnings

try:
    import onnxruntime as _onnxruntime  # noqa: F401 - every layer above the core runs on it
except ModuleNotFoundError as _e:
    if _e.name != "onnxruntime":
        raise
    raise ModuleNotFoundError(
        "onnx_offload needs onnxruntime 1.31 or 1.32, which comes as one of the package's extras: "
        "pip install 'onnx-offload[gpu]' (onnxruntime-gpu, the CUDA build, which runs on the CPU too) or "
        "'onnx-offload[cpu]' (the CPU-only onnxruntime)", name="onnxruntime") from None

try:
    from ._core import Arena, BudgetOwner, ScratchAllocator, WeightSlot, Zone
except ModuleNotFoundError as _e:  # the source tree, whose compiled core is built only on install
    if _e.name != f"{__name__}._core":
        raise
    raise ModuleNotFoundError(
        f"onnx_offload's compiled core (_core) is not in {_os.path.dirname(__file__)}: this is the source tree, "
        f"imported because Python looks in the current folder first. Install the package ('pip install .') and "
        f"run from another folder, or run 'pytest' (not 'python -m pytest') from the repository root.",
        name=_e.name) from None
from .config import OffloadConfig, parse_bytes
from .engines import GraphCaptureDecision, resolve_graph_capture_enabled
from .errors import (BudgetExceeded, CorruptModel, CudaDriverError, CudaUnavailable, ModelNotFound, ModelRunError,
                     OffloadError, OffloadWarning, StateError, UnsupportedModel)
from .install import conflict as _conflict, installed_versions as _installed_versions
from .memory import Device, cuda_available
from .session import OffloadSession
from .devices import StagedSession, StagedStats
from .stats import OffloadStats

try:
    __version__ = _metadata.version("onnx-offload")  # written once, in pyproject.toml
except _metadata.PackageNotFoundError:  # pragma: no cover - imported without being installed
    __version__ = "unknown"


def _check_ort_install() -> None:
    import onnxruntime
    from .errors import OffloadWarning
    why = _conflict(_installed_versions(onnxruntime.__file__), f"{onnxruntime.__version__} with {', '.join(onnxruntime.get_available_providers())}")
    if why:
        _warnings.warn(why, OffloadWarning, stacklevel=3)


_check_ort_install()

__all__ = [
    "Arena", "BudgetExceeded", "BudgetOwner", "CorruptModel", "CudaDriverError", "CudaUnavailable", "Device",
    "GraphCaptureDecision", "ModelNotFound", "ModelRunError", "OffloadConfig", "OffloadError", "OffloadSession",
    "OffloadStats", "OffloadWarning", "ScratchAllocator", "StagedSession", "StagedStats", "StateError", "UnsupportedModel",
    "WeightSlot", "Zone",
    "cuda_available", "parse_bytes", "resolve_graph_capture_enabled",
]
