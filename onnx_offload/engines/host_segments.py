"""Host compute where the weights stream in segments: the host backend (docs/host_compute.md).

The host backend captures no graphs, so the host's part cannot sit inside a step graph;
the segment runner does it between segments instead. The model rewritten for the split
(``loading.rewrite_for_host``) is cut with a segment boundary before each host MatMul's
Where, so the segment that makes a host MatMul's X ends before the one that reads its Y.
Between the two the runner multiplies X by the weight where it lies in the pinned store,
with the compiled core's host kernels, and binds the product as Y. The host's weights are
in no segment: they are never paged in.

It runs where a thread count asks for it (``host_compute=N``); ``auto`` leaves it off here:
the host backend's device is the host's own cores, so there is no second link to add, and
each host MatMul costs a segment boundary (an ORT run, the page-in bookkeeping) that the
planner, made for a captured step, does not count. Measured on a 2-core CI machine, a
13.7 MiB decoder on a 4.1 MiB card decoded at 43.8 ms/token with it against 19.1 without;
a 4-layer decoder of hidden 1024 at 84-124 against 126-145.

The split is chosen as the streaming engine's is (``host_step.choose_split``), from rates
measured when the runner is made: the copy into device memory (on the host backend a copy
into the arena) and the host GEMV while those copies run. Every weight of a streaming plan
counts as streamed. One set of segments runs every step. A step of a few rows (at most
PREFILL_TOKENS) has the host kernels multiply; a larger one (a prompt), which they are not
made for, runs each host MatMul as a one-node ORT session whose initializers are the
weights where they lie in the store: ORT's own CPU kernel, with the segments' session
options (no prepacking), gives what that MatMul gives with host compute off.

On the host backend ORT's CPU kernels run on the host pool's cores right after each host
MatMul, so the pool's workers sleep after a job instead of spinning for the next one
(unless ONNX_OFFLOAD_HOST_SPIN_US says otherwise): spinning, they would take those cores.
The bound is the process's: it is 0 from a step's first host MatMul until the last
HostSteps that ran one closes, and then what it was before (``QuietPool``).
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from onnxruntime.capi.onnxruntime_pybind11_state import Fail

from .. import _core
from ..errors import BudgetExceeded, HostComputeRefused, ModelRunError, with_ort_type
from ..loading import (CPU_EP, HostMatMul, Segment, plan_segments, point_weights_at_placeholder, save_model,
                       segment_weights, split)
from ..memory import PREFILL_TOKENS
from .host_step import COPY_BYTES, HostPlan, gemv, weight_views, choose_split
from .ortvalues import as_ortvalue, copy_into, ortvalue_at

SPIN_ENV = "ONNX_OFFLOAD_HOST_SPIN_US"
FIT_TRIES = 8  # segment targets tried (each 3/4 of the one before) for segments that fit the plan


def plan_for_segments(mode, device, store, run) -> Tuple[Optional[HostPlan], str]:
    """The split for streamed segments (see the module's docstring), or (None, why not).
    Under "auto" whatever the rewrite or the measurement meets leaves host compute off; a
    thread count given raises it, as the streaming engine's does. `run`: the engines'
    RunInputs."""
    if mode == "off":
        return None, "host compute is off"
    if device.is_cuda:
        return None, ("host compute is off: on CUDA it runs inside the streaming engine's captured step, and this "
                      "session's weights run in segments")
    if mode == "auto":
        return None, ("host compute is off: on the host backend the device's cores are the host's, so the split adds "
                      "no second link, and each host MatMul costs a segment boundary the planner does not count; "
                      "a thread count (host_compute=N) runs it")
    if run.routing is not None:
        return None, "host compute is off: the model's experts are routed between its segments"
    if not run.stable:
        return None, "host compute is off: the weights are bound as inputs without stable addresses (vmm=False)"
    info = {w.name: w for w in run.weights}
    streamed = [w.name for w in run.weights]  # in first-use order
    if not streamed:
        return None, "host compute is off: the model has no weights to stream"
    nbytes = min(COPY_BYTES, max(w.nbytes for w in run.weights))
    try:
        dst = device.scratch.allocate(nbytes)
    except BudgetExceeded as e:
        return None, f"host compute is off: no room to measure the copies' rate ({e})"
    try:
        return choose_split(mode, device, store, run.model, streamed, 0.0, info, dst)
    except Exception as e:  # noqa: BLE001 - under "auto", whatever the rewrite meets turns it off
        if mode != "auto":
            raise
        return None, f"host compute is off: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
    finally:
        device.scratch.deallocate(dst)


def host_segments_of(engines, plan) -> Optional[List[Segment]]:
    """The segments of the streaming `plan` with the host's part between them, or None where
    host compute does not run (the split, chosen once, is kept in ``engines.host_split``
    with what it does or why it is off, which the notes say). `engines`: the Engines.

    The plan sets aside what paging in its largest segment of the model as given commits
    (the transient zone's reserve). The rewrite's segments lay the slots out otherwise (the
    host's weights in none of them), so one may straddle a granule more: those of smaller
    targets are tried, and where none fits, this plan runs the model as given
    (``engines.host_unfit`` says why)."""
    run = engines.run_inputs
    engines.host_unfit = ""
    if engines.host_split is None:
        mode = engines.config.host_compute
        engines.host_split = plan_for_segments(mode, engines.device, engines.store, run)
        if mode != "off":
            engines.notes.append(engines.host_split[1])
    host = engines.host_split[0]
    if host is None:
        return None
    room, costs = plan.zones["transient"].reserve, run.plan_inputs["segment_costs"]
    target, need = plan.segment_target, 0
    def fits(weights_of_each: List[List[str]]) -> bool:
        nonlocal need
        need = max(costs(weights_of_each), default=0)
        return need <= room

    try:
        for _ in range(FIT_TRIES):
            segments = host_segments(host, run.weights, engines.cost, target, fits)
            if segments is not None:
                return segments
            target = max(1, target * 3 // 4)
    except HostComputeRefused as e:
        if engines.config.host_compute != "auto":
            raise
        engines.host_split = (None, f"host compute is off: {e}")
        engines.notes.append(engines.host_split[1])
        return None
    engines.host_unfit = (f"host compute is off under this budget plan: paging in a segment of the model rewritten "
                          f"for it commits up to {need} bytes, more than the {room} the plan sets aside for one")
    engines.notes.append(engines.host_unfit)
    return None


def host_steps_for(engines, plan, segments: List[Segment]) -> Tuple[Optional["HostSteps"], str]:
    """(The host's part for a runner of `segments` under `plan`, or None; what it does or why
    it is off.)"""
    host, note = engines.host_split or (None, "host compute is off")
    if engines.config.host_compute == "off":
        return None, "host compute is off"
    if not plan.streaming:
        return None, "host compute is off: every weight is resident"
    if host is None or not any(h.y_input in s.inputs for s in segments for h in host.hosts):
        # Segments of the model as given: by the split, or by this plan (host_segments_of sets host_unfit).
        return None, getattr(engines, "host_unfit", "") or note
    run = engines.run_inputs
    return HostSteps(host, segments, engines.store, {w.name: w for w in run.weights}, engines.device,
                     engines.segment_factory.session_options, run.workdir, run.model), note


def host_segments(host: HostPlan, weights, cost, target: int,
                  fits: Callable[[List[List[str]]], bool] = lambda weights_of_each: True) -> Optional[List[Segment]]:
    """The segments of the rewrite `host.model`, planned for `target` as plan_inputs plans
    them, with a boundary before each host MatMul's Where, or None where `fits(the weights of
    each)` says they do not fit. `weights`: every WeightInfo of the model (the host's are in
    no segment). HostComputeRefused where a Where would share a segment with its X's
    producer."""
    g = host.model.graph
    names = {w.name for w in weights} - set(host.host_weights)
    wheres = {h.output for h in host.hosts}
    hard = {i for i, n in enumerate(g.node) if n.op_type == "Where" and n.output[0] in wheres}
    groups = plan_segments(host.model, cost, names.__contains__, target, hard=hard)
    if not fits([segment_weights(host.model, grp, names.__contains__) for grp in groups]):
        return None
    segments = split(host.model, groups, names.__contains__)
    made = {o: s.index for s in segments for o in s.outputs}
    for s in segments:
        for h in host.hosts:
            if h.y_input in s.inputs and made.get(h.x_output, -1) >= s.index:
                raise HostComputeRefused(f"the segments cannot compute {h.node!r} between them", list(h.weights))
    return segments


class HostSteps:
    """The host's part of a step in segments: after each segment, the host MatMuls whose X
    it made (``after(index, ...)``; index -1: those whose X is a graph input, before the
    first segment)."""

    def __init__(self, plan: HostPlan, segments: List[Segment], store, info: Mapping, device,
                 options: Callable[[], ort.SessionOptions], workdir: str, model: onnx.ModelProto):
        self.plan, self.device, self.store, self.info = plan, device, store, info
        self._options, self._workdir = options, workdir  # for the one-node sessions
        self._sessions: Dict[str, ort.InferenceSession] = {}  # by Y input, made at the first prompt
        # Each host MatMul's node in the model as given (`model`), by its Y input.
        by_output = {n.output[0]: n for n in model.graph.node if n.output}
        self._nodes = {h.y_input: by_output[h.output] for h in plan.hosts}
        self._values: List[ort.OrtValue] = []  # their initializers, over the store
        made = {o: s.index for s in segments for o in s.outputs}
        self._after: Dict[int, List[HostMatMul]] = {}
        for h in plan.hosts:
            self._after.setdefault(made.get(h.x_output, -1), []).append(h)
        # Each host MatMul's weights where they lie in the pinned store.
        # (An int4 weight's K is its node's, which its blocks may pad.)
        self._views = {h.y_input: dict(weight_views(store, h.kind, [info[n] for n in h.weights]), k=h.k)
                       for h in plan.hosts}
        self.steps = 0
        self._quiet = False  # whether this holds the host pool's spin bound at 0 (QUIET)

    def after(self, index: int, values: Dict, bound: Mapping, feeds: Mapping, plan) -> None:
        """Computes the Ys of the host MatMuls segment `index` made the X of: into the plan's
        fixed buffer where it has one (its bindings hold that address), else into `values`.
        X is this step's value, the caller's bound output, or a feed."""
        if not self._quiet and not self.device.is_cuda and self._after.get(index):
            self._quiet = QUIET.hold()
        for h in self._after.get(index, ()):
            name = h.x_output
            x = values[name] if name in values else bound[name] if name in bound else feeds[name]
            x = np.asarray(x.numpy())
            if x.shape[-1:] != (h.k,):  # as ORT's MatMul refuses it (a graph input's K is the caller's)
                raise with_ort_type(ModelRunError, Fail)(
                    f"MatMul dimension mismatch in {h.node!r}: its input {name!r} is {list(x.shape)}, and its "
                    f"weight's K is {h.k}")
            v = self._views[h.y_input]
            x2 = np.ascontiguousarray(x.reshape(-1, h.k).astype(v["x_dtype"], copy=False))
            if x2.shape[0] == 0:  # an empty batch or sequence: an empty product, as ORT gives
                y = np.zeros((0, h.n), h.y_dtype)
            elif x2.shape[0] > PREFILL_TOKENS:
                y = self._session(h).run(None, {"x": x2})[0]
            else:
                y = gemv(v, x2, self.plan.threads)
            y = y.reshape(x.shape[:-1] + (h.n,))
            buf = plan.buffers.get(h.y_input) if plan is not None else None
            if buf is not None:
                copy_into(self.device, buf, as_ortvalue(y))
            else:
                values[h.y_input] = as_ortvalue(y)

    def _session(self, h: HostMatMul) -> ort.InferenceSession:
        """The one-node ORT session of host MatMul `h`, its weights read where they lie."""
        if h.y_input not in self._sessions:
            t = helper.np_dtype_to_tensor_dtype(h.y_dtype)
            node = onnx.NodeProto()
            node.CopyFrom(self._nodes[h.y_input])  # its attributes too (accuracy_level, ...)
            node.input[0], node.output[0] = "x", "y"
            g = helper.make_graph([node], "host_matmul", [helper.make_tensor_value_info("x", t, ["m", h.k])],
                                  [helper.make_tensor_value_info("y", t, ["m", h.n])])
            opsets = [helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)]
            so = self._options()
            for name in h.weights:  # declared with no data: add_initializer gives it (save_model)
                w = self.info[name]
                t = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(w.dtype), dims=w.shape)
                g.initializer.append(t)
                value = ortvalue_at(self.store.ptr(name), w.shape, w.dtype, False, 0)
                so.add_initializer(name, value)
                self._values.append(value)
            model = helper.make_model(g, opset_imports=opsets, ir_version=8)
            point_weights_at_placeholder(model, h.weights)
            path = save_model(model, os.path.join(self._workdir, f"host_matmul{len(self._sessions)}.onnx"))
            self._sessions[h.y_input] = ort.InferenceSession(path, so, providers=[CPU_EP])
        return self._sessions[h.y_input]

    def close(self) -> None:
        """Drops the one-node sessions and every view of the store (which goes next)."""
        self._sessions.clear()
        self._values.clear()
        self._views.clear()
        self._after.clear()
        if self._quiet:
            self._quiet = False
            QUIET.release()

    def report(self) -> dict:
        """What stats() says of host compute."""
        return self.plan.report(self.steps)


class QuietPool:
    """The host pool's spin bound (a process-wide setting) at 0 while any holder runs host
    MatMuls between segments; once the last lets go, the bound it found. Where SPIN_ENV
    sets the bound, it is left alone (``hold`` gives False)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._before = 0
        os.register_at_fork(after_in_child=self._in_child)

    def hold(self) -> bool:
        if SPIN_ENV in os.environ:
            return False
        with self._lock:
            if not self._holders:
                self._before = int(_core.host_cpu()["spin_us"])
                _core.host_set_spin_us(0)
            self._holders += 1
        return True

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if not self._holders:
                _core.host_set_spin_us(self._before)

    def _in_child(self) -> None:
        """A forked child: the parent's holders are not its own (their sessions refuse it),
        and the lock may have been held by another of the parent's threads."""
        self._lock = threading.Lock()
        if self._holders:
            self._holders = 0
            _core.host_set_spin_us(self._before)


QUIET = QuietPool()
