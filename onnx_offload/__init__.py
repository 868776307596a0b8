"""onnx-offload: run ONNX Runtime models whose weights exceed their VRAM budget, with
every weight at a stable address (CUDA VMM) under one committed-byte budget owner."""
from ._core import Arena, BudgetOwner, ScratchAllocator, WeightSlot, Zone
from .config import OffloadConfig, parse_bytes
from .device import Device, cuda_available
from .errors import BudgetExceeded, CorruptModel, CudaDriverError, CudaUnavailable, OffloadError, StateError
from .graph_capture import GraphCaptureDecision, resolve_graph_capture_enabled
from .session import OffloadSession
from .stats import OffloadStats

__version__ = "0.1.0"

__all__ = [
    "Arena", "BudgetExceeded", "BudgetOwner", "CorruptModel", "CudaDriverError", "CudaUnavailable", "Device",
    "GraphCaptureDecision", "OffloadConfig", "OffloadError", "OffloadSession", "OffloadStats", "ScratchAllocator",
    "StateError", "WeightSlot", "Zone", "cuda_available", "parse_bytes", "resolve_graph_capture_enabled",
]
