"""The streaming engine: one ORT session for the whole model, its run captured into a
CUDA graph that the package owns, and the page-ins of the streamed weights added to
that graph as copies.

What stays resident, the units the others stream in and the ring behind them are the
plan's (``stream_plan``); the ring's mapping is ``stream_ring``'s; a signature's graph
(warm-up, capture, page-in copies) is made by ``stream_capture``.

A step (``StreamEngine``). Each input-shape signature gets one graph, kept for the
steps to come (up to GRAPH_SIGNATURES of them). The step's leading copies, which wait
for no reader, are not in the graph: they are issued on the copy stream as soon as the
step before ends, while the host reads its outputs, and the launch waits for them on an
event. A replay is one graph launch: the copies run on the copy engine while the kernels
run, a kernel waits only for its own weights, and nothing in a step maps, unmaps, sets
access, creates or releases; the host waits once, at the end, for the outputs.
"""
from __future__ import annotations

import collections
import os
from typing import Dict, List, Optional, Sequence, Tuple

import onnxruntime as ort

from ..errors import StateError
from ..loading import WeightInfo, save_model
from ..loading import Segment
from ..memory import REBALANCE_STEPS, Counters, ExpertPages
from .base import Engine
from .graph_capture import GraphCaptureDecision
from .host_step import HostPlan
from .stream_host import HostComputeMembers
from .in_place import in_place_nodes, with_router_outputs
from .ortvalues import FixedBuffer, as_ortvalue, copy_into, nbytes_of, numpy_dtype, ortvalue_at, signature
from .step_state import StateCopy
from .stream_capture import GraphBuilder, StepGraph
from .stream_plan import StreamPlan
from .stream_ring import Ring

# Input-shape signatures kept captured: a generation of 4 rows whose prompt runs in
# chunks holds 2 per row (the first step and the chunks') and its decode step's.
GRAPH_SIGNATURES = 16


class StreamEngine(HostComputeMembers, Engine):
    """Runs a model whose weights do not fit as one captured ORT session, streaming
    through the ring, behind the one surface both engines offer (``Engine``)."""

    streaming = True
    plain = False  # the model runs captured, with the page-ins in its graph

    def __init__(self, device, residency, store, weights: Sequence[WeightInfo], plan: StreamPlan, factory, meter,
                 model, workdir: str, inputs: Sequence[str], graph_outputs: List[str], capture_reason: str,
                 device_id: int, host_compute="off", state=frozenset()):
        self.device = device
        self.residency = residency
        self.store = store
        self.plan = plan
        self._meter = meter
        self._graph_outputs = list(graph_outputs)
        self._device_id = device_id
        self.info = {w.name: w for w in weights}
        self.capture = GraphCaptureDecision(True, f"{capture_reason}; the streaming engine captures one ORT run per "
                                                  f"input-shape signature and adds the page-ins to that graph")
        self.notes: List[str] = []
        if plan.in_host:
            held = sum(self.info[n].nbytes for n in plan.in_host)
            self.notes.append(f"{len(plan.in_host)} weight(s) stay in pinned host memory and are read there, over "
                              f"the link ({', '.join(plan.in_host[:3])}{', ...' if len(plan.in_host) > 3 else ''}; "
                              f"{held} bytes): a table only Gathers read, a row a token; a stack of experts "
                              f"(experts='in_place'), the experts a token picks. Their device bytes go to other "
                              f"weights")
        self.steps = 0
        self.graph_steps = 0
        self.last_step = Counters()
        self._graphs: "collections.OrderedDict[tuple, StepGraph]" = collections.OrderedDict()
        self._oneshot: Optional[StepGraph] = None
        self._ring = Ring(device, plan)
        self._initializer_values: List[ort.OrtValue] = []
        self.session = None
        self.host: Optional[HostPlan] = None  # the split in force for decode steps (host compute)
        self.host_session = None  # the ORT session of the model rewritten for it
        self._host_builder: Optional[GraphBuilder] = None
        self._host_dims: Dict[str, list] = {}
        self.host_steps = 0  # steps whose graph had the host compute its MatMuls
        self.host_note = ""  # why host compute is off, or what it does
        self._host_mode = host_compute
        self._host_captures = 0  # graphs made by host-compute builders since dropped
        self._state = frozenset(state)  # inputs the model changes in place (step_state.py)
        self.runs = []
        self._per_step: Dict[bool, Counters] = {}  # a step's counters, by whether the host computed
        self._lead: Optional[tuple] = None  # the lead copies issued for the next step, if any
        self._lead_done = self._compute_done = None  # events: after the lead copies, after queued compute
        # Stacks read in place from the host store's paged region: their hot experts on
        # device pages behind the stack's address, the picks counted from the routers.
        nodes = in_place_nodes(model, weights, plan.in_host, store.pages)
        self.experts: Optional[ExpertPages] = None
        self._routers = [n.router for n in nodes]
        try:
            self._ring.map()
            if nodes:
                self.experts = ExpertPages(device, store, nodes)
                model = with_router_outputs(model, nodes, weights)
            so = factory.session_options()
            for w in weights:
                if w.name in residency.slots:
                    va = residency.slots[w.name].va
                elif self.experts is not None and w.name in self.experts.address:
                    va = self.experts.address[w.name]
                elif w.name in plan.in_host:  # read in place
                    va = store.device_address(w.name)
                else:  # streamed: a weight the plan left out has no address, and fails here
                    va = self._ring.address[w.name]
                value = ortvalue_at(va, w.shape, w.dtype, device.is_cuda, device_id)
                so.add_initializer(w.name, value)
                self._initializer_values.append(value)
            path = save_model(model, os.path.join(workdir, "model.onnx"))
            mark = meter.mark()
            self.session = factory.create(path, so, False)[0]
            meter.charge_since(mark, creating=True)
            self._start_host_compute(host_compute, factory, model, weights, workdir)
            if self.experts is not None:
                self.experts.place()
                self.notes.append(f"{len(self.experts.resident)} of {len(self.experts.counts)} experts read in place "
                                  f"are resident on device pages behind their stacks' addresses "
                                  f"({self.experts.committed} bytes); every {REBALANCE_STEPS} steps the most "
                                  f"picked take the place of colder ones")
        except BaseException:
            self.session = self.host_session = None
            self._initializer_values = []
            if self.experts is not None:
                self.experts.close()
                self.experts = None
            self._ring.unmap()  # the session never sees a half-built engine: give the ring back here
            raise
        segment = Segment(0, list(range(len(model.graph.node))), [w.name for w in weights], list(inputs),
                          list(graph_outputs), model)
        self.runs = [_Run(segment, self.session)]
        outputs = self._graph_outputs + [r for r in self._routers if r not in self._graph_outputs]
        self._builder = GraphBuilder(device, self.session, self._ring, store, self.info, meter, outputs, device_id)
        if self.host is not None:
            xs = [h.x_output for h in self.host.hosts if h.x_output not in outputs]
            self._host_builder = GraphBuilder(device, self.host_session, self._ring, store, self.info, meter,
                                              outputs + list(dict.fromkeys(xs)), device_id, host=self.host)

    # ------------------------------------------------------------------ running
    def _issue_lead(self, lead) -> None:
        """The lead copies of a step, on the copy stream after everything the compute
        stream has queued; the next launch waits for them (`_lead_done`)."""
        dev = self.device
        self._lead = None
        if self._lead_done is None:
            self._lead_done, self._compute_done = dev.backend.create_event(), dev.backend.create_event()
        self._compute_done.record(dev.compute_stream)
        self._compute_done.wait_on(dev.copy_stream)
        for dst, src, n in lead:
            dev.backend.copy_h2d(dst, src, n, dev.copy_stream)
        self._lead_done.record(dev.copy_stream)
        self._lead = lead

    def _launch(self, g: StepGraph) -> None:
        stream = self.device.compute_stream
        if self._lead != g.lead:  # the copies issued after the last step were another graph's
            self._issue_lead(g.lead)
        if self._lead_done is not None:
            self._lead_done.wait_on(stream)
        self._lead = None  # the graph may overwrite them from here on
        g.graph.launch(stream)
        # As after ORT's own run, the outputs are complete on return: the caller reads
        # them from the host (the step's one host wait) or from any stream.
        stream.synchronize()
        if g.host is not None:
            self._check_host(g)
        self.steps += 1
        self.graph_steps += 1
        self._count_step(g.host is not None)
        if self.experts is not None:
            self._count_experts(g)
        # The next step's lead copies run while the caller works on this one's outputs:
        # nothing reads the granules they land in before the next launch, which waits
        # for them.
        self._issue_lead(g.lead)

    def _count_step(self, host: bool) -> None:
        """Counts a replayed step: every resident weight hits, every streamed one is copied
        (in a host-computed step, those the host does not compute; the host's weights are
        no device access)."""
        per = self._per_step.get(host)
        if per is None:
            on_host = set(self.host.host_weights) if host else set()
            resident, streamed = list(self.residency.slots), [n for n in self.plan.streamed if n not in on_host]
            resident_bytes = sum(self.info[n].nbytes for n in resident)
            streamed_bytes = sum(self.info[n].nbytes for n in streamed)
            per = self._per_step[host] = Counters(
                steps=1, accesses=len(resident) + len(streamed), hits=len(resident), page_ins=len(streamed),
                access_bytes=resident_bytes + streamed_bytes, hit_bytes=resident_bytes, bypassed=len(streamed),
                bypassed_bytes=streamed_bytes, htod_bytes=streamed_bytes)
        self.residency.counters = self.residency.counters + per  # one store
        self.last_step = per

    def _count_experts(self, g: StepGraph) -> None:
        """The experts the step's routers picked, read back from the graph's outputs: hits on
        device pages, misses read over the link. Every REBALANCE_STEPS steps, between this
        step (ended: the host waited for it) and the next, the most picked experts take the
        device pages of colder ones."""
        hits, misses, read = self.experts.count({r: g.outputs[r].numpy() for r in self._routers if r in g.outputs})
        counted = dict(expert_accesses=hits + misses, expert_hits=hits, expert_read_bytes=read)
        self.residency.counters = self.residency.counters.plus(**counted)
        self.last_step = self.last_step.plus(**counted)
        if self.experts.due():
            self.experts.rebalance()

    def _keep(self, sig, g: StepGraph) -> None:
        self._graphs[sig] = g
        while len(self._graphs) > GRAPH_SIGNATURES:
            self._free(self._graphs.popitem(last=False)[1])

    def _free(self, g: Optional[StepGraph]) -> None:
        if g is None:
            return
        self.device.compute_stream.synchronize()  # nothing may still replay onto the buffers
        g.graph = g.host = None
        for buf in g.buffers.values():
            self.device.scratch.deallocate(buf.ptr)
        g.buffers.clear()

    def run_bound(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue], *,
                  fixed: bool, key: Optional[tuple] = None) -> Tuple[Dict[str, ort.OrtValue], bool]:
        """One step with the caller's values bound where they are (see Engine.run_bound).
        Every step runs as a graph: `fixed` keeps it for the steps to come."""
        sig = ("bound", key if key is not None
               else signature(feeds, addresses=True) + signature(outputs, "->", addresses=True))
        g = self._graphs.get(sig) if fixed else None
        if g is None:
            self._free(self._oneshot)
            self._oneshot = None
            # Making the graph runs ORT twice: inputs the model changes in place are put back
            # before the launch, which then runs the step once on them (step_state.py).
            with StateCopy(self.device, feeds, self._state) as saved:
                try:
                    g, keep = self._build(feeds, outputs, {})
                finally:  # also for a step run again after a failure (a new plan)
                    saved.restore()
            if fixed and keep:
                self._keep(sig, g)
            else:
                self._oneshot = g
        else:
            self._graphs.move_to_end(sig)
        self._launch(g)
        values = dict(feeds)
        values.update(g.outputs)
        return values, True

    def run_segments(self, input_feed, run_options=None) -> Dict[str, ort.OrtValue]:
        """One step on the caller's values (host or device); returns every output's value."""
        feeds = {k: as_ortvalue(v) for k, v in input_feed.items()}
        sig = ("run",) + signature(feeds)
        g = self._graphs.get(sig)
        if g is None:
            self._free(self._oneshot)
            self._oneshot = None
            g, keep = _build_on_copies(self, feeds)
            if keep:
                self._keep(sig, g)
            else:
                self._oneshot = g
        else:
            self._graphs.move_to_end(sig)
            for k, v in feeds.items():
                copy_into(self.device, g.buffers[k], v)
        self._launch(g)
        values = dict(feeds)
        values.update(g.outputs)
        return values

    def run(self, output_names, input_feed, run_options):
        values = self.run_segments(input_feed, run_options)
        return [values[n].numpy() for n in (output_names or self._graph_outputs)]

    @property
    def single(self) -> ort.InferenceSession:
        if self.session is None:  # closed, as another thread may find it while the session closes
            raise StateError("the session is closed")
        return self.session

    @property
    def address(self) -> Dict[str, int]:
        """Each streamed weight's address, fixed for the engine's life (its ring's)."""
        return self._ring.address

    @property
    def plan_count(self) -> int:
        return len(self._graphs)

    def drop_plans(self, keys) -> None:
        for key in keys:
            g = self._graphs.pop(("bound", key), None)
            self._free(g)
        if self._oneshot is not None:
            self._free(self._oneshot)
            self._oneshot = None

    def close(self) -> None:
        """The graphs, then the ORT session (it may free scratch), then the ring."""
        try:
            for stream in (self.device.compute_stream, self.device.copy_stream):
                if not stream.closed:
                    stream.synchronize()
            self._lead = None
            for g in list(self._graphs.values()) + [self._oneshot]:
                self._free(g)
            self._graphs.clear()
            self._oneshot = None
            self.runs = []
            self.session = self._builder.session = None
            if self._host_builder is not None:
                self._host_builder.session = None
            self.host_session = None
            self._initializer_values = []
        finally:
            try:
                if self.experts is not None:
                    self.experts.close()
                    self.experts = None
            finally:
                self._ring.unmap()


class _Run:
    def __init__(self, seg: Segment, session):
        self.seg = seg
        self.session = session
        self.captured = True


def _build_on_copies(engine: StreamEngine, feeds: Dict[str, ort.OrtValue]) -> Tuple[StepGraph, bool]:
    """engine._build on buffers of the engine's own that hold copies of `feeds` (a step of
    run(), whose values are the caller's for this call only). As in run_bound, the inputs the
    model changes in place are put back after the build, so the launch runs the step once on
    them (step_state.py)."""
    buffers: Dict[str, FixedBuffer] = {}
    try:
        for k, v in feeds.items():
            dtype = numpy_dtype(v.data_type())
            ptr = engine.device.scratch.allocate(max(1, nbytes_of(v.shape(), dtype)))
            buffers[k] = FixedBuffer.on(engine.device, ptr, v.shape(), dtype)
        for k, v in feeds.items():
            copy_into(engine.device, buffers[k], v)
        fed = {k: buffers[k].value for k in feeds}
        with StateCopy(engine.device, fed, engine._state) as saved:
            try:
                return engine._build(fed, {}, buffers)
            finally:
                saved.restore()
    except BaseException:
        for buf in buffers.values():
            engine.device.scratch.deallocate(buf.ptr)
        raise
