"""generate() and chat() on text: prompts encoded by the model folder's tokenizer (a batch
left-padded with its attention mask, as a tokenizer with padding_side='left' gives it),
and each row's new tokens streamed back as text, up to its first EOS.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

import numpy as np

from .text import TextModel


def is_text(prompt) -> bool:
    """A str, or a non-empty list or tuple of them."""
    return isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and len(prompt) > 0
                                       and all(isinstance(p, str) for p in prompt))


def text_model(session) -> TextModel:
    """The session's TextModel (its folder's tokenizer and chat template), read once."""
    folder = getattr(session, "model_folder", None)
    if not folder:
        raise ValueError("text needs the model's folder (its tokenizer.json): this session was made from bytes; "
                         "pass token ids instead")
    cached = getattr(session, "_text_model", None)
    if cached is None or cached.folder != folder:  # __init__ run again may have loaded another model
        session._text_model = cached = TextModel(folder)
    return cached


def encode_rows(tm: TextModel, prompts: list, special: bool = True) -> tuple:
    """(ids [batch, longest], mask [batch, longest] or None) of prompts, left-padded."""
    rows = [tm.encode(p, special) for p in prompts]
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise ValueError(f"prompt {empty[0]} encodes to no tokens")
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), tm.pad_id(), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for r, row in enumerate(rows):
        ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
    return ids, (None if mask.all() else mask)


def text_pieces(tm: TextModel, steps: Iterator[np.ndarray], rows: int, eos: tuple) -> Iterator[list]:
    """Each step's text of every row ('' for a row whose character is not whole yet, or
    that has ended): a row ends at its first EOS, which gives no text."""
    streams = [tm.stream() for _ in range(rows)]
    ended = [False] * rows
    stop = set(int(e) for e in eos)
    for tokens in steps:
        pieces = []
        for r, t in enumerate(tokens):
            if ended[r] or int(t) in stop:
                ended[r] = True
                pieces.append("")
            else:
                pieces.append(streams[r].step(int(t)))
        yield pieces


def chat_prompt(session, messages, add_generation_prompt: bool = True) -> np.ndarray:
    """The ids [1, n] of `messages` through the model's chat template (the rendered text
    holds its special tokens: the tokenizer adds none)."""
    tm = text_model(session)
    ids, _ = encode_rows(tm, [tm.render(messages, add_generation_prompt)], special=False)
    return ids


def model_folder(path_or_bytes) -> Optional[str]:
    """The folder of a model given as a path (a file or a folder), else None."""
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        return None
    path = os.fspath(path_or_bytes)
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
