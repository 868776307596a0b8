"""generate() across stages.

Each stage keeps the KV cache of its own layers on its own device, in that device's
``kv`` zone. A step runs the stages in order, each with its past and present bound where
they lie; the values one stage passes to the next move between the devices
(``moves.py``). A prompt longer than ``prefill_chunk`` runs in chunks, as one session
feeds it (``generation.prompt``).

- The builder's layout (GroupQueryAttention) keeps each layer's past and present in one
  buffer of the whole length (generation.SharedKV). From the second decode step on,
  every value a stage reads or writes lies in a buffer of its own device at a fixed
  address: ids, mask and positions are written there, the values from the stage before
  are copied there, and the stage's outputs are bound there. Each stage's step is then
  the same every time, and the streaming engine replays the graph it captured of it.
- Standard attention keeps each layer's past at its exact length, the present written by
  ORT beside it (generation.ExactKV). Its shapes grow every step: the steps run
  uncaptured.

A stage that reads another stage's past only for its shape (a standard-attention export
whose layers take the past's length from the first layer's) is fed a past of its own,
which has that shape: every layer's past has one shape. A stage that reads another's
past for its values gets a copy moved to its device.
"""
from __future__ import annotations

import contextlib
import itertools
import re
from typing import Dict, List, Optional

import numpy as np
import onnxruntime as ort

from ..engines import FixedBuffer, numpy_dtype
from ..errors import OffloadError
from ..generation import DeviceBuffers, ExactKV, SharedKV, last_logits, peak_bytes, prompt_chunk, prompt_pieces, write
from ..interrupts import deferred_interrupts
from ..loading import DecoderSpec
from .moves import StepMoves

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")
_SHAPE_ONLY = ("Shape", "Size")
_GENERATIONS = itertools.count()  # names each generation's kept step plans


@contextlib.contextmanager
def on_device(device: int, stage: int, stages: int):
    """An OffloadError raised inside names the device and stage it came from."""
    try:
        yield
    except OffloadError as e:
        if e.args and isinstance(e.args[0], str):
            # A budget keyword's advice is this device's value, in a list of one per device.
            said = re.sub(r"\b(vram_limit|weight_bytes|kv_bytes|scratch_bytes)=(\w+)",
                          rf"\1=\2 for device {device} (its entry in a list of one value per device)", e.args[0])
            e.args = (f"device {device} (stage {stage + 1} of {stages}): {said}",) + e.args[1:]
        raise


class _Fixed:
    """One stage's decode step at fixed addresses: its buffers by name."""

    def __init__(self):
        self.host: Dict[str, FixedBuffer] = {}  # ids, mask, positions
        self.inputs: Dict[str, FixedBuffer] = {}  # the values of the stages before
        self.outputs: Dict[str, FixedBuffer] = {}  # its values for the stages after, and the logits


class StagedGeneration:
    """One generation over a StagedSession: each stage's cache, and the mask."""

    def __init__(self, session, spec: DecoderSpec, batch: int, prompt: int, total: int):
        self.session, self.spec, self.batch = session, spec, batch
        self.shared = spec.layout == "gqa"
        self.mask: Optional[np.ndarray] = None
        self.length = 0  # positions cached
        self.owner: Dict[int, int] = {}  # layer -> the stage that holds its cache
        self.caches: list = []
        self._kv: List[DeviceBuffers] = []
        self._io: List[DeviceBuffers] = []
        self._fixed: List[Optional[_Fixed]] = []
        self._peaks: List[int] = []  # the most bytes each stage's cache holds
        self._name = next(_GENERATIONS)
        try:
            for s, (stage, seg) in enumerate(zip(session.stages, session._model.segments)):
                layers = sorted({int(m.group(1)) for n in seg.outputs if (m := _PRESENT.match(n))})
                self.owner.update((i, s) for i in layers)
                # A buffer short of room asks the stage's session, which may plan its budget
                # again so that its weights stream (as one session's generation does).
                windows = {i: w for i, w in spec.window_caches if i in layers}
                peak = peak_bytes("gqa" if self.shared else "exact", len(layers), batch, spec.kv_heads,
                                  spec.head_size, spec.kv_dtype, prompt, total, stage.device.granularity,
                                  windows=list(windows.values()))
                self._peaks.append(peak)
                self._kv.append(DeviceBuffers(stage.device, "kv", shortage(stage, peak, 0)))
                self._io.append(DeviceBuffers(stage.device, "scratch", shortage(stage, peak, 1)))
                self._fixed.append(None)
                args = (batch, spec.kv_heads, total, spec.head_size, spec.kv_dtype, windows) if self.shared else \
                    (batch, spec.kv_heads, spec.head_size, spec.kv_dtype, prompt)
                form = SharedKV if self.shared else ExactKV
                with stage._step(), on_device(session.devices[s], s, len(session.stages)):
                    self.caches.append(form(self._kv[-1], layers, *args) if layers else None)
                    # The shared layout's zero fills are queued on the compute stream; the CPU
                    # EP runs on this thread.
                    stage.device.compute_stream.synchronize()
        except BaseException:
            self.close()
            raise
        self._shape_only = [self._reads_shape_only(s, seg) for s, seg in enumerate(session._model.segments)]

    def _reads_shape_only(self, s: int, seg) -> bool:
        """Whether stage `s` reads the pasts of other stages' layers for their shape alone
        (true where it reads none)."""
        foreign = {n for n in seg.inputs if (m := _PAST.match(n)) and self.owner.get(int(m.group(1))) != s}
        return all(node.op_type in _SHAPE_ONLY for node in seg.model.graph.node if foreign & set(node.input))

    def prompt(self, ids: np.ndarray, mask: Optional[np.ndarray]) -> np.ndarray:
        """The prompt, in chunks of at most the stages' prefill_chunk tokens when it is
        longer (each appending to the caches, as one session's generation feeds it):
        the last position's logits [batch, vocab], float32."""
        b, p = ids.shape
        self.mask = full = np.ones((b, p), np.int64) if mask is None else mask
        pos = np.where(full == 1, np.cumsum(full, axis=1) - 1, 1)
        chunk = prompt_chunk(p, self.session.stages[0].config.prefill_chunk)
        pieces = prompt_pieces(p, chunk)
        with self.session._step():  # one step of the pipeline at a time
            if not self.shared:
                for start, n in pieces:
                    logits = self._step(self._host(ids[:, start:start + n], full[:, :start + n],
                                                   pos[:, start:start + n]), n, first=start == 0)
            else:
                # GroupQueryAttention takes a chunk beside a past one row at a time: a batch's
                # rows run in turn, through views of their rows of the shared caches. The
                # first chunk's mask is as long as it; the others' the caches' whole length,
                # ones up to their end, as a decode step's.
                rows = [(r, slice(r, r + 1)) for r in range(b)] if chunk and b > 1 else [(None, slice(0, b))]
                out = []
                for row, take in rows:
                    for start, n in pieces:
                        m = np.ones((take.stop - take.start, n), np.int64)
                        if start:
                            m = np.zeros((take.stop - take.start, self._shared_length()), np.int64)
                            m[:, :start + n] = 1
                        logits = self._step(self._host(ids[take, start:start + n], m, pos[take, start:start + n]), n,
                                            first=start == 0, row=row)
                    out.append(logits)
                logits = np.concatenate(out, axis=0)
        self.length = p
        return logits

    def decode(self, tokens: np.ndarray, position: int):
        """A decode step of one token per row; (logits, None) as Generation.decode gives."""
        self.mask = np.concatenate([self.mask, np.ones((self.batch, 1), np.int64)], axis=1)
        positions = self.mask.sum(axis=1, keepdims=True) - 1
        mask = self.mask
        if self.shared:  # the whole length, ones where a position is cached or new
            mask = np.zeros((self.batch, self._shared_length()), np.int64)
            mask[:, :self.length + 1] = 1
        with self.session._step():
            logits = self._step(self._host(tokens[:, None], mask, positions), 1, first=False, decode=True)
        self.length += 1
        return logits, None

    def _host(self, ids, mask, positions) -> Dict[str, np.ndarray]:
        """A step's ids, mask and positions, in the types the model declares."""
        spec = self.spec
        host = {"input_ids": np.ascontiguousarray(ids, spec.ids_dtype),
                "attention_mask": np.ascontiguousarray(mask, spec.mask_dtype)}
        if spec.position_ids:
            host["position_ids"] = np.ascontiguousarray(positions, spec.pos_dtype)
        return host

    def _step(self, host: Dict[str, np.ndarray], new: int, first: bool, row: Optional[int] = None,
              decode: bool = False) -> np.ndarray:
        """One step of `new` positions through every stage: the last position's logits.
        `first`: the prompt's first (its cache starts empty); `row`: the one row of the
        shared caches it runs on (None: every row); `decode`: a decode step."""
        session = self.session
        passed: Dict[str, tuple] = {}  # a value one stage made for later ones: (value, stage)
        logits = None
        for s, (stage, seg) in enumerate(zip(session.stages, session._model.segments)):
            moves = StepMoves(stage.device, shortage(stage, self._peaks[s], 1))
            try:
                with stage._step(), on_device(session.devices[s], s, len(session.stages)):
                    values = self._stage(s, stage, seg, host, passed, moves, new, first, row, decode)
            finally:
                moves.close()
                session.moved_bytes += moves.bytes
            for n in seg.outputs:
                if n in values and not _PRESENT.match(n):
                    passed[n] = (values[n], s)
            if "logits" in seg.outputs:
                logits = values["logits"]
        return last_logits(session.stages[-1].device, logits)

    def _shared_length(self) -> int:
        """The positions the shared layout's buffers hold (the generation's whole length)."""
        return next(c.length for c in self.caches if c is not None)

    def _stage(self, s: int, stage, seg, host, passed, moves: StepMoves, new: int, first: bool,
               row: Optional[int], decode: bool) -> dict:
        """Stage `s`'s part of a step, under the stage's lock: its values by name."""
        cache, fixed = self.caches[s], self._fixed[s] if decode else None
        feeds: Dict[str, ort.OrtValue] = {}
        outputs: Dict[str, ort.OrtValue] = {}
        if cache is not None:
            if self.shared:
                cache.bind(feeds, outputs, row=row)
            elif not first:
                cache.ensure(cache.length + new)
                cache.bind(feeds, outputs, new)
        writes = []
        for n in seg.inputs:
            if n in feeds:
                continue
            if n in host:
                if fixed is not None:
                    writes.append((fixed.host[n], host[n]))
                    feeds[n] = fixed.host[n].value
                else:
                    feeds[n] = ort.OrtValue.ortvalue_from_numpy(host[n])
            elif n in passed:
                value, origin = passed[n]
                source = self.session.stages[origin].device
                if fixed is not None:
                    moves.move_into(source, value, fixed.inputs[n])
                    feeds[n] = fixed.inputs[n].value
                else:
                    feeds[n] = value if origin == s else moves.move(source, value)
            elif _PAST.match(n):
                feeds[n] = self._foreign_past(s, n, first, moves, feeds)
        if fixed is not None:
            write(stage.device, *writes)
            outputs.update((n, b.value) for n, b in fixed.outputs.items())
        if fixed is not None:
            key = ("staged", self._name, s)
            values, replayed = stage._run_bound(feeds, outputs, fixed=True, key=key)
            runner = stage._runner
            if not replayed and runner.streaming and runner.capture.enabled:
                # The first step of these buffers learned the boundaries' sizes; the same
                # step again writes the same cache position and runs under the new graphs.
                values, _ = stage._run_bound(feeds, outputs, fixed=True, key=key)
        else:
            values, _ = stage._run_bound(feeds, outputs, fixed=False)
        values = {**values, **outputs}  # a bound output's value is where it was bound
        if cache is not None and not self.shared:
            if first:
                cache.fill_from([values[f"present.{i}.{kv}"] for i in cache.ids for kv in ("key", "value")], new)
            else:
                cache.advance(new)
        if self.shared and decode and fixed is None:
            self._fix(s, stage, seg, feeds, values, host)
        return values

    def _fix(self, s: int, stage, seg, feeds, values, host) -> None:
        """After stage `s`'s first decode step: buffers of its own device for what its next
        steps read and write, in the shapes this one had."""
        if not self._shape_only[s]:
            return  # it reads another stage's past, moved into a new buffer every step
        io, fixed = self._io[s], _Fixed()
        for n in seg.inputs:
            if n in host:
                fixed.host[n] = io.new(list(host[n].shape), host[n].dtype, what=f"the decode step's {n}")
            elif n in feeds and not _PAST.match(n):
                v = feeds[n]
                fixed.inputs[n] = io.new(list(v.shape()), numpy_dtype(v.data_type()), what=f"the decode step's {n}")
        for n in seg.outputs:
            if n in values and not _PRESENT.match(n):
                v = values[n]
                fixed.outputs[n] = io.new(list(v.shape()), numpy_dtype(v.data_type()), what=f"the decode step's {n}")
        self._fixed[s] = fixed

    def _foreign_past(self, s: int, name: str, first: bool, moves: StepMoves, feeds) -> ort.OrtValue:
        """What stage `s` reads of another stage's past `name`: nothing yet (the prompt),
        its own past of the same shape (read for the shape alone), or a copy."""
        spec = self.spec
        if first and not self.shared:
            return ort.OrtValue.ortvalue_from_numpy(
                np.zeros((self.batch, spec.kv_heads, 0, spec.head_size), spec.kv_dtype))
        own = next((v for k, v in feeds.items() if _PAST.match(k)), None)
        if self._shape_only[s] and own is not None:
            return own
        m = _PAST.match(name)
        layer, owner = int(m.group(1)), self.owner[int(m.group(1))]
        cache = self.caches[owner]
        return moves.move(self.session.stages[owner].device, cache.past_of(layer, m.group(2)))

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches if c is not None)

    def hold(self, total: int) -> None:
        """Grows each stage's cache to `total` positions, as decoding would grow it (a cache of
        fixed length holds them already): what the generation's last step holds, for a
        probe of its budget."""
        stages, spec = self.session.stages, self.spec
        for s, (stage, cache, seg) in enumerate(zip(stages, self.caches, self.session._model.segments)):
            with stage._step(), on_device(self.session.devices[s], s, len(stages)):
                while cache is not None and getattr(cache, "room", total) < total:
                    cache.ensure(cache.room + 1)
                # The pasts of other stages' layers it reads, moved into its scratch each
                # step (_foreign_past) where it has no past of its own to stand in: the
                # last step's, as long as the cache.
                foreign = [n for n in seg.inputs if (m := _PAST.match(n)) and self.owner.get(int(m.group(1))) != s]
                if not foreign or (self._shape_only[s] and cache is not None):
                    continue
                moved = DeviceBuffers(stage.device, "scratch", shortage(stage, self._peaks[s], 1))
                try:
                    for _ in foreign:
                        moved.new([self.batch, spec.kv_heads, total, spec.head_size], spec.kv_dtype,
                                  what="a value moved from another device")
                finally:
                    moved.close()

    def close(self) -> None:
        """Forgets the stages' plans of this generation's buffers, then gives every
        stage's buffers back (idempotent). Under the session's lock and each stage's, with
        Ctrl-C held back until every stage is done: a stage closing meanwhile from another
        thread waits, and one already closed gave everything back itself."""
        s = self.session
        with s._lock, deferred_interrupts():
            failed = None
            try:
                for i, stage in enumerate(s.stages):
                    try:
                        with stage._lock:
                            try:
                                if not (stage._closed or stage._closing) and stage._runner is not None:
                                    stage._runner.drop_plans([("staged", self._name, i)])
                            finally:
                                for bufs in self._io[i:i + 1] + self._kv[i:i + 1]:
                                    bufs.close()
                    except BaseException as e:  # an interrupt too: the other stages still give theirs back
                        failed = failed or e
            finally:
                self._io, self._kv, self.caches, self._fixed = [], [], [], []
            if failed is not None:
                raise failed

def shortage(stage, kv_peak: int, io: int):
    """The shortage callback of a stage's buffers (generation.buffers.DeviceBuffers): of the KV cache
    (`io` 0), which holds at most `kv_peak` bytes, or of the step buffers (`io` 1)."""
    return lambda nbytes, full: stage._kv_shortage(0 if io else nbytes, kv_peak, nbytes if io else 0, 0, full)
