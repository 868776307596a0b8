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

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
from typing import List, Optional, Set, Tuple

from . import workdir
from .cache_marks import PARTIAL, STALE, adopt, is_partial, is_set_aside, marked, write_mark
from .files import read_range
from .fingerprints import MANIFEST, MARK, HeldFiles, fingerprint_fd
from .graphs import external_locations
from .optimize import OPTIMIZED, OPTIMIZED_DATA
from .weights import load_optimized


def cache_folder(cache: str) -> Tuple[Optional[str], str]:
    """The cache folder to use for `cache`: (its real path, '') after creating it (0700, as
    every folder it creates above it), or (None, why) when it cannot be used or is not to
    be trusted (`why` continues "the cache folder ...").

    The rule, as ssh's for ~/.ssh: the cache folder must be this user's and writable by
    nobody else. Each folder above it (links resolved) must be this user's or root's, and
    writable by nobody else unless it is sticky, as /tmp is: there nobody can rename or
    remove what is not theirs, so nobody can put another folder in the cache's place. The
    real path is what the session uses from then on: a link to the cache switched later
    changes nothing. A folder used that holds only the package's own is tagged as a
    cache (cache_marks.adopt)."""
    try:
        _make_private_folders(cache)
        real = os.path.realpath(cache)
        why = _not_private(os.stat(real))
        why = f"{real} {why}" if why else ""
        parent = real
        while not why and parent != os.path.dirname(parent):
            parent = os.path.dirname(parent)
            why = _not_safe_above(os.stat(parent), parent)
        if not why:
            adopt(real)  # tagged as a cache folder, where all it holds is the package's
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
        aside = tempfile.mkdtemp(dir=cache, prefix=STALE)
    except OSError:
        return False
    try:
        write_mark(aside)  # so that remove_set_aside and `cache clear` know it for the package's
        os.rename(path, os.path.join(aside, "entry"))
        return True
    except OSError:
        shutil.rmtree(aside, ignore_errors=True)  # this call's folder: nothing else is in it
        return False


def remove_set_aside(cache: str) -> None:
    """Removes the folders entries were set aside into (only those, see
    cache_marks.is_set_aside)."""
    for name in os.listdir(cache):
        if name.startswith(STALE) and is_set_aside(os.path.join(cache, name)):
            shutil.rmtree(os.path.join(cache, name), ignore_errors=True)


def make_partial(cache: str) -> str:
    """A new partial folder (0700, marked as the package's) for an entry being made, named
    after this process and removed when it exits or gets SIGTERM (see
    workdir.make_owned_dir)."""
    path = workdir.make_owned_dir(cache, PARTIAL)
    try:
        write_mark(path)
    except BaseException:
        workdir.remove_workdir(path)
        raise
    return path


def publish(partial: str, entry: str) -> None:
    """Publishes the partial folder `partial` as `entry` with one rename, without its mark
    (an entry's files are as its manifest lists them). OSError where `entry` exists."""
    os.unlink(os.path.join(partial, MARK))
    os.rename(partial, entry)


def sweep_partials(cache: str) -> List[str]:
    """Removes the partial folders of passes whose process is gone (see
    cache_marks.is_partial: a folder of the user's is never taken for one); returns them."""
    swept = []
    for name in os.listdir(cache):
        path = os.path.join(cache, name)
        if name.startswith(PARTIAL) and workdir.owner_gone(name, PARTIAL) and is_partial(path):
            if marked(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.rmdir(path)  # only while it is empty
            swept.append(path)
    return swept


