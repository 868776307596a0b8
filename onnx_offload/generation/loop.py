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


def prompt_chunk(prompt: int, prefill_chunk: int, thresholds: Optional[tuple] = ()) -> int:
    """The tokens of a prompt's chunks: `prefill_chunk` for a prompt longer than it, else 0
    (the prompt runs in one step), as it does for a graph that chooses by the lengths in
    a way not read (`thresholds`, DecoderSpec.length_thresholds, None)."""
    return prefill_chunk if prompt > prefill_chunk and thresholds is not None else 0


def prompt_pieces(prompt: int, chunk: int, thresholds: Optional[tuple] = ()) -> list:
    """(start, length) of each step of a prompt fed `chunk` tokens at a time (0: in one
    step): the remainder first, then whole chunks, so that every chunk after the first
    has one shape (one captured graph). Where the graph chooses by the total length
    (`thresholds`), the first step is long enough to cross the largest threshold below the
    prompt's length: every step then sees a length on the side of each threshold that one
    step over the whole prompt sees (the later ones, see fed_length)."""
    if not chunk:
        return [(0, prompt)]
    below = [t for t in thresholds or () if t < prompt]
    least = below[-1] + 1 if below else 1  # the first step's fewest tokens
    first = prompt - chunk * ((prompt - least) // chunk)
    return [(0, first)] + [(start, chunk) for start in range(first, prompt, chunk)]


def largest_step(spec: DecoderSpec, prompt: int, prefill_chunk: int) -> int:
    """The most tokens one step of a prompt of `prompt` tokens feeds."""
    chunk = prompt_chunk(prompt, prefill_chunk, spec.length_thresholds)
    return max(n for _, n in prompt_pieces(prompt, chunk, spec.length_thresholds))


def fed_length(length: int, room: int, thresholds: Optional[tuple]) -> int:
    """The mask length the builder layout feeds a step whose sequence holds `length`
    positions, in a cache of `room`: the room, one shape for every step; where the graph
    chooses by the mask's length (`thresholds`), the longest length on the side of each
    threshold that `length` itself is, as plain ORT's loop feeds `length`; where it
    chooses by the lengths in a way not read (None), `length` itself."""
    if thresholds is None:
        return length
    return min([room] + [t for t in thresholds if t >= length])


def kv_peak(spec: DecoderSpec, batch: int, prompt: int, total: int, granularity: int, prefill_chunk: int) -> int:
    """The most committed bytes the KV cache of a generation holds (kv_cache.peak_bytes),
    its prompt chunked as Generation chunks it."""
    return peak_bytes(spec.layout, spec.layers, batch, spec.kv_heads, spec.head_size, spec.kv_dtype, prompt, total,
                      granularity, chunk=prompt_chunk(prompt, prefill_chunk, spec.length_thresholds),
                      windows=[w for _, w in spec.window_caches])


def chunk_rows(spec: DecoderSpec, batch: int, prompt: int, chunk: int) -> int:
    """The rows of one prompt chunk's step: GroupQueryAttention's prompt runs in chunks one
    row at a time; the standard layouts chunk the whole batch."""
    return 1 if spec.layout == "gqa" and chunk and prompt > chunk else batch


def last_logits(device, value: ort.OrtValue) -> np.ndarray:
    """The last position's logits [batch, vocab], in the model's type, of a step's logits value:
    only those rows come to the host. (A prompt's logits of every position are the
    largest copy of its step: 131 MB for 512 tokens of a 128k vocabulary.) The array is
    the caller's own: on the host backend numpy() is a view of the device buffer, which
    the next step (or the next row's prompt chunk) writes over."""
    shape = value.shape()
    if len(shape) != 3 or shape[1] == 1:
        return np.array(last_position(value.numpy()), copy=True)
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
    if spec.layout == "gqa" and mask is not None:
        yield from _rows_one_at_a_time(session, ids, new, sampling, seed, eos, mask)
        return
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


def _rows_one_at_a_time(session, ids: np.ndarray, new: int, sampling: Sampling, seed: Optional[int], eos: tuple,
                        mask: np.ndarray) -> Iterator[np.ndarray]:
    """A left-padded batch on GroupQueryAttention, whose cache holds each row's tokens from
    position 0 and whose positions count from there: each row runs alone without its
    padding, then the steps are given as a batch's, a row that ended repeating its EOS.
    (Row r samples with seed + r.) The first step comes once every row has run."""
    rows = []
    for r in range(len(ids)):
        row = ids[r][mask[r] == 1][None, :]
        row_seed = None if seed is None else seed + r
        rows.append([int(t[0]) for t in generate_tokens(session, row, new, sampling, row_seed, eos)])
    for step in range(max(len(row) for row in rows)):
        yield np.array([row[min(step, len(row) - 1)] for row in rows], np.int64)
