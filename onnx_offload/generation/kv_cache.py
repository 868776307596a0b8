"""The KV cache of a decode loop, on the device, in the ``kv`` zone of the one budget.

Three forms, one per export layout:

- ``SharedKV`` (GroupQueryAttention, onnxruntime-genai's builder): one buffer per layer
  and per K/V, of the whole length the generation may reach, bound as both the past
  input and the present output. ORT writes each new position in place, so every decode
  step has the same shapes and addresses.
- ``BucketKV`` (standard attention, Optimum / ``torch.onnx``): the past is a bucket of
  B positions (a power of two) and the present, which ORT writes, has B + 1. Each step
  the new position (the last of the present) is copied on the device into the past at
  the current length; positions in between are zero and masked out by the attention
  mask. When the bucket fills, a bucket of twice the length takes its place, by a
  device copy. Shapes repeat for every step inside a bucket. For models that take
  position_ids: the padding is masked out, but the past's length is the bucket's.
- ``ExactKV`` (standard attention without position_ids): the past at its exact length,
  since such a model may count positions from it; shapes change every step.

Bytes come from the ``kv`` zone, which outranks the weights zone: when the budget is
short the ledger asks the weights to give way (evicting unpinned weights between
steps). Weights pinned for the session's life cannot; ``DeviceBuffers`` then asks the
session (its `shortage` callback), which plans the budget again so that they stream.
A real shortage raises ``BudgetExceeded`` before the step, naming the zones and the
smallest budget that holds the weights and the cache (``peak_bytes``).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import onnxruntime as ort

from .. import _core
from .._core import round_up
from ..engines import FixedBuffer, nbytes_of
from .buffers import DeviceBuffers

_ALIGNMENT = _core.DEFAULT_ALIGNMENT  # of each buffer in a growing cache's block, as the scratch allocator aligns


class SharedKV:
    def __init__(self, bufs: DeviceBuffers, layers: Union[int, Sequence[int]], batch: int, kv_heads: int,
                 length: int, head_size: int, dtype, windows: Optional[Dict[int, int]] = None):
        """`windows`: layer -> positions, for the layers whose attention keeps a window-sized
        cache (DecoderSpec.window_caches); every other layer's holds `length`."""
        self.length = length
        self._device = bufs.device
        # The layers held: all of the model's, or those of one stage of a split across devices.
        self.ids = list(range(layers)) if isinstance(layers, int) else list(layers)
        windows = windows or {}
        shapes = [[batch, kv_heads, windows.get(i, length), head_size] for i in self.ids]
        self.k, self.v = ([bufs.new(sh, dtype, zero=True, what=f"the KV cache (layer {i} {kv})")
                           for i, sh in zip(self.ids, shapes)] for kv in ("key", "value"))

    @property
    def nbytes(self) -> int:
        return sum(nbytes_of(b.shape, b.dtype) for b in self.k + self.v)

    def past_of(self, layer: int, kv: str) -> ort.OrtValue:
        """Layer `layer`'s key or value buffer ('key', 'value'), of the whole length (or window)."""
        k = self.ids.index(layer)
        return (self.k if kv == "key" else self.v)[k].value

    def bind(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue],
             row: Optional[int] = None) -> None:
        """Every row's buffers, or row `row`'s alone: a [1, heads, length, head_size] view."""
        for i, k, v in zip(self.ids, self.k, self.v):
            for name, buf in (("key", k), ("value", v)):
                if row is not None:
                    shape = [1] + list(buf.shape[1:])
                    buf = FixedBuffer.on(self._device, buf.ptr + row * nbytes_of(shape, buf.dtype), shape, buf.dtype)
                feeds[f"past_key_values.{i}.{name}"] = outputs[f"present.{i}.{name}"] = buf.value


class _GrowingKV:
    """The standard layout's caches: per layer and K/V, a past buffer and a present buffer
    with room for `room` positions, replaced by buffers of twice the room as the cache
    grows (the old ones given back once the past is copied over)."""

    def __init__(self, bufs: DeviceBuffers, layers: Union[int, Sequence[int]], batch: int, kv_heads: int,
                 head_size: int, dtype, length: int, extra: int = 1):
        self._bufs = bufs
        self.extra = extra  # positions the present holds beyond the past's room (a prompt chunk's)
        # The layers held: all of the model's, or those of one stage of a split across devices.
        self.ids = list(range(layers)) if isinstance(layers, int) else list(layers)
        self.layers, self.batch, self.kv_heads, self.head_size = len(self.ids), batch, kv_heads, head_size
        self.dtype = np.dtype(dtype)
        self.room = 0
        self.past: List[FixedBuffer] = []
        self.present: List[FixedBuffer] = []
        self._block: Optional[int] = None
        self._allocate(bucket_for(length))

    @property
    def nbytes(self) -> int:
        return sum(nbytes_of(b.shape, b.dtype) for b in self.past + self.present)

    def _row(self) -> int:
        return self.head_size * self.dtype.itemsize

    def _shapes(self, room: int):
        """(the past's shape, the present's, whether the past starts zeroed) for `room`."""
        raise NotImplementedError

    def _allocate(self, room: int):
        """New past and present buffers for `room` positions, one after another in one
        block (what kv_cache.peak_bytes counts); returns the old ones and their block."""
        past_shape, present_shape, zero = self._shapes(room)
        sizes = [round_up(nbytes_of(sh, self.dtype), _ALIGNMENT) for sh in (past_shape, present_shape)]
        dev = self._bufs.device
        block = self._bufs.block(self.layers * 2 * sum(sizes), what=f"the KV cache ({room} positions)")
        past, present, at = [], [], block
        for _ in range(2 * self.layers):
            past.append(FixedBuffer.on(dev, at, past_shape, self.dtype))
            present.append(FixedBuffer.on(dev, at + sizes[0], present_shape, self.dtype))
            if zero:
                dev.backend.fill(at, 0, nbytes_of(past_shape, self.dtype), dev.compute_stream)
            at += sum(sizes)
        old = (self.past, self.present, self._block)
        self.past, self.present, self.room, self._block = past, present, room, block
        return old

    def _grow(self, length: int, copy) -> None:
        """Room for `length` positions: `copy(new, old, old_room)` moves each past over."""
        if length <= self.room:
            return
        old_room = self.room
        old_past, _, old_block = self._allocate(bucket_for(length))
        for buf, prev in zip(self.past, old_past):
            copy(buf, prev, old_room)
        self._bufs.free_block(old_block)  # once the copies have run

    def release(self) -> None:
        """Gives the buffers back (the generation goes on with another cache)."""
        if self._block is not None:
            self._bufs.free_block(self._block)  # once no copy reads them
        self.past, self.present, self._block = [], [], None


class BucketKV(_GrowingKV):
    @property
    def bucket(self) -> int:
        return self.room

    def _shapes(self, room: int):
        b, h, d = self.batch, self.kv_heads, self.head_size
        return [b, h, room, d], [b, h, room + max(1, self.extra), d], True

    def fill_from(self, presents: Sequence[ort.OrtValue], length: int) -> None:
        """The prompt's presents ([b, h, length, d] each) into the past."""
        dev = self._bufs.device
        for buf, value in zip(self.past, presents):
            rows = self.batch * self.kv_heads
            src_pitch = int(value.shape()[2]) * self._row()
            dev.backend.copy_d2d_2d(buf.ptr, self.bucket * self._row(), value.data_ptr(), src_pitch,
                                    length * self._row(), rows, dev.compute_stream)
        dev.compute_stream.synchronize()  # the presents are ORT's, freed when the caller drops them

    def append(self, position: int, new: int = 1) -> None:
        """The step's `new` positions (the present's last) into the past from `position`."""
        dev, row = self._bufs.device, self._row()
        for past, present in zip(self.past, self.present):
            dev.backend.copy_d2d_2d(past.ptr + position * row, self.bucket * row,
                                    present.ptr + self.bucket * row, (self.bucket + new) * row,
                                    new * row, self.batch * self.kv_heads, dev.compute_stream)

    def ensure(self, length: int) -> None:
        """Room for `length` cached positions: a larger bucket, copied on the device."""
        dev, row = self._bufs.device, self._row()
        self._grow(length, lambda buf, prev, old: dev.backend.copy_d2d_2d(
            buf.ptr, self.bucket * row, prev.ptr, old * row, old * row, self.batch * self.kv_heads,
            dev.compute_stream))

    def bind(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue], new: int = 1) -> None:
        """The past, and the present of a step of `new` positions at the front of its buffer."""
        dev = self._bufs.device
        shape = [self.batch, self.kv_heads, self.bucket + new, self.head_size]
        for k, i in enumerate(self.ids):
            feeds[f"past_key_values.{i}.key"] = self.past[2 * k].value
            feeds[f"past_key_values.{i}.value"] = self.past[2 * k + 1].value
            for j, kv in enumerate(("key", "value")):
                present = self.present[2 * k + j]
                outputs[f"present.{i}.{kv}"] = present.value if new == 1 and self.extra <= 1 else \
                    FixedBuffer.on(dev, present.ptr, shape, self.dtype).value


class ExactKV(_GrowingKV):
    """Standard attention fed its past at its exact length, for a model that takes no
    position_ids and so may derive positions from the past's length (as a ``torch.onnx``
    export of a Llama or GPT-2 does): a bucket's padding would shift them. Each layer's K
    and V have two buffers with room for `capacity` positions: the step reads the past,
    [batch, heads, length, head_size], from the front of one, and ORT writes the present,
    one position longer, at the front of the other, which is the next step's past.
    Nothing is copied per step (the model's Concat writes the present), but the shapes
    change every step, so these steps run uncaptured. When the room runs out, buffers of
    twice the room take its place, the past copied on the device."""

    def __init__(self, *args):
        self.length = 0  # positions in the past
        super().__init__(*args)

    @property
    def capacity(self) -> int:
        return self.room

    def _positions(self, n: int) -> int:
        return self.batch * self.kv_heads * n * self.head_size

    def _shapes(self, room: int):
        return [self._positions(room)], [self._positions(room)], False

    def _view(self, buf: FixedBuffer, positions: int) -> ort.OrtValue:
        shape = [self.batch, self.kv_heads, positions, self.head_size]
        return FixedBuffer.on(self._bufs.device, buf.ptr, shape, self.dtype).value

    def fill_from(self, presents: Sequence[ort.OrtValue], length: int) -> None:
        """The prompt's presents ([b, h, length, d] each) into the past."""
        dev = self._bufs.device
        for buf, value in zip(self.past, presents):
            dev.backend.copy_d2d(buf.ptr, value.data_ptr(), self._positions(length) * self.dtype.itemsize,
                                 dev.compute_stream)
        dev.compute_stream.synchronize()  # the presents are ORT's, freed when the caller drops them
        self.length = length

    def take_from(self, bucket: BucketKV, length: int) -> None:
        """The first `length` positions of a bucketed past, one strided copy per buffer."""
        dev, row = self._bufs.device, self._row()
        for buf, prev in zip(self.past, bucket.past):
            dev.backend.copy_d2d_2d(buf.ptr, length * row, prev.ptr, bucket.bucket * row, length * row,
                                    self.batch * self.kv_heads, dev.compute_stream)
        dev.compute_stream.synchronize()
        self.length = length

    def ensure(self, length: int) -> None:
        """Room for `length` positions in the present."""
        dev, nbytes = self._bufs.device, self._positions(self.length) * self.dtype.itemsize
        self._grow(length, lambda buf, prev, old: dev.backend.copy_d2d(buf.ptr, prev.ptr, nbytes,
                                                                       dev.compute_stream))

    def past_of(self, layer: int, kv: str) -> ort.OrtValue:
        """Layer `layer`'s past key or value ('key', 'value') at its length."""
        k = self.ids.index(layer)
        return self._view(self.past[2 * k + ("key", "value").index(kv)], self.length)

    def bind(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue], new: int = 1) -> None:
        for k, i in enumerate(self.ids):
            for j, kv in enumerate(("key", "value")):
                feeds[f"past_key_values.{i}.{kv}"] = self._view(self.past[2 * k + j], self.length)
                outputs[f"present.{i}.{kv}"] = self._view(self.present[2 * k + j], self.length + new)

    def advance(self, new: int = 1) -> None:
        """After a step of `new` positions: its present is the next step's past."""
        self.past, self.present = self.present, self.past
        self.length += new


def peak_bytes(layout: str, layers: int, batch: int, kv_heads: int, head_size: int, dtype, prompt: int,
               total: int, granularity: int, alignment: int = _ALIGNMENT, chunk: int = 1, windows: Sequence[int] = ()) -> int:
    """The most committed bytes the cache of one generation holds at once: the whole
    length for the shared layout (a window's positions for the layers of `windows`, one
    entry each, which are among `layers`); for buckets, the last growth, when the old
    bucket and the new one are both held (past and present of each; for the exact layout,
    its two buffers of each). The buffers of one allocation lie one after another: the
    shared layout's count a granule more, for the partly used granules at their ends;
    a growing cache's lie in a block of whole granules of its own (_GrowingKV._allocate)."""
    row = batch * kv_heads * head_size * np.dtype(dtype).itemsize

    def group(*positions, count=layers):
        return 2 * count * sum(round_up(row * n, alignment) for n in positions)

    def held(nbytes):
        return round_up(nbytes, granularity)

    if layout == "gqa":
        return held(group(total, count=layers - len(windows)) + sum(group(w, count=1) for w in windows)) + granularity
    last, first = bucket_for(total), bucket_for(prompt)
    # A bucket's present holds a step's positions more than its past: one, or a prompt chunk's.
    extra = 0 if layout == "exact" else max(1, chunk)
    if last == first:
        return held(group(last, last + extra))
    return held(group(last // 2, last // 2 + extra)) + held(group(last, last + extra))


def bucket_for(length: int, smallest: int = 16) -> int:
    """The bucket (a power of two, at least `smallest`) that holds `length` positions."""
    b = smallest
    while b < length:
        b *= 2
    return b
