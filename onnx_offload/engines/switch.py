"""The engine in force, and the one place that moves a session between engines.

A session runs its model on one engine at a time: the streaming engine (one ORT session,
captured, the page-ins in its graph) or the segment runner (one ORT session per
segment, one in all when every weight is resident). ``Engines`` builds the one the plan
chooses, and replaces it when a step or a generation needs what the plan in force cannot
give:
- a step that needs more memory than was set aside plans the streaming engine again with
  that room (``run``);
- a step the streaming engine cannot capture moves the weights to segments (``run``);
- a generation whose KV cache or largest step does not fit plans the engine again before
  its first step (``prepare``), and a cache that runs short mid-way asks ``kv_short``
  (``replan.py``).
A replacement that fails brings the engine in force back, and the error is raised; when
even that fails, the session is told to close (``on_lost``).

Locking: every method but ``runner`` and ``residency`` runs under the session's lock.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Set

import onnx

from .._core import round_up
from ..config import fmt_bytes
from ..errors import BudgetExceeded, CudaDriverError, OffloadError, OffloadWarning, with_ort_type
from ..loading import Routing, Segment, WeightInfo, check_bindable, split, value_types
from ..memory import (Counters, ResidencyManager, StepMemoryShort, ZonePlan, describe_zones, device_out_of_memory,
                      is_out_of_memory)
from .graph_capture import GraphCaptureDecision
from .host_segments import host_segments_of, host_steps_for
from .replan import engine_short, kv_short, segments_with_room
from .ort_sessions import SessionFactory
from .runner import SegmentRunner
from .in_place import stream_layout
from .stream_plan import StreamingUnavailable
from .streaming import StreamEngine


@dataclasses.dataclass
class RunInputs:
    """What every engine of a session is built from."""

    model: onnx.ModelProto  # optimized, its weights pointing at their slots (or fed as inputs)
    weights: List[WeightInfo]
    names: Set[str]  # the weights' names
    groups_by_target: Dict[int, list]  # the node groups plan_segments made for each segment target
    shared: List[str]  # weights that more than one node reads: never streamed by the engine
    stable: bool  # stable addresses (vmm, or offload off)
    capture: GraphCaptureDecision
    outputs: List[str]  # the graph's outputs, as listed
    feed_inputs: List[str]  # what a caller feeds, never the weights
    graph_inputs: list  # IOInfo of every graph input
    plan_inputs: dict  # the device's memory and the weights' costs, as plan_budget takes them
    record_timeline: bool
    workdir: str
    routing: Optional[Routing] = None  # the MoE nodes whose experts stream by route, when weights stream
    tables: Sequence[str] = ()  # weights only Gathers read (embeddings): the streaming engine reads them in place
    stacks: Sequence[str] = ()  # expert stacks it may read in place (experts="in_place"), in first-use order
    state: frozenset = frozenset()  # inputs the model changes in place (window-sized caches): step_state.py


class Engines:
    """The engine in force (``runner``) and its residency manager, the plan it runs
    under, and the moves between engines."""

    def __init__(self, device, store, meter, config, options, cuda_options, run: RunInputs, plan,
                 notes: List[str], release_kept: Callable[[], bool], on_lost: Callable[[], None]):
        self.device, self.store, self.meter, self.config = device, store, meter, config
        self.options, self.cuda_options, self.run_inputs = options, cuda_options, run
        self.plan = plan  # the budget plan in force for segments
        # Segments' ORT sessions are made under the cap of the session's first plan.
        self.segment_factory = self.factory(plan.ort_memory_cap)
        self.notes = notes
        self.release_kept = release_kept  # gives a kept generation's buffers back; whether it held any
        self.on_lost = on_lost  # the engine in force could not be brought back: the session closes
        self.runner = None
        self.residency: Optional[ResidencyManager] = None
        self.needs: Optional[tuple] = None  # (KV, scratch) the streaming engine in force sets aside
        self.planned_for = ""  # the generation the reserves hold, in words ("" where none is planned for)
        # Whether the weights would run on the streaming engine once they stream: a
        # generation that finds no room beside resident weights moves there, not to segments.
        self.graph_possible = False
        self.host_split: Optional[tuple] = None  # host compute in segments: (split or None, why)

    @property
    def cost(self):
        return self.run_inputs.plan_inputs["cost"]

    def factory(self, cap: int) -> SessionFactory:
        cfg = self.config
        return SessionFactory(self.device, self.options, self.cuda_options, cfg.device_id, cap)

    # ------------------------------------------------------------------ building
    def start(self, engine: str, needs: tuple, progress) -> None:
        """The first engine: the streaming engine with `needs` (KV, scratch) set aside, or
        segments (also when the streaming engine cannot run the model, unless asked for
        by name)."""
        if engine == "graph":
            try:
                with progress.phase("creating the ORT session"):
                    self.make_engine_with_room(*needs)
            except StreamingUnavailable as e:
                if self.config.engine == "graph":
                    raise
                self.notes.append(f"the weights run in segments: {e}")
                self.device.apply(self.plan)
                engine = "segments"
        if engine != "graph":
            with progress.phase("creating ORT sessions"):
                self.make_segments_with_room()
        self.notes.extend(self.runner.notes)
        self.residency.reset_counters()  # count runs, not the page-ins of construction

    def make_engine(self, kv: int, scratch: int) -> None:
        """The streaming engine, with `kv` bytes set aside for the KV cache and `scratch`
        for the steps' memory (ORT's and the step's buffers): the transient zone holds its
        ring, the weights zone the rest of the budget's resident weights."""
        dev, cfg, run = self.device, self.config, self.run_inputs
        g = dev.granularity
        kv, scratch = round_up(kv, g), round_up(scratch, g)
        budget = dev.budget
        allowance = min(cfg.weight_bytes or budget, budget - kv - scratch)
        layout = stream_layout(run, max(0, allowance), g, self.cost, cfg.policy, dev.is_cuda)
        dev.set_zones({"weights": ZonePlan(min(budget, layout.allowance - layout.ring_bytes), 0),
                       "kv": ZonePlan(budget, kv), "scratch": ZonePlan(budget, scratch),
                       "transient": ZonePlan(budget, layout.ring_bytes)})
        kept = set(layout.resident)
        self.residency = ResidencyManager(dev, self.store, [w for w in run.weights if w.name in kept],
                                          [layout.resident], cfg.policy, vmm=True, record_timeline=run.record_timeline)
        try:
            self.residency.make_all_resident()
            # ORT's arena may take what the weights, the ring and the cache leave; what it
            # takes is charged to scratch, and more than the scratch reserve plans again.
            cap = max(g, budget - self.cost(layout.resident) - layout.ring_bytes - kv)
            self.runner = StreamEngine(dev, self.residency, self.store, run.weights, layout, self.factory(cap),
                                       self.meter, run.model, run.workdir, run.feed_inputs, run.outputs,
                                       run.capture.reason, cfg.device_id, cfg.host_compute, run.state)
        except BaseException:
            self.residency.close()
            self.residency = None
            self.meter.refund()
            raise
        self.needs = (kv, scratch)

    def make_engine_with_room(self, kv: int, scratch: int) -> None:
        """make_engine, planned again with more scratch while ORT takes more than it set
        aside when it creates its session."""
        for attempt in range(3):
            try:
                return self.make_engine(kv, scratch)
            except StepMemoryShort as e:
                if attempt == 2:
                    raise
                scratch += e.needed or scratch

    def make_segments_with_room(self) -> None:
        """See replan.segments_with_room."""
        segments_with_room(self)

    def split(self, plan) -> List[Segment]:
        """The segments of `plan` (host_segments.py's with host compute), made first: a model may not split."""
        run = self.run_inputs
        if plan.streaming:
            return host_segments_of(self, plan) or split(run.model, run.groups_by_target[plan.segment_target],
                                                         run.names.__contains__)
        everything = list(range(len(run.model.graph.node)))
        if not run.stable:  # the weights are inputs, so every value goes through IOBinding
            # One segment: only the graph's inputs and outputs are bound, whose types the
            # graph declares (inferred only where it does not).
            types = {o.name: o.type for o in run.model.graph.output}
            if not all(t.WhichOneof("value") for t in types.values()):
                types = value_types(run.model)
            check_bindable(run.model, [everything], {}, types,
                           "the model, whose weights are bound as inputs without stable addresses (vmm=False)",
                           "use vmm=True, or offload=False")
        # A graph output listed twice is one output of the segment: ORT binds a name once.
        return [Segment(0, everything, [w.name for w in run.weights],
                        [v.name for v in run.graph_inputs if v.name not in run.names],
                        list(dict.fromkeys(run.outputs)), run.model)]

    def make_segment_runner(self, segments: Optional[List[Segment]] = None) -> None:
        dev, cfg, run, plan = self.device, self.config, self.run_inputs, self.plan
        self.needs = None  # the streaming engine's reserves no longer apply
        if segments is None:
            segments = self.split(plan)
        host, note = host_steps_for(self, plan, segments)
        routing = run.routing if plan.streaming else None
        self.residency = ResidencyManager(dev, self.store, run.weights, [s.weights for s in segments], cfg.policy,
                                          vmm=run.stable, record_timeline=run.record_timeline,
                                          experts=routing.stacks if routing is not None else None)
        if not plan.streaming:
            self.residency.make_all_resident()
        # Graph outputs that are initializers too small to be weights: no segment holds them.
        constants = {t.name: onnx.numpy_helper.to_array(t) for t in run.model.graph.initializer
                     if t.name in run.outputs and t.name not in run.names
                     and t.data_location != onnx.TensorProto.EXTERNAL}
        self.runner = SegmentRunner(dev, self.residency, self.segment_factory, self.meter, segments,
                                    run.workdir, run.outputs, streaming=plan.streaming, stable=run.stable,
                                    capture=run.capture, device_id=cfg.device_id, constants=constants,
                                    routing=routing, state=run.state, host=host, host_note=note)

    def make_segments(self, plan, segments: Optional[List[Segment]] = None) -> None:
        self.plan = plan
        self.device.apply(plan)
        self.make_segment_runner(segments)

    # ------------------------------------------------------------------ moving between engines
    def replan_engine(self, kv: int, scratch: int, why: str) -> None:
        """Moves onto the streaming engine planned for `kv` and `scratch` bytes (from
        resident segments, or from an engine planned for less). When it cannot be made,
        the engine in force comes back and the error is raised (see swap)."""
        before = self.needs if isinstance(self.runner, StreamEngine) else None
        plan = self.plan
        self.swap(lambda: self.make_engine_with_room(kv, scratch),
                  (lambda: self.make_engine(*before)) if before is not None else (lambda: self.make_segments(plan)))
        if why.startswith("a generation") or why.startswith("a KV cache"):
            self.planned_for = why
        self.notes.append(f"the streaming engine was planned again for {why}: KV cache {fmt_bytes(kv)}, step "
                          f"memory {fmt_bytes(scratch)}, {len(self.residency.slots)} weights resident")

    def run_in_segments(self, plan) -> None:
        """Replaces the engine with segments under `plan`. When they cannot be made (a
        model that cannot be split, an ORT error), the segments of the plan in force come
        back and the error is raised (see swap)."""
        before = self.plan
        segments = self.split(plan)
        self.swap(lambda: self.make_segments(plan, segments), lambda: self.make_segments(before))

    def swap(self, make, restore) -> None:
        """The engine in force replaced by what `make()` builds; when that fails, `restore()`
        builds the one in force again and the error is raised; should that fail too, the
        session closes (on_lost), so that the next call says so. The residency counters
        carry over."""
        counters = self.residency.counters if self.residency is not None else Counters()
        try:
            self.drop()
            make()
        except BaseException as error:
            try:
                self.drop()
                restore()
            except BaseException:
                self.on_lost()
            raise error
        finally:
            if self.residency is not None:
                self.residency.counters = counters

    def drop(self) -> None:
        """Closes the engine in force and its residency. The engine is let go before it
        closes: a member that takes no lock finds None, and waits for the lock and the
        engine made under it. A kept generation's graphs are the engine's: it goes first."""
        self.release_kept()
        mark = self.meter.mark()
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.close()
        if self.residency is not None:
            self.residency.close()
            self.residency = None
        # The handles the arena keeps for reuse are sized for the plan that went: the
        # device gets them back, for ORT's next session and the next plan's own.
        pooled = self.device.ledger.snapshot().pooled
        if pooled:
            self.device.arena.trim_pool(pooled)
        # The engine's ORT sessions are gone: what they gave back is refunded, and the
        # next ones are measured anew.
        self.meter.refund(mark)

    def prepare(self, kv: int, scratch: int, why: str) -> None:
        """Before a generation that needs `kv` bytes of KV cache and `scratch` for its
        largest step: when those do not fit the plan in force, the streaming engine is
        planned again for them (reserves only grow: a shorter generation later runs in
        the same plan). Resident weights that leave no room move to the engine."""
        if not self.graph_possible:
            return
        if isinstance(self.runner, StreamEngine):
            have_kv, have_scratch = self.needs
            if kv <= have_kv and scratch <= have_scratch:
                return
            kv, scratch = max(kv, have_kv), max(scratch, have_scratch)
        else:
            snap = self.device.ledger.snapshot()
            weights = snap.zones["weights"].committed.current
            if weights + kv + scratch + snap.zones["scratch"].committed.current <= snap.budget:
                return  # beside the resident weights
            why = f"{why}, which the resident weights left no room for"
        try:
            self.replan_engine(kv, scratch, why)
        except StreamingUnavailable as e:
            # The engine in force stays: a buffer short of room asks for a plan again
            # (kv_short), and the error says what would run.
            self.notes.append(f"the streaming engine cannot be planned for {why}: {e}")
        except CudaDriverError as e:
            if not device_out_of_memory(e):
                raise
            raise BudgetExceeded(f"the device has no room for the plan for {why}: {e} "
                                 f"({describe_zones(self.device.ledger)}). Lower the batch or the length, or raise "
                                 f"the budget") from e

    def run(self, call):
        """`call()`, and where it fails for want of room or of a graph, the step again:
        - ORT needed more memory for a step than the plan set aside (measured, or ORT ran
          out before it could be): on the streaming engine, or resident weights that can
          move to it, the plan is made again with that room (twice the reserve when it was
          not measured); elsewhere, or a third time, BudgetExceeded naming the zones;
        - the streaming engine cannot build a step's graph (and the engine was not asked
          for by name): the weights move to segments, and the session says so."""
        attempt = -1
        while True:
            attempt += 1
            try:
                return call()
            except StreamingUnavailable as e:
                if self.config.engine == "graph" or not isinstance(self.runner, StreamEngine):
                    raise
                why = f"the streaming engine cannot run this model, so its weights run in segments: {e}"
                warnings.warn(why, OffloadWarning, stacklevel=4)
                self.notes.append(why)
                self.run_in_segments(self.plan)
                return call()
            except Exception as e:  # noqa: BLE001 - ORT's own types too: only an out-of-memory is taken here
                if isinstance(e, StepMemoryShort):
                    short = (str(e), e.needed, BudgetExceeded)
                elif device_out_of_memory(e):  # memory outside the ledger took what the plan counted on
                    short = (f"the device ran out of memory in a step: {e}", 0, BudgetExceeded)
                elif isinstance(e, OffloadError) or not is_out_of_memory(e):
                    raise
                else:  # also of ORT's type (Fail, ...), which code written for InferenceSession catches
                    short = (f"ORT ran out of memory in a step: {' '.join(str(e).split())[-300:]}", 0,
                             with_ort_type(BudgetExceeded, type(e)))
            # Past the except clause: the failed step's frames, which hold the ORT session
            # and so its arena, are let go before the plan is made again.
            message, needed, error_type = short
            if self.release_kept():
                attempt -= 1  # the kept generation's bytes first: not an attempt of its own
                continue
            if not self.graph_possible or attempt == 2:
                raise error_type(f"{message} ({describe_zones(self.device.ledger)}). Lower the batch, the inputs' "
                                 f"sizes or prefill_chunk (the prompt's tokens per step, now "
                                 f"{self.config.prefill_chunk}), or raise the budget")
            zones = self.device.ledger.snapshot().zones
            kv, scratch = self.needs or (zones["kv"].reserve, zones["scratch"].reserve)
            kv = max(kv, zones["kv"].committed.current)
            scratch = max(scratch, zones["scratch"].committed.current)
            scratch += needed or max(scratch, self.device.granularity)
            try:
                self.replan_engine(kv, scratch, "a step that needed more memory than was set aside")
            except StreamingUnavailable as e:
                raise engine_short(self, kv, scratch, e) from None

    def kv_short(self, nbytes: int, kv_peak: int, io_peak: int, boundary: int,
                 device_full: bool = False, at_chunk=None) -> Optional[str]:
        """See replan.kv_short."""
        return kv_short(self, nbytes, kv_peak, io_peak, boundary, device_full, at_chunk)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        if self.residency is not None:
            self.residency.close()
