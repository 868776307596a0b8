"""The key of an optimized model in the cache, and the files a session holds.

A cache entry is valid for one model as its files are now (the .onnx and every external
data file any tensor names, subgraphs included), one execution provider, one
optimization level, one weight threshold and one ORT version: the key is a hash of all
of it, the files by their content (see fingerprint_fd). The files a session reads are
opened once (HeldFiles): each is fingerprinted and read through the same descriptor, so
a file renamed over meanwhile is never mixed in. An entry's manifest records the
fingerprint of each of its files when it is made, for open_entry to check them against.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List, Optional, Set

import onnx
import onnxruntime as ort

from ..errors import CorruptModel
from .files import open_regular
from .graphs import all_tensors, external_locations
from .optimize import OPTIMIZED

# Files up to this size are hashed in full (sha256 runs at 1.5-2 GB/s, so at most about
# 0.5 s each). Larger ones, the weight files whose full hash would add seconds to every
# load, are identified by their stat fingerprint plus sampled blocks (see fingerprint_fd).
FULL_HASH_BYTES = 1 << 30
_SAMPLE_BYTES = 1 << 20
_SAMPLES = 64
# Bumped when the layout of the optimized model or of the manifest changes, so older cache
# entries are not reused.
_CACHE_FORMAT = 3


class HeldFiles:
    """The files a session reads, each opened once (a regular file, never waiting on a FIFO,
    see files.open_regular) and kept open until the session has read its weights: each is
    fingerprinted and read through the same descriptor. By the path the weights name them
    by: a model's file by its real path, an entry's by its path in the cache.

    `get` gives the descriptor of a path (files.Files), `changed` the model's files that
    are no longer what was opened (renamed over, or written)."""

    def __init__(self):
        self._fds: Dict[str, int] = {}
        self._opened: Dict[str, os.stat_result] = {}
        self.sources: Set[str] = set()  # the model's own files, by real path

    def source(self, path: str) -> int:
        """The model's file `path`, opened by its real path."""
        real = os.path.realpath(path)
        if real not in self._fds:
            self._hold(real, open_regular(real))
            self.sources.add(real)
        return self._fds[real]

    def entry_file(self, path: str, name: str, dir_fd: int) -> int:
        """The file `name` of the entry folder open as `dir_fd`, held as `path`; a symbolic
        link is refused (ELOOP)."""
        if path not in self._fds:
            self._hold(path, open_regular(name, dir_fd=dir_fd, follow=False))
        return self._fds[path]

    def _hold(self, key: str, fd: int) -> None:
        self._fds[key] = fd
        self._opened[key] = os.fstat(fd)

    def get(self, path: str) -> Optional[int]:
        if path in self._fds:
            return self._fds[path]
        return self._fds.get(os.path.realpath(path)) if os.path.isabs(path) else None

    def adopt(self, other: "HeldFiles") -> None:
        """Takes over the files `other` holds (in place of any held under the same path)."""
        for key in other._fds.keys() & self._fds.keys():
            os.close(self._fds[key])
        self._fds.update(other._fds)
        self._opened.update(other._opened)
        self.sources |= other.sources
        other._fds, other._opened, other.sources = {}, {}, set()

    def changed(self) -> List[str]:
        """The model's files whose path now names another file (a rename over it), or whose
        held file was written since it was opened (size, mtime, ctime)."""
        moved = []
        for path in sorted(self.sources):
            then, fd = self._opened[path], self._fds[path]
            try:
                now, there = os.fstat(fd), os.stat(path)
            except OSError:
                moved.append(path)
                continue
            if not os.path.samestat(then, there) or (now.st_size, now.st_mtime_ns, now.st_ctime_ns) != (
                    then.st_size, then.st_mtime_ns, then.st_ctime_ns):
                moved.append(path)
        return moved

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds, self._opened, self.sources = {}, {}, set()


def cache_key(src: str, on_cuda: bool, level, min_weight_bytes: int, disabled_optimizers=(), options: str = "",
              shares_files: bool = False, files: Optional[HeldFiles] = None) -> str:
    """Identifies an optimized model: the content of every file the model reads (the
    .onnx and each external data file, main graph and subgraphs), the provider, the
    level, the threshold, the optimizers turned off, the caller's session options that
    can change the graph (`options`, from ort_options.options_key) and the ORT version.
    An entry that reads weights from the model's own files (`shares_files`, see
    weights.share_unchanged) is also keyed by where those files really are: a copy of the
    model elsewhere, or a link that now points at another version, is another entry.
    The files are opened into `files` (and stay open there for the weights to be read
    from), else opened and closed here."""
    h = hashlib.sha256()
    for v in (_CACHE_FORMAT, on_cuda, int(level), min_weight_bytes, ort.__version__, sorted(disabled_optimizers),
              options, shares_files):
        h.update(f"{v}|".encode())
    held = files if files is not None else HeldFiles()
    try:
        for path in model_files(src):  # the .onnx names the others, so their names are covered
            try:
                h.update(fingerprint_fd(held.source(path)))
            except FileNotFoundError:
                raise CorruptModel(f"{src!r} keeps tensor data in {path!r}, which does not exist") from None
            if shares_files:
                h.update(f"{os.path.realpath(path)}|".encode())
    finally:
        if files is None:
            held.close()
    return h.hexdigest()[:24]


def model_files(src: str) -> list[str]:
    """The .onnx file and every external data file its tensors name, each once."""
    model = onnx.load(src, load_external_data=False)
    base = os.path.dirname(os.path.abspath(src))
    files = [os.path.abspath(src)]
    for t in all_tensors(model.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            location = {e.key: e.value for e in t.external_data}.get("location", "")
            path = os.path.normpath(os.path.join(base, location))
            if path not in files:
                files.append(path)
    return files


def _fingerprint(path: str) -> bytes:
    """The fingerprint (see fingerprint_fd) of the regular file `path`."""
    fd = open_regular(path)
    try:
        return fingerprint_fd(fd)
    finally:
        os.close(fd)


def fingerprint_fd(fd: int) -> bytes:
    """What identifies the content of the open file `fd`.

    Up to FULL_HASH_BYTES: a sha256 of all of it, exact whatever happened to the file.
    Above: size, mtime_ns, ctime_ns, inode and device, and a sha256 of 64 evenly spaced
    1 MiB blocks plus the last one. Any write, rename-over or copy moves ctime (which no
    user call can set back) or the inode, so only a same-size rewrite inside one timestamp
    tick (a few ms) of the previous write could go unseen, and the samples catch most of
    those. A full hash there would cost about 0.6 s per GB on every load, on top of the
    read that fills the host store.
    """
    st = os.fstat(fd)
    h = hashlib.sha256()
    if st.st_size <= FULL_HASH_BYTES:
        h.update(b"full|")
        for offset in range(0, st.st_size, 1 << 20):
            h.update(os.pread(fd, 1 << 20, offset))
        return h.digest()
    h.update("|".join(str(v) for v in ("sampled", st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                                        st.st_dev)).encode())
    step = (st.st_size - _SAMPLE_BYTES) // _SAMPLES
    for offset in [i * step for i in range(_SAMPLES)] + [st.st_size - _SAMPLE_BYTES]:
        h.update(os.pread(fd, _SAMPLE_BYTES, offset))
    return h.digest()


MANIFEST = "manifest.json"  # the fingerprints of an entry's files, written before it is published
# The file that marks a partial or set-aside folder of the cache as the package's (see
# cache_marks); a partial folder's is removed just before the folder is published.
MARK = ".onnx-offload-cache"


def write_manifest(folder: str, key: str, made_from: str = "") -> None:
    """Makes every file of an entry about to be published private (0600: the entry's folder
    is 0700 already) and writes its manifest: the key it is for, the fingerprint of each
    file (see _fingerprint), the model files its optimized model reads weights from
    (by real path, see weights.share_unchanged), and `made_from`, the model it was made from
    (for `onnx-offload cache` to show)."""
    for rel in _entry_files(folder):
        os.chmod(os.path.join(folder, rel), 0o600)
    prints = {rel: _fingerprint(os.path.join(folder, rel)).hex() for rel in _entry_files(folder)}
    model = onnx.load(os.path.join(folder, OPTIMIZED), load_external_data=False)
    sources = sorted(loc for loc in external_locations(model) if os.path.isabs(loc))
    fd = os.open(os.path.join(folder, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w") as f:
        json.dump({"made_by": "onnx-offload", "key": key, "files": prints, "sources": sources, "model": made_from}, f)


def hold_made(folder: str, published: str) -> HeldFiles:
    """The files of the entry just made in `folder`, held by the names they will have once
    `folder` is published as `published`: the session reads what it made, unchecked."""
    held = HeldFiles()
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for name in _entry_files(folder):
            held.entry_file(os.path.join(published, name), name, fd)
    except BaseException:
        held.close()
        raise
    finally:
        os.close(fd)
    return held


def _entry_files(folder: str) -> List[str]:
    return sorted(os.path.relpath(os.path.join(root, f), folder) for root, _, files in os.walk(folder)
                  for f in files if not (root == folder and f in (MANIFEST, MARK)))
