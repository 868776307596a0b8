"""What `onnx-offload cache` shows and clears: only what is provably the package's (see
cache_marks), and only in a folder marked as its cache."""
from __future__ import annotations

import fcntl
import os
from typing import List, NamedTuple

from .cache import remove_set_aside, set_aside, sweep_partials
from ..errors import CacheNotMarked
from .cache_marks import TAG, adopt, foreign_names, is_entry, read_manifest, tagged

cache_tagged = tagged  # whether a folder carries CACHEDIR.TAG


class CacheEntry(NamedTuple):
    path: str
    nbytes: int  # the entry's own files (not the model files it reads weights from)
    made: float  # when it was published (seconds since the epoch)
    model: str = ""  # the model it was made from, as its manifest says ("" where it does not)


def _made_from(path: str) -> str:
    """What the entry's manifest says it was made from; "" where it does not say."""
    manifest = read_manifest(path)
    model = manifest.get("model", "") if isinstance(manifest, dict) else ""
    return model if isinstance(model, str) else ""


def cache_entries(cache: str) -> List[CacheEntry]:
    """The published entries under `cache` (folders whose manifest the package wrote, see
    cache_marks.is_entry), oldest first."""
    found = []
    try:
        names = os.listdir(cache)
    except FileNotFoundError:
        return found
    for name in names:
        path = os.path.join(cache, name)
        if is_entry(path):
            try:
                found.append(CacheEntry(path, _tree_bytes(path), os.stat(path).st_mtime, _made_from(path)))
            except FileNotFoundError:  # removed meanwhile by another process
                continue
    return sorted(found, key=lambda e: (e.made, e.path))


class Cleared(NamedTuple):
    removed: int  # entries
    freed: int  # their bytes
    busy: int  # entries kept because a session is reading them
    kept: int  # names in the folder that are not the package's, left alone
    partials: int  # partial folders of passes that are over


def clear_cache(cache: str) -> Cleared:
    """Removes every published entry under `cache` that no session is reading, the folders
    entries were set aside into, and the partial folders of passes whose process is gone:
    each only where it is provably the package's (see cache_marks). Everything else in the
    folder (the user's files and folders, symbolic links, leftovers an older version did
    not mark) is left alone and counted in `kept`.

    Refuses (CacheNotMarked, removing nothing) a folder without CACHEDIR.TAG that holds
    anything that is not the package's: a folder given by mistake. One that holds only the
    package's (an older version's cache) is tagged first.

    Each entry is renamed aside under an exclusive lock, so a session that looks it up
    sees it whole or not at all, and one that is reading it (holding the shared lock of
    ``cache.hold_entry``) keeps it."""
    if not os.path.isdir(cache) or not os.listdir(cache):
        return Cleared(0, 0, 0, 0, 0)
    if not adopt(cache):
        foreign = foreign_names(cache)
        shown = ", ".join(repr(n) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise CacheNotMarked(
            f"{cache} is not marked as onnx-offload's cache (it has no {TAG}) and holds what onnx-offload did not "
            f"make ({shown}): nothing was removed. Check the folder; if it is the cache, remove what is not "
            f"onnx-offload's, or add a {TAG} (https://bford.info/cachedir/) to clear only onnx-offload's entries "
            f"from it")
    removed = freed = busy = 0
    for entry in cache_entries(cache):
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
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
    partials = len(sweep_partials(cache))
    return Cleared(removed, freed, busy, len(foreign_names(cache)), partials)


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                continue
    return total
