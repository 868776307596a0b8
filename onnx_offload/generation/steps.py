"""One generation's device state and its decode steps.

A generation runs the prompt uncaptured (PromptSteps), then one step per token at fixed
shapes and addresses: token ids, attention mask, positions and logits live in device
buffers the step writes in place, so under capture every decode step replays the same
graphs (one per segment when the weights stream). The exact layout's shapes grow every
step: its steps run uncaptured.
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings
from typing import Dict, Optional

import numpy as np

from ..engines import FixedBuffer, StreamEngine
from ..errors import BudgetExceeded, OffloadError, OffloadWarning
from ..interrupts import deferred_interrupts
from ..loading import DecoderSpec
from .buffers import DeviceBuffers, write
from .kv_cache import BucketKV, ExactKV, SharedKV, bucket_for
from .loop import chunk_rows, fed_length, kv_peak, largest_step, last_logits, prompt_chunk
from .prompt import PromptSteps

_GENERATIONS = itertools.count()  # names each generation's step plans
# Measured on an H100 (8B widths, 4 x 4096 tokens): the cache after a prompt in chunks is
# the same bitwise for a batch and for its rows one by one, and differs from one step's by
# fp16 rounding (ORT's attention over a chunk beside its past is another kernel).
CHUNK_NOTE = ("a prompt longer than prefill_chunk runs in chunks; on CUDA, ORT's attention of a chunk beside its "
              "past rounds otherwise than one step's, so the tokens may part from an unchunked run's where two "
              "logits nearly tie. A prefill_chunk of at least the prompt's length runs it in one step, where the "
              "budget holds that step")


def peaks(spec: DecoderSpec, batch: int, prompt: int, total: int, granularity: int, prefill_chunk: int) -> tuple:
    """(the KV cache's peak, the step buffers' peak in scratch: ids, positions, mask and
    logits) of a generation whose prompt is fed `prefill_chunk` tokens a step."""
    chunk = largest_step(spec, prompt, prefill_chunk) if prompt_chunk(prompt, prefill_chunk,
                                                                        spec.length_thresholds) else 0
    mask_peak = total if spec.layout == "gqa" else bucket_for(total) + max(1, chunk)
    rows = chunk_rows(spec, batch, prompt, chunk)
    io_peak = batch * (2 * 8 + 8 * mask_peak + 4 * (spec.vocab or 0))
    io_peak += rows * (chunk * (3 * 8 + 4 * (spec.vocab or 0)) + 8 * mask_peak)
    return kv_peak(spec, batch, prompt, total, granularity, prefill_chunk), io_peak


class Generation(PromptSteps):
    """One generation's device state: the KV cache and the step buffers, freed on close."""

    def __init__(self, session, spec: DecoderSpec, batch: int, prompt: int, total: int):
        dev = session.device
        self.session, self.spec, self.batch = session, spec, batch
        self._name = next(_GENERATIONS)
        self._keys = set()  # the runner's plans for this generation's buffers
        self._closed = False
        # What this generation holds at most, for a shortage to plan with: the cache, and
        # the step buffers (ids, positions, mask, logits) in scratch.
        self.chunk = prompt_chunk(prompt, session.config.prefill_chunk, spec.length_thresholds)
        chunk = largest_step(spec, prompt, session.config.prefill_chunk) if self.chunk else 0
        if chunk and dev.is_cuda and CHUNK_NOTE not in session._notes:
            session._notes.append(CHUNK_NOTE)
        peak, io_peak = peaks(spec, batch, prompt, total, dev.granularity, session.config.prefill_chunk)

        def at_chunk(prefill_chunk: int) -> tuple:
            """This generation's peaks with its prompt fed `prefill_chunk` tokens a step."""
            return peaks(spec, batch, prompt, total, dev.granularity, prefill_chunk)
        # and, per segment boundary, a mask-sized value (as the mask a split model's
        # layers pass on; the hidden state of one position is smaller), twice: the
        # buffers of each bucket's steps are kept until the generation ends, and the
        # buckets double
        boundary = 2 * batch * 8 * (total + 1)
        self.kv_bufs = DeviceBuffers(dev, "kv",
                                     lambda nbytes, full: session._kv_shortage(nbytes, peak, io_peak, boundary,
                                                                               full, at_chunk))
        # A step buffer short of room is the same shortage, seen from the scratch zone
        # (the buffer asked for is one of those io_peak counts).
        self.io_bufs = DeviceBuffers(dev, "scratch",
                                     lambda nbytes, full: session._kv_shortage(0, peak, max(io_peak, nbytes),
                                                                               boundary, full, at_chunk))
        try:
            kv_before = dev.ledger.snapshot().zones["kv"].committed.current
            if spec.layout == "gqa":
                self.cache = SharedKV(self.kv_bufs, spec.layers, batch, spec.kv_heads, total, spec.head_size,
                                      spec.kv_dtype, dict(spec.window_caches))
                mask_len = total
            else:
                form = ExactKV if spec.layout == "exact" else BucketKV
                self.cache = form(self.kv_bufs, spec.layers, batch, spec.kv_heads, spec.head_size, spec.kv_dtype,
                                  prompt, *((max(1, chunk),) if form is BucketKV else ()))
                mask_len = None
                self._room_to_grow(peak - (dev.ledger.snapshot().zones["kv"].committed.current - kv_before), total)
            self.ids = self.io_bufs.new([batch, 1], spec.ids_dtype)
            self.pos = self.io_bufs.new([batch, 1], spec.pos_dtype) if spec.position_ids else None
            self.mask = self.io_bufs.new([batch, mask_len], spec.mask_dtype) if mask_len else None
            self.logits = None
            self.prompt_mask: Optional[np.ndarray] = None  # the prompt's padding, None for none
            self._tokens = None  # each row's tokens so far (the next one's position)
            self._logits_shape = None  # the prompt's logits' shape: [b, p, vocab], or [b, vocab] of the last
            self._bound = None  # (key, feeds, outputs) of the decode steps
            self._chunk_bufs = None  # ids, mask, positions and logits of a prompt chunk (GQA)
            self._first_bufs: Dict[tuple, FixedBuffer] = {}  # a GQA prompt's first step's, by shape
            # The zero fills are queued on the compute stream; the CPU EP runs on this thread.
            dev.compute_stream.synchronize()
        except BaseException:
            self.close()
            raise

    def _room_to_grow(self, extra: int, total: int) -> None:
        """Before the first step, that the budget holds the bucketed cache at its largest:
        its last growth holds the old bucket and the new one at once, `extra` bytes more than
        the prompt's bucket. Where the ledger cannot charge them now, a block of that size is
        taken and given back, through the shortage a growth would meet: the budget is planned
        again now, or the generation refused at the call with the advice, rather than after
        its steps ran and their tokens were lost."""
        ledger = self.session.device.ledger
        if extra <= 0 or ledger.can_charge("kv", extra):
            return
        self.kv_bufs.free_block(self.kv_bufs.block(
            extra, what=f"the KV cache at its largest ({total} positions, batch {self.batch}, while it grows)"))

    def fits(self, spec: DecoderSpec, batch: int, prompt: int, total: int) -> bool:
        """Whether a generation of these sizes runs on this one's buffers, and so replays the
        graphs captured on them: the builder layout's shared cache, of the same length (the
        steps' shapes, and so ORT's kernels, stay those of a new generation) and batch,
        its prompt chunked alike."""
        return (self.reusable() and spec == self.spec and batch == self.batch and total == self.cache.length
                and prompt_chunk(prompt, self.session.config.prefill_chunk, spec.length_thresholds) == self.chunk)

    def reusable(self) -> bool:
        """Whether the next generation may take these buffers: the shared cache, whose
        length is fixed at creation. (Only a generation whose steps all completed is
        offered: generate_tokens closes one that raised.)"""
        return not self._closed and self.spec.layout == "gqa"

    def hold(self, total: int) -> None:
        """Grows the cache to `total` positions, as decoding would grow it (the shared cache
        holds them already): what the generation's last step holds, for a probe of its
        budget (generation.advice)."""
        with self.session._step():
            while getattr(self.cache, "room", total) < total:
                self.cache.ensure(self.cache.room + 1)

    def close(self) -> None:
        """Gives every buffer back; idempotent, and whole even when Ctrl-C or an error
        arrives half way (the interrupt is raised once everything is back)."""
        s = self.session
        with s._lock, deferred_interrupts():
            if self._closed:
                return
            self._closed = True
            try:
                # The plans (and graphs) of these buffers go first: nothing may replay
                # onto memory the buffers below give back.
                if not s._closed and s._runner is not None:
                    s._runner.drop_plans(self._keys)
            finally:
                try:
                    self.io_bufs.close()
                finally:
                    self.kv_bufs.close()

    # ---------------------------------------------------------------- steps
    # Each step, cache growth included, runs under the session's lock with Ctrl-C held
    # back: allocations may make the weights give way, which the residency manager must
    # not see from two threads at once.
    def prompt(self, input_ids: np.ndarray, mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Runs the prompt (`mask`: its attention mask, None for all ones); returns the last
        position's logits [batch, vocab]."""
        with self.session._step():
            return self._prompt(input_ids, mask)

    def decode(self, tokens: np.ndarray, length: int) -> tuple:
        """One token per row at position `length - 1` (so `length` positions in all).
        Returns (logits [batch, vocab], whether the step ran under a plan made before it)."""
        with self.session._step():
            return self._decode(tokens, length)

    def _decode(self, tokens: np.ndarray, length: int) -> tuple:
        spec, s, b = self.spec, self.session, self.batch
        cur = length - 1  # the new token's position; `cur` positions are cached
        if self.logits is None:
            self.logits = self.io_bufs.new([b, 1, self._logits_shape[-1]] if len(self._logits_shape) == 3
                                           else [b, self._logits_shape[-1]], spec.logits_dtype)
        if spec.layout == "exact":
            return self._decode_exact(tokens, cur)
        mask_buf = self.mask
        # A graph that chooses by the lengths in a way not read gets the mask at the
        # sequence's length, a shape of each step's own: such steps run uncaptured.
        fixed = spec.length_thresholds is not None
        if spec.layout == "gqa":
            # The cache's whole length, one shape for every step; where the graph chooses
            # by the mask's length, a length on the side of each threshold that `length` is.
            fed = fed_length(length, self.mask.shape[1], spec.length_thresholds)
            if fed != self.mask.shape[1]:
                mask_buf = FixedBuffer.on(s.device, self.mask.ptr, [b, fed], spec.mask_dtype)
            mask = np.zeros((b, fed), np.int64)
            mask[:, :length] = 1
        else:
            self.cache.ensure(cur + 1)  # a step boundary: the only place the cache grows
            if self.mask is None or self.mask.shape[1] != self.cache.bucket + 1:
                if self.mask is not None:
                    self.io_bufs.free(self.mask)
                self.mask = self.io_bufs.new([b, self.cache.bucket + 1], spec.mask_dtype)
            mask = np.zeros((b, self.cache.bucket + 1), np.int64)
            mask[:, :cur] = 1
            if self.prompt_mask is not None:
                mask[:, :self.prompt_mask.shape[1]] = self.prompt_mask
            mask[:, -1] = 1
            mask_buf = self.mask
        writes = [(self.ids, tokens.reshape(b, 1)), (mask_buf, mask)]
        if self.pos is not None:
            writes.append((self.pos, self._tokens[:, None]))
        # One wait (on the CPU) for all of them; it also orders the last step's cache
        # copies before this step, as the stream does on CUDA.
        write(s.device, *writes)
        # The buffers' shapes and addresses change only with the bucket (a new mask and
        # cache): the key says so without reading every value, and the bindings are
        # built once per key.
        key = ("generate", self._name, self.cache.bucket if spec.layout != "gqa" else self.cache.length,
               mask_buf.shape[1])
        if self._bound is None or self._bound[0] != key:
            feeds = {"input_ids": self.ids.value, "attention_mask": mask_buf.value}
            if self.pos is not None:
                feeds["position_ids"] = self.pos.value
            outputs = {"logits": self.logits.value}
            self.cache.bind(feeds, outputs)
            self._bound = (key, feeds, outputs)
            if fixed:
                self._keys.add(key)
        _, feeds, outputs = self._bound

        def step() -> bool:
            _, replayed = s._run_bound(feeds, outputs, fixed=fixed, key=key if fixed else None)
            if not replayed and fixed and s._runner.streaming and s._runner.capture.enabled and \
                    not spec.window_caches:
                # The first step of these shapes learned the boundaries' sizes; the same step
                # again writes the same cache positions and runs under the new plan's graphs.
                # Not where a window-sized cache evicts a position each step: run twice, it
                # would evict twice. There the first run's logits stand, and the next step
                # replays.
                _, replayed = s._run_bound(feeds, outputs, fixed=True, key=key)
            return replayed
        try:
            replayed = step()
        except RuntimeError as e:
            if spec.layout != "standard" or isinstance(e, OffloadError):
                raise
            try:  # once more as it was: a failure of the moment (memory short) is not the padding's
                replayed = step()
            except RuntimeError as again:
                if isinstance(again, OffloadError):
                    raise
                return self._pad_refused(tokens, cur, e)
        self._tokens = self._tokens + 1
        if spec.layout != "gqa":
            self.cache.append(cur)  # in order on the stream; the next step's write waits for it
        # ORT waited for its work before returning, so the logits are complete.
        return last_logits(s.device, self.logits.value), replayed

    def _pad_refused(self, tokens: np.ndarray, cur: int, error: RuntimeError) -> tuple:
        """ORT failed twice on a step of the padded past (a model may size a table by the
        past's length, as GPT-2's causal mask is sliced from a fixed one): the cache is laid
        out at its exact length and the step runs again so. Should it pass, the session
        feeds this model's past at its exact length from then on (in segments, where the
        streaming engine ran it: it would capture a graph per step); should it fail too,
        ORT's first error is raised."""
        s, old = self.session, self.cache
        try:
            cache = ExactKV(self.kv_bufs, self.spec.layers, self.batch, self.spec.kv_heads, self.spec.head_size,
                            self.spec.kv_dtype, cur + 1)
        except BudgetExceeded as short:  # no room for the other layout: ORT's error stands
            raise error from short
        s._runner.drop_plans(self._keys)
        self.cache, self._bound = cache, None
        try:
            cache.take_from(old, cur)
            old.release()
            self.io_bufs.free(self.mask)
            self.mask = None
            self.spec = dataclasses.replace(self.spec, layout="exact")
            if isinstance(s._runner, StreamEngine) and s.config.engine != "graph":
                s._engines.run_in_segments(s._engines.plan)
            result = self._decode_exact(tokens, cur)
        except (RuntimeError, ValueError) as other:  # the other layout fails too: ORT's error stands
            raise error from other
        if s._decoder_spec.layout == "standard":
            s._decoder_spec = dataclasses.replace(s._decoder_spec, layout="exact")
            why = (f"generate(): ONNX Runtime failed on a past padded to {old.bucket} positions for a sequence of "
                   f"{cur + 1} ({str(error).strip().splitlines()[-1][:300]}); this model's past is fed at its exact "
                   f"length from now on, and its decode steps run uncaptured")
            s._notes.append(why)
            warnings.warn(why, OffloadWarning, stacklevel=5)
        return result

    def _decode_exact(self, tokens: np.ndarray, cur: int) -> tuple:
        """A step of the exact layout: the past of `cur` positions as it is, the mask at
        the front of a buffer with room for the cache's (all ones, and written once, when
        the prompt has no padding). Its shapes are new every step: it runs uncaptured."""
        spec, s, b = self.spec, self.session, self.batch
        self.cache.ensure(cur + 1)
        writes = [(self.ids, tokens.reshape(b, 1))]
        if self.mask is None or self.mask.shape[0] < b * (cur + 1):
            if self.mask is not None:
                self.io_bufs.free(self.mask)
                self.mask = None
            self.mask = self.io_bufs.new([b * (self.cache.capacity + 1)], spec.mask_dtype)
            if self.prompt_mask is None:
                writes.append((self.mask, np.ones(self.mask.shape, np.int64)))
        mask = FixedBuffer.on(s.device, self.mask.ptr, [b, cur + 1], spec.mask_dtype)
        if self.prompt_mask is not None:
            rows = np.ones((b, cur + 1), np.int64)
            rows[:, :self.prompt_mask.shape[1]] = self.prompt_mask
            writes.append((mask, rows))
        if self.pos is not None:  # a model with position_ids whose padded past ORT refused
            writes.append((self.pos, self._tokens[:, None]))
        write(s.device, *writes)
        feeds = {"input_ids": self.ids.value, "attention_mask": mask.value}
        if self.pos is not None:
            feeds["position_ids"] = self.pos.value
        outputs = {"logits": self.logits.value}
        self.cache.bind(feeds, outputs)
        s._run_bound(feeds, outputs, fixed=False)
        self._tokens = self._tokens + 1
        self.cache.advance()
        return last_logits(s.device, self.logits.value), False

