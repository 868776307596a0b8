"""OffloadSession: a drop-in for onnxruntime.InferenceSession whose weights live in
stable slots under one committed-byte budget.

The model is optimized once; every weight (an initializer of at least
``min_weight_bytes``) gets a slot in the arena and is handed to ORT zero-copy through
``SessionOptions.add_initializer``. When the weights fit their allowance, one ORT
session runs the whole graph with every weight resident. When they do not and offload
is on, the graph is split into segments, each its own ORT session, whose weights the
residency manager pages in before it runs; boundary tensors live in fixed scratch
buffers bound through IOBinding, one set per input-shape signature. Under CUDA graph
capture each segment is captured once per signature and replayed while its weights page
in and out behind their fixed addresses.

On the CUDA EP every segment runs on the device's compute stream (ORT's
``user_compute_stream``), so a page-in is ordered before its readers by a stream wait on
its event, not by a host wait. ORT's own device memory (its arena, capped from the
scratch allowance, and cuBLAS's workspace) is measured with cuMemGetInfo and charged to
the scratch zone.
"""
from __future__ import annotations

import collections
import os
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

from . import _core
from .config import OffloadConfig
from .device import Device
from .errors import BudgetExceeded, CudaUnavailable, OffloadError, StateError
from .graph_capture import GraphCaptureDecision, resolve_graph_capture_enabled, structural_safety
from .host_store import HostStore
from .model import (OPTIMIZED_DATA, cache_key, materialize, optimization_level, optimize_once,
                    point_weights_at_placeholder, read_weights, save_model, weights_as_inputs)
from .residency import Counters, ResidencyManager
from .segmenter import Segment, dims, plan_segments, split
from .stats import OffloadStats

CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
_MAX_SIGNATURES = 4
# The gpu_graph_ids that run() captures under, apart from the small ids (0 by default)
# that callers pass to run_with_iobinding with their own buffers: a shared id would
# replay the caller's graph on the caller's buffers.
_FIRST_GRAPH_ID = 1 << 20
_OUTSIDE_MEASURED_RUNS = 3


def _normalize_providers(providers, provider_options):
    if providers is None:
        providers = [CPU_EP]
    names, options = [], []
    for i, p in enumerate(providers):
        if isinstance(p, tuple):
            names.append(p[0])
            options.append(dict(p[1]))
        else:
            names.append(p)
            options.append(dict(provider_options[i]) if provider_options else {})
    return names, options


def ortvalue_at(ptr: int, shape: Sequence[int], dtype: np.dtype, on_cuda: bool, device_id: int) -> ort.OrtValue:
    """A non-owning OrtValue over memory the arena owns (DLPack, zero-copy)."""
    cap = _core.make_dlpack(ptr, [int(d) for d in shape], np.dtype(dtype).name, 2 if on_cuda else 1, device_id)
    return ort.OrtValue(C.OrtValue.from_dlpack(cap, False))


def packed_cost(sizes: Sequence[int], granularity: int, vmm: bool) -> int:
    """Committed bytes of weights packed at 256-byte alignment from a granule boundary."""
    if not vmm:
        return sum(_core.plain_charge(n, granularity) for n in sizes)
    end = 0
    for n in sizes:
        end = -(-end // 256) * 256 + n
    return -(-end // granularity) * granularity


class IOInfo:
    """What get_inputs()/get_outputs() return for a split model (like ORT's NodeArg)."""

    def __init__(self, vi: onnx.ValueInfoProto):
        self.name = vi.name
        tt = vi.type.tensor_type
        self.type = f"tensor({onnx.helper.tensor_dtype_to_string(tt.elem_type).split('.')[-1].lower()})"
        self.shape = dims(tt)

    def __repr__(self):
        return f"IOInfo(name={self.name!r}, type={self.type!r}, shape={self.shape!r})"


class _SegmentRun:
    def __init__(self, seg: Segment, session: ort.InferenceSession, captured: bool):
        self.seg = seg
        self.session = session
        self.captured = captured  # created with enable_cuda_graph


class _Plan:
    """Fixed buffers for one set of input shapes: every segment input and output."""

    def __init__(self, graph_id: int):
        self.buffers: Dict[str, tuple] = {}  # name -> (ptr, shape, dtype, OrtValue)
        self.graph_id = graph_id  # ORT's gpu_graph_id for captured segments; -1: not captured
        self.runs = 0


class OffloadSession:
    def __init__(self, path_or_bytes, sess_options: Optional[ort.SessionOptions] = None, providers=None,
                 provider_options=None, *, config: Optional[OffloadConfig] = None, progress=None,
                 record_timeline: bool = False, **config_kwargs):
        self._closed = True
        if config is not None and config_kwargs:
            raise TypeError("pass either config= or configuration keywords, not both")
        self.config = config if config is not None else OffloadConfig.from_env(**config_kwargs)
        names, options = _normalize_providers(providers, provider_options)
        unknown = [n for n in names if n not in (CUDA_EP, CPU_EP)]
        if unknown:
            raise ValueError(f"OffloadSession supports {CUDA_EP} and {CPU_EP}, not {', '.join(unknown)}")
        self._on_cuda = names[0] == CUDA_EP
        if self._on_cuda and CUDA_EP not in ort.get_available_providers():
            raise CudaUnavailable("this onnxruntime has no CUDA execution provider: install onnxruntime-gpu")
        self._cuda_options = options[0] if self._on_cuda else {}
        self._user_options = sess_options
        self._workdir = tempfile.mkdtemp(prefix="onnx-offload-")
        self._sessions: List[_SegmentRun] = []
        self._initializer_values: List[ort.OrtValue] = []
        self._plans: "collections.OrderedDict[tuple, _Plan]" = collections.OrderedDict()
        self._next_graph_id = _FIRST_GRAPH_ID
        self._residency = None
        self._store = None
        self._device = None
        self._final_ledger = None
        self._outside = 0
        self._ort_owned = 0
        self._runs = 0
        self._notes: List[str] = []
        try:
            self._device = Device("cuda" if self._on_cuda else "host", self.config)
            if self._device.budget_note:
                self._notes.append(self._device.budget_note)
            self._build(path_or_bytes, progress, record_timeline)
        except BaseException:
            self._teardown()
            raise
        self._closed = False

    # ------------------------------------------------------------------ construction
    def _build(self, path_or_bytes, progress, record_timeline):
        cfg, dev = self.config, self._device
        src = materialize(path_or_bytes, self._workdir)
        level = optimization_level(cfg.optimization_level, self._user_options)
        if cfg.cache_dir:
            opt_dir = os.path.join(cfg.cache_dir, cache_key(src, self._on_cuda, level, cfg.min_weight_bytes))
            if not os.path.isdir(opt_dir):
                # Optimize beside the cache entry, then publish it with one rename.
                os.makedirs(cfg.cache_dir, exist_ok=True)
                tmp = tempfile.mkdtemp(dir=cfg.cache_dir, prefix=".partial-")
                optimize_once(src, tmp, self._on_cuda, level, cfg.min_weight_bytes, dev, self._notes)
                try:
                    os.rename(tmp, opt_dir)
                except OSError:  # another process published it first
                    shutil.rmtree(tmp, ignore_errors=True)
        else:
            opt_dir = self._workdir
        opt_path = optimize_once(src, opt_dir, self._on_cuda, level, cfg.min_weight_bytes, dev, self._notes)
        model = onnx.load(opt_path, load_external_data=False)
        weights = read_weights(model)
        self._weights = weights
        self._graph_inputs = [IOInfo(v) for v in model.graph.input]
        self._graph_outputs = [IOInfo(v) for v in model.graph.output]
        names = {w.name for w in weights}
        sizes = {w.name: w.nbytes for w in weights}
        stable = (not cfg.offload) or cfg.vmm
        self._vmm = stable
        g = dev.granularity

        def cost(ns):
            return packed_cost([sizes[n] for n in ns], g, stable)

        ledger = dev.ledger
        snap = ledger.snapshot()["zones"]
        others = snap["scratch"]["reserve"] + snap["kv"]["reserve"]
        usable = dev.budget - others
        if weights:
            largest = max(weights, key=lambda w: w.nbytes)
            if cost([largest.name]) > usable:
                raise BudgetExceeded(
                    f"the budget of {dev.budget} bytes ({usable} after the scratch and KV reserves) cannot hold "
                    f"the largest weight {largest.name!r} ({cost([largest.name])} committed bytes)")
        total = cost([w.name for w in weights])
        allowance = snap["weights"]["allowance"]
        if total <= min(allowance, usable):
            groups = [list(range(len(model.graph.node)))]
        elif not cfg.offload:
            raise BudgetExceeded(
                f"the weights need {total} committed bytes but the weights zone allows "
                f"{min(allowance, usable)}: set ONNX_GENAI_WEIGHT_OFFLOAD=1 (offload=True) to stream them, "
                f"or raise the budget")
        else:
            target = cfg.segment_bytes or max(cost([largest.name]), min(allowance, usable) // 4)
            groups = plan_segments(model, cost, names.__contains__, target)
        self._multi = len(groups) > 1

        if stable:
            point_weights_at_placeholder(model, names)
        else:
            weights_as_inputs(model, weights)
        if self._multi:
            segments = split(model, groups, names.__contains__)
        else:
            seg_weights = [w.name for w in weights]
            segments = [Segment(0, groups[0], seg_weights, [v.name for v in self._graph_inputs if v.name not in names],
                                [v.name for v in self._graph_outputs], model)]

        # Budget: the transient zone holds the largest streamed segment; the weights zone the rest.
        if self._multi:
            # A segment's pack may start inside a granule: one more than its packed cost.
            streamed = max(cost(s.weights) for s in segments) + (g if stable else 0)
            if streamed > usable:
                raise BudgetExceeded(f"a segment needs {streamed} committed bytes, more than the usable budget {usable}")
            dev.set_transient_reserve(streamed)
            dev.set_weights_allowance(max(0, min(allowance, usable - streamed)))

        safe, why = structural_safety(model)
        self._capture = resolve_graph_capture_enabled(
            on_cuda=self._on_cuda, offload=cfg.offload, stable_addresses=stable,
            override=cfg.graph_override, env_value=cfg.cuda_graph, structurally_safe=safe, safety_reason=why)

        self._store = HostStore(dev.backend, weights)
        self._store.fill_from_file(os.path.join(opt_dir, OPTIMIZED_DATA), weights, progress)
        self._residency = ResidencyManager(dev, self._store, weights, [s.weights for s in segments],
                                           cfg.policy, vmm=stable, record_timeline=record_timeline)
        if not self._multi:
            self._residency.make_all_resident()
            for s in self._residency.slots.values():
                s.pin()  # resident for the session's life, safe under captured replays

        for seg in segments:
            self._sessions.append(self._create_segment_session(seg))
        if self._capture.enabled and self._multi:
            n = sum(r.captured for r in self._sessions)
            self._capture = GraphCaptureDecision(
                n > 0, f"{self._capture.reason}; per segment: {n} of {len(self._sessions)} captured, once per "
                       f"input-shape signature, and replayed while their weights page behind fixed addresses")
        self._residency.counters = Counters()  # count runs, not the page-ins of construction

    def _session_options(self) -> ort.SessionOptions:
        so = ort.SessionOptions()
        user = self._user_options
        if user is not None:
            for attr in ("intra_op_num_threads", "inter_op_num_threads", "execution_mode", "log_severity_level",
                         "log_verbosity_level", "enable_cpu_mem_arena", "enable_mem_pattern", "enable_mem_reuse",
                         "use_deterministic_compute", "logid", "enable_profiling", "profile_file_prefix"):
                setattr(so, attr, getattr(user, attr))
        # The graph was optimized once already: nothing may replace the weights now.
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.add_session_config_entry("session.disable_prepacking", "1")
        return so

    def _provider_list(self, capture: bool):
        if not self._on_cuda:
            return [CPU_EP]
        opts = {k: str(v) for k, v in self._cuda_options.items()}
        opts["device_id"] = str(self.config.device_id)
        opts["has_user_compute_stream"] = "1"
        opts["user_compute_stream"] = str(self._device.compute_stream.native)
        # ORT's own arena, capped from the scratch allowance; what it takes is measured and
        # charged. (With ORT 1.31.1 the external allocator cannot be used here: with it ORT
        # reads initializers from the model file instead of the add_initializer values, and
        # it breaks capture.)
        opts["arena_extend_strategy"] = "kSameAsRequested"
        opts["gpu_mem_limit"] = str(max(self._device.ledger.headroom("scratch"), self._device.granularity))
        if capture:
            opts["enable_cuda_graph"] = "1"
        return [(CUDA_EP, opts), CPU_EP]

    def _create_segment_session(self, seg: Segment) -> _SegmentRun:
        res = self._residency
        path = save_model(seg.model, os.path.join(self._workdir, f"segment{seg.index}.onnx"))
        so = self._session_options()
        if self._vmm:
            if self._multi:
                ready = res.acquire(seg.index)
                if ready is not None:
                    ready.synchronize()
            for name in seg.weights:
                slot = res.slots[name]
                info = res.info[name]
                value = ortvalue_at(slot.va, info.shape, info.dtype, self._on_cuda, self.config.device_id)
                so.add_initializer(name, value)
                self._initializer_values.append(value)
        mark = self._outside_mark()
        try:
            session, captured = self._make_session(path, so, seg)
        finally:
            if self._vmm and self._multi:
                res.release(seg.index, None)
        # What ORT committed while creating the session: its own initializers (small
        # constants, any copy it makes) and its workspaces.
        self._ort_owned += self._charge_outside(mark)
        return _SegmentRun(seg, session, captured)

    def _make_session(self, path: str, so: ort.SessionOptions, seg: Segment):
        """(session, captured). ORT refuses capture when it places nodes on the CPU; that
        segment then runs without it, and the others keep theirs."""
        if not self._capture.enabled:
            return ort.InferenceSession(path, so, providers=self._provider_list(False)), False
        try:
            return ort.InferenceSession(path, so, providers=self._provider_list(True)), True
        except Exception as e:  # noqa: BLE001 - ORT raises its own types
            msg = str(e)
            if "CUDA Graph" not in msg:
                raise
            why = f"ORT refused capture: {msg.strip()[:200]}"
            if self._multi:
                self._notes.append(f"segment {seg.index} runs without capture: {why}")
            else:
                self._capture = GraphCaptureDecision(False, why)
            return ort.InferenceSession(path, so, providers=self._provider_list(False)), False

    # ------------------------------------------------------------------ outside bytes
    def _outside_mark(self):
        if not self._on_cuda:
            return None
        free, _ = self._device.backend.mem_info()
        snap = self._device.ledger.snapshot()
        return free, snap["committed"] + snap["pooled"]

    def _charge_outside(self, mark) -> int:
        """Charges device memory that appeared outside the arena since `mark` (ORT's
        arena and initializers, cuBLAS/cuDNN workspaces); returns the bytes charged."""
        if mark is None:
            return 0
        free0, ours0 = mark
        free1, _ = self._device.backend.mem_info()
        snap = self._device.ledger.snapshot()
        grown = (free0 - free1) - (snap["committed"] + snap["pooled"] - ours0)
        g = self._device.granularity
        grown = (grown // g) * g
        if grown <= 0:
            return 0
        self._device.ledger.charge("scratch", grown, outside=True)
        self._outside += grown
        return grown

    # ------------------------------------------------------------------ running
    def _check_open(self):
        if self._closed:
            raise StateError("the session is closed")

    def run(self, output_names, input_feed: Dict[str, Any], run_options=None):
        self._check_open()
        if not self._multi and not self._capture.enabled:
            mark = self._outside_mark() if self._runs < _OUTSIDE_MEASURED_RUNS else None
            out = self._sessions[0].session.run(output_names, input_feed, run_options)
            self._after_single_run(mark)
            return out
        # Split graphs, and any graph under capture (ORT replays only through IOBinding with
        # fixed buffers): the segment loop binds fixed buffers per input shape.
        values = self._run_segments(input_feed, run_options)
        outs = [values[n].numpy() for n in (output_names or [o.name for o in self._graph_outputs])]
        # On CUDA numpy() is already a host copy; on the CPU it aliases the fixed buffer
        # that the next step overwrites.
        return outs if self._on_cuda else [o.copy() for o in outs]

    def _after_single_run(self, mark) -> None:
        c = self._residency.counters
        n = len(self._weights)
        c.steps += 1
        c.accesses += n
        c.hits += n
        nbytes = self._store.nbytes if self._store else 0
        c.access_bytes += nbytes
        c.hit_bytes += nbytes
        if self._residency.timeline is not None:
            self._residency.timeline.append(self._residency._snapshot_states())
        self._runs += 1
        self._charge_outside(mark)

    def _feed_value(self, value) -> ort.OrtValue:
        if isinstance(value, ort.OrtValue):
            return value
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value))

    def _run_segments(self, input_feed: Dict[str, Any], run_options=None) -> Dict[str, ort.OrtValue]:
        """One step through every segment. The first step of an input-shape signature
        passes ORT's own outputs along and sizes the fixed buffers from them; later steps
        bind those buffers, so every segment reads and writes the same addresses each step
        (which is what a captured segment replays)."""
        dev, res = self._device, self._residency
        feeds = {k: self._feed_value(v) for k, v in input_feed.items()}
        sig = tuple(sorted((k, tuple(v.shape()), v.data_type()) for k, v in feeds.items()))
        plan = self._plans.get(sig)
        if plan is not None:
            self._plans.move_to_end(sig)
            for name, v in feeds.items():
                if name in plan.buffers:
                    self._copy_into(plan.buffers[name], v)
        measured = plan is None or plan.runs < _OUTSIDE_MEASURED_RUNS  # capture happens on an early run
        mark = self._outside_mark() if measured else None
        graph_options = self._graph_run_options(plan, run_options)
        values: Dict[str, ort.OrtValue] = {}
        device_name = "cuda" if self._on_cuda else "cpu"
        before = Counters(**vars(res.counters))
        for run in self._sessions:
            seg = run.seg
            ready = res.acquire(seg.index)
            try:
                if ready is not None:
                    if self._on_cuda:
                        # ORT runs the segment on the compute stream: a stream wait orders
                        # its reads after the copy without blocking the host.
                        ready.wait_on(dev.compute_stream)
                    else:
                        ready.synchronize()  # the CPU EP reads on this thread
                io = run.session.io_binding()
                for name in seg.inputs:
                    if plan is not None:
                        io.bind_ortvalue_input(name, plan.buffers[name][3])
                    else:
                        io.bind_ortvalue_input(name, values[name] if name in values else feeds[name])
                if not self._vmm:
                    for name in seg.weights:
                        slot, info = res.slots[name], res.info[name]
                        io.bind_input(name, device_name, self.config.device_id, info.dtype, list(info.shape), slot.va)
                for name in seg.outputs:
                    if plan is not None:
                        io.bind_ortvalue_output(name, plan.buffers[name][3])
                    else:
                        io.bind_output(name, device_name, self.config.device_id)
                run.session.run_with_iobinding(io, graph_options if run.captured else run_options)
                for name, v in zip(seg.outputs, io.get_outputs()):
                    if plan is not None and v.data_ptr() != plan.buffers[name][0]:
                        raise StateError(f"ORT wrote boundary tensor {name!r} outside its fixed buffer")
                    values[name] = v
                # The segment's reads end here: ORT synchronizes its stream before returning,
                # and this event, on that stream, orders every later unmap after it.
                reader = dev.backend.create_event()
                reader.record(dev.compute_stream)
            except BaseException:
                res.release(seg.index, None)
                raise
            res.release(seg.index, reader)
        res.end_step()
        self._last_step = res.counters.minus(before)
        self._runs += 1
        self._charge_outside(mark)
        if plan is None:
            self._make_plan(sig, feeds, values)
        else:
            plan.runs += 1
        return values

    def _graph_run_options(self, plan: Optional[_Plan], user: Optional[ort.RunOptions]) -> Optional[ort.RunOptions]:
        """Run options for captured segments: the plan's gpu_graph_id, or -1 (neither
        capture nor replay) while a signature has no fixed buffers yet."""
        if not self._capture.enabled:
            return user
        ro = ort.RunOptions()
        if user is not None:
            for attr in ("log_severity_level", "log_verbosity_level", "logid", "only_execute_path_to_fetches"):
                setattr(ro, attr, getattr(user, attr))
        ro.add_run_config_entry("gpu_graph_id", str(plan.graph_id if plan is not None else -1))
        return ro

    def _copy_into(self, entry, value: ort.OrtValue) -> None:
        """Copies `value` into a fixed buffer, in order on the compute stream."""
        ptr, shape, dtype, target = entry
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if tuple(value.shape()) != tuple(shape) or numpy_dtype(value.data_type()) != np.dtype(dtype):
            raise ValueError(f"a {value.data_type()} {value.shape()} value does not fit a {np.dtype(dtype)} "
                             f"{list(shape)} buffer")
        backend, stream = self._device.backend, self._device.compute_stream
        src_host = value.device_name().lower() == "cpu"
        dst_host = target.device_name().lower() == "cpu"
        if not self._on_cuda or (src_host and dst_host):
            # Host memory on both sides (the host backend's device memory is host memory).
            backend.copy_h2d(ptr, value.data_ptr(), nbytes, stream)
            stream.synchronize()
        elif src_host:
            backend.copy_h2d(ptr, value.data_ptr(), nbytes, stream)
            stream.synchronize()  # the source is the caller's memory
        elif dst_host:
            backend.copy_d2h(ptr, value.data_ptr(), nbytes, stream)
            stream.synchronize()
        else:
            backend.copy_d2d(ptr, value.data_ptr(), nbytes, stream)

    def _detached(self, value: ort.OrtValue) -> ort.OrtValue:
        """A copy of `value` in memory of its own, on the same device."""
        if value.device_name().lower() == "cpu":
            return ort.OrtValue.ortvalue_from_numpy(np.array(value.numpy(), copy=True))
        dtype = numpy_dtype(value.data_type())
        out = ort.OrtValue.ortvalue_from_shape_and_type(value.shape(), dtype, "cuda", self.config.device_id)
        self._copy_into((out.data_ptr(), value.shape(), dtype, out), value)
        return out

    def _make_plan(self, sig, feeds, values) -> None:
        """Fixed buffers for these input shapes, so later steps bind the same addresses.
        Under capture a plan lives as long as the session (its captured graphs point at
        it), so at most _MAX_SIGNATURES shapes are captured; others run uncaptured."""
        capturing = self._capture.enabled
        if capturing and len(self._plans) >= _MAX_SIGNATURES:
            return
        plan = _Plan(self._next_graph_id if capturing else -1)
        scratch = self._device.scratch
        needed = set()
        for run in self._sessions:
            needed.update(run.seg.inputs)
            needed.update(run.seg.outputs)
        try:
            for name in sorted(needed):
                v = values[name] if name in values else feeds[name]
                shape = list(v.shape())
                dtype = numpy_dtype(v.data_type())
                nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
                ptr = scratch.allocate(nbytes)
                plan.buffers[name] = (ptr, shape, dtype, ortvalue_at(ptr, shape, dtype, self._on_cuda, self.config.device_id))
        except BaseException:
            self._free_plan(plan)
            raise
        if capturing:
            self._next_graph_id += 1
        self._plans[sig] = plan
        while len(self._plans) > _MAX_SIGNATURES:
            _, old = self._plans.popitem(last=False)
            self._free_plan(old)

    def _free_plan(self, plan: _Plan) -> None:
        if self._device is None or self._device.scratch is None:
            return
        for ptr, *_ in plan.buffers.values():
            self._device.scratch.deallocate(ptr)
        plan.buffers.clear()

    # ------------------------------------------------------------------ IOBinding
    def io_binding(self):
        self._check_open()
        if not self._multi:
            return self._sessions[0].session.io_binding()
        return OffloadIOBinding(self)

    def run_with_iobinding(self, iobinding, run_options=None):
        self._check_open()
        if not self._multi:
            mark = self._outside_mark() if self._runs < _OUTSIDE_MEASURED_RUNS else None
            self._sessions[0].session.run_with_iobinding(iobinding, run_options)
            self._after_single_run(mark)
            return
        if not isinstance(iobinding, OffloadIOBinding):
            raise TypeError("a split OffloadSession takes the binding from its own io_binding()")
        iobinding._run(run_options)

    # ------------------------------------------------------------------ introspection
    def get_inputs(self):
        return self._sessions[0].session.get_inputs() if not self._multi else list(self._graph_inputs)

    def get_outputs(self):
        return self._sessions[0].session.get_outputs() if not self._multi else list(self._graph_outputs)

    def get_providers(self):
        return self._sessions[0].session.get_providers()

    def get_session_options(self):
        return self._sessions[0].session.get_session_options()

    @property
    def graph_capture(self) -> GraphCaptureDecision:
        return self._capture

    @property
    def segments(self) -> List[Segment]:
        return [r.seg for r in self._sessions]

    @property
    def device(self) -> Device:
        return self._device

    @property
    def residency(self) -> ResidencyManager:
        return self._residency

    def stats(self) -> OffloadStats:
        dev, res = self._device, self._residency
        closed = self._closed
        ledger = self._final_ledger if closed else dev.ledger.snapshot()
        notes = list(self._notes)
        return OffloadStats(
            backend=dev.kind, policy=self.config.policy, vmm=self._vmm, segments=len(self._sessions) or 0,
            weights=len(self._weights), weight_bytes=sum(w.nbytes for w in self._weights),
            capture=f"{'on' if self._capture.enabled else 'off'}: {self._capture.reason}",
            ledger=ledger, arena=dev.arena.stats(), driver=dev.backend.counters(),
            counters=Counters(**vars(res.counters)) if res else Counters(),
            last_step=getattr(self, "_last_step", Counters()),
            scratch=dev.scratch.stats() if dev.scratch is not None else {},
            ort_owned_bytes=self._ort_owned, outside_bytes=self._outside, notes=tuple(notes))

    # ------------------------------------------------------------------ closing
    def close(self) -> dict:
        """Releases every byte; returns the final ledger snapshot (all zones at 0)."""
        if self._closed:
            return self._final_ledger
        self._teardown()
        self._closed = True
        return self._final_ledger

    def _teardown(self) -> None:
        if self._device is not None and not self._device.closed:
            self._device.compute_stream.synchronize()
        self._sessions = []  # ORT sessions go first: they may still free scratch blocks
        self._initializer_values = []
        for plan in self._plans.values():
            self._free_plan(plan)
        self._plans.clear()
        if self._residency is not None:
            self._residency.close()
        if self._device is not None:
            if self._outside:
                self._device.ledger.refund("scratch", self._outside, outside=True)
                self._outside = 0
            self._final_ledger = self._device.close()
        if self._store is not None:
            self._store.close()
            self._store = None
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception as e:  # noqa: BLE001 - never raise from a finalizer
                print(f"onnx_offload: closing a session at exit failed: {e}", file=sys.stderr)


_ORT_TO_NP = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int8)": np.int8, "tensor(int16)": np.int16, "tensor(int32)": np.int32, "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}


def numpy_dtype(type_str: str) -> np.dtype:
    """The numpy dtype of an ORT type string such as 'tensor(float16)'."""
    if type_str == "tensor(bfloat16)":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    if type_str not in _ORT_TO_NP:
        raise OffloadError(f"boundary tensors of type {type_str} are not supported")
    return np.dtype(_ORT_TO_NP[type_str])


class OffloadIOBinding:
    """IOBinding for a split session: inputs and outputs of the whole graph, routed to
    the segments that consume and produce them."""

    def __init__(self, session: OffloadSession):
        self._session = session
        self._inputs: Dict[str, ort.OrtValue] = {}
        self._outputs: Dict[str, Optional[ort.OrtValue]] = {}
        self._results: Dict[str, ort.OrtValue] = {}

    def bind_cpu_input(self, name, arr):
        self._inputs[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr))

    def bind_ortvalue_input(self, name, value):
        self._inputs[name] = value

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr):
        on_cuda = str(device_type).lower() == "cuda"
        self._inputs[name] = ortvalue_at(buffer_ptr, shape, np.dtype(element_type), on_cuda, device_id)

    def bind_output(self, name, device_type="cpu", device_id=0, element_type=None, shape=None, buffer_ptr=None):
        if buffer_ptr is not None:
            on_cuda = str(device_type).lower() == "cuda"
            self._outputs[name] = ortvalue_at(buffer_ptr, shape, np.dtype(element_type), on_cuda, device_id)
        else:
            self._outputs[name] = None

    def bind_ortvalue_output(self, name, value):
        self._outputs[name] = value

    def clear_binding_inputs(self):
        self._inputs.clear()

    def clear_binding_outputs(self):
        self._outputs.clear()
        self._results.clear()

    def synchronize_inputs(self):
        pass

    def synchronize_outputs(self):
        self._session._device.compute_stream.synchronize()

    def _run(self, run_options):
        values = self._session._run_segments(self._inputs, run_options)
        names = list(self._outputs) or [o.name for o in self._session._graph_outputs]
        self._results = {}
        for n in names:
            target = self._outputs.get(n)
            if target is not None:
                self._session._copy_into((target.data_ptr(), target.shape(), numpy_dtype(target.data_type()), target),
                                         values[n])
                self._results[n] = target
            else:
                # Its own copy, as ORT returns: the fixed buffer is overwritten next step.
                self._results[n] = self._session._detached(values[n])
        self._session._device.compute_stream.synchronize()

    def get_outputs(self):
        return list(self._results.values())

    def copy_outputs_to_cpu(self):
        return [np.array(v.numpy(), copy=True) for v in self._results.values()]
