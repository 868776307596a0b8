"""What a generate() call asks for: its arguments, checked before anything runs, and the
sampling that picks each new token from the last position's logits.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Optional

import numpy as np

from ..loading import DecoderSpec

MAX_POSITIONS = 2**31 - 1  # positions and masks may be int32


@dataclasses.dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not isinstance(self.do_sample, (bool, np.bool_)):  # "no" would be true
            raise TypeError(f"do_sample must be a bool, got {type(self.do_sample).__name__} {self.do_sample!r}")
        for name in ("temperature", "top_k", "top_p"):
            if isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"{name} must be a number, got the bool {getattr(self, name)!r}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if operator.index(self.top_k) < 0:  # TypeError for a non-integer
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:  # False for nan too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def pick(self, logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One token per row of `logits` [batch, vocab], in the model's float type."""
        if not self.do_sample:
            return greedy(logits)
        logits = logits.astype(np.float64)
        out = np.empty(len(logits), np.int64)
        # Shifted before scaling: the largest becomes 0, so no temperature overflows exp
        # (a tiny one sends the others to -inf, whose exp is 0).
        with np.errstate(over="ignore"):
            scaled = (logits - logits.max(axis=-1, keepdims=True)) / self.temperature
        for r, row in enumerate(scaled):
            order = np.argsort(-row, kind="stable")
            if self.top_k:
                order = order[:self.top_k]
            p = np.exp(row[order])
            p /= p.sum()
            if self.top_p < 1:
                keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
                order, p = order[:keep], p[:keep] / p[:keep].sum()
            out[r] = order[rng.choice(len(order), p=p)]
        return out


def greedy(logits: np.ndarray) -> np.ndarray:
    """Each row's token of the largest logit [batch] int64: what numpy's argmax of the
    logits' values gives (the first of equal values, the first NaN of a row with one), as
    a user's loop over plain ORT picks it; types numpy has only through ml_dtypes
    (bfloat16, float8) are read as their float32 values, which are the same values.

    float16 logits are not cast: casting [4, 128256] of them took 1.04 ms of a host's
    step on an H100, where a step's kernels take a few. A float16's bits, read as int16,
    order the values from +0 up as the values do, and put every negative value below +0;
    so a row whose largest value is positive, with no NaN, takes its token from an int16
    argmax (a positive NaN has larger bits than +inf, a negative one's read as uint16
    are the largest). A row of negative values only orders by its bits with a negative
    value's magnitude bits flipped; a row holding a NaN, or whose largest value is +0
    (a -0 before it would be the first maximum), takes the float32 way."""
    if logits.ndim != 2:
        raise ValueError(f"greedy() takes logits [batch, vocab], got shape {list(logits.shape)}")
    if logits.dtype != np.float16:  # numpy's own types as they are; bfloat16 and float8 as float32
        own = logits.dtype.kind in "fiub"
        return (logits if own else logits.astype(np.float32)).argmax(axis=-1).astype(np.int64)
    bits = logits.view(np.int16)
    out = bits.argmax(axis=-1).astype(np.int64)
    top = np.take_along_axis(bits, out[:, None], axis=-1)[:, 0]
    nan = (top > 0x7C00) | (bits.view(np.uint16).max(axis=-1) > 0xFC00)
    negative = np.flatnonzero(~nan & (top < 0))
    if negative.size:
        rows = bits[negative]
        out[negative] = (rows ^ np.int16(0x7FFF)).argmax(axis=-1)
    odd = np.flatnonzero(nan | (top == 0))
    if odd.size:
        out[odd] = logits[odd].astype(np.float32).argmax(axis=-1)
    return out


def check_generate_args(session, input_ids, max_new_tokens, eos_token_id, attention_mask=None, seed=None):
    """(ids [batch, prompt] int64, new tokens, EOS ids, the prompt's mask [batch, prompt]
    int64 or None for all ones) for a generation, or a clear error before anything runs."""
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
        raise ValueError(f"input_ids must be [batch, prompt] with a non-empty prompt, got shape {ids.shape}")
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"input_ids must be integers, got {ids.dtype}")
    if isinstance(max_new_tokens, (bool, np.bool_)):  # True would be 1 token
        raise TypeError(f"max_new_tokens must be an integer, got the bool {max_new_tokens!r}")
    new = operator.index(max_new_tokens)  # TypeError for 2.5 or "3"
    if new < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if seed is not None and (isinstance(seed, bool) or operator.index(seed) < 0):
        raise ValueError(f"seed must be an integer >= 0 or None, got {seed!r}")
    spec = session.decoder_spec
    if ids.min() < 0 or (spec.vocab and ids.max() >= spec.vocab):
        raise ValueError(f"token ids must lie in [0, {spec.vocab or 'the vocabulary size'}), got ids from "
                         f"{ids.min()} to {ids.max()}")
    ids = ids.astype(np.int64)
    positions = ids.shape[1] + max(new - 1, 0)  # the last token is never fed back
    if spec.max_length and positions > spec.max_length:
        raise ValueError(f"a prompt of {ids.shape[1]} and {new} new tokens need {positions} positions; the model "
                         f"holds {spec.max_length}")
    if positions > MAX_POSITIONS:
        raise ValueError(f"a prompt of {ids.shape[1]} and {new} new tokens need {positions} positions; generate() "
                         f"holds at most {MAX_POSITIONS} (positions and masks may be int32)")
    if eos_token_id is None:
        eos = spec.eos_token_id
    else:
        arr = np.atleast_1d(np.asarray(eos_token_id))
        if arr.ndim != 1 or (arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer))):
            raise TypeError(f"eos_token_id must be an integer or a sequence of integers, got {eos_token_id!r}")
        eos = tuple(int(e) for e in arr)
        if any(not -2**63 <= e < 2**63 for e in eos):
            raise ValueError(f"eos_token_id must be token ids (64-bit integers), got {eos_token_id!r}")
    return ids, new, eos, check_prompt_mask(spec, attention_mask, ids.shape)


def check_prompt_mask(spec: DecoderSpec, attention_mask, shape) -> Optional[np.ndarray]:
    """The prompt's attention mask as int64, or None when it is all ones (or not given)."""
    if attention_mask is None:
        return None
    mask = np.asarray(attention_mask)
    if mask.ndim == 1:
        mask = mask[None, :]
    if mask.shape != tuple(shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {list(shape)}, got {list(mask.shape)}")
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)) or not np.isin(mask, (0, 1)).all():
        raise ValueError("attention_mask must hold 0 (padding) and 1 (a token) only")
    mask = mask.astype(np.int64)
    if not mask.any(axis=1).all():
        raise ValueError("every row of attention_mask needs at least one token (a 1)")
    if mask.all():
        return None
    # Each new token goes after the prompt's last column: a 0 after a 1 would leave
    # padding inside a row's sequence, and its positions and cache out of step.
    falls = (np.diff(mask, axis=1) < 0).any(axis=1)
    if falls.any():
        raise ValueError(f"attention_mask row {int(np.flatnonzero(falls)[0])} has a 0 after a 1 (right padding, or a "
                         f"gap), which generate() does not support: it takes left padding, each row's zeros before "
                         f"its tokens, as a tokenizer with padding_side='left' gives it")
    return mask
