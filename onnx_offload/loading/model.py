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
not fit (a card smaller than the model), the model runs as it was exported, its weights
rewritten into the data file unchanged, and the session says so in its notes. A pass on
the CPU is no fallback: ORT would save the casts it inserts around the float16 nodes
its CPU provider lacks, and the CUDA provider would then run those nodes in float32.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import os
import resource
import stat
from typing import Dict, Optional, Protocol, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_errors

from .. import _core
from ..errors import CorruptModel, ModelNotFound, OffloadError, invalid_protobuf, with_ort_type
from .ort_options import EXTERNAL_FOLDER_KEY, config_entry, copy_options, set_config

OPTIMIZED = "optimized.onnx"
OPTIMIZED_DATA = "optimized.onnx.data"
PLACEHOLDER = "offload.placeholder"


class SaveFailed(OSError, OffloadError):
    """A file the session writes (the optimized model, its weights, the model given as
    bytes) could not be written: a full disk (errno ENOSPC) or a file size limit (EFBIG).
    The message names the folder."""


class Files(Protocol):
    """Descriptors of files already open and checked, by path (model_cache.HeldFiles): the
    weights are read through them, so a file renamed over meanwhile is never mixed in."""

    def get(self, path: str) -> Optional[int]: ...

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
    offset: int  # in its data file
    first_use: int  # index of the first node that reads it
    path: str = ""  # its data file: the optimized model's, or the caller's own for a weight optimization left as is


def optimization_level(name: Optional[str], sess_options: Optional[ort.SessionOptions]):
    if name is not None:
        if name not in _LEVELS:
            raise ValueError(f"optimization_level={name!r} is not valid: expected one of {', '.join(_LEVELS)}")
        return _LEVELS[name]
    if sess_options is not None:
        return sess_options.graph_optimization_level
    return ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def external_data_folder(sess_options: Optional[ort.SessionOptions]) -> str:
    """Where ORT looks for the external data of a model given as bytes: the folder the
    SessionOptions name, else the current working directory."""
    folder = config_entry(sess_options, EXTERNAL_FOLDER_KEY) if sess_options is not None else None
    return os.path.abspath(folder) if folder is not None else os.getcwd()


def model_file(path: str) -> str:
    """The ONNX file a model path names: the file itself, or in a folder as
    onnxruntime-genai and Optimum hand it over, the file genai_config.json names
    (model.decoder.filename), else model.onnx, else the folder's one .onnx file."""
    if not os.path.isdir(path):
        return path
    names = sorted(n for n in os.listdir(path) if n.endswith(".onnx") and os.path.isfile(os.path.join(path, n)))
    try:
        with open(os.path.join(path, "genai_config.json")) as f:
            named = json.load(f)["model"]["decoder"]["filename"]
        if isinstance(named, str) and os.path.basename(named) == named and named in names:
            return os.path.join(path, named)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no genai_config.json, or one that names no file here
    if "model.onnx" in names:
        return os.path.join(path, "model.onnx")
    if len(names) == 1:
        return os.path.join(path, names[0])
    if not names:
        raise ModelNotFound(2, "the folder holds no ONNX model (model.onnx or one .onnx file)", path)
    raise ModelNotFound(2, f"the folder holds several ONNX models ({', '.join(names[:5])}): name the file", path)


def materialize(path_or_bytes, workdir: str, external_folder: Optional[str] = None) -> tuple:
    """(a path to the model on disk, the model as parsed, without its external data). A
    model given as bytes finds its external data where ORT would (`external_folder`, see
    external_data_folder): its files are hard-linked (copied across filesystems) beside
    the copy written to `workdir`. External data is checked by ORT's rules first (see
    check_external_data), so that nothing outside the model's folder is ever read."""
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        path = os.path.join(workdir, "input.onnx")
        with saving(workdir, "the model given as bytes"), open(path, "wb") as f:
            f.write(path_or_bytes)
        try:
            model = onnx.load(path, load_external_data=False)
        except Exception as e:  # protobuf raises its own DecodeError types
            raise invalid_protobuf(f"the model bytes are not a valid ONNX model: {e}") from e
        folder = external_folder or os.getcwd()
        for location in check_external_data(model, folder, "the model bytes", as_bytes=True):
            link = os.path.join(workdir, location)
            if not os.path.lexists(link):
                os.makedirs(os.path.dirname(link), exist_ok=True)
                with saving(workdir, "the external data of the model given as bytes"):
                    _link_or_copy(os.path.realpath(os.path.join(folder, location)), link)
        return path, model
    path = os.fspath(path_or_bytes)
    if not os.path.exists(path):
        raise ModelNotFound(2, "the model file does not exist", path)
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf raises its own DecodeError types
        raise invalid_protobuf(f"{path!r} is not a valid ONNX model: {e}") from e
    check_external_data(model, os.path.dirname(os.path.abspath(path)), repr(path))
    return path, model


def _link_or_copy(target: str, link: str) -> None:
    """A hard link to the regular file `target` (no copy), else a copy of it across file
    systems. `target` is a real path (no symbolic link in it), checked by
    check_external_data; the copy is read from a descriptor checked again."""
    try:
        os.link(target, link, follow_symlinks=False)
        return
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
    fd = open_regular(target, follow=False)
    with os.fdopen(fd, "rb") as src, open(link, "wb") as dst:
        while chunk := src.read(64 << 20):
            dst.write(chunk)


def open_regular(path: str, *, dir_fd: Optional[int] = None, follow: bool = True) -> int:
    """A read-only descriptor of the regular file `path` (relative to `dir_fd` if given).
    It is opened non-blocking, so that a FIFO cannot hold the open, and checked through
    fstat: a FIFO, a device (/dev/zero) or a folder raises OSError (EINVAL), as does a
    symbolic link when `follow` is false (ELOOP)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"not a regular file but {_kind(mode)}", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a file"


def check_external_data(model: onnx.ModelProto, folder: str, what: str, as_bytes: bool = False) -> list:
    """Refuses, as ORT 1.31 does (its Fail), external data at an absolute location, at one
    that resolves (symbolic links followed) outside `folder`, the model's folder (for a
    model given as bytes, the one its data is read from), or in a file that is missing or
    is not a regular file (a FIFO, /dev/zero): with os.stat, before anything opens it.
    Returns the locations, each once."""
    real = os.path.realpath(folder)
    locations = []
    for t in all_tensors(model.graph):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = _external(t).get("location", "")
        if location in locations:
            continue
        where = f"initializer {t.name!r} of {what} names external data {location!r}"
        if not location or "\0" in location or os.path.isabs(location):
            raise _fail(CorruptModel, f"{where}: not a location relative to its folder, and so outside the folder "
                                      f"it is read from ({folder})")
        target = os.path.realpath(os.path.join(real, location))
        if os.path.commonpath([real, target]) != real:
            raise _fail(CorruptModel, f"{where}, outside the folder it is read from ({folder}) once links are "
                                      f"resolved ({target})")
        try:
            mode = os.stat(target).st_mode
        except FileNotFoundError:
            if as_bytes:
                raise _fail(FileNotFoundError, f"{where}, which is not in {folder} (a model given as bytes reads its "
                                               f"external data from the working directory, or from "
                                               f"{EXTERNAL_FOLDER_KEY} in the SessionOptions, as ORT does)") from None
            raise _fail(CorruptModel, f"{what} keeps tensor data in {target!r}, which does not exist") from None
        if not stat.S_ISREG(mode):
            raise _fail(CorruptModel, f"{where}, which is not a regular file but {_kind(mode)}")
        locations.append(location)
    return locations


def _fail(cls: type, message: str) -> BaseException:
    """`cls`, also ORT's Fail (what ORT raises for external data it refuses)."""
    return with_ort_type(cls, _ort_errors.Fail())(message)


@contextlib.contextmanager
def saving(folder: str, what: str):
    """Turns a full disk or a file size limit met while writing `what` in `folder` into
    SaveFailed, which says so."""
    try:
        yield
    except SaveFailed:
        raise
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        raise SaveFailed(e.errno, f"{what} could not be written in {folder}: {_disk_reason(folder, e.errno)}") from e


def _disk_reason(folder: str, code: int) -> str:
    """What the file system says of a write in `folder` that failed with `code`."""
    if code == errno.EFBIG:
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        return f"{os.strerror(code)} (a file size limit, ulimit -f, of {soft} bytes)"
    try:
        st = os.statvfs(folder)
        free = f"{st.f_bavail * st.f_frsize} bytes free"
    except OSError:
        free = "free space unknown"
    return f"{os.strerror(code)} ({free})"


def _save_error(folder: str, error: Optional[BaseException]) -> SaveFailed:
    """ORT began to save the optimized model in `folder` and failed: the disk (it says no
    more than "Failed to write"). EFBIG where a file it left reached the file size limit,
    else ENOSPC."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    sizes = [os.lstat(p).st_size for p in (os.path.join(folder, f) for f in (OPTIMIZED, OPTIMIZED_DATA))
             if os.path.lexists(p)]
    code = errno.EFBIG if soft != resource.RLIM_INFINITY and max(sizes, default=0) >= soft else errno.ENOSPC
    return SaveFailed(code, f"ONNX Runtime could not save the optimized model in {folder}: "
                            f"{_disk_reason(folder, code)}; ORT said: {error or 'nothing'}")


def all_tensors(graph: onnx.GraphProto):
    """Every tensor a graph holds: initializers, sparse ones, constant attributes, and
    those of its subgraphs."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield attr.sparse_tensor.values
                yield attr.sparse_tensor.indices
            for g in _subgraphs(attr):
                yield from all_tensors(g)


def _subgraphs(attr) -> list:
    return ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)


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
    providers = [("CUDAExecutionProvider", {
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
        _core.unbind_external_allocator(index)
        allocator.empty_cache()
        arena.close()
    _as_exported(src, out, min_weight_bytes)
    return out


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
        info = _external(t)
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


def external_locations(model: onnx.ModelProto) -> set:
    """The location of every external tensor of `model`, each once."""
    return {_external(t).get("location", "") for t in all_tensors(model.graph)
            if t.data_location == onnx.TensorProto.EXTERNAL}


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
    """Removes the second and later initializers of one name; returns how many. ORT runs
    such a model (with a warning) on the first one, and its optimized model keeps them
    all; a slot or a segment takes a name once."""
    seen, repeated = set(), []
    for i, t in enumerate(graph.initializer):
        if t.name in seen:
            repeated.append(i)
        seen.add(t.name)
    for i in reversed(repeated):
        del graph.initializer[i]
    return len(repeated)


def read_range(fd: int, offset: int, length: int, name: str = "") -> bytes:
    """`length` bytes at `offset` of the open file `fd` (os.pread, so that readers of one
    descriptor do not share a position); OSError where the file is shorter."""
    parts, got = [], 0
    while got < length:
        part = os.pread(fd, min(length - got, 1 << 30), offset + got)
        if not part:
            raise OSError(errno.EIO, f"cut short: {length} bytes at {offset} wanted, {got} there", name)
        parts.append(part)
        got += len(part)
    return b"".join(parts)


@contextlib.contextmanager
def opened(path: str, files: Optional[Files] = None):
    """A descriptor of `path`: the one `files` holds, or one opened (a regular file only)
    and closed afterwards."""
    fd = files.get(path) if files is not None else None
    if fd is not None:
        yield fd
        return
    fd = open_regular(path)
    try:
        yield fd
    finally:
        os.close(fd)


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
                for g in _subgraphs(attr):
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
            for g in _subgraphs(attr):
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
            for g in _subgraphs(attr):
                local = ({v.name for v in g.input} | {t.name for t in g.initializer}
                         | {o for n in g.node for o in n.output})
                if old not in local:
                    _rename_in_scope(g, old, new)
    for v in list(graph.output) + list(graph.value_info):
        if v.name == old:
            v.name = new


def _external(t: onnx.TensorProto) -> dict:
    return {e.key: e.value for e in t.external_data}


def _inside(location: str) -> bool:
    """Whether an external-data location names a file inside the model's folder (as ORT
    requires): relative, and never through a parent folder."""
    return bool(location) and not os.path.isabs(location) and ".." not in location.replace("\\", "/").split("/")


def data_path(t: onnx.TensorProto, folder: str) -> str:
    """The file an optimized model's external tensor lives in: the optimized data file
    in `folder`, or the caller's own data file (an absolute path, see share_unchanged)."""
    location = _external(t).get("location", "")
    if location == OPTIMIZED_DATA:
        return os.path.join(folder, OPTIMIZED_DATA)
    if os.path.isabs(location):
        return location
    raise OffloadError(f"initializer {t.name!r} lives in {location!r}, not the optimized data file")


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
        elif dtype.kind in "iu" and int(_external(t).get("length", HOST_READ_BYTES)) < HOST_READ_BYTES:
            small.append(t)
    for t in odd + small:
        _bring_inside(t, folder, files)
    return [t.name for t in odd]


def _bring_inside(t: onnx.TensorProto, folder: str, files: Optional[Files] = None) -> int:
    """Reads an external tensor's data into the tensor itself; returns its bytes."""
    info = _external(t)
    path = data_path(t, folder)
    with opened(path, files) as fd:
        t.raw_data = read_range(fd, int(info.get("offset", 0)), int(info["length"]), path)
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT
    return len(t.raw_data)


def read_weights(model: onnx.ModelProto, folder: str) -> list[WeightInfo]:
    """The initializers stored in external data files, in first-use order; `folder`
    holds the optimized model."""
    first_use = {}
    for i, node in enumerate(model.graph.node):
        for name in node_inputs(node):
            first_use.setdefault(name, i)
    for g in _nested_graphs(model.graph):
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
        weights.append(WeightInfo(t.name, dtype, shape, nbytes, int(_external(t).get("offset", 0)),
                                  first_use.get(t.name, len(model.graph.node)), path))
    weights.sort(key=lambda w: (w.first_use, w.name))
    return weights


def write_optimized(opt_path: str, dest: str, files: Optional[Files] = None, chunk: int = 64 << 20) -> None:
    """Writes the optimized model as one standalone ONNX model at `dest`, as ORT does for
    SessionOptions.optimized_model_filepath: weights inside it, or, above protobuf's
    2 GB, in `dest`.data beside it (written afresh, copied in chunks, never all in RAM).
    What it reads, it reads through the descriptors `files` holds, where it holds one."""
    model = load_optimized(opt_path, files)
    folder = os.path.dirname(opt_path)
    external = [t for t in all_tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
    try:
        if sum(int(_external(t)["length"]) for t in external) <= (1 << 31) - (64 << 20):
            for t in external:
                _bring_inside(t, folder, files)
        else:
            data = os.path.basename(dest) + ".data"
            at = 0
            with open(os.path.join(os.path.dirname(os.path.abspath(dest)), data), "wb") as out:
                for t in external:
                    info = _external(t)
                    offset, length, path = int(info.get("offset", 0)), int(info["length"]), data_path(t, folder)
                    with opened(path, files) as fd:
                        for i in range(0, length, chunk):
                            out.write(read_range(fd, offset + i, min(chunk, length - i), path))
                    _set_external(t, data, at, length)
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
            info = _external(t)
            location = info.get("location", "")
            if _inside(location):
                theirs[t.name] = (t.data_type, tuple(t.dims), os.path.realpath(os.path.join(base, location)),
                                  int(info.get("offset", 0)), int(info["length"]) if "length" in info else None)
    ours = [t for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL and _external(t).get("location") == OPTIMIZED_DATA]
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
            info = _external(t)
            offset, length = int(info.get("offset", 0)), int(info["length"])
            match = theirs.get(t.name)
            if match and match[0] == t.data_type and match[1] == tuple(t.dims) and match[4] in (None, length) \
                    and same(data, offset, match[2], match[3], length):
                _set_external(t, match[2], match[3], length)
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
                _set_external(t, OPTIMIZED_DATA, at, length)
                at += length
    os.replace(tmp, data)
    with saving(folder, "the optimized model"):
        onnx.save(model, out)
    return shared


def _set_external(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del t.external_data[:]
    t.external_data.add(key="location", value=location)
    t.external_data.add(key="offset", value=str(offset))
    t.external_data.add(key="length", value=str(length))


def _nested_graphs(graph):
    for node in graph.node:
        for attr in node.attribute:
            for g in _subgraphs(attr):
                yield g
                yield from _nested_graphs(g)


def node_inputs(node) -> list[str]:
    """Every value a node reads, including outer-scope names used by its subgraphs."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        for g in _subgraphs(attr):
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
