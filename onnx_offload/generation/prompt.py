"""A generation's prompt: the steps that fill the KV cache before the first new token.

The prompt runs uncaptured in one step with no past or, longer than the session's
prefill_chunk, in chunks that each append to the cache, so that a step's memory is
bounded by the chunk. The builder layout's first step and chunks run on buffers the
generation keeps, so that the next generation of the shape replays their graphs.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import onnxruntime as ort

from ..engines import FixedBuffer, StreamEngine
from .buffers import write
from .loop import fed_length, last_logits, prompt_pieces


def _host(array: np.ndarray, dtype) -> ort.OrtValue:
    """A chunk's feed on the host: `array` as `dtype`, contiguous."""
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array, dtype))


class PromptSteps:
    """The prompt steps of a Generation, on the state it holds: the session, the spec, the
    batch, the chunk length, the cache, the scratch buffers (io_bufs, and the prompt's
    _first_bufs and _chunk_bufs), the generation's name and its plan keys. They set what
    the decode steps read on: prompt_mask, _tokens and _logits_shape."""

    def _prompt(self, input_ids: np.ndarray, mask: Optional[np.ndarray]) -> np.ndarray:
        b, p = input_ids.shape
        self.prompt_mask = mask
        # A row's positions count its tokens, not its padding (as HF's generate sets them).
        self._tokens = np.full(b, p, np.int64) if mask is None else mask.sum(axis=1)
        if self.chunk:
            return self._prompt_in_chunks(input_ids, mask)
        logits = self._no_past_step(input_ids, mask)
        self._logits_shape = tuple(logits.shape())
        return last_logits(self.session.device, logits)

    def _no_past_step(self, ids: np.ndarray, mask: Optional[np.ndarray], row: Optional[int] = None) -> ort.OrtValue:
        """The first tokens of the prompt (all of it, when it runs in one step) with no past;
        the cache takes their keys and values (the shared layout's ORT writes in place:
        every row's buffers, or row `row`'s, on buffers kept for the next generation, see
        _gqa_first; the standard layouts' step runs once, its present copied into the
        cache). Returns the step's logits (their value)."""
        spec, s = self.spec, self.session
        b, p = ids.shape
        arrays = {"input_ids": np.ascontiguousarray(ids, spec.ids_dtype),
                  "attention_mask": np.ascontiguousarray(np.ones((b, p)) if mask is None else mask, spec.mask_dtype)}
        if spec.position_ids:
            pos = np.tile(np.arange(p), (b, 1)) if mask is None else np.where(mask == 1, np.cumsum(mask, 1) - 1, 1)
            arrays["position_ids"] = np.ascontiguousarray(pos, spec.pos_dtype)
        if spec.layout == "gqa":
            return self._gqa_first(arrays, row)
        feeds = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in arrays.items()}
        empty = ort.OrtValue.ortvalue_from_numpy(np.zeros((b, spec.kv_heads, 0, spec.head_size), spec.kv_dtype))
        for i in range(spec.layers):
            for kv in ("key", "value"):
                feeds[f"past_key_values.{i}.{kv}"] = empty
        values = s._run_bound(feeds, {}, fixed=False)[0]
        self.cache.fill_from([values[f"present.{i}.{kv}"] for i in range(spec.layers) for kv in ("key", "value")], p)
        return values["logits"]

    def _gqa_first(self, arrays: Dict[str, np.ndarray], row: Optional[int]) -> ort.OrtValue:
        """The first step of a prompt of the shared layout (`arrays`: its ids, mask and
        positions), on buffers of this generation's for its shape, so that its graph is
        kept and the next generation of the shape replays it. The logits of the rows after
        the first of a prompt in chunks go to the chunks' buffer (the first row's chunks
        made it); else to the runner's own buffer."""
        s, dev = self.session, self.session.device
        feeds: Dict[str, ort.OrtValue] = {}
        outputs: Dict[str, ort.OrtValue] = {}
        self.cache.bind(feeds, outputs, row=row)
        writes = []
        for name, array in arrays.items():
            buf = self._first_bufs.get((name, array.shape))
            if buf is None:
                buf = self._first_bufs[(name, array.shape)] = self.io_bufs.new(list(array.shape), array.dtype)
            writes.append((buf, array))
            feeds[name] = buf.value
        write(dev, *writes)
        rows, n = arrays["input_ids"].shape
        clogits = self._chunk_bufs[3] if row and self._chunk_bufs is not None else None
        # the same for every generation of these buffers: the key stands for it (a first
        # step longer than a chunk, as one crossing a length threshold, does not fit it)
        if clogits is not None and (len(clogits.shape) != 3 or n <= clogits.shape[1]):
            shape = [rows, n] + clogits.shape[2:] if len(clogits.shape) == 3 else clogits.shape
            outputs["logits"] = FixedBuffer.on(dev, clogits.ptr, shape, clogits.dtype).value
        key = ("prompt", self._name, row, n)
        self._keys.add(key)
        # Kept by the streaming engine, whose graph of the step holds its page-ins; the
        # segment runner captures a few shapes for the session's life, the decode steps'.
        values = s._run_bound(feeds, outputs, fixed=isinstance(s._runner, StreamEngine), key=key)[0]
        return values["logits"]

    # ------------------------------------------------------------ the prompt in chunks
    def _prompt_in_chunks(self, input_ids: np.ndarray, mask: Optional[np.ndarray]) -> np.ndarray:
        """The prompt fed `chunk` tokens at a time, each chunk appending to the cache, so a
        step's memory is bounded by the chunk whatever the prompt's length. Returns the
        last position's logits [batch, vocab]."""
        spec = self.spec
        if spec.layout == "gqa":
            rows = [self._gqa_row(input_ids[r:r + 1], r) for r in range(self.batch)] if self.batch > 1 else \
                [self._gqa_row(input_ids, None)]
            return np.concatenate(rows, axis=0)
        b, p = input_ids.shape
        pos = np.tile(np.arange(p), (b, 1)) if mask is None else np.where(mask == 1, np.cumsum(mask, 1) - 1, 1)
        full = np.ones((b, p), np.int64) if mask is None else mask
        logits = None
        for start, n in prompt_pieces(p, self.chunk, spec.length_thresholds):
            if start == 0 and spec.layout != "exact":  # as an unchunked prompt: no past
                logits = self._no_past_step(input_ids[:, :n], None if mask is None else mask[:, :n])
                continue
            feeds = {"input_ids": _host(input_ids[:, start:start + n], spec.ids_dtype)}
            if spec.position_ids:
                feeds["position_ids"] = _host(pos[:, start:start + n], spec.pos_dtype)
            outputs: Dict[str, ort.OrtValue] = {}
            self.cache.ensure(start + n)
            if spec.layout == "exact":
                feeds["attention_mask"] = _host(full[:, :start + n], spec.mask_dtype)
            else:  # the past padded to its bucket, the padding masked out, as a decode step
                m = np.zeros((b, self.cache.bucket + n), np.int64)
                m[:, :start] = full[:, :start]
                m[:, self.cache.bucket:] = full[:, start:start + n]
                feeds["attention_mask"] = _host(m, spec.mask_dtype)
            self.cache.bind(feeds, outputs, new=n)
            values = self.session._run_bound(feeds, outputs, fixed=False)[0]
            if spec.layout == "exact":
                self.cache.advance(n)
            else:
                self.cache.append(start, n)
                if not self.session.device.is_cuda:
                    # The copy is queued on the host backend's stream, a thread of its own;
                    # the CPU EP runs the next chunk, which reads it, on this one.
                    self.session.device.compute_stream.synchronize()
            logits = values["logits"]
        self._logits_shape = (b,) + tuple(logits.shape())[1:]
        return last_logits(self.session.device, logits)

    def _gqa_row(self, ids: np.ndarray, row: Optional[int]) -> np.ndarray:
        """One row's prompt (all rows when `row` is None) in chunks, through views of its
        rows of the shared cache: ORT's CUDA GroupQueryAttention takes a chunk beside a
        past for one row at a time. The first chunk runs as an unchunked prompt (the mask
        as long as it); the others see the cache's whole length (or, where the graph
        chooses by the mask's length, the length fed_length gives the prompt's), ones up
        to their end, as a decode step does, and share one shape and one set of buffers
        (one graph)."""
        spec, s, dev = self.spec, self.session, self.session.device
        rows, p = ids.shape
        length = fed_length(p, self.cache.length, spec.length_thresholds)
        logits = None
        for start, n in prompt_pieces(p, self.chunk, spec.length_thresholds):
            if start == 0:
                logits = self._no_past_step(ids[:, :n], None, row)
                continue
            outputs: Dict[str, ort.OrtValue] = {}
            feeds: Dict[str, ort.OrtValue] = {}
            self.cache.bind(feeds, outputs, row=row)
            # (Buffers replaced stay the generation's until it closes: a plan kept for
            # their key may still name them.)
            if self._chunk_bufs is None or self._chunk_bufs[0].shape != [rows, n] or \
                    self._chunk_bufs[1].shape[1] != length:
                shape = logits.shape()
                self._chunk_bufs = (self.io_bufs.new([rows, n], spec.ids_dtype),
                                    self.io_bufs.new([rows, length], spec.mask_dtype),
                                    self.io_bufs.new([rows, n], spec.pos_dtype) if spec.position_ids else None,
                                    self.io_bufs.new([rows, n] + list(shape[2:]) if len(shape) == 3
                                                     else [rows] + list(shape[1:]), spec.logits_dtype))
            cids, cmask, cpos, clogits = self._chunk_bufs
            m = np.zeros((rows, length), np.int64)
            m[:, :start + n] = 1
            writes = [(cids, ids[:, start:start + n]), (cmask, m)]
            if cpos is not None:
                writes.append((cpos, np.tile(np.arange(start, start + n), (rows, 1))))
            write(dev, *writes)
            feeds.update({"input_ids": cids.value, "attention_mask": cmask.value})
            if cpos is not None:
                feeds["position_ids"] = cpos.value
            outputs["logits"] = clogits.value
            key = ("prefill", self._name, row, n, length)
            self._keys.add(key)
            # As the first step: the streaming engine keeps the graph of the chunks; the
            # segment runner keeps its few captured shapes (MAX_SIGNATURES) for the
            # decode steps, which a prompt of 4 rows in chunks (8 shapes) would take.
            s._run_bound(feeds, outputs, fixed=isinstance(s._runner, StreamEngine), key=key)
            logits = clogits.value
        if self._logits_shape is None:
            self._logits_shape = (self.batch,) + tuple(logits.shape())[1:]
        return last_logits(dev, logits)

    # ------------------------------------------------------------ a prompt continued
    def rewind(self, positions: int) -> None:
        """Counts the first `positions` of the cache as the sequence (one row's): the
        next step writes after them, over what lies there."""
        self._tokens = np.full(self.batch, positions, np.int64)

    def extend(self, ids, start: int) -> np.ndarray:
        """Feeds one row's tokens `ids` after the first `start` positions of the cache, as a
        prompt's later chunks run (a chat's next turn, whose history the cache holds up to
        `start`; positions after it are written over). Each piece, of at most a chunk's
        tokens (the standard layout's: what its present holds beyond the past), is a step
        of its own, uncaptured; Ctrl-C ends between them, `_tokens` counting the positions
        fed. The exact layout continues only at its end. Returns the last position's
        logits [1, vocab]."""
        if self.batch != 1 or not len(ids):
            raise ValueError("a prompt continues one row by at least one token")
        if self.spec.layout == "exact" and start != self.cache.length:
            raise ValueError(f"the exact layout's cache holds {self.cache.length} positions; it continues there, "
                             f"not at {start}")
        piece = max(1, self.cache.extra) if self.spec.layout == "standard" else \
            max(1, self.chunk or self.session.config.prefill_chunk)
        logits = None
        for at in range(0, len(ids), piece):
            with self.session._step():
                logits = self._extend_step(np.asarray(ids[at:at + piece], np.int64)[None], start + at)
        return logits

    def _extend_step(self, ids: np.ndarray, start: int) -> np.ndarray:
        spec, dev = self.spec, self.session.device
        n = ids.shape[1]
        end = start + n
        feeds = {"input_ids": _host(ids, spec.ids_dtype)}
        if spec.position_ids:
            feeds["position_ids"] = _host(np.arange(start, end)[None], spec.pos_dtype)
        outputs: Dict[str, ort.OrtValue] = {}
        if spec.layout == "gqa":  # the cache's whole length, ones up to the piece's end
            mask = np.zeros((1, self.cache.length), np.int64)
            mask[:, :end] = 1
            self.cache.bind(feeds, outputs)
        else:
            self.cache.ensure(end)
            if spec.layout == "exact":
                mask = np.ones((1, end), np.int64)
            else:  # the past padded to its bucket, the padding (and what lies past `start`) masked out
                mask = np.zeros((1, self.cache.bucket + n), np.int64)
                mask[:, :start] = 1
                mask[:, self.cache.bucket:] = 1
            self.cache.bind(feeds, outputs, new=n)
        feeds["attention_mask"] = _host(mask, spec.mask_dtype)
        values = self.session._run_bound(feeds, outputs, fixed=False)[0]
        if spec.layout == "exact":
            self.cache.advance(n)
        elif spec.layout == "standard":
            self.cache.append(start, n)
            if not dev.is_cuda:  # the copy runs on the host backend's stream; the next step reads it here
                dev.compute_stream.synchronize()
        self._tokens = np.full(1, end, np.int64)
        return last_logits(dev, values["logits"])
