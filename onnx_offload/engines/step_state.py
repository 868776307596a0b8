"""A step that runs more than once the first time its graph is made, on inputs that the
model changes in place.

Window-sized KV caches (GroupQueryAttention's sliding_window_cache) are such inputs: the
op evicts the oldest position from them in place each time it runs, so running a step
twice evicts twice. The first run of a step's graph runs the model more than once:
- ORT, asked to capture a graph (``gpu_graph_id``), runs the model once more, inside the
  same Run, before it captures (InferenceSession::Run starts "another run for necessary
  memory allocation or graph capture");
- the streaming engine runs ORT twice uncaptured before it captures its own graph, then
  launches it.
So such a step keeps a copy of those inputs before its first run (``StateCopy``), puts it
back once the graph is made, and runs the graph once more: the step then has run once on
them, as plain ORT's loop without graphs runs it.
"""
from __future__ import annotations

from typing import Dict, List

import onnxruntime as ort

from .ortvalues import FixedBuffer, copy_into, nbytes_of, numpy_dtype


class StateCopy:
    """A copy, in the device's scratch zone, of the values of `feeds` named in `names`
    (inputs the model changes in place); `restore()` writes them back, `free()` gives the
    copy back (also on failure: use it as a context manager)."""

    def __init__(self, device, feeds: Dict[str, ort.OrtValue], names):
        self.device = device
        self._saved: List[tuple] = []  # (the input's own buffer, its copy)
        try:
            for name in sorted(set(names) & set(feeds)):
                v = feeds[name]
                dtype = numpy_dtype(v.data_type())
                own = FixedBuffer(v.data_ptr(), v.shape(), dtype, v)
                copy = FixedBuffer.on(device, device.scratch.allocate(max(1, nbytes_of(v.shape(), dtype))),
                                      v.shape(), dtype)
                self._saved.append((own, copy))
                copy_into(device, copy, v)
        except BaseException:
            self.free()
            raise

    def __bool__(self) -> bool:
        return bool(self._saved)

    def restore(self) -> None:
        for own, copy in self._saved:
            copy_into(self.device, own, copy.value)

    def free(self) -> None:
        if not self._saved:
            return
        self.device.compute_stream.synchronize()  # no copy may still read or write them
        for _, copy in self._saved:
            self.device.scratch.deallocate(copy.ptr)
        self._saved = []

    def __enter__(self) -> "StateCopy":
        return self

    def __exit__(self, *exc) -> None:
        self.free()


def run_once_on_state(device, session, io, options, feeds: Dict[str, ort.OrtValue], state) -> None:
    """The first run of a segment under its plan's graph, which ORT runs twice to capture
    it: the inputs of `feeds` named in `state` (those the model changes in place) are
    copied first and put back, and the graph replays once; without such inputs, the run."""
    with StateCopy(device, feeds, state) as saved:
        if not saved:
            session.run_with_iobinding(io, options)
            return
        try:
            session.run_with_iobinding(io, options)
        finally:  # also for a step run again after a failure
            saved.restore()
        session.run_with_iobinding(io, options)  # a replay: the step once on its inputs
