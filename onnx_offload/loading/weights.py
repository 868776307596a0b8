"""The weights table and the models ORT loads.

The weights are the initializers of the optimized model kept in external data files, in
first-use order. The optimized model is read through the descriptors the cache key
fingerprinted; its weights that optimization left unchanged are read from the caller's
own data file instead of a copy; the small or odd ones ORT must own are moved inside the
model. The models the sessions load keep only the weights' declarations (they arrive
through add_initializer, or as graph inputs for the plain baseline).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Dict, Optional, Sequence

import numpy as np
import onnx
from onnx import helper
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_errors

from ..errors import OffloadError, with_ort_type
from .files import Files, opened, read_range, saving
from .graphs import all_tensors, external_info, nested_graphs, node_inputs, set_external
from .optimize import OPTIMIZED, OPTIMIZED_DATA

# The empty file the models ORT loads name as the weights' data file (see point_weights_at_placeholder).
PLACEHOLDER = "offload.placeholder"


@dataclasses.dataclass
class WeightInfo:
    name: str
    dtype: np.dtype
    shape: tuple
    nbytes: int
    offset: int  # in its data file
    first_use: int  # index of the first node that reads it
    path: str = ""  # its data file: the optimized model's, or the caller's own for a weight optimization left as is


def read_weights(model: onnx.ModelProto, folder: str) -> list[WeightInfo]:
    """The initializers stored in external data files, in first-use order; `folder`
    holds the optimized model."""
    first_use = {}
    for i, node in enumerate(model.graph.node):
        for name in node_inputs(node):
            first_use.setdefault(name, i)
    for g in nested_graphs(model.graph):
        for t in g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                raise OffloadError(f"initializer {t.name!r} of subgraph {g.name!r} lives in the data file: the "
                                   "optimized model predates lift_subgraph_weights (clear the cache entry)")
    weights = []
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        path = data_path(t, folder)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        shape = tuple(int(d) for d in t.dims)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        weights.append(WeightInfo(t.name, dtype, shape, nbytes, int(external_info(t).get("offset", 0)),
                                  first_use.get(t.name, len(model.graph.node)), path))
    weights.sort(key=lambda w: (w.first_use, w.name))
    return weights


def data_path(t: onnx.TensorProto, folder: str) -> str:
    """The file an optimized model's external tensor lives in: the optimized data file
    in `folder`, or the caller's own data file (an absolute path, see share_unchanged)."""
    location = external_info(t).get("location", "")
    if location == OPTIMIZED_DATA:
        return os.path.join(folder, OPTIMIZED_DATA)
    if os.path.isabs(location):
        return location
    raise OffloadError(f"initializer {t.name!r} lives in {location!r}, not the optimized data file")


def load_optimized(path: str, files: Optional[Files] = None) -> onnx.ModelProto:
    """The optimized model at `path`, without its external data: read through the
    descriptor `files` holds for it (the one its fingerprint was checked through), else
    from the path. An initializer named twice keeps its first definition only."""
    fd = files.get(path) if files is not None else None
    if fd is None:
        model = onnx.load(path, load_external_data=False)
    else:
        model = onnx.load_model_from_string(read_range(fd, 0, os.fstat(fd).st_size, path))
    drop_repeated_initializers(model.graph)
    return model


def drop_repeated_initializers(graph: onnx.GraphProto) -> int:
    """Removes the second and later initializers of one name; returns how many. A model
    that names two alike is refused when it is loaded (files.refuse_repeated_initializers);
    this keeps an optimized model read from a cache entry to one per name, as a slot or
    a segment takes a name once."""
    seen, repeated = set(), []
    for i, t in enumerate(graph.initializer):
        if t.name in seen:
            repeated.append(i)
        seen.add(t.name)
    for i in reversed(repeated):
        del graph.initializer[i]
    return len(repeated)


# Integer initializers under this size stay in the model whatever min_weight_bytes says:
# they may be shape, axes or pads tensors, whose values ORT's shape inference reads
# when it loads the model (and a CUDA kernel reads on the host).
HOST_READ_BYTES = 4096


def keep_in_model(model: onnx.ModelProto, folder: str, shareable, files: Optional[Files] = None) -> list[str]:
    """Moves from the data file into the model the data of the initializers whose element
    type ORT cannot take zero-copy (`shareable(np.dtype)` is false: float8, int4, ...),
    so that ORT owns them like any small constant, and of the small integer ones (see
    HOST_READ_BYTES). Returns the names of the first kind. The data is read through the
    descriptors `files` holds, where it holds one."""
    odd, small = [], []
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        except (KeyError, TypeError):
            dtype = None
        if dtype is None or not shareable(dtype):
            odd.append(t)
        elif dtype.kind in "iu" and int(external_info(t).get("length", HOST_READ_BYTES)) < HOST_READ_BYTES:
            small.append(t)
    for t in odd + small:
        _bring_inside(t, folder, files)
    return [t.name for t in odd]


def _bring_inside(t: onnx.TensorProto, folder: str, files: Optional[Files] = None) -> int:
    """Reads an external tensor's data into the tensor itself; returns its bytes."""
    info = external_info(t)
    path = data_path(t, folder)
    with opened(path, files) as fd:
        t.raw_data = read_range(fd, int(info.get("offset", 0)), int(info["length"]), path)
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT
    return len(t.raw_data)


def write_optimized(opt_path: str, dest: str, files: Optional[Files] = None, chunk: int = 64 << 20) -> None:
    """Writes the optimized model as one standalone ONNX model at `dest`, as ORT does for
    SessionOptions.optimized_model_filepath: weights inside it, or, above protobuf's
    2 GB, in `dest`.data beside it (written afresh, copied in chunks, never all in RAM).
    What it reads, it reads through the descriptors `files` holds, where it holds one."""
    model = load_optimized(opt_path, files)
    folder = os.path.dirname(opt_path)
    external = [t for t in all_tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
    try:
        if sum(int(external_info(t)["length"]) for t in external) <= (1 << 31) - (64 << 20):
            for t in external:
                _bring_inside(t, folder, files)
        else:
            data = os.path.basename(dest) + ".data"
            at = 0
            with open(os.path.join(os.path.dirname(os.path.abspath(dest)), data), "wb") as out:
                for t in external:
                    info = external_info(t)
                    offset, length, path = int(info.get("offset", 0)), int(info["length"]), data_path(t, folder)
                    with opened(path, files) as fd:
                        for i in range(0, length, chunk):
                            out.write(read_range(fd, offset + i, min(chunk, length - i), path))
                    set_external(t, data, at, length)
                    at += length
        onnx.save(model, dest)
    except OSError as e:  # a folder that does not exist, no permission: ORT's InvalidArgument, still an OSError
        raise with_ort_type(type(e), _ort_errors.InvalidArgument())(e.errno, e.strerror, dest) from e


def share_unchanged(folder: str, src: str, files: Optional[Files] = None, chunk: int = 64 << 20) -> int:
    """Points each weight of the optimized model in `folder` that optimization left
    byte-for-byte as it was at the caller's own data file (`src`'s external data, by its
    real path), and rewrites the optimized data file with only the others. Loads then
    read those weights from the model's own files, and the cache holds no second copy of
    them. The model's files are compared through the descriptors `files` holds (those the
    cache key fingerprinted), where it holds them. Returns the bytes no longer copied."""
    out = os.path.join(folder, OPTIMIZED)
    model = onnx.load(out, load_external_data=False)
    source = onnx.load(src, load_external_data=False)
    base = os.path.dirname(os.path.abspath(src))
    theirs = {}
    for t in source.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = external_info(t)
            location = info.get("location", "")
            if _inside(location):
                theirs[t.name] = (t.data_type, tuple(t.dims), os.path.realpath(os.path.join(base, location)),
                                  int(info.get("offset", 0)), int(info["length"]) if "length" in info else None)
    ours = [t for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL and external_info(t).get("location") == OPTIMIZED_DATA]
    if not ours:
        return 0
    data = os.path.join(folder, OPTIMIZED_DATA)
    with contextlib.ExitStack() as stack:
        fds: Dict[str, int] = {}

        def fd_of(path: str) -> int:
            if path not in fds:
                fds[path] = stack.enter_context(opened(path, files))
            return fds[path]

        def same(a: str, a_at: int, b: str, b_at: int, length: int) -> bool:
            sizes = os.fstat(fd_of(a)).st_size, os.fstat(fd_of(b)).st_size
            if a_at + length > sizes[0] or b_at + length > sizes[1]:
                return False
            return all(read_range(fd_of(a), a_at + i, min(chunk, length - i), a)
                       == read_range(fd_of(b), b_at + i, min(chunk, length - i), b) for i in range(0, length, chunk))

        shared, kept = 0, []
        for t in ours:
            info = external_info(t)
            offset, length = int(info.get("offset", 0)), int(info["length"])
            match = theirs.get(t.name)
            if match and match[0] == t.data_type and match[1] == tuple(t.dims) and match[4] in (None, length) \
                    and same(data, offset, match[2], match[3], length):
                set_external(t, match[2], match[3], length)
                shared += length
                continue
            kept.append((t, offset, length))
        if not shared:
            return 0
        tmp = data + ".partial"
        with saving(folder, "the optimized weights"), open(tmp, "wb") as g:
            at = 0
            for t, offset, length in kept:
                for i in range(0, length, chunk):
                    g.write(read_range(fd_of(data), offset + i, min(chunk, length - i), data))
                set_external(t, OPTIMIZED_DATA, at, length)
                at += length
    os.replace(tmp, data)
    with saving(folder, "the optimized model"):
        onnx.save(model, out)
    return shared


def _inside(location: str) -> bool:
    """Whether an external-data location names a file inside the model's folder (as ORT
    requires): relative, and never through a parent folder."""
    return bool(location) and not os.path.isabs(location) and ".." not in location.replace("\\", "/").split("/")


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
    """For the plain baseline: weights become graph inputs, bound per run by address (one
    the model already lists as an input, an overridable initializer, keeps its entry)."""
    names = {w.name for w in weights}
    kept = [t for t in model.graph.initializer if t.name not in names]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    listed = {i.name for i in model.graph.input}
    for w in weights:
        if w.name in listed:
            continue
        model.graph.input.append(helper.make_tensor_value_info(
            w.name, helper.np_dtype_to_tensor_dtype(w.dtype), list(w.shape)))


def save_model(model: onnx.ModelProto, path: str) -> str:
    with open(os.path.join(os.path.dirname(path), PLACEHOLDER), "wb"):
        pass
    onnx.save(model, path)
    return path
