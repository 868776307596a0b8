"""OffloadSession: a drop-in for onnxruntime.InferenceSession whose weights live in
stable slots under one committed-byte budget.

The session checks its arguments (``arguments.py``), asks the loading pipeline for the
prepared model (``loading.pipeline``), the budget plan for the device's zones
(``memory.planning``) and the capture and engine choice (``engines``), fills the pinned
host store, and hands running to the engine in force (``engines.switch``), which also
moves the session between engines when a step or a generation needs it. The members
InferenceSession has beyond ``run`` are ``dropin.py``'s; generation is ``generation``'s.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import os
import threading
import warnings
import weakref
from typing import Optional

import onnxruntime as ort

from .arguments import read_arguments
from .dropin import InferenceSessionMembers
from .engines import (CONTROL_FLOW_OPS, Engines, OffloadIOBinding, RunInputs, StreamingUnavailable, as_arrays,
                      choose_engine, resolve_graph_capture_enabled, shareable, structural_safety)
from .errors import BudgetExceeded, OffloadWarning, StateError, UnsupportedModel
from .generation import (FIRST_CONTEXT, GenerationMembers, default_generation, first_generation, first_needs,
                         release_kept, with_generation)
from .interrupts import deferred_interrupts
from .loading import (CUDA_EP, LoadRequest, copy_options, make_workdir, point_weights_at_placeholder, prepare,
                      read_as_tables, read_in_place, remove_workdir, routing_for, unseen, weights_as_inputs,
                      window_cache_inputs)
from .memory import Device, HostStore, OrtMemoryMeter, activation_shape, cuda_available, plan_inputs, plan_or_explain
from .progress import LoadProgress
from .stats import ReportingMembers


def _cuda_status() -> str:
    """'' when CUDA can run here, else why not. The driver is asked first: without one,
    installing onnxruntime-gpu would not make CUDA run, so only with one is it the fix."""
    ok, why = cuda_available()
    if not ok:
        return why
    if CUDA_EP not in ort.get_available_providers():
        return ("this onnxruntime is the CPU build, without a CUDA execution provider; "
                "pip install 'onnx-offload[gpu]' installs onnxruntime-gpu, which runs this machine's GPU")
    return ""


def session_arguments(providers, provider_options, config, config_kwargs):
    """The arguments of a session as OffloadSession reads them (arguments.read_arguments)."""
    return read_arguments(providers, provider_options, config, config_kwargs, _cuda_status)


# The sessions of this process. A forked child keeps its parent's for good: freeing them
# there would wait on threads that do not exist in the child (ORT's thread pools, the
# host backend's stream workers) and hang it, and the child cannot use them anyway
# (StateError). So a child may drop them, or replace them with its own.
_LIVE: "weakref.WeakSet[OffloadSession]" = weakref.WeakSet()
_KEPT_IN_CHILD: list = []


def _keep_in_child() -> None:
    _KEPT_IN_CHILD.extend(_LIVE)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT_IN_CHILD))  # not freed even at interpreter exit


os.register_at_fork(after_in_child=_keep_in_child)


class ClosedAtExit:
    """close() at the end of a with block, and when the session is collected in the
    process that made it (a finalizer warns, never raises)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce_ex__(self, protocol):
        # copy.copy, copy.deepcopy and pickle all come here. A copy would own the same
        # device memory, host store and ORT sessions, and its close() (or its collection)
        # would free them under the original; so a session is not copied, as other owners
        # of native resources (locks, sockets, files) are not.
        raise TypeError(f"{type(self).__name__} objects cannot be copied or pickled: each owns device memory, its "
                        f"weights and ORT sessions; share the session itself (its calls are safe from several "
                        f"threads)")

    def __del__(self):
        if not getattr(self, "_closed", True) and getattr(self, "_pid", None) == os.getpid():
            try:
                self.close()
            except Exception as e:  # noqa: BLE001 - never raise from a finalizer
                warnings.warn(f"closing a session at exit failed: {e}", OffloadWarning)


class OffloadSession(ClosedAtExit, InferenceSessionMembers, GenerationMembers, ReportingMembers):
    def __new__(cls, *args, devices=None, **kwargs):
        """`devices` naming several devices splits the model across them, a stage per
        device: the session is then a devices.StagedSession, which takes these arguments."""
        if devices is not None and cls is OffloadSession:
            from .devices import StagedSession, check_devices
            if len(check_devices(devices)) > 1:
                return StagedSession(*args, devices=devices, **kwargs)
        return super().__new__(cls)

    def __init__(self, path_or_bytes, sess_options: Optional[ort.SessionOptions] = None, providers=None,
                 provider_options=None, *, config=None, progress=None, record_timeline: bool = False,
                 devices=None, **config_kwargs):
        # __init__ run again on a live session replaces it, as InferenceSession.__init__
        # run again drops the ORT session it had: what the first run made (device memory,
        # streams, threads, the session's folder) is closed first, or nothing would ever
        # free it. Calls meanwhile answer StateError; the lock stays the one they wait on.
        if not getattr(self, "_closed", True):
            self.close()
        if getattr(self, "_pid", None) != os.getpid():  # a new object (or a forked child's copy)
            self._lock = threading.RLock()  # one step at a time: slots, pins and fixed buffers are shared
        self._closed, self._closing = True, False
        self._parked = None  # the last generation's buffers, kept for the next of its shape (generation.kept)
        self._chat = None  # the last chat's cache, kept for its next turn (generation.chat_cache)
        self.last_chat = None  # what the last chat() fed (GenerationMembers.last_chat)
        # A keyword InferenceSession takes: ORT optimizers the caller turns off.
        self._disabled_optimizers = sorted(config_kwargs.pop("disabled_optimizers", None) or ())
        if devices is not None:  # one device: its id
            (device,) = devices
            if config is not None:
                config = dataclasses.replace(config, device_id=device)
            elif config_kwargs.setdefault("device_id", device) != device:
                raise ValueError(f"devices={list(devices)} and device_id={config_kwargs['device_id']} name "
                                 f"different devices")
        args = read_arguments(providers, provider_options, config, config_kwargs, _cuda_status)
        self.config, self._on_cuda, self._cuda_options = args.config, args.on_cuda, args.cuda_options
        self._graph_request = args.graph_request
        self._pid = os.getpid()
        _LIVE.add(self)
        self._cwd = os.getcwd()  # where ORT writes relative file names (profiles)
        self._user_options = sess_options
        if unseen(sess_options):
            warnings.warn("these SessionOptions were made before onnx_offload was imported, so free-dimension "
                          "overrides, custom-op libraries and initializers added to them are not seen (only their "
                          "properties and ORT's documented config entries are); import onnx_offload first",
                          OffloadWarning, stacklevel=2)
        # The settings as they are now, as ORT takes them: a later change to the caller's
        # object reaches no session made later (a fallback to segments included).
        self._options = copy_options(sess_options) if sess_options is not None else None
        self._workdir = make_workdir()
        self._engines: Optional[Engines] = None
        self._prepared = self._store = self._device = self._meter = self._final_ledger = None
        self._segments_at_close = self._residency_at_close = None
        self._weights, self._notes = [], []
        self._decoder_spec: object = UnsupportedModel("the session was not built")
        try:
            self._device = Device("cuda" if self._on_cuda else "host", self.config)
            if self._device.budget_note:
                self._notes.append(self._device.budget_note)
            self._build(path_or_bytes, LoadProgress(progress), record_timeline)
        except BudgetExceeded as e:
            spec = self._decoder_spec
            self._teardown()
            if isinstance(spec, Exception):
                raise
            # A decoder's smallest budget is tried with the generation it plans for, so
            # that the advice holds that generation too (generation.advice).
            batch, prompt, total = default_generation(spec)
            raise with_generation(e, lambda **budget: OffloadSession(
                path_or_bytes, sess_options, providers, provider_options, disabled_optimizers=self._disabled_optimizers,
                config=dataclasses.replace(self.config, **budget)), batch, prompt, total,
                f"a generation of one sequence of up to {total} positions") from None
        except BaseException:
            self._teardown()
            raise
        self._closed = False

    def _build(self, path_or_bytes, progress: LoadProgress, record_timeline: bool) -> None:
        cfg, dev = self.config, self._device
        self._prepared = p = prepare(path_or_bytes, LoadRequest(
            self._on_cuda, cfg, dev, self._workdir, self._disabled_optimizers, self._options, self._user_options,
            shareable, self._notes), progress)
        model, self._weights, self._decoder_spec = p.model, p.weights, p.decoder
        self._model_name, self._modelmeta, self._overridable = p.name, p.meta, p.overridable
        self._feed_inputs, self._required_inputs = p.feed_inputs, p.required_inputs
        self._graph_inputs, self._graph_outputs = p.graph_inputs, p.graph_outputs
        names = {w.name for w in self._weights}
        self._stable = stable = (not cfg.offload) or cfg.vmm
        experts = cfg.experts
        if experts == "auto" and self._on_cuda and stable and cfg.offload:
            experts = "in_place"  # the streaming engine's MoE kernel reads the picked experts in host memory
        routing, dense_why = routing_for(model, self._weights, experts, self._on_cuda, stable and cfg.offload)
        spec = p.decoder
        vocab, logits = (None, None) if isinstance(spec, Exception) else (spec.vocab, spec.logits_dtype)
        self._activations = activation_shape(model, names, vocab, logits)
        # A decoder's reserves, where the configuration leaves them, are those of the
        # generation it plans for before one asks (generation.needs.first_generation).
        reserves = None if isinstance(spec, Exception) else dict(zip(("kv", "scratch"), first_generation(
            spec, cfg, self._activations, dev.granularity, dev.is_cuda)))
        inputs, groups_by_target = plan_inputs(model, self._weights, stable, dev, routing.cuts if routing else (),
                                               reserves)
        plan = plan_or_explain(cfg, inputs)
        dev.apply(plan)
        if plan.streaming and dense_why:
            self._notes.append(dense_why)
        if stable:
            point_weights_at_placeholder(model, names)
        else:
            weights_as_inputs(model, self._weights)
        safe, why = structural_safety(model)
        override, source = cfg.graph_override, ""
        if override is None and self._graph_request is not None:
            override = self._graph_request
            source = f"enable_cuda_graph={int(override)} in the CUDA provider options"
        capture = resolve_graph_capture_enabled(
            on_cuda=self._on_cuda, offload=cfg.offload, stable_addresses=stable, override=override,
            override_source=source, env_value=cfg.cuda_graph, structurally_safe=safe, safety_reason=why,
            decoder=not isinstance(spec, Exception) and not p.op_types & CONTROL_FLOW_OPS)
        growing = not isinstance(spec, Exception) and spec.layout == "exact"
        engine = choose_engine(cfg, self._on_cuda, plan.streaming, stable, capture, growing_steps=growing,
                               notes=self._notes, routed=routing is not None)
        readers = collections.Counter(i for node in model.graph.node for i in node.input if i in names)
        shared = [n for n, c in readers.items() if c > 1]
        # Stacks read in place get host pages of their own, which their hot experts' device
        # pages replace behind a stable address (memory.expert_pages).
        stacks = read_in_place(model, self._weights, experts) if stable and cfg.offload else []
        self._store = HostStore(dev.backend, self._weights, paged=stacks)
        with progress.phase("reading weights", sum(w.nbytes for w in self._weights), "B") as update:
            self._store.fill_from_file(p.data_file, self._weights, update, p.held)
        p.release()  # everything the session reads from the cache entry is read
        self._meter = OrtMemoryMeter(dev)
        run = RunInputs(model, self._weights, names, groups_by_target, shared, stable, capture,
                        [o.name for o in self._graph_outputs], self._feed_inputs, self._graph_inputs, inputs,
                        record_timeline, self._workdir, routing, read_as_tables(model, names), stacks,
                        window_cache_inputs(model))
        self._engines = Engines(dev, self._store, self._meter, cfg, self._options, self._cuda_options, run, plan,
                                self._notes, lambda: release_kept(self), self.close)
        # The reserves the plan took from the first generation (memory.budget.base_zones), or
        # the streaming engine's, which first_needs sizes so.
        applied = inputs["reserves"] is not None and not cfg.kv_bytes and plan.zones["kv"].reserve > 0
        if not isinstance(spec, Exception) and (applied or engine == "graph"):
            first = min(spec.max_length or FIRST_CONTEXT, FIRST_CONTEXT)
            self._engines.planned_for = (f"one sequence of up to {first} positions, its prompt a chunk (the first "
                                         f"generation, before one asks)")
        try:
            self._engines.graph_possible = choose_engine(cfg, self._on_cuda, True, stable, capture, growing,
                                                         routed=routing is not None) == "graph"
        except StreamingUnavailable:
            pass
        needs = first_needs(spec, cfg, plan.zones["scratch"].reserve, self._activations, dev.granularity,
                            dev.is_cuda) if engine == "graph" else None
        self._engines.start(engine, needs, progress)

    # ------------------------------------------------------------------ the engine in force
    @property
    def _runner(self):
        return self._engines.runner if self._engines is not None else None

    @property
    def _residency(self):
        if self._engines is None or self._engines.residency is None:
            return self._residency_at_close
        return self._engines.residency

    def _with_fallback(self, call):
        """`call()` on the engine in force, moved or planned again where it needs (see
        Engines.run). The caller holds the session's lock."""
        return self._engines.run(call)

    def _run_bound(self, feeds, outputs, *, fixed: bool, key=None):
        """The engine's run_bound, for generate()'s steps."""
        return self._with_fallback(lambda: self._runner.run_bound(feeds, outputs, fixed=fixed, key=key))

    def _kv_shortage(self, nbytes: int, kv_peak: int, io_peak: int, boundary: int, device_full: bool = False,
                     at_chunk=None):
        """A generation's KV cache found no room: None once the budget is planned again,
        else the advice for the error (engines.replan.kv_short)."""
        return self._engines.kv_short(nbytes, kv_peak, io_peak, boundary, device_full, at_chunk)

    # ------------------------------------------------------------------ running
    def _check_process(self):
        if self._pid != os.getpid():
            raise StateError(f"this session was created in process {self._pid}; a forked child cannot use its "
                             f"device streams or memory: create a new OffloadSession in the child")

    def _check_open(self):
        self._check_process()
        if self._closed or self._closing:
            raise StateError("the session is closed")

    @contextlib.contextmanager
    def _step(self):
        """One call at a time, and no Ctrl-C half way through a state change."""
        self._check_open()
        with self._lock, deferred_interrupts():
            self._check_open()
            yield

    def run(self, output_names, input_feed, run_options=None):
        with self._step():
            input_feed = as_arrays(self._graph_inputs, input_feed)
            self._check_call(input_feed, output_names, run_options)
            return self._with_fallback(lambda: self._runner.run(output_names, input_feed, run_options))

    def io_binding(self):
        self._check_open()
        if not self._runner.streaming:
            return self._runner.single.io_binding()
        return OffloadIOBinding(lambda: self._runner, [i.name for i in self._graph_inputs], self._required_inputs,
                                [o.name for o in self._graph_outputs], self.config.device_id)

    def run_with_iobinding(self, iobinding, run_options=None):
        with self._step():
            if not self._runner.streaming:
                self._runner.run_single_with_iobinding(iobinding, run_options)
                return
            if not isinstance(iobinding, OffloadIOBinding):
                raise TypeError("a split OffloadSession takes the binding from its own io_binding()")
            self._refuse_overrides(iobinding.input_names)
            self._with_fallback(lambda: iobinding.run(run_options))

    # ------------------------------------------------------------------ closing
    def close(self):
        """Releases every byte; returns the final ledger snapshot (all zones at 0)."""
        if self._closed:
            return self._final_ledger
        if self._pid != os.getpid():
            # A forked child: the device memory, streams and folder are the parent's.
            self._closed = True
            return self._final_ledger
        with self._lock, deferred_interrupts():
            if not self._closed:
                self._closing = True  # members that take no lock answer StateError from here
                self._teardown()
                self._closed = True
        return self._final_ledger

    def _teardown(self) -> None:
        release_kept(self)
        if self._prepared is not None:
            self._prepared.release()
        if self._device is not None and not self._device.closed:
            self._device.compute_stream.synchronize()
        if self._engines is not None:
            if self._engines.runner is not None:
                self._segments_at_close = self.segments  # what stats() and the timeline report afterwards
            self._residency_at_close = self._engines.residency
            self._engines.close()
        if self._device is not None:
            if self._meter is not None:
                self._meter.refund()
            self._final_ledger = self._device.close()
        if self._store is not None:
            self._store.close()
            self._store = None
        remove_workdir(self._workdir)
