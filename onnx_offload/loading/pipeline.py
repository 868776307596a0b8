"""The loading pipeline: a path or bytes becomes a prepared model, in one call.

``prepare`` runs every step of it:
1. the model file is found (a folder gives its one model) and materialized where ORT
   would read it, its external data checked by ORT's rules (``files.py``);
2. it is optimized once for the target provider, into a cache entry published with one
   rename (or the session's own folder when the cache cannot be used or trusted), its
   files fingerprinted and held open (``optimize.py``, ``cache.py``, ``fingerprints.py``);
3. the optimized model is loaded through the held files and its weights table read
   (``weights.py``);
4. the graph's inputs, outputs and decoder layout (``decoder.py``) are read from it.

The ``PreparedModel`` keeps the held files open until ``release()``: the weights are read
through the descriptors that were fingerprinted, so a file replaced in between cannot
mix versions.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Callable, Dict, List, Optional

import onnx

from ..config import fmt_bytes
from ..errors import OffloadWarning, UnsupportedModel
from .cache import cache_folder, make_partial, open_entry, publish, remove_set_aside, set_aside, sweep_partials
from .cache_env import check_env_cache_dir, named_by_env
from .decoder import decoder_spec, rotary_rows, window_caches
from .lengths import length_thresholds
from .files import external_data_folder, materialize, model_file
from .fingerprints import HeldFiles, cache_key, hold_made, write_manifest
from .optimize import OPTIMIZED, OPTIMIZED_DATA, optimization_level, optimize_once
from .ort_options import options_key
from .values import IOInfo
from .weights import WeightInfo, keep_in_model, load_optimized, read_weights, share_unchanged, write_optimized
from .workdir import disown, remove_workdir


@dataclasses.dataclass(frozen=True)
class ModelMeta:
    """What ORT's ModelMetadata says, read from the caller's model."""

    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: Dict[str, str]

    @classmethod
    def of(cls, model: onnx.ModelProto) -> "ModelMeta":
        # A model without model_version reads as ORT's "no version", the largest int64.
        version = model.model_version if model.HasField("model_version") else 2**63 - 1
        return cls(model.producer_name, model.graph.name, model.domain, model.doc_string, model.graph.doc_string,
                   version, {p.key: p.value for p in model.metadata_props})


@dataclasses.dataclass
class LoadRequest:
    """How a session asks for its model to be prepared."""

    on_cuda: bool
    config: object  # OffloadConfig
    device: object  # the Device whose provider the pass optimizes for
    workdir: str  # the session's own folder
    disabled_optimizers: List[str]
    options: object  # the caller's SessionOptions as ORT takes them (a copy), or None
    user_options: object  # the caller's SessionOptions object, or None
    in_place: Callable  # whether ORT can take an initializer of a dtype in place
    notes: List[str]


@dataclasses.dataclass
class PreparedModel:
    """A model ready to be placed and run."""

    model: onnx.ModelProto  # the optimized model; its weights still name their data file
    folder: str  # where the optimized model and its data file are
    weights: List[WeightInfo]
    held: HeldFiles  # the files the weights are read through, open until release()
    name: str  # for reports: the file's name, or "model (bytes)"
    model_dir: Optional[str]  # the folder of the caller's file (its config files), None for bytes
    meta: ModelMeta
    overridable: List[IOInfo]  # initializers the caller's model lets callers override
    feed_inputs: List[str]  # the inputs a caller feeds (never the weights)
    required_inputs: List[str]  # of those, the ones that cannot be left out
    graph_inputs: List[IOInfo]
    graph_outputs: List[IOInfo]
    op_types: set
    decoder: object  # the DecoderSpec generate() runs, or the UnsupportedModel that says why not
    entry_lock: Optional[int] = None  # a shared lock on the cache entry while it is read

    @property
    def data_file(self) -> str:
        return os.path.join(self.folder, OPTIMIZED_DATA)

    def release(self) -> None:
        """Everything the session reads from the cache entry is read: its lock and the
        held files go."""
        if self.entry_lock is not None:
            os.close(self.entry_lock)
            self.entry_lock = None
        self.held.close()


def prepare(path_or_bytes, request: LoadRequest, progress) -> PreparedModel:
    """The prepared model of `path_or_bytes`: a model file, a model folder or bytes."""
    if isinstance(path_or_bytes, (str, os.PathLike)):
        path_or_bytes = model_file(os.fspath(path_or_bytes))  # a model folder: the file in it
    src, original = materialize(path_or_bytes, request.workdir, external_data_folder(request.user_options))
    meta = ModelMeta.of(original)
    initializers = {t.name for t in original.graph.initializer}
    overridable = [IOInfo(v) for v in original.graph.input if v.name in initializers]
    del original  # the optimized model is what runs
    from_file = isinstance(path_or_bytes, (str, os.PathLike))
    cfg, notes = request.config, request.notes
    level = optimization_level(cfg.optimization_level, request.user_options)
    held, entry_lock = HeldFiles(), None
    try:
        with progress.phase("optimizing the model"):
            folder, entry_lock = _optimized_folder(src, level, from_file, request, held)
            path = optimize_once(src, folder, request.on_cuda, level, cfg.min_weight_bytes, request.device, notes,
                                 request.disabled_optimizers, request.options)
        user = request.user_options
        if user is not None and user.optimized_model_filepath:
            write_optimized(path, user.optimized_model_filepath, held)
        model = load_optimized(path, held)
        inside = keep_in_model(model, folder, request.in_place, held)
        if inside:
            notes.append(f"{len(inside)} initializers of types ORT cannot take in place (such as {inside[0]!r}) "
                         f"stay inside the model: ORT owns their memory")
        weights = read_weights(model, folder)
        own = [w for w in weights if w.path != os.path.join(folder, OPTIMIZED_DATA)]
        if own:
            notes.append(f"{len(own)} weights ({fmt_bytes(sum(w.nbytes for w in own))}) are read from the model's own "
                         f"data files: optimization left them unchanged, so the cache holds no copy")
        inits = {t.name for t in model.graph.initializer}
        # The inputs a caller feeds (never the weights); as ORT's Python layer, one of
        # optional type may be left out.
        feed = [v.name for v in model.graph.input if v.name not in inits]
        required = [v.name for v in model.graph.input if v.name in feed and not v.type.HasField("optional_type")]
        graph_inputs = [IOInfo(v) for v in model.graph.input]
        graph_outputs = [IOInfo(v) for v in model.graph.output]
        op_types = {n.op_type for n in model.graph.node}
        model_dir = os.path.dirname(os.path.abspath(os.fspath(path_or_bytes))) if from_file else None
        feeding = set(feed)
        decoder = _decoder([i for i in graph_inputs if i.name in feeding], graph_outputs, op_types, model_dir, model,
                           notes)
        return PreparedModel(
            model=model, folder=folder, weights=weights, held=held, entry_lock=entry_lock,
            name=os.path.basename(os.fspath(path_or_bytes)) if from_file else "model (bytes)", model_dir=model_dir,
            meta=meta, overridable=overridable, feed_inputs=feed, required_inputs=required, graph_inputs=graph_inputs,
            graph_outputs=graph_outputs, op_types=op_types, decoder=decoder)
    except BaseException:  # a failure or Ctrl-C anywhere before the model is handed over loses nothing
        if entry_lock is not None:
            os.close(entry_lock)
        held.close()
        raise


def _decoder(inputs, outputs, op_types, model_dir, model, notes):
    """The decoder layout generate() runs, or the UnsupportedModel that says why not."""
    try:
        spec = decoder_spec(inputs, outputs, op_types, model_dir, rotary_rows(model), window_caches(model),
                            length_thresholds(model))
    except UnsupportedModel as e:
        return e
    window = spec.sliding_window
    why = (f"generate(): config.json gives this model a sliding window of {window} positions, which it places by "
           f"the past's length: its past is fed at its exact length, and its decode steps run uncaptured")
    if window and spec.layout == "exact" and why not in notes:
        notes.append(why)
    return spec


def _note(request: LoadRequest, why: str, depth: int) -> None:
    """A warning at the caller of OffloadSession(), `depth` frames above this one's
    caller (OffloadSession.__init__, its _build, prepare and the steps between), and a
    note of the session's."""
    warnings.warn(why, OffloadWarning, stacklevel=depth + 2)
    request.notes.append(why)


def _optimized_folder(src: str, level, own_files: bool, request: LoadRequest, held: HeldFiles) -> tuple:
    """(where the optimized model lives, the entry's lock or None): a cache entry,
    published with one rename, or the session's own folder (also when the cache folder
    cannot be used or is not to be trusted, see cache.cache_folder, with a warning). A
    cache entry made from the caller's files on disk (`own_files`) reads the weights
    optimization left unchanged from those files, not from a copy. The files the key
    fingerprints and the entry's files are held open in `held`: the weights are read
    through them."""
    cfg = request.config
    usable = True
    if named_by_env(cfg.cache_dir):
        usable, note = check_env_cache_dir(cfg.cache_dir)
        if note:
            _note(request, note, 4)
    cache, why = cache_folder(cfg.cache_path) if cfg.cache_path and usable else (None, "")
    if why:
        _note(request, f"the cache folder {cfg.cache_path!r} {why}; the optimized model stays in the session's folder",
              4)
    if not cache:
        return request.workdir, None
    key = cache_key(src, request.on_cuda, level, cfg.min_weight_bytes, request.disabled_optimizers,
                    options_key(request.options), own_files, held)
    opt_dir = os.path.join(cache, key)
    # The entry is read under a shared lock (released once the weights are read), so
    # that `onnx-offload cache clear` leaves it alone meanwhile. An entry cleared
    # between the lookup and the lock is looked up again, and made again.
    for _ in range(3):
        lock, why = open_entry(opt_dir, key, held)
        if lock is not None:
            return opt_dir, lock
        if why:
            _note(request, f"the cache entry {opt_dir} {why}: it is made again", 4)
        if os.path.lexists(opt_dir):
            # An entry missing a file (removed by hand), changed or not to be trusted:
            # set aside, then made again and published like a new one, never rewritten
            # where others may be reading it.
            set_aside(cache, opt_dir)
            remove_set_aside(cache)
        published = _publish_entry(cache, opt_dir, key, src, level, own_files, request, held)
        if published != opt_dir or held.get(os.path.join(opt_dir, OPTIMIZED)) is not None:
            return published, None  # the session's folder, or the entry it made (its files held)
    return request.workdir, None  # cleared as fast as it was made: the session's own folder


def _publish_entry(cache: str, opt_dir: str, key: str, src: str, level, own_files: bool, request: LoadRequest,
                   held: HeldFiles) -> str:
    """Optimizes into a new partial folder (named after this process, so that a start
    killed half-way leaves it behind for no longer than the process: see
    cache.make_partial) and publishes it as `opt_dir` with one rename, its files held
    open for this session to read. Returns `opt_dir`, or the session's folder when the
    cache folder cannot take the entry (a full disk, a file size limit) or the model's
    files changed during the pass (what ORT read is not what the key names)."""
    cfg = request.config
    why = tmp = None
    made = HeldFiles()
    try:
        sweep_partials(cache)
        tmp = make_partial(cache)
        optimize_once(src, tmp, request.on_cuda, level, cfg.min_weight_bytes, request.device, request.notes,
                      request.disabled_optimizers, request.options)
        if own_files:
            share_unchanged(tmp, src, held)
        write_manifest(tmp, key, os.path.abspath(src) if own_files else "a model given as bytes")
        changed = held.changed()
        if not changed:
            made = hold_made(tmp, opt_dir)
    except OSError as e:  # a full disk, a file size limit (SaveFailed), no permission
        why = f"the cache folder {cache!r} cannot be used ({e}); the optimized model stays in the session's folder"
    else:
        if changed:
            why = (f"the model's files changed while ORT optimized it ({', '.join(changed)}): no cache entry is "
                   f"made of what it read; the optimized model stays in the session's folder")
        else:
            try:
                publish(tmp, opt_dir)
            except OSError:
                pass  # another process published it first: it is looked up next
            else:
                disown(tmp)
                held.adopt(made)
    finally:
        made.close()
        if tmp is not None:
            remove_workdir(tmp)  # a failed or interrupted pass leaves nothing behind
    if why:
        _note(request, why, 5)
        return request.workdir
    return opt_dir
