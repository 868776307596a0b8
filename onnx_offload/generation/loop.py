"""The generation loop and what its steps share.

``generate_tokens`` runs the prompt, then picks a token per row from each step's logits
until the new tokens are out or every row has reached EOS. The step sizes (how the
prompt is chunked, the KV cache's peak) are what the session plans with before a
generation; ``last_logits`` brings only the last position's logits to the host.
"""
from __future__ import annotations

from typing import Iterator, Optional

import numpy as np
import onnxruntime as ort

from ..engines import FixedBuffer, numpy_dtype
from ..loading import DecoderSpec
from .kv_cache import peak_bytes
from .sampling import Sampling

# The positions a session's advice plans a decoder's generation for (generation.advice).
DEFAULT_CONTEXT = 4096
# The positions a session plans a decoder's KV cache for at construction, before a
# generation says its batch and length: a prompt chunk and as many new tokens. A
# generation that needs more plans again before its first step (Engines.prepare).
FIRST_CONTEXT = 1024


def prompt_chunk(prompt: int, prefill_chunk: int) -> int:
    """The tokens of a prompt's chunks: `prefill_chunk` for a prompt longer than it, else 0
    (the prompt runs in one step)."""
    return prefill_chunk if prompt > prefill_chunk else 0


def prompt_pieces(prompt: int, chunk: int) -> list:
    """(start, length) of each step of a prompt fed `chunk` tokens at a time (0: in one
    step): the remainder first, then whole chunks, so that every chunk after the first
    has one shape (one captured graph)."""
    if not chunk:
        return [(0, prompt)]
    first = prompt - chunk * ((prompt - 1) // chunk)
    return [(0, first)] + [(start, chunk) for start in range(first, prompt, chunk)]


def kv_peak(spec: DecoderSpec, batch: int, prompt: int, total: int, granularity: int, prefill_chunk: int) -> int:
    """The most committed bytes the KV cache of a generation holds (kv_cache.peak_bytes),
    its prompt chunked as Generation chunks it."""
    return peak_bytes(spec.layout, spec.layers, batch, spec.kv_heads, spec.head_size, spec.kv_dtype, prompt, total,
                      granularity, chunk=prompt_chunk(prompt, prefill_chunk),
                      windows=[w for _, w in spec.window_caches])


def chunk_rows(spec: DecoderSpec, batch: int, prompt: int, chunk: int) -> int:
    """The rows of one prompt chunk's step: GroupQueryAttention's prompt runs in chunks one
    row at a time; the standard layouts chunk the whole batch."""
    return 1 if spec.layout == "gqa" and chunk and prompt > chunk else batch


def last_logits(device, value: ort.OrtValue) -> np.ndarray:
    """The last position's logits [batch, vocab], in the model's type, of a step's logits value:
    only those rows come to the host. (A prompt's logits of every position are the
    largest copy of its step: 131 MB for 512 tokens of a 128k vocabulary.)"""
    shape = value.shape()
    if len(shape) != 3 or shape[1] == 1:
        return last_position(np.asarray(value.numpy()))
    rows, n, vocab = shape
    dtype = numpy_dtype(value.data_type())
    row = vocab * dtype.itemsize
    ptr = value.data_ptr()
    tails = [FixedBuffer.on(device, ptr + ((r + 1) * n - 1) * row, [1, vocab], dtype).value.numpy()
             for r in range(rows)]
    return np.concatenate(tails)


def last_position(logits: np.ndarray) -> np.ndarray:
    """The last position's logits [batch, vocab], in the model's type (Sampling.pick reads
    them as it needs), of [batch, sequence, vocab] logits or of [batch, vocab] ones (a
    model that returns the last position only)."""
    return logits[:, -1, :] if logits.ndim == 3 else logits

def generate_tokens(session, ids: np.ndarray, new: int, sampling: Sampling, seed: Optional[int],
                    eos: tuple, mask: Optional[np.ndarray] = None) -> Iterator[np.ndarray]:
    """Yields each step's new tokens [batch]; rows that reached EOS repeat their EOS.
    The arguments come from check_generate_args."""
    if new == 0:
        return
    spec = session.decoder_spec
    rng = np.random.default_rng(seed)
    eos_ids = np.array(eos, np.int64)
    b, p = ids.shape
    gen = session._new_generation(spec, b, p, p + max(new - 1, 0))
    kept = False
    try:
        logits = gen.prompt(ids, mask)
        done = np.zeros(b, bool)
        ended = np.zeros(b, np.int64)  # the EOS id each finished row produced
        for step in range(new):
            tokens = sampling.pick(logits, rng)
            if eos:
                tokens = np.where(done, ended, tokens)
                now = ~done & (tokens[:, None] == eos_ids).any(axis=1)
                ended = np.where(now, tokens, ended)
                done |= now
            last = done.all() or step + 1 == new
            if last:
                # The cache goes to the session before the last token is handed over (kept
                # for the next generation of this shape, or given back): a caller that
                # takes exactly what it asked for never resumes this generator.
                session._park(gen)
                kept = True
            yield tokens
            if last:
                return
            logits, _ = gen.decode(tokens, p + step + 1)
    finally:
        if not kept:  # an error, an interrupt, or a caller that stopped early
            gen.close()  # idempotent
