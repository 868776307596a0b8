"""Whether a session captures CUDA graphs, and why.

Precedence, first match wins:

1. Offload without stable addresses: off. Weights move between runs, so a captured
   graph would read freed memory.
2. The caller's explicit request: ``OffloadSession(..., cuda_graph=True)``, or
   ``enable_cuda_graph`` in the CUDA provider options, as plain ORT takes it.
3. An explicit ``ONNX_GENAI_CUDA_GRAPH`` value.
4. Auto: on only on the CUDA EP when the graph is structurally safe: no control flow,
   and fixed input shapes (bound through IOBinding). ORT itself refuses capture when it
   places nodes on the CPU; the session then falls back and reports that reason.
5. Auto, for a decoder with a KV cache and no control flow: on for ``generate()``,
   whose decode steps run at fixed shapes and addresses and replay; its prompt step,
   and ``run()`` calls, run uncaptured (``decode_only``).

A CPU-only session never captures, whatever was asked: there is nothing to capture.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})


@dataclasses.dataclass(frozen=True)
class GraphCaptureDecision:
    enabled: bool
    reason: str
    decode_only: bool = False  # captured only for generate()'s decode steps

    def __bool__(self) -> bool:
        return self.enabled


def structural_safety(model) -> tuple[bool, str]:
    """(safe, reason) for capture: no control flow, every graph input of fixed shape."""
    ops = sorted({n.op_type for n in model.graph.node if n.op_type in CONTROL_FLOW_OPS})
    if ops:
        return False, f"the graph has control flow ({', '.join(ops)})"
    initializers = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        dims = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        if not vi.type.tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in dims):
            return False, f"input '{vi.name}' has a dynamic shape"
    return True, "the graph is structurally safe (no control flow, fixed input shapes)"


def resolve_graph_capture_enabled(
    *,
    on_cuda: bool,
    offload: bool,
    stable_addresses: bool,
    override: Optional[bool] = None,
    override_source: str = "",
    env_value: Optional[bool] = None,
    structurally_safe: bool = False,
    safety_reason: str = "",
    decoder: bool = False,
) -> GraphCaptureDecision:
    """Decides capture with the precedence in this module's docstring."""
    if not on_cuda:
        return GraphCaptureDecision(False, "CUDA graphs need the CUDA execution provider")
    if offload and not stable_addresses:
        return GraphCaptureDecision(
            False,
            "weight offload without stable addresses (ONNX_GENAI_WEIGHT_OFFLOAD_VMM is not 1) "
            "reallocates weights on every page-in, so captured pointers would go stale")
    if override is not None:
        return GraphCaptureDecision(override, f"set by the caller ({override_source or f'cuda_graph={override}'})")
    if env_value is not None:
        return GraphCaptureDecision(env_value, f"ONNX_GENAI_CUDA_GRAPH={int(env_value)}")
    if structurally_safe:
        return GraphCaptureDecision(True, f"auto: {safety_reason or 'the graph is structurally safe'}")
    if decoder:
        return GraphCaptureDecision(
            True, "auto: a decoder with a KV cache: generate() replays its decode steps, which run at fixed "
                  "shapes and addresses; the prompt step and run() calls run uncaptured", decode_only=True)
    return GraphCaptureDecision(False, f"auto: {safety_reason or 'the graph is not structurally safe'}")
