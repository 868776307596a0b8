"""OffloadSession: a drop-in for onnxruntime.InferenceSession whose weights live in
stable slots under one committed-byte budget.

Building a session:
1. the model is optimized once, so the weights placed in slots are the final ones
   (``model.py``);
2. the budget plan splits the device budget into zones and decides whether the
   weights stream, and in which segments (``budget.py``, ``segmenter.py``);
3. the weights are read into the pinned host store, and the residency manager gives
   each a slot (``host_store.py``, ``residency.py``);
4. the segment runner creates one ORT session per segment, each handed its weights
   zero-copy through ``SessionOptions.add_initializer`` (``runner.py``).

Running is the runner's; ORT's own device memory is measured and charged to the
scratch zone by the meter (``ort_memory.py``); a split model's IOBinding is
``iobinding.py``.
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
from typing import List, Optional

import numpy as np
import onnx
import onnxruntime as ort

from ._core import round_up
from .config import ENV_VRAM_LIMIT, OffloadConfig, env_is_set, parse_flag, parse_index
from .dropin import InferenceSessionMembers, model_facts
from .engines import CONTROL_FLOW_OPS, GraphCaptureDecision, resolve_graph_capture_enabled, structural_safety
from .engines import OffloadIOBinding
from .engines import InvalidArgument, IOInfo, as_arrays, check_feeds, shareable
from .engines import SegmentRunner
from .engines import StreamEngine, StreamingUnavailable, choose_engine, plan_stream
from .errors import (BudgetExceeded, CudaDriverError, CudaUnavailable, OffloadError, OffloadWarning, StateError,
                     with_ort_type)
from .generation import (DEFAULT_CONTEXT, SAMPLING_DEFAULTS, Generation, Sampling, UnsupportedModel,
                         check_generate_args, chunk_rows, decoder_spec, generate_tokens, kv_peak, rotary_rows)
from .generation import bucket_for, describe_zones
from .interrupts import deferred_interrupts
from .loading import (HeldFiles, cache_folder, cache_key, hold_made, make_partial, open_entry, remove_set_aside,
                      set_aside, sweep_partials, write_manifest)
from .loading import (OPTIMIZED, OPTIMIZED_DATA, external_data_folder, keep_in_model, load_optimized, materialize,
                      model_file, optimization_level, optimize_once, point_weights_at_placeholder, read_weights,
                      share_unchanged, weights_as_inputs, write_optimized)
from .loading import CUDA_EP, SessionFactory, choose_providers, copy_options, normalize_providers, options_key, unseen
from .loading import Segment, check_bindable, plan_segments, segment_weights, split, value_types
from .loading import disown, make_workdir, remove_workdir
from .memory import ZonePlan, base_zones, plan_budget, smallest_budget
from .memory import Device, cuda_available
from .memory import HostStore
from .memory import OrtMemoryMeter
from .memory import Counters, ResidencyManager, segment_costs
from .memory import slot_kind
from .memory import StepMemoryShort, activation_shape, device_out_of_memory, is_out_of_memory, step_scratch
from .progress import LoadProgress
from .stats import OffloadStats, fmt_bytes


def _cuda_status() -> str:
    """'' when CUDA can run here, else why not."""
    if CUDA_EP not in ort.get_available_providers():
        return "this onnxruntime has no CUDA execution provider"
    ok, why = cuda_available()
    return "" if ok else why


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


class OffloadSession(InferenceSessionMembers):
    def __init__(self, path_or_bytes, sess_options: Optional[ort.SessionOptions] = None, providers=None,
                 provider_options=None, *, config: Optional[OffloadConfig] = None, progress=None,
                 record_timeline: bool = False, **config_kwargs):
        # __init__ run again on a live session replaces it, as InferenceSession.__init__
        # run again drops the ORT session it had: what the first run made (device memory,
        # streams, threads, the session's folder) is closed first, or nothing would ever
        # free it. Calls meanwhile answer StateError; the lock stays the one they wait on.
        if not getattr(self, "_closed", True):
            self.close()
        if getattr(self, "_pid", None) != os.getpid():  # a new object (or a forked child's copy)
            self._lock = threading.RLock()  # one step at a time: slots, pins and fixed buffers are shared
        self._closed = True
        self._closing = False
        self._parked = None  # the last generation's buffers, kept for the next of its shape (_park)
        # A keyword InferenceSession takes: ORT optimizers the caller turns off.
        self._disabled_optimizers = sorted(config_kwargs.pop("disabled_optimizers", None) or ())
        if config is not None and config_kwargs:
            raise TypeError("pass either config= or configuration keywords, not both")
        self.config = config if config is not None else OffloadConfig.from_env(**config_kwargs)
        names, options = normalize_providers(providers, provider_options)
        cuda_given = next((o for n, o in zip(names, options) if n == CUDA_EP), {})
        names, options, notes = choose_providers(names, options, _cuda_status)
        for note in notes:
            warnings.warn(note, OffloadWarning, stacklevel=2)
        self._on_cuda = names[0] == CUDA_EP
        if self._on_cuda and CUDA_EP not in ort.get_available_providers():
            raise CudaUnavailable("this onnxruntime has no CUDA execution provider: install onnxruntime-gpu")
        # The CUDA provider's device_id and gpu_mem_limit, as ORT reads them, unless the
        # configuration names a device or a limit itself.
        given = set(config_kwargs) | ({"vram_limit"} if env_is_set(ENV_VRAM_LIMIT) else set())
        if config is not None:
            given |= {f for f in ("device_id", "vram_limit") if getattr(config, f) != getattr(OffloadConfig(), f)}
        taken = {}
        if "device_id" in cuda_given and "device_id" not in given and self._on_cuda:
            taken["device_id"] = parse_index(cuda_given["device_id"], "device_id (CUDA provider option)")
        if "gpu_mem_limit" in cuda_given and "vram_limit" not in given and self._on_cuda:
            taken["vram_limit"] = parse_index(cuda_given["gpu_mem_limit"], "gpu_mem_limit (CUDA provider option)")
        if taken:
            try:
                self.config = dataclasses.replace(self.config, **taken)
            except ValueError as e:
                raise ValueError(f"the CUDA provider options {taken} cannot be the session's configuration: "
                                 f"{e}") from None
        self._cuda_options = options[0] if self._on_cuda else {}
        # enable_cuda_graph in the provider options is the caller's explicit request, as
        # plain ORT takes it; the runner sets it on the sessions that capture.
        self._graph_request = parse_flag(self._cuda_options.pop("enable_cuda_graph", None),
                                         "enable_cuda_graph (CUDA provider option)")
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
        self._runner: Optional[SegmentRunner] = None
        self._segments_at_close: Optional[List[Segment]] = None
        self._residency: Optional[ResidencyManager] = None
        self._store: Optional[HostStore] = None
        self._device: Optional[Device] = None
        self._meter: Optional[OrtMemoryMeter] = None
        self._final_ledger = None
        self._entry_lock: Optional[int] = None  # a shared lock on the cache entry while it is read
        self._held_files: Optional[HeldFiles] = None  # the files the weights are read from, open until they are
        self._weights = []
        self._required_inputs: List[str] = []
        self._feed_inputs: List[str] = []
        self._decoder_spec: object = UnsupportedModel("the session was not built")
        self._stable = True
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
    def _optimized_dir(self, src: str, level, own_files: bool) -> str:
        """Where the optimized model lives: a cache entry, published with one rename, or
        the session's own folder (also when the cache folder cannot be used or is not to be
        trusted, see model_cache.cache_folder, with a warning). A cache entry made from the
        caller's files on disk (`own_files`) reads the weights optimization left unchanged
        from those files, not from a copy. The files the key fingerprints and the entry's
        files are held open (self._held_files): the weights are read through them."""
        cfg = self.config
        self._held_files = HeldFiles()
        cache, why = cache_folder(cfg.cache_path) if cfg.cache_path else (None, "")
        if why:
            why = f"the cache folder {cfg.cache_path!r} {why}; the optimized model stays in the session's folder"
            warnings.warn(why, OffloadWarning, stacklevel=4)
            self._notes.append(why)
        if not cache:
            return self._workdir
        key = cache_key(src, self._on_cuda, level, cfg.min_weight_bytes, self._disabled_optimizers,
                        options_key(self._options), own_files, self._held_files)
        opt_dir = os.path.join(cache, key)
        # The entry is read under a shared lock (released once the weights are read), so
        # that `onnx-offload cache clear` leaves it alone meanwhile. An entry cleared
        # between the lookup and the lock is looked up again, and made again.
        for _ in range(3):
            lock, why = open_entry(opt_dir, key, self._held_files)
            if lock is not None:
                self._entry_lock = lock
                return opt_dir
            if why:
                why = f"the cache entry {opt_dir} {why}: it is made again"
                warnings.warn(why, OffloadWarning, stacklevel=4)
                self._notes.append(why)
            if os.path.lexists(opt_dir):
                # An entry missing a file (removed by hand), changed or not to be trusted:
                # set aside, then made again and published like a new one, never rewritten
                # where others may be reading it.
                set_aside(cache, opt_dir)
                remove_set_aside(cache)
            published = self._publish_entry(cache, opt_dir, key, src, level, own_files)
            if published != opt_dir or self._held_files.get(os.path.join(opt_dir, OPTIMIZED)) is not None:
                return published  # the session's folder, or the entry it made (its files held)
        return self._workdir  # cleared as fast as it was made: the session's own folder

    def _publish_entry(self, cache: str, opt_dir: str, key: str, src: str, level, own_files: bool) -> str:
        """Optimizes into a new partial folder (named after this process, so that a start
        killed half-way leaves it behind for no longer than the process: see
        model_cache.make_partial) and publishes it as `opt_dir` with one rename, its files
        held open for this session to read. Returns `opt_dir`, or the session's folder when
        the cache folder cannot take the entry (a full disk, a file size limit) or the
        model's files changed during the pass (what ORT read is not what the key names)."""
        cfg, dev = self.config, self._device
        why = tmp = None
        made = HeldFiles()
        try:
            sweep_partials(cache)
            tmp = make_partial(cache)
            optimize_once(src, tmp, self._on_cuda, level, cfg.min_weight_bytes, dev, self._notes,
                          self._disabled_optimizers, self._options)
            if own_files:
                share_unchanged(tmp, src, self._held_files)
            write_manifest(tmp, key, os.path.abspath(src) if own_files else "a model given as bytes")
            changed = self._held_files.changed()
            if not changed:
                made = hold_made(tmp, opt_dir)
        except OSError as e:  # a full disk, a file size limit (model.SaveFailed), no permission
            why = f"the cache folder {cache!r} cannot be used ({e}); the optimized model stays in the session's folder"
        else:
            if changed:
                why = (f"the model's files changed while ORT optimized it ({', '.join(changed)}): no cache entry is "
                       f"made of what it read; the optimized model stays in the session's folder")
            else:
                try:
                    os.rename(tmp, opt_dir)
                except OSError:
                    pass  # another process published it first: it is looked up next
                else:
                    disown(tmp)
                    self._held_files.adopt(made)
        finally:
            made.close()
            if tmp is not None:
                remove_workdir(tmp)  # a failed or interrupted pass leaves nothing behind
        if why:
            warnings.warn(why, OffloadWarning, stacklevel=4)
            self._notes.append(why)
            return self._workdir
        return opt_dir

    def _release_entry(self) -> None:
        if self._entry_lock is not None:
            os.close(self._entry_lock)
            self._entry_lock = None
        if self._held_files is not None:
            self._held_files.close()
            self._held_files = None

    def _build(self, path_or_bytes, progress, record_timeline):
        cfg, dev = self.config, self._device
        if isinstance(path_or_bytes, (str, os.PathLike)):
            path_or_bytes = model_file(os.fspath(path_or_bytes))  # a model folder: the file in it
        src, original = materialize(path_or_bytes, self._workdir, external_data_folder(self._user_options))
        self._modelmeta, self._overridable = model_facts(original)
        del original  # the optimized model is what runs
        from_file = isinstance(path_or_bytes, (str, os.PathLike))
        self._model_name = os.path.basename(os.fspath(path_or_bytes)) if from_file else "model (bytes)"
        level = optimization_level(cfg.optimization_level, self._user_options)
        self._progress = LoadProgress(progress)
        with self._progress.phase("optimizing the model"):
            opt_dir = self._optimized_dir(src, level, from_file)
            opt_path = optimize_once(src, opt_dir, self._on_cuda, level, cfg.min_weight_bytes, dev, self._notes,
                                     self._disabled_optimizers, self._options)
        held = self._held_files  # what the weights are read through: the files that were fingerprinted
        if self._user_options is not None and self._user_options.optimized_model_filepath:
            write_optimized(opt_path, self._user_options.optimized_model_filepath, held)
        model = load_optimized(opt_path, held)
        inside = keep_in_model(model, opt_dir, shareable, held)
        if inside:
            self._notes.append(f"{len(inside)} initializers of types ORT cannot take in place (such as "
                               f"{inside[0]!r}) stay inside the model: ORT owns their memory")
        self._weights = weights = read_weights(model, opt_dir)
        own = [w for w in weights if w.path != os.path.join(opt_dir, OPTIMIZED_DATA)]
        if own:
            self._notes.append(f"{len(own)} weights ({fmt_bytes(sum(w.nbytes for w in own))}) are read from the "
                               f"model's own data files: optimization left them unchanged, so the cache holds no copy")
        initializers = {t.name for t in model.graph.initializer}
        # The inputs a caller feeds (never the weights); as ORT's Python layer, one of
        # optional type may be left out.
        self._feed_inputs = [v.name for v in model.graph.input if v.name not in initializers]
        self._required_inputs = [v.name for v in model.graph.input
                                 if v.name in self._feed_inputs and not v.type.HasField("optional_type")]
        self._graph_inputs = [IOInfo(v) for v in model.graph.input]
        self._graph_outputs = [IOInfo(v) for v in model.graph.output]
        self._op_types = {n.op_type for n in model.graph.node}
        self._rotary_rows = rotary_rows(model)
        self._model_dir = os.path.dirname(os.path.abspath(os.fspath(path_or_bytes))) if from_file else None
        names = {w.name for w in weights}
        sizes = {w.name: w.nbytes for w in weights}
        self._stable = stable = (not cfg.offload) or cfg.vmm
        kind = slot_kind(stable)

        def cost(ns):
            return kind.packed_cost([sizes[n] for n in ns], dev.granularity)

        groups_by_target = {}

        def segments_for(target):
            groups = plan_segments(model, cost, names.__contains__, target)
            groups_by_target[target] = groups
            return [segment_weights(model, g, names.__contains__) for g in groups]

        first_use = {w.name: w.first_use for w in weights}

        def costs_of(segments):
            return segment_costs(segments, sizes, first_use, kind, dev.granularity)

        inputs = dict(free=dev.device_free, total=dev.device_total, granularity=dev.granularity,
                      weight_costs={n: cost([n]) for n in names}, cost=cost, plan_segments=segments_for,
                      segment_costs=costs_of)
        self._plan_inputs = inputs
        try:
            plan = plan_budget(cfg, **inputs)
        except BudgetExceeded as e:
            least = smallest_budget(cfg, **inputs)
            why = str(e).rstrip(".") + "."
            if not least:
                limit = self._what_limits(inputs)
                raise BudgetExceeded(f"{why} Not even the device's {fmt_bytes(dev.device_total)} would run this "
                                     f"model with this configuration.{limit}") from None
            raise BudgetExceeded(f"{why} The smallest budget that runs it with this configuration is "
                                 f"{fmt_bytes(least)} ({least} bytes): pass vram_limit={least} (or set "
                                 f"ONNX_GENAI_VRAM_LIMIT)"
                                 f"{'' if cfg.offload else ', or turn offload on to stream the weights'}.") from None
        dev.apply(plan)
        if stable:
            point_weights_at_placeholder(model, names)
        else:
            weights_as_inputs(model, weights)

        safe, why = structural_safety(model)
        override, source = cfg.graph_override, ""
        if override is None and self._graph_request is not None:
            override = self._graph_request
            source = f"enable_cuda_graph={int(override)} in the CUDA provider options"
        capture = resolve_graph_capture_enabled(
            on_cuda=self._on_cuda, offload=cfg.offload, stable_addresses=stable, override=override,
            override_source=source, env_value=cfg.cuda_graph, structurally_safe=safe, safety_reason=why,
            decoder=self._is_decoder() and not self._op_types & CONTROL_FLOW_OPS)
        spec = self._decoder_spec
        growing = not isinstance(spec, Exception) and spec.layout == "exact"
        engine = choose_engine(cfg, self._on_cuda, plan.streaming, stable, capture, growing_steps=growing,
                               notes=self._notes)
        # Whether the weights would run on the streaming engine once they stream: a
        # generation that finds no room beside resident weights moves there, not to segments.
        try:
            self._graph_possible = choose_engine(cfg, self._on_cuda, True, stable, capture, growing) == "graph"
        except StreamingUnavailable:
            self._graph_possible = False
        readers = collections.Counter(i for node in model.graph.node for i in node.input if i in names)
        self._shared = [n for n, c in readers.items() if c > 1]
        self._activations = activation_shape(model, names, None if isinstance(spec, Exception) else spec.vocab,
                                              None if isinstance(spec, Exception) else spec.logits_dtype)

        self._store = HostStore(dev.backend, weights)
        with self._progress.phase("reading weights", sum(w.nbytes for w in weights), "B") as update:
            self._store.fill_from_file(os.path.join(opt_dir, OPTIMIZED_DATA), weights, update, self._held_files)
        self._release_entry()  # everything the session reads from the cache entry is read
        self._meter = OrtMemoryMeter(dev)
        factory = SessionFactory(dev, self._options, self._cuda_options, cfg.device_id, plan.ort_memory_cap)
        outputs = [o.name for o in self._graph_outputs]
        self._segments_from = (plan, model, groups_by_target, names, stable, capture, outputs, factory,
                               record_timeline)
        self._engine_needs: Optional[tuple] = None
        if engine == "graph":
            try:
                with self._progress.phase("creating the ORT session"):
                    self._make_engine_with_room(*self._first_needs(plan))
            except StreamingUnavailable as e:
                if cfg.engine == "graph":
                    raise
                self._notes.append(f"the weights run in segments: {e}")
                dev.apply(plan)
                engine = "segments"
        if engine != "graph":
            with self._progress.phase("creating ORT sessions"):
                self._make_segment_runner()
        self._notes.extend(self._runner.notes)
        self._residency.reset_counters()  # count runs, not the page-ins of construction

    # ------------------------------------------------------------------ the streaming engine's plan
    def _first_needs(self, plan) -> tuple:
        """(KV bytes, scratch bytes) the streaming engine sets aside at construction: what
        the configuration gives, else, for a decoder, the cache of one sequence of up to
        DEFAULT_CONTEXT positions and a prompt chunk's step; for other models the plan's
        scratch reserve. A generation that needs more plans again (_prepare_generation)."""
        cfg, g = self.config, self._device.granularity
        spec = self._decoder_spec
        decoder = not isinstance(spec, Exception)
        kv = cfg.kv_bytes
        if not kv and decoder:
            length = min(spec.max_length or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
            kv = kv_peak(spec, 1, min(length, cfg.prefill_chunk), length, g, cfg.prefill_chunk)
        if cfg.scratch_bytes is not None:
            scratch = cfg.scratch_bytes
        elif decoder:
            scratch = self._step_scratch(1, min(cfg.prefill_chunk, DEFAULT_CONTEXT), DEFAULT_CONTEXT)
        else:
            scratch = plan.zones["scratch"].reserve
        return kv, scratch

    def _step_scratch(self, batch: int, prompt: int, total: int) -> int:
        """The scratch a generation of `batch` rows needs at its largest step: a prompt
        chunk (one row at a time where the layout chunks row by row) or a decode step."""
        spec, g = self._decoder_spec, self._device.granularity
        chunk = min(prompt, self.config.prefill_chunk)
        rows = chunk_rows(spec, batch, prompt, chunk)
        vocab = spec.vocab or self._activations.vocab
        logits = np.dtype(spec.logits_dtype).itemsize * vocab
        mask = total + 1 if spec.layout == "gqa" else bucket_for(total) + chunk + 1
        # A chunk's ids, positions and logits (twice: the first chunk's logits are the
        # engine's own buffer), its mask, and a decode step's buffers.
        io = rows * chunk * (3 * 8 + 2 * logits) + rows * mask * 8 + batch * (3 * 8 + logits + mask * 8)
        if spec.layout != "gqa":  # the present of a chunk step holds the past and the chunk
            row = spec.kv_heads * spec.head_size * np.dtype(spec.kv_dtype).itemsize
            io += 2 * spec.layers * rows * chunk * row
        return step_scratch(self._activations, max(rows * chunk, batch), io, g, ort=self._device.is_cuda)

    def _make_engine(self, kv: int, scratch: int) -> None:
        """The streaming engine, with `kv` bytes set aside for the KV cache and `scratch`
        for the steps' memory (ORT's and the step's buffers): the transient zone holds its
        ring, the weights zone the rest of the budget's resident weights. The caller holds
        the session's lock (or builds the session)."""
        dev, cfg = self._device, self.config
        _, model, _, _, _, capture, outputs, _, record_timeline = self._segments_from
        g = dev.granularity
        kv, scratch = round_up(kv, g), round_up(scratch, g)
        budget = dev.budget
        allowance = min(cfg.weight_bytes or budget, budget - kv - scratch)
        cost = self._plan_inputs["cost"]
        layout = plan_stream(self._weights, max(0, allowance), g, cost, cfg.policy, shared=self._shared)
        dev.set_zones({"weights": ZonePlan(min(budget, layout.allowance - layout.ring_bytes), 0),
                       "kv": ZonePlan(budget, kv), "scratch": ZonePlan(budget, scratch),
                       "transient": ZonePlan(budget, layout.ring_bytes)})
        kept = set(layout.resident)
        self._residency = ResidencyManager(dev, self._store, [w for w in self._weights if w.name in kept],
                                           [layout.resident], cfg.policy, vmm=True,
                                           record_timeline=record_timeline)
        try:
            self._residency.make_all_resident()
            # ORT's arena may take what the weights, the ring and the cache leave; what it
            # takes is charged to scratch, and more than the scratch reserve plans again.
            cap = max(g, budget - cost(layout.resident) - layout.ring_bytes - kv)
            factory = SessionFactory(dev, self._options, self._cuda_options, cfg.device_id, cap)
            self._runner = StreamEngine(dev, self._residency, self._store, self._weights, layout, factory,
                                        self._meter, model, self._workdir, self._feed_inputs, outputs,
                                        capture.reason, cfg.device_id)
        except BaseException:
            self._residency.close()
            self._residency = None
            self._meter.refund()
            raise
        self._engine_needs = (kv, scratch)

    def _make_engine_with_room(self, kv: int, scratch: int) -> None:
        """_make_engine, planned again with more scratch while ORT takes more than it set
        aside when it creates its session."""
        for attempt in range(3):
            try:
                return self._make_engine(kv, scratch)
            except StepMemoryShort as e:
                if attempt == 2:
                    raise
                scratch += e.needed or scratch

    def _engine_short(self, kv: int, scratch: int, why) -> BudgetExceeded:
        """The error for a budget too small for the streaming engine with these reserves,
        with the smallest budget that runs it."""
        dev, g = self._device, self._device.granularity
        largest = max((w.nbytes for w in self._weights if w.name not in set(self._shared)), default=0)
        ring = round_up(largest, g) + 2 * g
        least = kv + scratch + ring + (self._plan_inputs["cost"](self._shared) if self._shared else 0)
        what = (f"the streaming engine needs {fmt_bytes(kv)} for the KV cache, {fmt_bytes(scratch)} for a step's "
                f"memory (ORT's and the step's buffers) and a ring of about {fmt_bytes(ring)} for the streamed "
                f"weights, and the budget is {fmt_bytes(dev.budget)} ({why})")
        if least <= dev.device_total * 0.9 and least > dev.budget:
            return BudgetExceeded(f"{what}: pass vram_limit={least} (or set {ENV_VRAM_LIMIT}={least}), or lower the "
                                  f"batch or the length")
        return BudgetExceeded(f"{what}: lower the batch, the length or prefill_chunk (the prompt's tokens per "
                              f"step, now {self.config.prefill_chunk})")

    def _replan_engine(self, kv: int, scratch: int, why: str) -> None:
        """Moves the session onto the streaming engine planned for `kv` and `scratch`
        bytes (from resident segments, or from an engine planned for less). When it cannot
        be made, the runner in force comes back and the error is raised (see
        _swap_runner). The caller holds the session's lock."""
        before = self._engine_needs if isinstance(self._runner, StreamEngine) else None
        plan = self._segments_from[0]
        self._swap_runner(lambda: self._make_engine_with_room(kv, scratch),
                          (lambda: self._make_engine(*before)) if before is not None else
                          (lambda: self._make_segments(plan)))
        self._notes.append(f"the streaming engine was planned again for {why}: KV cache {fmt_bytes(kv)}, step "
                           f"memory {fmt_bytes(scratch)}, {len(self._residency.slots)} weights resident")

    def _prepare_generation(self, spec, batch: int, prompt: int, total: int) -> None:
        """Before a generation on CUDA: when its KV cache and its largest step do not fit
        the plan in force, the streaming engine is planned again for them (reserves only
        grow: a shorter generation later runs in the same plan). Resident weights that
        leave no room move to the engine. The caller holds the session's lock."""
        if not self._graph_possible:
            return
        g = self._device.granularity
        kv = kv_peak(spec, batch, prompt, total, g, self.config.prefill_chunk)
        scratch = self._step_scratch(batch, prompt, total)
        if isinstance(self._runner, StreamEngine):
            have_kv, have_scratch = self._engine_needs
            if kv <= have_kv and scratch <= have_scratch:
                return
            kv, scratch = max(kv, have_kv), max(scratch, have_scratch)
            why = f"a generation of {batch} x {total} positions"
        else:
            snap = self._device.ledger.snapshot()
            weights = snap.zones["weights"].committed.current
            if weights + kv + scratch + snap.zones["scratch"].committed.current <= snap.budget:
                return  # beside the resident weights
            why = f"a generation of {batch} x {total} positions, which the resident weights left no room for"
        try:
            self._replan_engine(kv, scratch, why)
        except StreamingUnavailable as e:
            # The runner in force stays: a buffer short of room asks for a plan again
            # (_kv_shortage), and the error says what would run.
            self._notes.append(f"the streaming engine cannot be planned for {why}: {e}")
        except CudaDriverError as e:
            if not device_out_of_memory(e):
                raise
            raise BudgetExceeded(f"the device has no room for the plan for {why}: {e} "
                                 f"({describe_zones(self._device.ledger)}). Lower the batch or the length, or raise "
                                 f"the budget") from e

    def _what_limits(self, inputs) -> str:
        """For a configuration that no budget of this device runs: the keyword to change."""
        cfg, total = self.config, self._device.device_total
        largest = max(inputs["weight_costs"].values(), default=0)
        reserves = {k: getattr(cfg, k) for k in ("kv_bytes", "scratch_bytes") if getattr(cfg, k)}
        if reserves and sum(reserves.values()) + largest > total:
            given = " and ".join(f"{k}={v}" for k, v in reserves.items())
            return (f" The reserves ({given}) leave no room for the largest weight ({largest} committed bytes) on "
                    f"the device's {total} bytes: lower {' or '.join(reserves)} below {max(0, total - largest)} "
                    f"in all.")
        if cfg.weight_bytes:
            return (f" The weights zone's allowance (weight_bytes={cfg.weight_bytes}) is what limits: raise it"
                    f"{'' if cfg.offload else ' or turn offload on'}.")
        return ""

    def _split(self, plan) -> List[Segment]:
        """The segments of `plan`: made before anything changes, since a model may not split."""
        _, model, groups_by_target, names, _, _, outputs, _, _ = self._segments_from
        if plan.streaming:
            return split(model, groups_by_target[plan.segment_target], names.__contains__)
        everything = list(range(len(model.graph.node)))
        if not self._stable:  # the weights are inputs, so every value goes through IOBinding
            # One segment: only the graph's inputs and outputs are bound, whose types the
            # graph declares (inferred only where it does not).
            types = {o.name: o.type for o in model.graph.output}
            if not all(t.WhichOneof("value") for t in types.values()):
                types = value_types(model)
            check_bindable(model, [everything], {}, types,
                           "the model, whose weights are bound as inputs without stable addresses (vmm=False)",
                           "use vmm=True, or offload=False")
        # A graph output listed twice is one output of the segment: ORT binds a name once.
        return [Segment(0, everything, [w.name for w in self._weights],
                        [v.name for v in self._graph_inputs if v.name not in names], list(dict.fromkeys(outputs)),
                        model)]

    def _make_segment_runner(self, segments: Optional[List[Segment]] = None) -> None:
        plan, model, groups_by_target, names, stable, capture, outputs, factory, record_timeline = self._segments_from
        dev, cfg, weights = self._device, self.config, self._weights
        self._engine_needs = None  # the streaming engine's reserves no longer apply
        if segments is None:
            segments = self._split(plan)
        self._residency = ResidencyManager(dev, self._store, weights, [s.weights for s in segments],
                                           cfg.policy, vmm=stable, record_timeline=record_timeline)
        if not plan.streaming:
            self._residency.make_all_resident()
        # Graph outputs that are initializers too small to be weights: no segment holds them.
        constants = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer
                     if t.name in outputs and t.name not in names and t.data_location != onnx.TensorProto.EXTERNAL}
        self._runner = SegmentRunner(dev, self._residency, factory, self._meter, segments, self._workdir,
                                     outputs, streaming=plan.streaming, stable=stable, capture=capture,
                                     device_id=cfg.device_id, constants=constants)

    def _with_fallback(self, call):
        """`call()`, and where it fails for want of room or of a graph, the step again:
        - ORT needed more memory for a step than the plan set aside (measured, or ORT ran
          out before it could be): on the streaming engine, or resident weights that can
          move to it, the plan is made again with that room (twice the reserve when it was
          not measured); elsewhere, or a third time, BudgetExceeded naming the zones;
        - the streaming engine cannot build a step's graph (and the engine was not asked
          for by name): the session moves to segments and says so.
        The caller holds the session's lock."""
        attempt = -1
        while True:
            attempt += 1
            try:
                return call()
            except StreamingUnavailable as e:
                if self.config.engine == "graph" or not isinstance(self._runner, StreamEngine):
                    raise
                why = f"the streaming engine cannot run this model, so its weights run in segments: {e}"
                warnings.warn(why, OffloadWarning, stacklevel=3)
                self._notes.append(why)
                self._run_in_segments(self._segments_from[0])
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
            if self._release_parked():
                attempt -= 1  # the kept generation's bytes first: not an attempt of its own
                continue
            if not self._graph_possible or attempt == 2:
                raise error_type(f"{message} ({describe_zones(self._device.ledger)}). Lower the batch, the inputs' "
                                 f"sizes or prefill_chunk (the prompt's tokens per step, now "
                                 f"{self.config.prefill_chunk}), or raise the budget")
            zones = self._device.ledger.snapshot().zones
            kv, scratch = self._engine_needs or (zones["kv"].reserve, zones["scratch"].reserve)
            kv = max(kv, zones["kv"].committed.current)
            scratch = max(scratch, zones["scratch"].committed.current)
            scratch += needed or max(scratch, self._device.granularity)
            try:
                self._replan_engine(kv, scratch, "a step that needed more memory than was set aside")
            except StreamingUnavailable as e:
                raise self._engine_short(kv, scratch, e) from None

    def _run_in_segments(self, plan) -> None:
        """Replaces the runner with segments under `plan`. When they cannot be made (a
        model that cannot be split, an ORT error), the segments of the plan in force come
        back and the error is raised (see _swap_runner). The caller holds the session's
        lock."""
        before = self._segments_from[0]
        segments = self._split(plan)
        self._swap_runner(lambda: self._make_segments(plan, segments), lambda: self._make_segments(before))

    def _swap_runner(self, make, restore) -> None:
        """The runner in force replaced by what `make()` builds; when that fails, `restore()`
        builds the one in force again and the error is raised; should that fail too, the
        session closes, so that the next call says so. The residency counters carry over."""
        counters = self._residency.counters if self._residency is not None else Counters()
        try:
            self._drop_runner()
            make()
        except BaseException as error:
            try:
                self._drop_runner()
                restore()
            except BaseException:
                self.close()
            raise error
        finally:
            if self._residency is not None:
                self._residency.counters = counters

    def _drop_runner(self) -> None:
        # The runner is let go before it closes: a member that takes no lock finds None,
        # and waits for the lock and the runner made under it (_live_runner). A kept
        # generation's graphs are the runner's: it goes first.
        self._release_parked()
        mark = self._meter.mark()
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.close()
        if self._residency is not None:
            self._residency.close()
            self._residency = None
        # The handles the arena keeps for reuse are sized for the plan that went: the
        # device gets them back, for ORT's next session and the next plan's own.
        pooled = self._device.ledger.snapshot().pooled
        if pooled:
            self._device.arena.trim_pool(pooled)
        # The runner's ORT sessions are gone: what they gave back is refunded, and the
        # next ones are measured anew.
        self._meter.refund(mark)

    def _make_segments(self, plan, segments: Optional[List[Segment]] = None) -> None:
        self._segments_from = (plan,) + self._segments_from[1:]
        self._device.apply(plan)
        self._make_segment_runner(segments)

    def _kv_shortage(self, nbytes: int, kv_peak: int, io_peak: int, boundary: int,
                     device_full: bool = False) -> Optional[str]:
        """A generation's KV cache, which holds at most `kv_peak` bytes (with `io_peak`
        bytes of step buffers in scratch, and about `boundary` bytes per segment
        boundary once the weights stream), found no room for `nbytes` more. Weights
        resident for the session's life (all of them, or the streaming engine's resident
        set) cannot give way: with offload on, the budget is planned again with the
        cache's bytes and the scratch zone's set aside (what this generation may reach;
        failing that, what it holds now), the weights stream in segments, which give way
        as the cache grows, and None says to try again. Otherwise, the advice for the
        error: the smallest budget that holds the weights and this cache. `device_full`:
        the budget had room and the device did not, so the engine's plan sets aside more
        for the steps (as for a step that ran out), which keeps fewer weights resident.
        The caller holds the session's lock."""
        if self._release_parked():
            return None  # the kept generation's bytes were the ones missing, perhaps
        cfg, dev = self.config, self._device
        g = dev.granularity
        zones = dev.ledger.snapshot().zones
        in_force = self._segments_from[0]
        kv = round_up(kv_peak, g)
        if self._graph_possible and cfg.offload:
            # On CUDA the streaming engine takes the weights: planned (again) for this cache
            # and for the step buffers held and asked for, or the advice of why it cannot be.
            have = self._engine_needs or (0, 0)
            need = (max(have[0], kv), max(have[1], round_up(zones["scratch"].committed.current + io_peak, g)))
            if device_full and need == have and have != (0, 0):
                need = (have[0], have[1] + max(have[1], g))
            if need == have:
                return (f"the plan in force already sets aside {fmt_bytes(have[0])} for the KV cache and "
                        f"{fmt_bytes(have[1])} for the steps")
            try:
                self._replan_engine(*need, f"a KV cache of up to {fmt_bytes(kv_peak)}")
                return None
            except StreamingUnavailable:
                pass  # the weights stream in segments instead, below
            except BudgetExceeded as e:
                return str(e)
        # Segments pass values between them through scratch, which the resident runner
        # never needed and whose sizes are known only once the segments run: the scratch
        # reserve the configuration gives is doubled, plus `boundary` bytes per segment.
        # (The configuration's, not the reserve in force, which an earlier plan may have
        # raised: a plan depends on the cache it is for, not on the ones before it.)
        configured = base_zones(cfg, in_force.budget, g)["scratch"].reserve
        base = 2 * max(configured, round_up(zones["scratch"].committed.current + io_peak, g))

        def trial_for(segments: int):
            scratch = base + round_up(boundary * segments, g)
            return dataclasses.replace(cfg, kv_bytes=max(cfg.kv_bytes, kv), scratch_bytes=scratch)

        trial = trial_for(len(in_force.segments))
        pinned = isinstance(self._runner, StreamEngine) or not in_force.streaming
        # Segments planned with less set aside for the cache than this generation needs (a
        # shorter one came first): planned again, as a session new to this length would be.
        short = in_force.streaming and kv > in_force.zones["kv"].reserve
        if (pinned or short) and cfg.offload and cfg.engine != "graph":
            kept = configured
            now = round_up(zones["kv"].committed.current + nbytes, g)

            def planned(trial):
                try:
                    return plan_budget(trial, **self._plan_inputs)
                except BudgetExceeded:
                    return None

            plan = planned(trial)
            if plan is not None and plan.streaming:
                plan = planned(trial_for(len(plan.segments)))
            for fallback in (dict(kv_bytes=max(cfg.kv_bytes, kv), scratch_bytes=kept),
                             dict(kv_bytes=max(cfg.kv_bytes, now), scratch_bytes=kept)):
                if plan is None or not plan.streaming:
                    plan = planned(dataclasses.replace(cfg, **fallback))
            if plan is not None and plan.streaming:
                self._run_in_segments(plan)
                if pinned:
                    why = (f"the KV cache needs up to {fmt_bytes(kv_peak)} and the weights, resident for the "
                           f"session's life, left no room: the weights now stream in {len(plan.segments)} segments. "
                           f"Pass kv_bytes={trial.kv_bytes} to plan for the cache from the start, or raise the budget "
                           f"to keep the weights resident")
                else:
                    why = (f"the KV cache needs up to {fmt_bytes(kv_peak)}, more than the "
                           f"{fmt_bytes(in_force.zones['kv'].reserve)} set aside for it: the weights now stream in "
                           f"{len(plan.segments)} segments. Pass kv_bytes={trial.kv_bytes} to plan for the cache from "
                           f"the start")
                self._notes.append(why)
                warnings.warn(why, OffloadWarning, stacklevel=2)
                return None
        # The smallest budget for this cache, with the scratch its segments need: their
        # number depends on the budget, so the search runs again while it grows.
        segments = len(in_force.segments)
        for _ in range(3):
            trial = trial_for(segments)
            least = smallest_budget(trial, **self._plan_inputs)
            if not least:
                break
            at = plan_budget(dataclasses.replace(trial, vram_limit=least),
                             **dict(self._plan_inputs, free=max(self._plan_inputs["free"], least)))
            if len(at.segments) <= segments:
                break
            segments = len(at.segments)
        if not least:
            return f"not even the device's {fmt_bytes(dev.device_total)} holds the weights and this cache"
        return (f"the smallest budget that holds the weights and this cache (up to {fmt_bytes(kv_peak)}) is "
                f"{fmt_bytes(least)}: pass vram_limit={least}, kv_bytes={trial.kv_bytes}, "
                f"scratch_bytes={trial.scratch_bytes}")

    def _run_bound(self, feeds, outputs, *, fixed: bool, key=None):
        """The runner's run_bound, for generate()'s steps."""
        return self._with_fallback(lambda: self._runner.run_bound(feeds, outputs, fixed=fixed, key=key))

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

    def _refuse_overrides(self, names) -> None:
        """An initializer the model also lists as an input is a weight in a slot here:
        feeding it would be silently ignored by the segments, so it is refused."""
        fed = sorted({i.name for i in self._overridable}.intersection(names))
        if fed:
            raise InvalidArgument(f"{fed[0]!r} is an initializer the model lets callers override, but under offload "
                                  f"it is a weight in a slot: overriding it is not supported (its value would be "
                                  f"ignored)")

    def _check_call(self, input_feed, output_names) -> None:
        """What ORT checks of a call, raising what ORT raises, where ORT does not check
        it itself."""
        if not self._runner.plain:  # else ORT checks feeds and applies overridden initializers itself
            self._refuse_overrides(input_feed)
            check_feeds(self._required_inputs, self._graph_inputs, [o.name for o in self._graph_outputs],
                        input_feed, output_names)

    def run(self, output_names, input_feed, run_options=None):
        with self._step():
            input_feed = as_arrays(self._graph_inputs, input_feed)
            self._check_call(input_feed, output_names)
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

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids, max_new_tokens: int = 32, *, attention_mask=None, do_sample: Optional[bool] = None,
                 temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 seed: Optional[int] = None, eos_token_id=None):
        """Token ids [batch, prompt + new] (int64): greedy unless `do_sample`. Sampling
        arguments left as None take the model's own (genai_config.json's search section,
        else generation_config.json), else greedy, temperature 1, no top-k, top-p 1.
        Generation stops at `max_new_tokens`, or when every row has produced an EOS id
        (from `eos_token_id`, else the model's files); finished rows repeat their EOS.
        `attention_mask` [batch, prompt]: 0 where a prompt is padded (left padding, as a
        tokenizer gives for prompts of different lengths), else 1."""
        ids, steps = self._generation(input_ids, max_new_tokens, attention_mask, do_sample, temperature, top_k,
                                      top_p, seed, eos_token_id)
        return np.concatenate([ids] + [t[:, None] for t in steps], axis=1)

    def generate_iter(self, input_ids, max_new_tokens: int = 32, *, attention_mask=None,
                      do_sample: Optional[bool] = None, temperature: Optional[float] = None,
                      top_k: Optional[int] = None, top_p: Optional[float] = None, seed: Optional[int] = None,
                      eos_token_id=None):
        """The step-wise form of generate(): yields each step's new tokens [batch]."""
        return self._generation(input_ids, max_new_tokens, attention_mask, do_sample, temperature, top_k, top_p, seed,
                                eos_token_id)[1]

    def _generation(self, input_ids, max_new_tokens, attention_mask, do_sample, temperature, top_k, top_p, seed,
                    eos_token_id):
        """(the checked prompt ids, the generator of new tokens); the arguments are checked
        now, not at the first next()."""
        self._check_open()
        given = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        model = dict(self.decoder_spec.sampling)  # UnsupportedModel for a model generate() cannot run
        sampling = Sampling(**{k: v if v is not None else model.get(k, SAMPLING_DEFAULTS[k])
                               for k, v in given.items()})
        ids, new, eos, mask = check_generate_args(self, input_ids, max_new_tokens, eos_token_id, attention_mask, seed)
        return ids, generate_tokens(self, ids, new, sampling, seed, eos, mask)

    def _is_decoder(self) -> bool:
        try:
            fed = set(self._feed_inputs)
            self._decoder_spec = decoder_spec([i for i in self._graph_inputs if i.name in fed],
                                              self._graph_outputs, self._op_types, self._model_dir,
                                              self._rotary_rows)
            window = self._decoder_spec.sliding_window
            why = (f"generate(): config.json gives this model a sliding window of {window} positions, which it places "
                   f"by the past's length: its past is fed at its exact length, and its decode steps run uncaptured")
            if window and self._decoder_spec.layout == "exact" and why not in self._notes:
                self._notes.append(why)
            return True
        except UnsupportedModel as e:
            self._decoder_spec = e
            return False

    @property
    def decoder_spec(self):
        """The decoder layout generate() runs; raises UnsupportedModel for other models."""
        if isinstance(self._decoder_spec, Exception):
            raise UnsupportedModel(str(self._decoder_spec))
        return self._decoder_spec

    def _new_generation(self, spec, batch: int, prompt: int, total: int) -> Generation:
        """A generation's buffers: the kept ones when they fit it (their graphs replay), else
        new ones, the kept ones given back first."""
        gen = None
        try:
            with self._step():
                if self._parked is not None and not self._parked.fits(spec, batch, prompt, total):
                    self._release_parked()
                self._prepare_generation(spec, batch, prompt, total)  # a new plan gives the kept ones back
                gen, self._parked = self._parked, None
                if gen is None:
                    gen = Generation(self, spec, batch, prompt, total)
        except BaseException:  # a Ctrl-C held back during the allocation arrives here
            if gen is not None:
                gen.close()
            raise
        return gen

    def _park(self, gen: Generation) -> None:
        """A generation that ended: its buffers, and the graphs captured on them, are kept for
        the next generation of its shape where the runner keeps graphs for the session's
        weights (the streaming engine, or resident weights), so that one replays its prompt
        and its steps; the one kept before goes back. Any shortage gives them back first."""
        with self._lock, deferred_interrupts():
            runner = self._runner
            if self._closed or self._closing or runner is None or not gen.reusable() or \
                    (runner.streaming and not isinstance(runner, StreamEngine)):
                gen.close()
                return
            if self._parked is not gen:
                self._release_parked()
                self._parked = gen

    def _release_parked(self) -> bool:
        """Gives the kept generation's buffers back; whether there were any."""
        gen, self._parked = self._parked, None
        if gen is None:
            return False
        gen.close()
        return True

    def free_generation_cache(self) -> None:
        """Gives back the KV cache and step buffers that the session keeps after a
        generation for the next one of the same batch and length (which then replays the
        graphs captured on them). The session does so itself when memory runs short."""
        with self._step():
            self._release_parked()

    # ------------------------------------------------------------------ introspection
    def get_inputs(self):
        # As ORT lists them: the inputs a caller feeds, never the weights (which a session
        # without stable addresses receives as inputs of its own).
        fed = set(self._feed_inputs)

        def listed(runner):
            return self._graph_inputs if runner.streaming else runner.single.get_inputs()
        return [i for i in self._ask_runner(listed) if i.name in fed]

    def get_outputs(self):
        return self._ask_runner(lambda r: r.single.get_outputs() if not r.streaming else list(self._graph_outputs))

    def get_providers(self):
        return self._ask_runner(lambda r: r.single.get_providers())

    def _live_runner(self):
        """The runner, for members that take no lock (as ORT's do not): None only while
        another thread moves the session to another runner (a fallback), which this
        waits out; once closing, StateError (the runner's `single` raises it too)."""
        self._check_open()
        runner = self._runner
        if runner is None:
            with self._lock:
                self._check_open()
                runner = self._runner
        return runner

    def _ask_runner(self, question):
        """question(runner) of the runner in force, for members that take no lock. A
        runner that another thread closes meanwhile (the session moving to segments) is
        no answer: the question goes to the runner made in its place. Once the session
        closes, StateError."""
        while True:
            runner = self._live_runner()
            try:
                return question(runner)
            except StateError:
                if self._runner is runner:  # the runner in force raised it: the answer
                    raise

    def get_session_options(self):
        """The SessionOptions as the caller gave them (ORT's defaults when none were).
        The ORT sessions underneath run the graph optimized once, with optimizations
        off; those settings are the package's own, not reported here."""
        self._check_open()
        return self._user_options if self._user_options is not None else ort.SessionOptions()

    @property
    def graph_capture(self) -> GraphCaptureDecision:
        runner = self._runner
        if runner is None and not self._closed:  # another thread moves the session to another runner
            runner = self._live_runner()
        return runner.capture

    def timeline_png(self, path: str) -> str:
        """Draws the residency timeline (a session made with record_timeline=True) with
        matplotlib, the optional extra [plot]; returns the path."""
        from .timeline import residency_png
        res = self._residency
        budget = self._final_ledger.budget if self._closed else self._device.ledger.snapshot().budget
        title = (f"{self._model_name}: budget {fmt_bytes(budget)}, policy {self.config.policy}, "
                 f"{len(self.segments)} segment(s)")
        return residency_png(path, res.timeline or (), res.zone_timeline or (), budget=budget, title=title)

    @property
    def engine(self) -> str:
        """"graph": the streaming engine runs the model (one ORT session, captured, with
        the page-ins in its graph); "segments": one ORT session per segment (one in all
        when every weight is resident)."""
        return "graph" if isinstance(self._runner, StreamEngine) else "segments"

    @property
    def segments(self) -> List[Segment]:
        if self._closed and self._segments_at_close is not None:
            return list(self._segments_at_close)
        return [r.seg for r in self._runner.runs] if self._runner else []

    @property
    def device(self) -> Device:
        return self._device

    @property
    def residency(self) -> ResidencyManager:
        return self._residency

    def stats(self) -> OffloadStats:
        # A forked child may not even read the counters: a lock of the arena's may have been
        # held by another of the parent's threads at the fork, and is held for good here.
        self._check_process()
        dev, res, runner = self._device, self._residency, self._runner
        ledger = self._final_ledger if self._closed else dev.ledger.snapshot()
        return OffloadStats(
            backend=dev.kind, policy=self.config.policy, vmm=self._stable, segments=len(self.segments),
            weights=len(self._weights),
            weight_bytes=sum(w.nbytes for w in self._weights),
            capture=f"{'on' if self.graph_capture.enabled else 'off'}: {self.graph_capture.reason}",
            ledger=ledger, arena=dev.arena.stats(), driver=dev.backend.counters(),
            counters=Counters(**vars(res.counters)) if res else Counters(),
            last_step=runner.last_step if runner else Counters(),
            scratch=dev.scratch.stats() if dev.scratch is not None else None,
            ort_owned_bytes=self._meter.at_creation if self._meter else 0,
            outside_bytes=self._meter.charged if self._meter else 0, notes=tuple(self._notes),
            graph_steps=runner.graph_steps if runner else 0)

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
        self._release_parked()
        self._release_entry()
        if self._device is not None and not self._device.closed:
            self._device.compute_stream.synchronize()
        if self._runner is not None:
            self._segments_at_close = self.segments  # what stats() and the timeline report afterwards
            self._runner.close()
        if self._residency is not None:
            self._residency.close()
        if self._device is not None:
            if self._meter is not None:
                self._meter.refund()
            self._final_ledger = self._device.close()
        if self._store is not None:
            self._store.close()
            self._store = None
        remove_workdir(self._workdir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True) and getattr(self, "_pid", None) == os.getpid():
            try:
                self.close()
            except Exception as e:  # noqa: BLE001 - never raise from a finalizer
                warnings.warn(f"closing a session at exit failed: {e}", OffloadWarning)

