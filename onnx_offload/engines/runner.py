"""The segment runner: one ORT session per segment, fixed boundary buffers, and the
run loop that pages each segment's weights in before it runs.

A step runs the segments in order. Before segment k runs, the residency manager makes
its weights resident (``acquire``); on CUDA the segment waits for the page-in with a
stream wait on its event, since ORT runs it on the same compute stream; afterwards an
event on that stream marks the end of its reads (``release``), and nothing it read is
unmapped before that event.

Boundary tensors live in fixed buffers, one set per input-shape signature (a
``Plan``, see ``segment_plans``): the first step of a signature passes ORT's own
outputs along and sizes the buffers from them; later steps bind the same addresses,
which is what a captured segment replays. Under capture each segment is captured once
per signature, under the plan's ``gpu_graph_id``.

``run_bound`` is the step of a decode loop: the caller's values (token and mask
buffers, the KV cache, the logits) stay where they are, at addresses that do not change
from step to step, and are bound directly; only the boundaries between segments use the
plan's buffers. Its signature includes those addresses, so a replay never reads a
buffer the caller has let go.
"""
from __future__ import annotations

import copy
import os
from typing import Dict, List, Optional, Tuple

import numpy as np
import onnxruntime as ort

from ..errors import ModelRunError, OffloadError, StateError
from ..loading import save_model
from ..loading import Segment
from ..memory import Counters
from .base import Engine
from .graph_capture import GraphCaptureDecision
from .host_segments import HostSteps
from .ortvalues import as_ortvalue, copy_into, ortvalue_at, signature
from .routing import Router
from .segment_plans import Binder, Plan, Plans, graph_run_options
from .step_state import run_once_on_state

# ORT takes its memory (arena growth, workspaces, capture) on the first steps: the
# meter measures these and trusts the figure after them.
MEASURED_RUNS = 3


class _SegmentRun:
    def __init__(self, seg: Segment, session: ort.InferenceSession, captured: bool, host_inputs=()):
        self.seg = seg
        self.session = session
        self.captured = captured  # created with enable_cuda_graph
        # Inputs ORT copies to host memory when they are bound (SessionFactory.host_inputs):
        # a binding kept for later steps binds these again before each run.
        self.host_inputs = tuple(host_inputs)


class SegmentRunner(Engine):
    """Runs a model as one ORT session per segment, paging each segment's weights in
    before it runs (see the module's docstring); the engine of resident weights too."""

    def __init__(self, device, residency, factory, meter, segments: List[Segment], workdir: str,
                 graph_outputs: List[str], *, streaming: bool, stable: bool, capture: GraphCaptureDecision,
                 device_id: int, constants: Optional[Dict[str, np.ndarray]] = None, routing=None,
                 state=frozenset(), host: Optional[HostSteps] = None, host_note: str = ""):
        self.device = device
        self.residency = residency
        self._factory = factory
        self._meter = meter
        self._workdir = workdir
        self._graph_outputs = graph_outputs
        self._constants = constants or {}  # graph outputs that are small initializers
        self._state = frozenset(state)  # inputs the model changes in place (step_state.py)
        self.host = host  # the host's MatMuls between segments (host_segments.py), or None
        self.host_note = host_note  # what host compute does, or why it is off
        self.streaming = streaming
        self._stable = stable
        self.capture = capture
        self._device_id = device_id
        self.runs: List[_SegmentRun] = []
        self._router = Router(routing if streaming else None, segments, residency)
        self._initializer_values: List[ort.OrtValue] = []
        self._plans = Plans(device)
        self._binder = Binder(device, residency, device_id, stable)
        self.steps = 0
        self.graph_steps = 0  # steps run under a plan's gpu_graph_id: captured once, then replayed
        self.last_step = Counters()  # the counters of the last step
        self.notes: List[str] = list(self._router.notes)
        for seg in segments:
            self.runs.append(self._create(seg))
        self._produced = {o for r in self.runs for o in r.seg.outputs}  # every segment output
        if self.capture.enabled and self.streaming:
            n = sum(r.captured for r in self.runs)
            self.capture = GraphCaptureDecision(
                n > 0, f"{self.capture.reason}; per segment: {n} of {len(self.runs)} captured, once per "
                       f"input-shape signature, and replayed while their weights page behind fixed addresses",
                self.capture.decode_only)

    @property
    def plain(self) -> bool:
        """Unsplit, uncaptured, with the weights as initializers: one plain ORT session runs
        the model as given. (Without stable addresses the weights are inputs, bound where
        their slots are.)"""
        return not self.streaming and not self.capture.enabled and self._stable

    # ------------------------------------------------------------------ construction
    def _create(self, seg: Segment) -> _SegmentRun:
        res = self.residency
        path = save_model(seg.model, os.path.join(self._workdir, f"segment{seg.index}.onnx"))
        # int4 weights that stay resident are prepacked, as plain ORT does (see
        # SessionFactory.session_options); every other weight is read from its slot.
        so = self._factory.session_options(
            prepack=not self.streaming and any(n.op_type == "MatMulNBits" for n in seg.model.graph.node))
        acquired = False
        try:
            if self._stable:
                if self.streaming:
                    ready = res.acquire(seg.index)
                    acquired = True
                    if ready is not None:
                        ready.synchronize()
                for name in seg.weights:
                    info = res.info[name]
                    value = ortvalue_at(res.address(name), info.shape, info.dtype, self.device.is_cuda,
                                        self._device_id)
                    so.add_initializer(name, value)
                    self._initializer_values.append(value)
            mark = self._meter.mark()
            session, captured, why = self._factory.create(path, so, self.capture.enabled)
        finally:
            if acquired:
                res.release(seg.index, None)
        if why:
            if self.streaming:
                self.notes.append(f"segment {seg.index} runs without capture: {why}")
            else:
                self.capture = GraphCaptureDecision(False, why)
        # What ORT committed while creating the session: its own initializers (small
        # constants, any copy it makes) and its workspaces.
        self._meter.charge_since(mark, creating=True)
        return _SegmentRun(seg, session, captured, self._factory.host_inputs(session))

    @property
    def single(self) -> ort.InferenceSession:
        """The one ORT session of a model that runs unsplit."""
        if not self.runs:  # closed, as another thread may find it while the session closes
            raise StateError("the session is closed")
        return self.runs[0].session

    @property
    def plan_count(self) -> int:
        return len(self._plans)

    def host_report(self) -> dict:
        return self.host.report() if self.host is not None else dict(on=False, why=self.host_note, steps=0)

    # ------------------------------------------------------------------ running
    def run(self, output_names, input_feed, run_options):
        if self.plain:  # ORT's own run
            mark = self._meter.mark() if self.steps < MEASURED_RUNS else None
            out = self.single.run(output_names, input_feed, run_options)
            self._after_single_run(mark)
            return out
        # Split graphs, and any graph under capture (ORT replays only through IOBinding with
        # fixed buffers): the segment loop binds fixed buffers per input shape.
        values = self.run_segments(input_feed, run_options)
        outs = [values[n].numpy() for n in (output_names or self._graph_outputs)]
        # On CUDA numpy() is already a host copy; on the CPU it aliases the fixed buffer
        # that the next step overwrites.
        return outs if self.device.is_cuda else [o.copy() for o in outs]

    def run_single_with_ort_values(self, output_names, feeds, run_options) -> list:
        """ORT's own run_with_ort_values on the one session, counted and measured as run() is."""
        mark = self._meter.mark() if self.steps < MEASURED_RUNS else None
        out = self.single.run_with_ort_values(output_names, feeds, run_options)
        self._after_single_run(mark)
        return out

    def run_single_with_iobinding(self, iobinding, run_options) -> None:
        mark = self._meter.mark() if self.steps < MEASURED_RUNS else None
        if not self._stable:
            self._binder.bind_weights(iobinding, self.runs[0].seg)  # the caller binds only its own values
        self.single.run_with_iobinding(iobinding, run_options)
        # The outputs are complete when this returns, as plain ORT's are: the caller may
        # read them from any stream, or from the host, at once. ORT's own wait covers the
        # streams it copies bound outputs on; ours covers the compute stream.
        iobinding.synchronize_outputs()
        self.device.compute_stream.synchronize()
        self._after_single_run(mark)

    def _after_single_run(self, mark) -> None:
        self.last_step = self.residency.count_resident_step()
        self.steps += 1
        self._meter.charge_since(mark)

    def run_segments(self, input_feed, run_options=None) -> Dict[str, ort.OrtValue]:
        """One step through every segment; returns every boundary and output value."""
        feeds = {k: as_ortvalue(v) for k, v in input_feed.items()}
        sig = signature(feeds)
        plan = self._plans.get(sig)
        if plan is None:
            # Under decode-only capture, run() neither captures nor keeps buffers per shape.
            return self._step(sig, plan, feeds, run_options, make_plan=not self.capture.decode_only)
        try:
            return self._step(sig, plan, feeds, run_options)
        except RuntimeError as e:  # ORT's errors, and StateError
            if isinstance(e, ModelRunError) or (isinstance(e, OffloadError) and not isinstance(e, StateError)):
                # A failure inside the model, a budget or a driver error: the same again
                # without fixed buffers (and a second run of the model's random ops).
                raise
            # A boundary came out in another shape than the buffers of its signature: its
            # shape depends on input values. The step runs again without fixed buffers,
            # and so does every later step of this signature.
            self._plans.forget_dynamic(sig)
            return self._step(sig, None, feeds, run_options)

    def run_bound(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue], *,
                  fixed: bool, key: Optional[tuple] = None) -> Tuple[Dict[str, ort.OrtValue], bool]:
        """One step with the caller's inputs and outputs bound where they are. `fixed`:
        the caller keeps these shapes and addresses for the steps to come, so the step
        gets a plan (and, under capture, a graph). `key`, when given, stands for those
        shapes and addresses (the caller vouches that it changes whenever they do);
        else they are read from the values. Returns every value and whether the step
        ran under a plan that existed before it (on CUDA with capture: a replay)."""
        sig = key if key is not None else (
            ("bound",) + signature(feeds, addresses=True) + signature(outputs, "->", addresses=True))
        plan = self._plans.get(sig) if fixed else None
        existed = plan is not None
        if not existed and fixed and not self.streaming and self._all_bound(feeds, outputs):
            # Unsplit with every value the caller's: no boundary to size, so the plan (and
            # its graph) can serve this very step.
            plan = self._plans.new(sig, self.capture.enabled)
        values = self._step(sig, plan, feeds, None, bound_outputs=outputs, make_plan=fixed)
        return values, existed

    def _step(self, sig, plan: Optional[Plan], feeds, run_options, bound_outputs=None,
              make_plan: bool = True) -> Dict[str, ort.OrtValue]:
        dev, res = self.device, self.residency
        bound_outputs = bound_outputs or {}
        if plan is not None:
            self._plans.touch(sig)
            for name, v in feeds.items():
                if name in plan.buffers:
                    copy_into(dev, plan.buffers[name], v)
        measured = plan is None or plan.runs < MEASURED_RUNS  # capture happens on an early run
        mark = self._meter.mark() if measured else None
        graph_options = graph_run_options(plan, run_options, self.capture.enabled)
        values: Dict[str, ort.OrtValue] = {}
        before = copy.copy(res.counters) if self.streaming else None
        if self.streaming:
            res.settle()  # what a step cut short by an exception left acquired
        try:  # an exception anywhere in the step (an interrupt lands between any two lines)
            if self.host is not None:
                self.host.after(-1, values, bound_outputs, feeds, plan)
            for run in self.runs:
                seg = run.seg
                # Unsplit, every weight is resident and pinned for the session's life.
                routed = self._router.picks(seg.index, values, feeds)
                ready = None
                if self.streaming:
                    ready = res.acquire(seg.index, routed) if routed else res.acquire(seg.index)
                if ready is not None:
                    if dev.is_cuda:
                        # ORT runs the segment on the compute stream: a stream wait orders
                        # its reads after the copy without blocking the host.
                        ready.wait_on(dev.compute_stream)
                    else:
                        ready.synchronize()  # the CPU EP reads on this thread
                # A plan binds the same buffers every step: its bindings are made once
                # (weights bound as inputs move, so not without stable addresses).
                io = plan.bindings.get(seg.index) if plan is not None and self._stable else None
                checked = io is None or plan.runs < MEASURED_RUNS
                if io is None:
                    io = run.session.io_binding()
                    self._binder.bind(io, run.seg, plan, values, feeds, bound_outputs)
                elif run.host_inputs:
                    self._binder.bind_inputs(io, run.host_inputs, plan, values, feeds)
                try:
                    if run.captured and plan is not None and plan.runs == 0 and self.capture.enabled:
                        run_once_on_state(dev, run.session, io, graph_options, feeds,
                                          self._state.intersection(run.seg.inputs))
                    else:
                        run.session.run_with_iobinding(io, graph_options if run.captured else run_options)
                except RuntimeError as e:
                    self._binder.raise_as_ort_run(e, run, plan, {**values, **bound_outputs}, feeds, run_options)
                    raise
                if checked:
                    self._binder.check_outputs(seg, io, plan, bound_outputs, values)
                    if plan is not None and self._stable:
                        plan.bindings[seg.index] = io
                else:  # the caller's own outputs are where it bound them
                    for name in seg.outputs:
                        if name not in bound_outputs:
                            values[name] = plan.buffers[name].value
                if self.streaming:
                    # The segment's reads end here: ORT synchronizes its stream before
                    # returning, and this event, on that stream, orders every later unmap
                    # after it.
                    reader = dev.backend.create_event()
                    reader.record(dev.compute_stream)
                    res.release(seg.index, reader)
                if self.host is not None:
                    self.host.after(seg.index, values, bound_outputs, feeds, plan)
        except BaseException:
            if self.streaming:
                res.settle()  # what the step acquired and did not release
            raise
        if self.streaming:
            res.end_step()
            self.last_step = res.counters.minus(before)
            if self.host is not None:
                self.host.steps += 1
        else:
            self.last_step = res.count_resident_step()
        pass_through(self, values, feeds)
        self.steps += 1
        self._meter.charge_since(mark)
        if plan is None:
            if make_plan:
                direct = set(bound_outputs) | (set(feeds) if bound_outputs else set())
                self._make_plan(sig, feeds, values, direct=direct)
        else:
            plan.runs += 1
            if self.capture.enabled and any(r.captured for r in self.runs):
                self.graph_steps += 1
        return values

    def _all_bound(self, feeds, outputs) -> bool:
        seg = self.runs[0].seg
        return all(n in feeds for n in seg.inputs) and all(n in outputs for n in seg.outputs)

    def _make_plan(self, sig, feeds, values, direct=frozenset()) -> None:
        """Fixed buffers for these input shapes (see Plans.make): every segment input and
        output but `direct`, the caller's own buffers, bound where they are."""
        needed = set()
        for run in self.runs:
            needed.update(run.seg.inputs)
            needed.update(run.seg.outputs)
        needed -= set(direct)
        self._plans.make(sig, needed, feeds, values, self.capture.enabled)

    def drop_plans(self, sigs) -> None:
        """Forgets the plans of buffers about to be freed; their graph ids are never used again."""
        self._plans.drop(sigs)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Drops the ORT sessions first (they may still free scratch), then the plans."""
        self.runs = []
        self._initializer_values = []
        if self.host is not None:
            self.host.close()
        self._plans.clear()


def pass_through(runner: "SegmentRunner", values, feeds) -> None:
    """Graph outputs that no node produces: a graph input, a weight or a small
    initializer, returned as is."""
    for name in runner._graph_outputs:
        if name in runner._produced or name in values:
            continue
        if name in feeds:
            values[name] = feeds[name]
        elif name in runner.residency.info:
            info = runner.residency.info[name]
            data = runner.residency.store.view(name).view(info.dtype).reshape(info.shape)
            values[name] = as_ortvalue(data.copy())
        elif name in runner._constants:
            values[name] = as_ortvalue(runner._constants[name].copy())
