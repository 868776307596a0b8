"""What a generation needs set aside in the budget: its KV cache and its largest step.

The streaming engine's plan (``engines.switch``) takes these as byte counts: the KV zone
holds the cache, the scratch zone a step's memory (its buffers, and ORT's activations
bounded from the model's widths: ``memory.step_memory``).
"""
from __future__ import annotations

import numpy as np

from ..memory import step_scratch as bounded_step
from .loop import FIRST_CONTEXT, chunk_rows, kv_peak, largest_step
from .kv_cache import bucket_for


def first_needs(spec, config, plan_scratch: int, activations, granularity: int, on_cuda: bool) -> tuple:
    """(KV bytes, scratch bytes) the streaming engine sets aside at construction: what
    the configuration gives, else, for a decoder (`spec` not an exception), those of
    first_generation; for other models the plan's scratch reserve (`plan_scratch`). A
    generation that needs more plans again (generation_needs)."""
    decoder = not isinstance(spec, Exception)
    kv, scratch = first_generation(spec, config, activations, granularity, on_cuda) if decoder else (0, plan_scratch)
    if config.kv_bytes:
        kv = config.kv_bytes
    if config.scratch_bytes is not None:
        scratch = config.scratch_bytes
    return kv, scratch


def first_generation(spec, config, activations, granularity: int, on_cuda: bool) -> tuple:
    """(KV bytes, scratch bytes) of the generation a decoder's session plans for before
    one asks: one sequence of up to FIRST_CONTEXT positions (or the model's context, if
    shorter), its prompt a chunk. The budget plan's default reserves (memory.budget)."""
    length = min(spec.max_length or FIRST_CONTEXT, FIRST_CONTEXT)
    prompt = min(length, config.prefill_chunk)
    return generation_needs(spec, config, activations, granularity, on_cuda, 1, prompt, length)


def generation_needs(spec, config, activations, granularity: int, on_cuda: bool, batch: int, prompt: int,
                     total: int) -> tuple:
    """(KV bytes, scratch bytes) of a generation of `batch` rows, a prompt of `prompt`
    tokens and `total` positions in all."""
    return (kv_peak(spec, batch, prompt, total, granularity, config.prefill_chunk),
            step_scratch(spec, config, activations, granularity, on_cuda, batch, prompt, total))


def step_scratch(spec, config, activations, granularity: int, on_cuda: bool, batch: int, prompt: int,
                 total: int) -> int:
    """The scratch a generation of `batch` rows needs at its largest step: a prompt chunk
    (one row at a time where the layout chunks row by row) or a decode step."""
    chunk = largest_step(spec, prompt, config.prefill_chunk)
    rows = chunk_rows(spec, batch, prompt, chunk)
    vocab = spec.vocab or activations.vocab
    logits = np.dtype(spec.logits_dtype).itemsize * vocab
    mask = total + 1 if spec.layout == "gqa" else bucket_for(total) + chunk + 1
    # A chunk's ids, positions and logits (twice: the first chunk's logits are the
    # engine's own buffer), its mask, and a decode step's buffers.
    io = rows * chunk * (3 * 8 + 2 * logits) + rows * mask * 8 + batch * (3 * 8 + logits + mask * 8)
    if spec.layout != "gqa":  # the present of a chunk step holds the past and the chunk
        row = spec.kv_heads * spec.head_size * np.dtype(spec.kv_dtype).itemsize
        io += 2 * spec.layers * rows * chunk * row
    return bounded_step(activations, max(rows * chunk, batch), io, granularity, ort=on_cuda)
