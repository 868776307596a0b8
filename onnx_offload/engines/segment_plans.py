"""The segment runner's plans and bindings: fixed buffers per input-shape signature, and
how a segment's IOBinding binds its values.

A plan (``Plan``) holds a buffer for every segment input and output that the caller
does not bind itself; the first step of a signature passes ORT's own outputs along and
sizes the buffers from them (``Plans.make``), later steps bind the same addresses,
which is what a captured segment replays. Under capture each plan has a gpu_graph_id of
its own and lives as long as the session (its graphs point at its buffers), so at most
MAX_SIGNATURES are made. ``Binder`` binds a segment's inputs and outputs: to a plan's
buffers, to the caller's own values, or (the rest) where ORT allocates them.
"""
from __future__ import annotations

import collections
from typing import Dict, Optional

import onnxruntime as ort

from ..errors import BudgetExceeded, ModelRunError, StateError, with_ort_type
from ..loading import Segment
from .ortvalues import FixedBuffer, nbytes_of, numpy_dtype, ortvalue_at, shareable

MAX_SIGNATURES = 4
# The gpu_graph_ids that run() captures under, apart from the small ids (0 by default)
# that callers pass to run_with_iobinding with their own buffers: a shared id would
# replay the caller's graph on the caller's buffers.
FIRST_GRAPH_ID = 1 << 20


class Plan:
    """Fixed buffers for one set of input shapes: every segment input and output."""

    def __init__(self, graph_id: int):
        self.buffers: Dict[str, FixedBuffer] = {}
        self.bindings: Dict[int, ort.IOBinding] = {}  # per segment, made on the first run
        self.run_options: Optional[ort.RunOptions] = None  # under capture: this plan's gpu_graph_id
        self.graph_id = graph_id  # ORT's gpu_graph_id for captured segments; -1: not captured
        self.runs = 0


class Plans:
    """The runner's plans by signature, the least recently used first. `capturing`:
    whether the runner captures (its plans then take graph ids and are never evicted)."""

    def __init__(self, device):
        self.device = device
        self._plans: "collections.OrderedDict[tuple, Plan]" = collections.OrderedDict()
        # Signatures whose boundary shapes depend on input values: no fixed buffers fit them.
        self._dynamic: set = set()
        self._next_graph_id = FIRST_GRAPH_ID

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, sig) -> Optional[Plan]:
        return self._plans.get(sig)

    def touch(self, sig) -> None:
        """Marks the plan of `sig` as the most recently used."""
        self._plans.move_to_end(sig)

    def new(self, sig, capturing: bool) -> Optional[Plan]:
        """An empty plan under a fresh graph id (None when the capture cap is reached)."""
        if sig in self._dynamic or (capturing and len(self._plans) >= MAX_SIGNATURES):
            return None
        plan = Plan(self._next_graph_id if capturing else -1)
        if capturing:
            self._next_graph_id += 1
        self._plans[sig] = plan
        return plan

    def make(self, sig, needed, feeds, values, capturing: bool) -> None:
        """Fixed buffers for the `needed` values of these input shapes, sized from `values`
        and `feeds`, so later steps bind the same addresses. Under capture a plan lives as
        long as the session (its captured graphs point at it), so at most MAX_SIGNATURES
        shapes are captured; others run uncaptured."""
        if sig in self._dynamic or (capturing and len(self._plans) >= MAX_SIGNATURES):
            return
        plan = Plan(self._next_graph_id if capturing else -1)
        scratch = self.device.scratch
        while True:
            try:
                for name in sorted(needed):
                    v = values[name] if name in values else feeds[name]
                    shape = list(v.shape())
                    dtype = numpy_dtype(v.data_type())
                    ptr = scratch.allocate(max(1, nbytes_of(shape, dtype)))
                    plan.buffers[name] = FixedBuffer.on(self.device, ptr, shape, dtype)
                break
            except BudgetExceeded:
                # The step has run; its plan only speeds the next ones. The scratch
                # budget goes to the shapes seen last: older plans give theirs back (not
                # under capture, where graphs hold them), else this shape runs without.
                self.free(plan)
                if capturing or not self._plans:
                    return
                self.free(self._plans.popitem(last=False)[1])
            except BaseException:
                self.free(plan)
                raise
        if capturing:
            self._next_graph_id += 1
        self._plans[sig] = plan
        while len(self._plans) > MAX_SIGNATURES:
            _, old = self._plans.popitem(last=False)
            self.free(old)

    def forget_dynamic(self, sig) -> None:
        """Frees the plan of `sig`, whose boundary shapes depend on input values, and
        makes none for it again."""
        self._dynamic.add(sig)
        self.free(self._plans.pop(sig))

    def drop(self, sigs) -> None:
        """Forgets the plans of buffers about to be freed; their graph ids are never used again."""
        for sig in sigs:
            plan = self._plans.pop(sig, None)
            if plan is not None:
                self.free(plan)

    def free(self, plan: Plan) -> None:
        if self.device.scratch is None:
            return
        plan.bindings.clear()
        for buf in plan.buffers.values():
            self.device.scratch.deallocate(buf.ptr)
        plan.buffers.clear()

    def clear(self) -> None:
        for plan in self._plans.values():
            self.free(plan)
        self._plans.clear()


def graph_run_options(plan: Optional[Plan], user: Optional[ort.RunOptions],
                      capturing: bool) -> Optional[ort.RunOptions]:
    """Run options for captured segments: the plan's gpu_graph_id, or -1 (neither
    capture nor replay) while a signature has no fixed buffers yet."""
    if not capturing:
        return user
    if plan is not None and user is None:
        if plan.run_options is None:  # made once: a step's own cost counts in decode
            plan.run_options = graph_run_options(plan, ort.RunOptions(), capturing)
        return plan.run_options
    ro = ort.RunOptions()
    if user is not None:
        for attr in ("log_severity_level", "log_verbosity_level", "logid", "only_execute_path_to_fetches"):
            setattr(ro, attr, getattr(user, attr))
    ro.add_run_config_entry("gpu_graph_id", str(plan.graph_id if plan is not None else -1))
    return ro


class Binder:
    """Binds a segment's values for ORT: `stable` weights are the sessions'
    initializers; without stable addresses they are inputs, bound where their slots are."""

    def __init__(self, device, residency, device_id: int, stable: bool):
        self.device = device
        self.residency = residency
        self._device_id = device_id
        self._stable = stable

    def bind(self, io, seg: Segment, plan: Optional[Plan], values, feeds, bound_outputs) -> None:
        device_name = "cuda" if self.device.is_cuda else "cpu"
        self.bind_inputs(io, seg.inputs, plan, values, feeds)
        if not self._stable:
            self.bind_weights(io, seg)
        for name in seg.outputs:
            if name in bound_outputs:
                io.bind_ortvalue_output(name, bound_outputs[name])
            elif plan is not None and name in plan.buffers:
                io.bind_ortvalue_output(name, plan.buffers[name].value)
            else:
                io.bind_output(name, device_name, self._device_id)

    @staticmethod
    def bind_inputs(io, names, plan: Optional[Plan], values, feeds) -> None:
        """Binds `names`: a plan's fixed buffer, else this step's value or the caller's feed."""
        for name in names:
            if plan is not None and name in plan.buffers:
                io.bind_ortvalue_input(name, plan.buffers[name].value)
            else:
                io.bind_ortvalue_input(name, values[name] if name in values else feeds[name])

    def bind_weights(self, io, seg: Segment) -> None:
        """Without stable addresses the weights are inputs, bound where their slots are now."""
        device_name = "cuda" if self.device.is_cuda else "cpu"
        for name in seg.weights:
            slot, info = self.residency.slots[name], self.residency.info[name]
            io.bind_input(name, device_name, self._device_id, info.dtype, list(info.shape), slot.va)

    @staticmethod
    def check_outputs(seg: Segment, io, plan: Optional[Plan], bound_outputs, values) -> None:
        """ORT's outputs into `values`, each checked to be where it was bound."""
        for name, v in zip(seg.outputs, io.get_outputs()):
            fixed = bound_outputs[name].data_ptr() if name in bound_outputs else None
            if fixed is None and plan is not None and name in plan.buffers:
                fixed = plan.buffers[name].ptr
            written = fixed is not None and nbytes_of(v.shape(), numpy_dtype(v.data_type())) > 0
            if written and v.data_ptr() != fixed:
                raise StateError(f"ORT wrote {name!r} outside the buffer bound for it")
            values[name] = v

    def raise_as_ort_run(self, e: RuntimeError, run, plan: Optional[Plan], values, feeds, run_options) -> None:
        """ORT's IOBinding run reports a failure inside the model as a RuntimeError whose
        message has lost the status code, where its run() raises the typed error (Fail,
        InvalidArgument, ...). The segment runs once more through run_with_ort_values on
        the same inputs, and what it raises is raised as both (ModelRunError). Only where
        such a run is the same run: nothing captured, and the weights where the failed run
        read them (in the session, or inputs at their slots' addresses); elsewhere ORT's
        RuntimeError stands."""
        if type(e) is not RuntimeError or not str(e).startswith("Error in execution: ") or run.captured:
            return
        inputs = {n: plan.buffers[n].value if plan is not None and n in plan.buffers
                  else values[n] if n in values else feeds[n] for n in run.seg.inputs}
        if not self._stable:
            for name in run.seg.weights:
                slot, info = self.residency.slots[name], self.residency.info[name]
                if not shareable(info.dtype):
                    return
                inputs[name] = ortvalue_at(slot.va, info.shape, info.dtype, self.device.is_cuda, self._device_id)
        try:
            run.session.run_with_ort_values(list(run.seg.outputs), inputs, run_options)
        except Exception as typed:  # noqa: BLE001 - ORT's own types
            raise with_ort_type(ModelRunError, typed)(str(typed)) from e
