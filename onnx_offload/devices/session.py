"""StagedSession: one model split across devices, one contiguous stage per device.

Each stage is an OffloadSession of its own on its own device: its own budget owner and
ledger, its own engine (the streaming engine's ring and captured graph where that is
what runs), and its own weights streaming over its own host-to-device link. A step runs
the stages in order; a value one stage makes and a later one reads moves to the later
stage's device (``moves.py``). The split balances the stages' step times
(``balance.py``); the stage models are written by ``stages.py``.

On the CPU execution provider every device is a host backend of its own, so the split,
the moves and the per-device ledgers run the code they run on GPUs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import threading
import warnings
from typing import Dict, List, Optional, Sequence

import onnxruntime as ort

from ..config import MAX_DEVICE_ID, OffloadConfig
from ..dropin import run_async
from ..engines import GraphCaptureDecision, as_arrays, as_ortvalue, check_feeds
from ..errors import BudgetExceeded, OffloadWarning, StateError, UnsupportedModel
from ..generation import GenerationMembers, model_folder, probing
from ..interrupts import deferred_interrupts
from ..loading import (copy_options, external_data_folder, make_workdir, optimization_level, remove_workdir,
                       unseen, write_optimized)
from ..memory import weights_allowance
from ..progress import LoadProgress
from ..session import ClosedAtExit, OffloadSession, session_arguments
from .advice import whole_advice
from .balance import DeviceShare
from .dropin import StagedMembers
from .generation import StagedGeneration, on_device, shortage
from .moves import StepMoves
from .stages import WholePass, stage_models
from .stats import StagedStats

# Keywords a caller may give per device, as a list with one value for each.
PER_DEVICE = ("vram_limit", "weight_bytes", "kv_bytes", "scratch_bytes")
# OffloadSession's keywords that are no part of the configuration.
SESSION_KEYWORDS = ("record_timeline", "disabled_optimizers")


def check_devices(devices) -> List[int]:
    """The device ids as a list of distinct non-negative ints."""
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a sequence of device ids such as [0, 1], got {devices!r}")
    ids = []
    for d in devices:
        if isinstance(d, bool):
            raise TypeError(f"devices must be device ids (integers), got {d!r}")
        d = operator.index(d)
        if d < 0:
            raise ValueError(f"device ids are >= 0, got {d}")
        if d > MAX_DEVICE_ID:
            raise ValueError(f"device id {d} is out of range: ONNX Runtime takes device ids up to {MAX_DEVICE_ID}")
        ids.append(d)
    if not ids:
        raise ValueError("devices names no device")
    if len(set(ids)) != len(ids):
        raise ValueError(f"devices names a device twice: {ids}")
    return ids


class StagedSession(ClosedAtExit, StagedMembers, GenerationMembers):
    """A model over several devices. Made by ``OffloadSession(..., devices=[0, 1])``; the
    other arguments are OffloadSession's, and ``vram_limit``, ``weight_bytes``,
    ``kv_bytes`` and ``scratch_bytes`` may each be a list with one value per device."""

    def __init__(self, path_or_bytes, sess_options: Optional[ort.SessionOptions] = None, providers=None,
                 provider_options=None, *, devices, config: Optional[OffloadConfig] = None, progress=None,
                 **config_kwargs):
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._cwd = os.getcwd()  # where ORT writes relative file names (profiles)
        self._user_options = sess_options
        self._closed, self.stages, self._workdir = True, [], None
        self.devices = ids = check_devices(devices)
        self._model_folder = model_folder(path_or_bytes)  # its tokenizer and chat template
        asked = dict(config_kwargs)  # for the advice of a budget too small, tried whole
        per = {k: config_kwargs.pop(k) for k in PER_DEVICE if isinstance(config_kwargs.get(k), (list, tuple))}
        for k, v in per.items():
            if len(v) != len(ids):
                raise ValueError(f"{k} gives {len(v)} values for {len(ids)} devices")
        if config is not None and (per or set(config_kwargs) - set(SESSION_KEYWORDS)):
            raise TypeError("pass either config= or configuration keywords, not both")
        if "device_id" in config_kwargs:
            raise TypeError("give the devices in devices=, not device_id=")
        # The stage models live in this session's folder, copied for it: a cache entry of
        # theirs would name files that go with the session, so the stages keep none.
        stage_kwargs = [dict(config_kwargs, device_id=d, cache_dir="off", **{k: v[i] for k, v in per.items()})
                        for i, d in enumerate(ids)]
        configs = [dataclasses.replace(config, device_id=d, cache_dir="off") if config is not None else None
                   for d in ids]
        self.moved_bytes = 0
        self._workdir = make_workdir()
        try:
            shares, first = [], None
            for i, (cfg, kw) in enumerate(zip(configs, stage_kwargs)):
                given = {k: v for k, v in kw.items() if k not in SESSION_KEYWORDS} if cfg is None else {}
                with on_device(ids[i], i, len(ids)):
                    args = session_arguments(providers, provider_options, cfg, given)
                    shares.append(DeviceShare(weights_allowance(args.on_cuda, args.config)))
                    first = args if first is None else first
            whole = WholePass(first.on_cuda, optimization_level(first.config.optimization_level, sess_options),
                              first.config, sorted(config_kwargs.get("disabled_optimizers") or ()),
                              copy_options(sess_options) if sess_options is not None else None)
            with on_device(ids[0], 0, len(ids)), LoadProgress(progress).phase("optimizing the whole model"):
                self._model = m = stage_models(path_or_bytes, self._workdir, shares, whole,
                                               external_data_folder(sess_options))
            self._decoder_spec = m.decoder
            stage_options = self._write_optimized(sess_options)
            if m.optimized:  # the stages run their parts of the optimized model as they are
                stage_kwargs = [dict(kw, optimization_level="disable") for kw in stage_kwargs]
                configs = [dataclasses.replace(c, optimization_level="disable") if c is not None else None
                           for c in configs]
            for d, path, cfg, kw in zip(ids, m.paths, configs, stage_kwargs):
                with on_device(d, len(self.stages), len(ids)):
                    session_kw = {k: v for k, v in kw.items() if k in SESSION_KEYWORDS}
                    self.stages.append(OffloadSession(path, stage_options, providers, provider_options, config=cfg,
                                                      progress=progress, **(kw if cfg is None else session_kw)))
                    if m.note:
                        self.stages[-1]._notes.append(m.note)
        except BudgetExceeded as e:
            spec = getattr(self, "_decoder_spec", None)
            self._teardown()
            if config is not None or probing():
                raise
            raise whole_advice(e, lambda **tried: StagedSession(
                path_or_bytes, sess_options, providers, provider_options, devices=ids, **tried), ids, asked,
                spec) from None
        except BaseException:
            self._teardown()
            raise
        self._closed = False

    def _write_optimized(self, sess_options):
        """Writes the whole optimized model where the caller's SessionOptions ask
        (optimized_model_filepath), as ORT and a one-device session write it; returns the
        SessionOptions the stages take, which ask for no file of their own part."""
        if sess_options is None or not sess_options.optimized_model_filepath:
            return sess_options
        if self._model.optimized is None:
            raise UnsupportedModel(f"optimized_model_filepath: {self._model.note}, so no optimized model of the whole "
                                   f"exists to write; leave optimized_model_filepath unset, or write it from a "
                                   f"session on one device of more free memory")
        write_optimized(self._model.optimized, sess_options.optimized_model_filepath)
        if unseen(sess_options):
            warnings.warn("these SessionOptions were made before onnx_offload was imported, so free-dimension "
                          "overrides, custom-op libraries and initializers added to them are not seen (only their "
                          "properties and ORT's documented config entries are); import onnx_offload first",
                          OffloadWarning, stacklevel=4)
        stage_options = copy_options(sess_options)
        stage_options.graph_optimization_level = sess_options.graph_optimization_level
        return stage_options

    # ------------------------------------------------------------------ as InferenceSession
    def get_inputs(self):
        """The model's inputs, in its order: as the stage that reads each lists it (or as
        the model declares one no node reads)."""
        listed = {i.name: i for stage in reversed(self.stages) for i in stage.get_inputs()}
        return [listed.get(x.name, x) for x in self._model.inputs]

    def get_outputs(self):
        made = {o.name: o for stage in self.stages for o in stage.get_outputs()}
        return [made[o.name] for o in self._model.outputs]

    def get_providers(self):
        return self.stages[0].get_providers()

    def get_modelmeta(self):
        return self._model.meta

    def get_session_options(self):
        """The SessionOptions as the caller gave them (ORT's defaults when none were)."""
        self._check_open()
        return self._user_options if self._user_options is not None else ort.SessionOptions()

    def get_provider_options(self) -> dict:
        """The first device's (each stage's names its own device_id)."""
        return self.stages[0].get_provider_options()

    def run_async(self, output_names, input_feed, callback, user_data, run_options=None) -> None:
        """As InferenceSession.run_async: runs on a thread of its own and calls
        callback(outputs, user_data, error message), the message empty on success."""
        self._check_open()
        run_async(self, self._model.required, output_names, input_feed, callback, user_data, run_options)

    def io_binding(self):
        raise NotImplementedError("a session split across devices takes no IOBinding (its values lie on several "
                                  "devices): use run() or run_with_ort_values()")

    def run_with_iobinding(self, iobinding, run_options=None):
        self.io_binding()

    @property
    def segments(self) -> list:
        """Every stage's segments, in order."""
        return [seg for stage in self.stages for seg in stage.segments]

    @property
    def graph_capture(self) -> GraphCaptureDecision:
        """Whether steps run as captured graphs: each stage decides for its own run()
        steps; generate() across devices runs its steps uncaptured (generation.py)."""
        each = [stage.graph_capture for stage in self.stages]
        return GraphCaptureDecision(all(each), "; ".join(f"device {d}: {c.reason}" for d, c in zip(self.devices, each)))

    @property
    def split(self):
        """Where the model was cut: each stage's nodes, weight bytes, step time and crossings."""
        return self._model.split

    def run(self, output_names, input_feed, run_options=None):
        with self._step():
            feeds = as_arrays(self._model.inputs, input_feed)
            check_feeds(self._model.required, self._model.inputs,
                        [o.name for o in self._model.outputs], feeds, output_names)
            names = list(output_names or [o.name for o in self._model.outputs])
            values = self._run_values(feeds, run_options)
            return [values[n].numpy() for n in names]

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None) -> List[ort.OrtValue]:
        """OrtValues in, OrtValues out, each on the device of the stage that made it."""
        with self._step():
            feeds = dict(input_dict_ort_values)
            check_feeds(self._model.required, self._model.inputs, [o.name for o in self._model.outputs], feeds,
                        output_names)
            names = list(output_names or [o.name for o in self._model.outputs])
            values = self._run_values(feeds, run_options)
            return [values[n] for n in names]

    def _run_values(self, feeds, run_options=None) -> Dict[str, ort.OrtValue]:
        """{name: OrtValue} of every value the stages make. A caller's value goes to
        each stage that reads it as it is; a value a stage made moves to the device of each
        later stage that reads it."""
        values = {n: as_ortvalue(v) for n, v in feeds.items()}
        made_by: Dict[str, int] = {}
        for s, (stage, seg) in enumerate(zip(self.stages, self._model.segments)):
            moves = StepMoves(stage.device, shortage(stage, 0, 1))
            try:
                with stage._step(), on_device(self.devices[s], s, len(self.stages)):
                    stage_feeds = {}
                    for n in seg.inputs:
                        if n not in values:
                            continue  # an optional input left out
                        origin = made_by.get(n, s)
                        stage_feeds[n] = values[n] if origin == s else \
                            moves.move(self.stages[origin].device, values[n])
                    outs = stage.run_with_ort_values(seg.outputs, stage_feeds, run_options)
            finally:
                moves.close()
                self.moved_bytes += moves.bytes
            for n, v in zip(seg.outputs, outs):
                values[n], made_by[n] = v, s
        return values

    # ------------------------------------------------------------------ generation
    # chat() runs each turn's whole conversation (generation.chat_cache)
    _chat_refused = "the model is split across devices"

    def _new_generation(self, spec, batch: int, prompt: int, total: int):
        return StagedGeneration(self, spec, batch, prompt, total)

    def _park(self, gen) -> None:
        gen.close()

    def free_generation_cache(self) -> None:
        """Nothing is kept between generations across devices; each stage's is freed."""
        with self._step():
            for stage in self.stages:
                stage.free_generation_cache()

    # ------------------------------------------------------------------ reporting
    def stats(self) -> StagedStats:
        self._check_process()
        return StagedStats(list(self.devices), [s.stats() for s in self.stages], self.moved_bytes)

    def timeline_png(self, path: str) -> str:
        """Each device's residency timeline (OffloadSession.timeline_png), one file per
        device beside `path`, named `<path stem>.device<id>.png`; returns their paths."""
        stem = path[:-4] if path.lower().endswith(".png") else path
        return ", ".join(stage.timeline_png(f"{stem}.device{d}.png") for d, stage in zip(self.devices, self.stages))

    # ------------------------------------------------------------------ state
    def _check_process(self):
        if self._pid != os.getpid():
            raise StateError(f"this session was created in process {self._pid}; a forked child cannot use its "
                             f"devices: create a new session in the child")

    def _check_open(self):
        self._check_process()
        if self._closed:
            raise StateError("the session is closed")

    @contextlib.contextmanager
    def _step(self):
        """One call at a time. A Ctrl-C between stages leaves the session as it was: each
        stage defers interrupts through its own step, and a step's moves are freed."""
        self._check_open()
        with self._lock:
            self._check_open()
            yield

    def close(self):
        """Closes every stage; returns each device's final ledger snapshot."""
        if self._pid != os.getpid():  # a forked child: the devices are the parent's
            self._closed = True
            return None
        with self._lock, deferred_interrupts():
            self._closed = True
            return self._teardown()

    def _teardown(self):
        finals = [s.close() for s in self.stages]
        if self._workdir is not None:
            remove_workdir(self._workdir)
            self._workdir = None
        return finals
