"""What one step needs on the device beside the weights, for the streaming engine's plan.

The streaming engine's weights budget is what the budget leaves once the KV cache and
the step's memory are set aside, so both are sized from the step they serve, not as a
share of the budget:
- the KV cache: ``kv_cache.peak_bytes`` for the generation's batch and length;
- the step's buffers (token ids, mask, positions, the logits of a prompt chunk), which
  the generation allocates in scratch;
- ORT's own memory for the step's activations. It is known only once ORT has run the
  step, so the plan starts from a bound computed from the model's dimensions
  (``ActivationShape``) and the engine then charges what ORT took in its warm-up run to
  the scratch zone; a step that needs more than the plan set aside makes the session
  plan again with what was measured (``StepMemoryShort``).

A decoder's prompt runs in chunks of at most ``prefill_chunk`` tokens, so the largest
step has ``rows x chunk`` tokens, whatever the prompt's length.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import numpy as np

from .._core import round_up
from ..errors import BudgetExceeded, CudaDriverError

MiB = 1 << 20
# ORT's fixed share of a step: cuBLAS and cuDNN workspaces, the arena's first chunks and
# the small values of every layer. On the H200 ORT grew by 88 MiB for a 128-token prompt
# step of a Llama-3-8B-width decoder (batch 1, fp16), 128 MiB at 512 tokens and 320 MiB at
# 2048: about 72 MiB and 127 KB per token.
FIXED = 96 * MiB
# Values of one token live at once in ORT's arena, in units of the widest projection's
# output: its output, its activation and the product of the two (a gated MLP), the
# attention's projections and its residuals. For that width (intermediate 14336) this
# gives 229 KB a token where ORT took 127 KB: the bound errs on the side of room.
LIVE_VALUES = 8


@dataclasses.dataclass(frozen=True)
class ActivationShape:
    """The model's widths that bound ORT's memory per token: the widest projection that
    is not the vocabulary's (`width`), the vocabulary (`vocab`, 0 when unknown) and the
    activations' element size."""
    width: int
    vocab: int
    itemsize: int

    def ort_bytes(self, tokens: int) -> int:
        """A bound on ORT's device memory for one step of `tokens` tokens (batch x length)."""
        per_token = self.itemsize * (LIVE_VALUES * self.width + self.vocab)
        return FIXED + tokens * per_token


def activation_shape(model, weights: Iterable[str], vocab: Optional[int], logits_dtype) -> ActivationShape:
    """The widths of the projections that read weights (MatMul, Gemm, MatMulNBits), as
    the graph gives them."""
    names = set(weights)
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    widths = []
    for node in model.graph.node:
        w = node.input[1] if len(node.input) > 1 else ""
        if w not in names:
            continue
        shape = dims.get(w) or []
        if node.op_type == "MatMul" and len(shape) >= 2:
            widths.append(int(shape[-1]))
        elif node.op_type == "Gemm" and len(shape) == 2:
            trans = next((a.i for a in node.attribute if a.name == "transB"), 0)
            widths.append(int(shape[0] if trans else shape[1]))
        elif node.op_type == "MatMulNBits":
            n = next((a.i for a in node.attribute if a.name == "N"), 0)
            if n:
                widths.append(int(n))
    others = [w for w in widths if not vocab or w != vocab]
    itemsize = np.dtype(logits_dtype).itemsize if logits_dtype is not None else 4
    return ActivationShape(max(others, default=max(widths, default=4096)), int(vocab or 0), itemsize)


def step_scratch(shape: ActivationShape, tokens: int, io_bytes: int, granularity: int, ort: bool = True) -> int:
    """The scratch a step of `tokens` tokens needs: ORT's bound (`ort`: on a GPU; on the
    host backend ORT's memory is the process's own, not the budget's), and `io_bytes` of
    the step's own buffers, in whole granules (each buffer group a granule more)."""
    ort_bytes = round_up(shape.ort_bytes(tokens), granularity) if ort else 0
    return ort_bytes + round_up(io_bytes, granularity) + 2 * granularity


class StepMemoryShort(BudgetExceeded):
    """ORT took more memory in a step than the scratch zone had room for (`needed`
    bytes more): the streaming engine's plan is made again with that room set aside."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


ORT_OUT_OF_MEMORY = ("Failed to allocate memory", "BFCArena", "out of memory", "CUDA_ERROR_OUT_OF_MEMORY",
                     "cudaErrorMemoryAllocation")


def device_out_of_memory(error: BaseException) -> bool:
    """Whether the package found the device full: a driver call that failed for want of
    memory, or the arena's BudgetExceeded for a budget that had room."""
    if isinstance(error, BudgetExceeded):
        return error.device_full
    return isinstance(error, CudaDriverError) and error.error_name == "CUDA_ERROR_OUT_OF_MEMORY"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ORT's error says its arena or the device ran out of memory."""
    text = str(error)
    return any(s in text for s in ORT_OUT_OF_MEMORY)
