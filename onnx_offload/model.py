"""The model side: optimize once, find the weights, and write the models ORT loads.

The model is optimized once, by ORT, for the target execution provider, and saved
with every initializer of at least ``min_weight_bytes`` in one external data file.
Those initializers are the weights: the ones that reach slots are the final ones, and
the sessions that run them are created with optimizations off, so nothing replaces
them afterwards.

On CUDA the pass needs the weights on the device once, as ORT places initializers
before it saves the optimized model. Its device memory comes through the plugin's
external allocator from a ledger of its own, sized to the memory free on the device,
and all of it is given back before the session's budget applies. When even that does
not fit, the pass falls back to ORT's provider-independent (basic) optimizations on
the CPU, and the session says so in its notes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Optional, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from . import _core
from .errors import CorruptModel, OffloadError

OPTIMIZED = "optimized.onnx"
OPTIMIZED_DATA = "optimized.onnx.data"
PLACEHOLDER = "offload.placeholder"

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@dataclasses.dataclass
class WeightInfo:
    name: str
    dtype: np.dtype
    shape: tuple
    nbytes: int
    offset: int  # in the optimized data file
    first_use: int  # index of the first node that reads it


def optimization_level(name: Optional[str], sess_options: Optional[ort.SessionOptions]):
    if name is not None:
        if name not in _LEVELS:
            raise ValueError(f"optimization_level={name!r} is not valid: expected one of {', '.join(_LEVELS)}")
        return _LEVELS[name]
    if sess_options is not None:
        return sess_options.graph_optimization_level
    return ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def materialize(path_or_bytes, workdir: str) -> str:
    """A path to the model on disk, checked to parse."""
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        path = os.path.join(workdir, "input.onnx")
        with open(path, "wb") as f:
            f.write(path_or_bytes)
    else:
        path = os.fspath(path_or_bytes)
        if not os.path.exists(path):
            raise FileNotFoundError(f"model file {path!r} does not exist")
    try:
        onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf raises its own DecodeError types
        raise CorruptModel(f"{path!r} is not a valid ONNX model: {e}") from e
    return path


def cache_key(src: str, on_cuda: bool, level, min_weight_bytes: int) -> str:
    """Identifies an optimized model: the source file, the provider, the level, the threshold."""
    st = os.stat(src)
    text = "|".join(str(v) for v in (os.path.realpath(src), st.st_size, st.st_mtime_ns, on_cuda, int(level),
                                      min_weight_bytes, ort.__version__))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def optimize_once(src: str, workdir: str, on_cuda: bool, level, min_weight_bytes: int,
                  device=None, notes: Optional[list] = None) -> str:
    """Runs ORT's graph optimizations once; returns the optimized model's path.
    An optimized model already in `workdir` (a cache directory) is reused."""
    out = os.path.join(workdir, OPTIMIZED)
    if _optimized_exists(out):
        return out
    if not on_cuda:
        _optimize(src, out, level, min_weight_bytes, ["CPUExecutionProvider"])
        return out
    free, _ = device.backend.mem_info()
    ledger = _core.BudgetOwner(free)
    arena = _core.Arena(device.backend, ledger, zone_va_bytes=max(free, device.granularity))
    allocator = _core.ScratchAllocator(arena, "scratch")
    index, alloc, release, empty = _core.bind_external_allocator(allocator)
    providers = [("CUDAExecutionProvider", {
        "device_id": str(device.config.device_id), "gpu_external_alloc": str(alloc),
        "gpu_external_free": str(release), "gpu_external_empty_cache": str(empty)}), "CPUExecutionProvider"]
    try:
        _optimize(src, out, level, min_weight_bytes, providers)
        return out
    except OffloadError as e:
        if notes is None:
            raise
        notes.append(f"the CUDA optimization pass did not fit the free device memory ({e}); "
                     "used ORT's basic, provider-independent optimizations")
    finally:
        _core.unbind_external_allocator(index)
        allocator.empty_cache()
        arena.close()
    _optimize(src, out, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, min_weight_bytes, ["CPUExecutionProvider"])
    return out


def _optimized_exists(out: str) -> bool:
    return os.path.exists(out) and os.path.exists(os.path.join(os.path.dirname(out), OPTIMIZED_DATA))


def _optimize(src: str, out: str, level, min_weight_bytes: int, providers) -> None:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.optimized_model_filepath = out
    so.log_severity_level = 4
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", OPTIMIZED_DATA)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                str(min_weight_bytes))
    so.add_session_config_entry("session.disable_prepacking", "1")
    error = None
    try:
        session = ort.InferenceSession(src, so, providers=providers)
        del session  # its device memory goes back before the allocator does
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        error = e
    if _optimized_exists(out):
        return  # a failure after the save (placing initializers) does not matter
    msg = str(error) if error else "ORT wrote no optimized model"
    if any(t in msg for t in ("INVALID_GRAPH", "INVALID_PROTOBUF", "ValidateGraph", "Protobuf parsing failed",
                              "Load model", "NOT_IMPLEMENTED")):
        raise CorruptModel(f"ONNX Runtime cannot load the model: {msg}") from error
    raise OffloadError(f"optimizing the model failed: {msg}") from error


def read_weights(model: onnx.ModelProto) -> list[WeightInfo]:
    """The initializers stored in the external data file, in first-use order."""
    first_use = {}
    for i, node in enumerate(model.graph.node):
        for name in node_inputs(node):
            first_use.setdefault(name, i)
    weights = []
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        if info.get("location") != OPTIMIZED_DATA:
            raise OffloadError(f"initializer {t.name!r} lives in {info.get('location')!r}, not the optimized data file")
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        shape = tuple(int(d) for d in t.dims)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        weights.append(WeightInfo(t.name, dtype, shape, nbytes, int(info.get("offset", 0)),
                                  first_use.get(t.name, len(model.graph.node))))
    weights.sort(key=lambda w: (w.first_use, w.name))
    return weights


def node_inputs(node) -> list[str]:
    """Every value a node reads, including outer-scope names used by its subgraphs."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        graphs = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
        for g in graphs:
            local = {t.name for t in g.initializer} | {i.name for i in g.input}
            for sub in g.node:
                local.update(sub.output)
            for sub in g.node:
                names.extend(n for n in node_inputs(sub) if n not in local)
    return names


def point_weights_at_placeholder(model: onnx.ModelProto, weight_names: Sequence[str]) -> None:
    """Weights arrive through add_initializer; the model keeps only their declarations.

    ORT checks that an external data file exists but does not read it for an
    initializer it was given, so an empty placeholder stands in: were ORT ever to read
    it, the read would fail loudly instead of running on a second copy.
    """
    names = set(weight_names)
    for t in model.graph.initializer:
        if t.name in names:
            del t.external_data[:]
            t.data_location = onnx.TensorProto.EXTERNAL
            t.external_data.add(key="location", value=PLACEHOLDER)


def weights_as_inputs(model: onnx.ModelProto, weights: Sequence[WeightInfo]) -> None:
    """For the plain baseline: weights become graph inputs, bound per run by address."""
    names = {w.name for w in weights}
    kept = [t for t in model.graph.initializer if t.name not in names]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    for w in weights:
        model.graph.input.append(helper.make_tensor_value_info(
            w.name, helper.np_dtype_to_tensor_dtype(w.dtype), list(w.shape)))


def save_model(model: onnx.ModelProto, path: str) -> str:
    with open(os.path.join(os.path.dirname(path), PLACEHOLDER), "wb"):
        pass
    onnx.save(model, path)
    return path
