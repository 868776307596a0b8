"""The key of an optimized model in the cache: the content of every file it reads.

A cache entry is valid for one model as its files are now (the .onnx and every external
data file any tensor names, subgraphs included), one execution provider, one
optimization level, one weight threshold and one ORT version.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from typing import List, NamedTuple, Optional, Tuple

import onnx
import onnxruntime as ort

from .errors import CorruptModel
from .model import all_tensors

# Files up to this size are hashed in full (sha256 runs at 1.5-2 GB/s, so at most about
# 0.5 s each). Larger ones, the weight files whose full hash would add seconds to every
# load, are identified by their stat fingerprint plus sampled blocks (see _fingerprint).
FULL_HASH_BYTES = 1 << 30
_SAMPLE_BYTES = 1 << 20
_SAMPLES = 64
# Bumped when the layout of the optimized model changes, so older cache entries are not reused.
_CACHE_FORMAT = 2


def cache_key(src: str, on_cuda: bool, level, min_weight_bytes: int, disabled_optimizers=(), options: str = "",
              shares_files: bool = False) -> str:
    """Identifies an optimized model: the content of every file the model reads (the
    .onnx and each external data file, main graph and subgraphs), the provider, the
    level, the threshold, the optimizers turned off, the caller's session options that
    can change the graph (`options`, from ort_sessions.options_key) and the ORT version.
    An entry that reads weights from the model's own files (`shares_files`, see
    model.share_unchanged) is also keyed by where those files really are: a copy of the
    model elsewhere, or a link that now points at another version, is another entry."""
    h = hashlib.sha256()
    for v in (_CACHE_FORMAT, on_cuda, int(level), min_weight_bytes, ort.__version__, sorted(disabled_optimizers),
              options, shares_files):
        h.update(f"{v}|".encode())
    for path in model_files(src):  # the .onnx names the others, so their names are covered
        try:
            h.update(_fingerprint(path))
        except FileNotFoundError:
            raise CorruptModel(f"{src!r} keeps tensor data in {path!r}, which does not exist") from None
        if shares_files:
            h.update(f"{os.path.realpath(path)}|".encode())
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
    """What identifies a file's content.

    Up to FULL_HASH_BYTES: a sha256 of all of it, exact whatever happened to the file.
    Above: size, mtime_ns, ctime_ns, inode and device, and a sha256 of 64 evenly spaced
    1 MiB blocks plus the last one. Any write, rename-over or copy moves ctime (which no
    user call can set back) or the inode, so only a same-size rewrite inside one timestamp
    tick (a few ms) of the previous write could go unseen, and the samples catch most of
    those. A full hash there would cost about 0.6 s per GB on every load, on top of the
    read that fills the host store.
    """
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if st.st_size <= FULL_HASH_BYTES:
            h.update(b"full|")
            while chunk := f.read(1 << 20):
                h.update(chunk)
            return h.digest()
        h.update("|".join(str(v) for v in ("sampled", st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                                            st.st_dev)).encode())
        step = (st.st_size - _SAMPLE_BYTES) // _SAMPLES
        for offset in [i * step for i in range(_SAMPLES)] + [st.st_size - _SAMPLE_BYTES]:
            f.seek(offset)
            h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


MANIFEST = "manifest.json"  # the fingerprints of an entry's files, written before it is published


def write_manifest(folder: str) -> None:
    """Fingerprints every file of an entry about to be published (see _fingerprint)."""
    prints = {rel: _fingerprint(os.path.join(folder, rel)).hex() for rel in _entry_files(folder)}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(prints, f)


def entry_intact(folder: str) -> bool:
    """Whether a published entry's files are the ones its manifest fingerprinted: a file
    truncated, rewritten or added since, or no manifest, and the entry is not used."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            prints = json.load(f)
        if not isinstance(prints, dict) or set(prints) != set(_entry_files(folder)):
            return False
        return all(_fingerprint(os.path.join(folder, rel)).hex() == fp for rel, fp in prints.items())
    except (OSError, ValueError):
        return False


def _entry_files(folder: str) -> List[str]:
    return sorted(os.path.relpath(os.path.join(root, f), folder) for root, _, files in os.walk(folder)
                  for f in files if not (root == folder and f == MANIFEST))


_ENTRY = re.compile(r"[0-9a-f]{24}$")  # a published entry is named by its key
# A folder still being written by an optimization pass (``.partial-``) is left alone
# unless it is this old: a pass that old was killed before it could clean up.
ABANDONED_S = 3600


class CacheEntry(NamedTuple):
    path: str
    nbytes: int  # the entry's own files (not the model files it reads weights from)
    made: float  # when it was published (seconds since the epoch)


def cache_entries(cache: str) -> List[CacheEntry]:
    """The published entries under `cache`, oldest first."""
    found = []
    try:
        names = os.listdir(cache)
    except FileNotFoundError:
        return found
    for name in names:
        path = os.path.join(cache, name)
        if _ENTRY.match(name) and os.path.isdir(path) and not os.path.islink(path):
            try:
                found.append(CacheEntry(path, _tree_bytes(path), os.stat(path).st_mtime))
            except FileNotFoundError:  # removed meanwhile by another process
                continue
    return sorted(found, key=lambda e: (e.made, e.path))


def hold_entry(path: str) -> Optional[int]:
    """A shared lock on the published entry `path`, held (an open descriptor) while a
    session reads it; None when the entry was set aside meanwhile."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        pass  # a file system without flock: the entry is read unlocked
    try:
        if os.path.samestat(os.fstat(fd), os.stat(path)):  # still the entry at that name
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def set_aside(cache: str, path: str) -> bool:
    """Moves the published entry `path` out of its name, into a ``.stale-`` folder that
    remove_set_aside deletes: a lookup sees the entry whole or not at all, and a reader
    that has its files open keeps them. False when another process moved it first (or
    the folder cannot be written)."""
    try:
        os.rename(path, os.path.join(tempfile.mkdtemp(dir=cache, prefix=".stale-"), "entry"))
        return True
    except OSError:
        return False


def remove_set_aside(cache: str) -> None:
    for stale in glob.glob(os.path.join(cache, ".stale-*")):
        shutil.rmtree(stale, ignore_errors=True)


def clear_cache(cache: str) -> Tuple[int, int, int]:
    """Removes every published entry under `cache` that no session is reading, the ones
    set aside, and partial ones abandoned by a killed pass. Returns (entries removed,
    bytes freed, entries kept because a session is reading them).

    Each entry is renamed aside under an exclusive lock, so a session that looks it up
    sees it whole or not at all, and one that is reading it (holding the shared lock of
    ``hold_entry``) keeps it."""
    removed = freed = busy = 0
    for entry in cache_entries(cache):
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue  # set aside by another process first
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy += 1
            os.close(fd)
            continue
        try:
            moved = set_aside(cache, entry.path)
        finally:
            os.close(fd)
        if moved:
            removed += 1
            freed += entry.nbytes
    remove_set_aside(cache)
    now = time.time()
    for partial in glob.glob(os.path.join(cache, ".partial-*")):
        try:
            if now - os.lstat(partial).st_mtime > ABANDONED_S:
                shutil.rmtree(partial, ignore_errors=True)
        except FileNotFoundError:
            continue
    return removed, freed, busy


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                continue
    return total
