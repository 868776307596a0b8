"""The model's files, found and opened by ORT's rules.

A model path names a file, or a folder as onnxruntime-genai and Optimum hand it over; a
model given as bytes is written to the working folder, its external data linked beside
it from where ORT would read it. External data is checked as ORT checks it (a relative
location inside the model's folder, a regular file) before anything opens it, and files
are opened as regular files only, so that a FIFO or a device is never read. What the
package writes (the model given as bytes, the optimized model) raises SaveFailed on a
full disk or a file size limit, naming the folder.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import stat
from typing import Optional, Protocol

import onnx
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_errors

from ..errors import CorruptModel, ModelNotFound, OffloadError, invalid_protobuf, with_ort_type
from .graphs import all_tensors, external_info, nested_graphs
from .ort_options import EXTERNAL_FOLDER_KEY, config_entry


class SaveFailed(OSError, OffloadError):
    """A file the session writes (the optimized model, its weights, the model given as
    bytes) could not be written: a full disk (errno ENOSPC) or a file size limit (EFBIG).
    The message names the folder."""


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
        raise SaveFailed(e.errno, f"{what} could not be written in {folder}: {disk_reason(folder, e.errno)}") from e


def disk_reason(folder: str, code: int) -> str:
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


class Files(Protocol):
    """Descriptors of files already open and checked, by path (fingerprints.HeldFiles): the
    weights are read through them, so a file renamed over meanwhile is never mixed in."""

    def get(self, path: str) -> Optional[int]: ...


def model_file(path: str) -> str:
    """The ONNX file a model path names: the file itself, or in a folder as
    onnxruntime-genai and Optimum hand it over, the file genai_config.json names
    (model.decoder.filename), else model.onnx, else the folder's one .onnx file."""
    if not os.path.isdir(path):
        return path
    names = sorted(n for n in os.listdir(path) if n.endswith(".onnx") and os.path.isfile(os.path.join(path, n)))
    try:
        named = read_json(os.path.join(path, "genai_config.json"))["model"]["decoder"]["filename"]
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


def external_data_folder(sess_options: Optional[ort.SessionOptions]) -> str:
    """Where ORT looks for the external data of a model given as bytes: the folder the
    SessionOptions name, else the current working directory."""
    folder = config_entry(sess_options, EXTERNAL_FOLDER_KEY) if sess_options is not None else None
    return os.path.abspath(folder) if folder is not None else os.getcwd()


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
        refuse_repeated_initializers(model, "the model bytes")
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
        fd = open_regular(path)  # a FIFO would hold onnx.load (and ORT) for ever, /dev/zero fill memory
    except OSError as e:
        raise _fail(CorruptModel, f"{path!r} cannot be read as a model: {e.strerror}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            model = onnx.load_model_from_string(f.read())  # its external data is not read here
    except Exception as e:  # protobuf raises its own DecodeError types
        raise invalid_protobuf(f"{path!r} is not a valid ONNX model: {e}") from e
    refuse_repeated_initializers(model, repr(path))
    check_external_data(model, os.path.dirname(os.path.abspath(path)), repr(path))
    return path, model


def refuse_repeated_initializers(model: onnx.ModelProto, what: str) -> None:
    """Refuses (CorruptModel) a graph, the main one or a subgraph, that names two of its
    initializers alike, as ONNX's checker does ("initializer name is not unique"). ORT
    1.31 runs such a model with a warning that it takes the latest, but takes the first
    where the data is inside the model and the last where it is external data: no one
    answer would match it."""
    for graph in (model.graph, *nested_graphs(model.graph)):
        seen = set()
        for name in [t.name for t in graph.initializer] + [t.values.name for t in graph.sparse_initializer]:
            if name in seen:
                raise CorruptModel(f"{what} names two initializers {name!r} in graph {graph.name!r}: ONNX requires "
                                   f"initializer names to be unique (onnx.checker refuses it), and ONNX Runtime "
                                   f"takes the first or the last depending on where their data is stored; remove "
                                   f"one of them")
            seen.add(name)


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
    copy_regular(target, link)


def copy_regular(target: str, dest: str) -> None:
    """A copy of the regular file `target` (a real path, checked by check_external_data)
    at `dest`, read from a descriptor checked again; the kernel copies where it can."""
    fd = open_regular(target, follow=False)
    with os.fdopen(fd, "rb") as src, open(dest, "wb") as dst:
        size = os.fstat(src.fileno()).st_size
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(src.fileno(), dst.fileno(), size - done)
                if n == 0:
                    break
                done += n
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            src.seek(done)
            dst.seek(done)
            dst.truncate()
        while chunk := src.read(64 << 20):
            dst.write(chunk)


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
        location = external_info(t).get("location", "")
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


CONFIG_BYTES = 64 << 20  # the most a configuration file (JSON) beside a model may hold


def read_config(path: str, limit: int = CONFIG_BYTES) -> bytes:
    """The bytes of `path`, a file beside a model that the package reads or hands to another
    library (tokenizers, transformers): read as every file is, a regular file only (a FIFO
    cannot hold the read, /dev/zero cannot fill memory), and at most `limit` bytes long.
    OSError where it cannot be read so (its strerror says why: "not a regular file but a
    FIFO"), ValueError where it is longer."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ValueError(f"it is {size} bytes long; a configuration file holds at most {limit}")
        return read_range(fd, 0, size, path)
    finally:
        os.close(fd)


def config_problem(path: str, e: BaseException) -> str:
    """`path` and why read_config refused it (or the parse of what it read), for a message."""
    return f"{path} cannot be read: {e.strerror if isinstance(e, OSError) and e.strerror else e}"


def read_json(path: str):
    """The JSON value of the configuration file `path`, read by read_config. OSError where
    it cannot be read so; ValueError for a file that is too long, no JSON, or one nested
    too deeply for the parser (which recurses once per level)."""
    data = read_config(path)
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("it is nested too deeply to read") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"it is not text ({e.reason})") from None


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
