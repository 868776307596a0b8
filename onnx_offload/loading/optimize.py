"""The one optimization pass: ORT optimizes the model once, for the target provider, and
saves it with every initializer of at least ``min_weight_bytes`` in one data file.

Those initializers are the weights: the ones that reach slots are the final ones, and
the sessions that run them are created with optimizations off, so nothing replaces
them afterwards. The weights of subgraphs are lifted into the main graph, so that every
weight is one the package places.

On CUDA the pass needs the weights on the device once, as ORT places initializers
before it saves the optimized model. Its device memory comes through the plugin's
external allocator from a ledger of its own, sized to the memory free on the device,
and all of it is given back before the session's budget applies. When even that does
not fit (a card smaller than the model), the model runs as it was exported, its weights
rewritten into the data file unchanged, and the session says so in its notes. A pass on
the CPU is no fallback: ORT would save the casts it inserts around the float16 nodes
its CPU provider lacks, and the CUDA provider would then run those nodes in float32.
"""
from __future__ import annotations

import collections
import errno
import os
import resource
import stat
import warnings
from typing import Dict, Optional, Sequence

import onnx
import onnxruntime as ort
from onnx import helper

from .. import _core
from ..errors import CorruptModel, OffloadError, OffloadWarning, with_ort_type
from .files import SaveFailed, disk_reason, open_regular, saving
from .graphs import all_tensors, external_info, subgraphs
from .ort_options import CUDA_EP, copy_options, set_config

# The files the pass writes, in the optimized model's folder (a cache entry, or the session's own).
OPTIMIZED = "optimized.onnx"
OPTIMIZED_DATA = "optimized.onnx.data"

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def optimization_level(name: Optional[str], sess_options: Optional[ort.SessionOptions]):
    if name is not None:
        if name not in _LEVELS:
            raise ValueError(f"optimization_level={name!r} is not valid: expected one of {', '.join(_LEVELS)}")
        return _LEVELS[name]
    if sess_options is not None:
        return sess_options.graph_optimization_level
    return ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def optimize_once(src: str, workdir: str, on_cuda: bool, level, min_weight_bytes: int,
                  device=None, notes: Optional[list] = None, disabled_optimizers: Sequence[str] = (),
                  user_options: Optional[ort.SessionOptions] = None) -> str:
    """Runs ORT's graph optimizations once, with the caller's session options (their
    free-dimension overrides and custom-op libraries included); returns the optimized
    model's path. An optimized model already in `workdir` (a cache directory) is reused."""
    out = os.path.join(workdir, OPTIMIZED)
    if optimized_exists(out):
        return out
    if not on_cuda:
        _optimize(src, out, level, min_weight_bytes, ["CPUExecutionProvider"], disabled_optimizers, user_options)
        return out
    free, _ = device.backend.mem_info()
    ledger = _core.BudgetOwner(free)
    arena = _core.Arena(device.backend, ledger, zone_va_bytes=max(free, device.granularity))
    allocator = _core.ScratchAllocator(arena, "scratch")
    index, alloc, release, empty = _core.bind_external_allocator(allocator)
    providers = [(CUDA_EP, {
        "device_id": str(device.config.device_id), "gpu_external_alloc": str(alloc),
        "gpu_external_free": str(release), "gpu_external_empty_cache": str(empty)}), "CPUExecutionProvider"]
    try:
        _optimize(src, out, level, min_weight_bytes, providers, disabled_optimizers, user_options)
        return out
    except SaveFailed:
        raise  # the disk: another pass would not fit either
    except OffloadError as e:
        if notes is None:
            raise
        notes.append(f"the CUDA optimization pass did not fit the free device memory ({e}); the model runs as it "
                     f"was exported, without ORT's graph optimizations")
    finally:
        _forget_external_allocator(device.config.device_id)
        _core.unbind_external_allocator(index)
        allocator.empty_cache()
        arena.close()
    _as_exported(src, out, min_weight_bytes)
    return out


def _forget_external_allocator(device_id: int) -> None:
    """ORT's Python binding keeps the external allocator of the last CUDA session it
    created in a process-wide variable, and gives it to every later CUDA session made
    without provider options and to the first CUDA OrtValue of a device (whose allocator
    it keeps for the process). Left pointing at the pass's allocator, which is unbound
    next, those fail in ORT ("CUDAExternalAllocator::Alloc ... p != nullptr"). A session
    created with provider options of its own sets that variable back to no external
    allocator: a one-node model on the same device, made and dropped here."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "reset", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), so,
                             providers=[(CUDA_EP, {"device_id": str(device_id)})])
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        warnings.warn(f"could not clear ONNX Runtime's record of the optimization pass's external allocator "
                      f"({e}); a CUDA session made later without provider options may fail to allocate",
                      OffloadWarning, stacklevel=3)


def _optimize(src: str, out: str, level, min_weight_bytes: int, providers, disabled_optimizers=(),
              user_options: Optional[ort.SessionOptions] = None) -> None:
    so = copy_options(user_options)
    so.graph_optimization_level = level
    so.optimized_model_filepath = out
    so.log_severity_level = 4
    so.enable_profiling = False  # the caller's profile covers the sessions that run
    set_config(so, "session.optimized_model_external_initializers_file_name", OPTIMIZED_DATA)
    set_config(so, "session.optimized_model_external_initializers_min_size_in_bytes", str(min_weight_bytes))
    set_config(so, "session.disable_prepacking", "1")
    error = None
    try:
        kw = {"disabled_optimizers": list(disabled_optimizers)} if disabled_optimizers else {}
        session = ort.InferenceSession(src, so, providers=providers, **kw)
        del session  # its device memory goes back before the allocator does
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        error = e
    folder = os.path.dirname(out)
    if optimized_exists(out):
        # A failure after the save (placing initializers) does not matter.
        model = onnx.load(out, load_external_data=False)
        if lift_subgraph_weights(model):
            with saving(folder, "the optimized model"):
                onnx.save(model, out)
        return
    if any(os.path.lexists(os.path.join(folder, f)) for f in (OPTIMIZED, OPTIMIZED_DATA)):
        raise _save_error(folder, error) from error  # ORT began to save, and could not finish
    msg = str(error) if error else "ORT wrote no optimized model"
    if any(t in msg for t in ("INVALID_GRAPH", "INVALID_PROTOBUF", "ValidateGraph", "Protobuf parsing failed",
                              "Load model", "NOT_IMPLEMENTED")):
        raise with_ort_type(CorruptModel, error)(f"ONNX Runtime cannot load the model: {msg}") from error
    raise OffloadError(f"optimizing the model failed: {msg}") from error


def _save_error(folder: str, error: Optional[BaseException]) -> SaveFailed:
    """ORT began to save the optimized model in `folder` and failed: the disk (it says no
    more than "Failed to write"). EFBIG where a file it left reached the file size limit,
    else ENOSPC."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    sizes = [os.lstat(p).st_size for p in (os.path.join(folder, f) for f in (OPTIMIZED, OPTIMIZED_DATA))
             if os.path.lexists(p)]
    code = errno.EFBIG if soft != resource.RLIM_INFINITY and max(sizes, default=0) >= soft else errno.ENOSPC
    return SaveFailed(code, f"ONNX Runtime could not save the optimized model in {folder}: "
                            f"{disk_reason(folder, code)}; ORT said: {error or 'nothing'}")


def _as_exported(src: str, out: str, min_weight_bytes: int) -> None:
    """The model unchanged, in the optimized model's files: the initializers of
    `min_weight_bytes` or more in its data file, the others inside it."""
    folder = os.path.dirname(out)
    model = onnx.load(src, load_external_data=True)
    lift_subgraph_weights(model)
    with saving(folder, "the model"):
        onnx.save(model, out, save_as_external_data=True, all_tensors_to_one_file=True, location=OPTIMIZED_DATA,
                  size_threshold=min_weight_bytes, convert_attribute=False)


def optimized_exists(out: str) -> bool:
    """An optimized model that ORT saved whole: a regular file that parses to a model with
    a graph, and every data file it names (beside it, or at an absolute path: see
    share_unchanged) a regular file that holds each tensor's bytes. ORT writes no data
    file when no initializer reaches the threshold; a save that failed (a full disk, a
    file size limit) leaves an empty model or a short data file."""
    try:
        fd = open_regular(out, follow=False)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    try:
        model = onnx.load_model_from_string(data)
    except Exception:  # noqa: BLE001 - a partial write; protobuf raises its own types
        return False
    if not model.HasField("graph"):
        return False
    return _data_in_place(model, os.path.dirname(out))


def _data_in_place(model: onnx.ModelProto, base: str) -> bool:
    sizes: Dict[str, int] = {}
    for t in all_tensors(model.graph):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = external_info(t)
        path = os.path.join(base, info.get("location", ""))
        if path not in sizes:
            try:
                st = os.stat(path)
            except OSError:
                return False
            if not stat.S_ISREG(st.st_mode):
                return False
            sizes[path] = st.st_size
        length = int(info["length"]) if "length" in info else 0
        if int(info.get("offset", 0)) + length > sizes[path]:
            return False
    return True


def lift_subgraph_weights(model: onnx.ModelProto) -> int:
    """Moves the weights of subgraphs (the initializers of If/Loop/Scan bodies that ORT
    stored in the data file) into the main graph; returns how many moved.

    A subgraph reads them as outer-scope values, which ONNX allows at any depth, so
    they become ordinary weights: a slot each, charged to the ledger, paged in with the
    segment of the node that holds the subgraph, and given to ORT through
    add_initializer (which matches the main graph's names). A name defined more than
    once in the model (two branches each with a `W`, or a shadowing inner value) is
    renamed to a fresh one inside its own scope; one that is also the subgraph's output
    is copied out by an Identity node.
    """
    defined: Dict[str, int] = collections.Counter()
    taken = set()
    _collect_names(model.graph, defined, taken)
    moved = 0

    def visit(graph):
        nonlocal moved
        for node in graph.node:
            for attr in node.attribute:
                for g in subgraphs(attr):
                    visit(g)
                    external = [i for i, t in enumerate(g.initializer)
                                if t.data_location == onnx.TensorProto.EXTERNAL]
                    outputs = {o.name for o in g.output}
                    for i in external:
                        t = g.initializer[i]
                        lifted = model.graph.initializer.add()
                        lifted.CopyFrom(t)
                        if t.name in outputs:
                            # ORT rejects a subgraph output that is an outer-scope value
                            # (constant folding makes these): the branch copies it out.
                            lifted.name = _fresh(t.name, taken)
                            g.node.insert(0, helper.make_node("Identity", [lifted.name], [t.name]))
                        elif defined[t.name] > 1:
                            lifted.name = _fresh(t.name, taken)
                            _rename_in_scope(g, t.name, lifted.name)
                    for i in reversed(external):
                        del g.initializer[i]
                    moved += len(external)

    visit(model.graph)
    return moved


def _collect_names(graph, defined, taken) -> None:
    """Counts each value's definitions (inputs, initializers, node outputs) in every graph."""
    for name in ([v.name for v in graph.input] + [t.name for t in graph.initializer]
                 + [t.values.name for t in graph.sparse_initializer] + [o for n in graph.node for o in n.output if o]):
        defined[name] += 1
        taken.add(name)
    taken.update(n for node in graph.node for n in node.input)
    for node in graph.node:
        for attr in node.attribute:
            for g in subgraphs(attr):
                _collect_names(g, defined, taken)


def _fresh(name: str, taken: set) -> str:
    i = 0
    while f"{name}__w{i}" in taken:
        i += 1
    taken.add(f"{name}__w{i}")
    return f"{name}__w{i}"


def _rename_in_scope(graph, old: str, new: str) -> None:
    """Renames the uses of `old` in `graph` and the subgraphs that do not define their own."""
    for node in graph.node:
        for i, n in enumerate(node.input):
            if n == old:
                node.input[i] = new
        for attr in node.attribute:
            for g in subgraphs(attr):
                local = ({v.name for v in g.input} | {t.name for t in g.initializer}
                         | {o for n in g.node for o in n.output})
                if old not in local:
                    _rename_in_scope(g, old, new)
    for v in list(graph.output) + list(graph.value_info):
        if v.name == old:
            v.name = new
