"""The cache folder and its entries, and what the cache trusts.

The key can be computed by anyone with the same model, so an entry is used only if this
user wrote it, as ssh trusts ~/.ssh (see cache_folder and open_entry): the cache folder
and every entry are this user's and writable by nobody else, no symbolic link inside the
cache is followed, every file read is a regular file, an entry's files are as its manifest
fingerprinted them, and its optimized model reads external data only from its own data
file or from the model's own files that its manifest lists. An entry is made in a partial
folder and published by one rename; it is read under a shared lock and removed only by
being renamed aside under an exclusive one, so a session sees an entry whole or not at all.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import re
import shutil
import stat
import tempfile
import time
from typing import List, NamedTuple, Optional, Set, Tuple

from . import workdir
from .files import read_json, read_range
from .fingerprints import MANIFEST, HeldFiles, fingerprint_fd
from .graphs import external_locations
from .optimize import OPTIMIZED, OPTIMIZED_DATA
from .weights import load_optimized

PARTIAL = ".partial-"  # an entry being made, by the process its name names (see workdir.make_owned_dir)
_ENTRY = re.compile(r"[0-9a-f]{24}$")  # a published entry is named by its key
_STALE = re.compile(r"\.stale-[0-9a-z_]{8}$")  # an entry set aside (tempfile.mkdtemp's names)
# A partial folder named without its owner (by an older version) is left alone unless it
# is this old: a pass that old was killed before it could clean up.
ABANDONED_S = 3600


def cache_folder(cache: str) -> Tuple[Optional[str], str]:
    """The cache folder to use for `cache`: (its real path, '') after creating it (0700, as
    every folder it creates above it), or (None, why) when it cannot be used or is not to
    be trusted (`why` continues "the cache folder ...").

    The rule, as ssh's for ~/.ssh: the cache folder must be this user's and writable by
    nobody else. Each folder above it (links resolved) must be this user's or root's, and
    writable by nobody else unless it is sticky, as /tmp is: there nobody can rename or
    remove what is not theirs, so nobody can put another folder in the cache's place. The
    real path is what the session uses from then on: a link to the cache switched later
    changes nothing."""
    try:
        _make_private_folders(cache)
        real = os.path.realpath(cache)
        why = _not_private(os.stat(real))
        why = f"{real} {why}" if why else ""
        parent = real
        while not why and parent != os.path.dirname(parent):
            parent = os.path.dirname(parent)
            why = _not_safe_above(os.stat(parent), parent)
    except OSError as e:
        return None, f"cannot be used ({e})"
    return (None, f"is not used: {why}") if why else (real, "")


def _make_private_folders(path: str) -> None:
    """Creates `path` and the folders above it that are missing, each 0700 (os.makedirs
    gives its mode to the last one only)."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass  # made meanwhile by another process


def _not_private(st: os.stat_result) -> str:
    """Why the file or folder lstat-ed as `st` is not this user's alone (a link, another
    user's, writable by others), as a phrase; '' when it is."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def _not_safe_above(st: os.stat_result, what: str) -> str:
    if st.st_uid not in (0, os.geteuid()):
        return f"{what}, a folder above it, is owned by uid {st.st_uid}"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"{what}, a folder above it, is writable by others and not sticky (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def open_entry(path: str, key: str, files: HeldFiles) -> Tuple[Optional[int], str]:
    """Looks up the published entry `path` of `key`, the model's files held in `files`.

    (a shared lock on it, '') when it can be used: its files are then held in `files`.
    (None, why) when it must not be: it is not this user's alone (a link, another user's,
    writable by others, a file in it that is), not as it was made, another key's, or its
    optimized model reads a file that is neither its own data file nor one of the model's
    files its manifest lists. (None, '') when there is none, or it lacks a file (removed
    by hand): it is made again without a word."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, ""
    why = _not_private(st) or ("" if stat.S_ISDIR(st.st_mode) else "is not a folder")
    if why:
        return None, why
    lock = hold_entry(path)
    if lock is None:
        return None, ""  # set aside meanwhile
    held = HeldFiles()
    try:
        why = _entry_problem(path, lock, key, files.sources, held)
    except (OSError, ValueError, TypeError, KeyError) as e:
        why = f"cannot be read ({e})"
    if why is None:
        files.adopt(held)
        return lock, ""
    held.close()
    os.close(lock)
    return None, why


def _entry_problem(path: str, dir_fd: int, key: str, sources: Set[str], held: HeldFiles) -> Optional[str]:
    """Why the entry open as `dir_fd` is not to be used ('' for a missing file), or None."""
    names = sorted(os.listdir(dir_fd))
    for name in names:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            return f"holds a symbolic link, {name!r}"
        if not stat.S_ISREG(st.st_mode):
            return f"holds {name!r}, which is not a regular file"
        why = _not_private(st)
        if why:
            return f"holds {name!r}, which {why}"
    if OPTIMIZED not in names or MANIFEST not in names:
        return "" if MANIFEST in names else "is not as it was made (it has no manifest)"
    fd = held.entry_file(os.path.join(path, MANIFEST), MANIFEST, dir_fd)
    manifest = json.loads(read_range(fd, 0, os.fstat(fd).st_size, MANIFEST))
    if not isinstance(manifest, dict):
        return "is not as it was made (its manifest is of another layout)"
    prints, listed = manifest.get("files"), manifest.get("sources")
    if not isinstance(prints, dict) or not isinstance(listed, list):
        return "is not as it was made (its manifest is of another layout)"
    if manifest.get("key") != key:
        return f"was made for another model (its manifest names the key {manifest.get('key')!r})"
    if set(prints) - set(names):
        return ""
    if set(prints) != set(names) - {MANIFEST}:
        return "is not as it was made (a file changed, was cut short or added since)"
    for name, fp in prints.items():
        if fingerprint_fd(held.entry_file(os.path.join(path, name), name, dir_fd)).hex() != fp:
            return "is not as it was made (a file changed, was cut short or added since)"
    model = load_optimized(os.path.join(path, OPTIMIZED), held)
    for location in sorted(external_locations(model)):
        if location == OPTIMIZED_DATA and location in prints:
            continue
        if not (os.path.isabs(location) and location in listed and os.path.realpath(location) in sources):
            return (f"names external data {location!r}, neither its own data file nor one of the model's files "
                    f"that its manifest lists")
    return None


class CacheEntry(NamedTuple):
    path: str
    nbytes: int  # the entry's own files (not the model files it reads weights from)
    made: float  # when it was published (seconds since the epoch)
    model: str = ""  # the model it was made from, as its manifest says ("" where it does not)


def _made_from(path: str) -> str:
    """What the entry's manifest says it was made from; "" where it cannot be read."""
    try:
        model = read_json(os.path.join(path, MANIFEST)).get("model", "")
        return model if isinstance(model, str) else ""
    except (OSError, ValueError, AttributeError):
        return ""


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
                found.append(CacheEntry(path, _tree_bytes(path), os.stat(path).st_mtime, _made_from(path)))
            except FileNotFoundError:  # removed meanwhile by another process
                continue
    return sorted(found, key=lambda e: (e.made, e.path))


def hold_entry(path: str) -> Optional[int]:
    """A shared lock on the published entry `path`, held (an open descriptor of the folder,
    never through a symbolic link) while a session reads it; None when the entry was set
    aside meanwhile (or is no folder)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        pass  # a file system without flock: the entry is read unlocked
    try:
        if os.path.samestat(os.fstat(fd), os.lstat(path)):  # still the entry at that name
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
    for stale in glob.glob(os.path.join(glob.escape(cache), ".stale-*")):
        if _STALE.match(os.path.basename(stale)) and not os.path.islink(stale):
            shutil.rmtree(stale, ignore_errors=True)


class Cleared(NamedTuple):
    removed: int  # entries
    freed: int  # their bytes
    busy: int  # entries kept because a session is reading them
    links: int  # symbolic links (never what they point at)
    partials: int  # partial folders of passes that are over


def clear_cache(cache: str) -> Cleared:
    """Removes every published entry under `cache` that no session is reading, the ones
    set aside, every symbolic link named as the cache names what it makes (none is ever
    the session's; a link of another name is the user's, as the folder may be one the
    user has other uses for), and the partial folders
    of passes whose process is gone (or, named without their owner, older than
    ABANDONED_S).

    Each entry is renamed aside under an exclusive lock, so a session that looks it up
    sees it whole or not at all, and one that is reading it (holding the shared lock of
    ``hold_entry``) keeps it."""
    removed = freed = busy = 0
    links = _remove_links(cache)
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
    return Cleared(removed, freed, busy, links, len(sweep_partials(cache, ABANDONED_S)))


def _cache_name(name: str) -> bool:
    """Whether `name` is one the cache gives what it makes: an entry, an entry set aside,
    a partial folder."""
    return bool(_ENTRY.match(name) or _STALE.match(name) or name.startswith(PARTIAL))


def _remove_links(cache: str) -> int:
    removed = 0
    try:
        names = os.listdir(cache)
    except FileNotFoundError:
        return 0
    for name in names:
        path = os.path.join(cache, name)
        try:
            if _cache_name(name) and stat.S_ISLNK(os.lstat(path).st_mode):
                os.unlink(path)
                removed += 1
        except FileNotFoundError:
            continue
    return removed


def make_partial(cache: str) -> str:
    """A new partial folder (0700) for an entry being made, named after this process and
    removed when it exits or gets SIGTERM (see workdir.make_owned_dir)."""
    return workdir.make_owned_dir(cache, PARTIAL)


def sweep_partials(cache: str, unnamed_after: Optional[float] = None) -> List[str]:
    """Removes the partial folders of passes whose process is gone, and (`unnamed_after`
    seconds old) those named without their owner, by older versions; returns them."""
    swept = workdir.sweep_stale(cache, PARTIAL)
    if unnamed_after is None:
        return swept
    now = time.time()
    for partial in glob.glob(os.path.join(glob.escape(cache), PARTIAL + "*")):
        try:
            st = os.lstat(partial)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode) and not workdir.owned_name(os.path.basename(partial), PARTIAL) \
                and now - st.st_mtime > unnamed_after:
            shutil.rmtree(partial, ignore_errors=True)
            swept.append(partial)
    return swept


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                continue
    return total
