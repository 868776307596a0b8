"""The session's temporary folder, which holds a full copy of the optimized weights, must
not outlive its process.

A folder is named ``onnx-offload-<pid>-<start>-<pidns>-<random>``: the owning process,
its start time (so a pid reused by another process neither keeps a dead owner's folder
nor, after a reboot or in a restarted container, passes for it) and its pid namespace
(a /tmp shared between containers holds pids that mean nothing here; those folders are
left alone).
It is removed by ``remove_workdir`` (a session's close), at interpreter exit, and on
SIGTERM. What none of those cover (SIGKILL, a crash, ``os._exit``) the next
``make_workdir`` in any process sweeps: it removes the folders whose owner is gone and
never those of a live process.

The cache's partial folders (an optimization pass writing a new entry) are named and
removed the same way (``make_owned_dir``, ``sweep_stale`` with their prefix).
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import tempfile
import threading
from functools import lru_cache
from typing import Dict, Optional

PREFIX = "onnx-offload-"

# path -> pid of the process that made it. A forked child inherits this table; the pid
# keeps it from removing its parent's folders. Read by the signal handler, so no lock:
# single dict operations are atomic under the GIL, and a lock held by the interrupted
# code would deadlock the handler.
_owned: Dict[str, int] = {}
_hooks_lock = threading.Lock()
_atexit_registered = False
_sigterm_decided = False


def make_workdir() -> str:
    """A new folder under the system temp dir, removed at exit or SIGTERM at the latest.
    Sweeps the folders that dead processes left behind first."""
    root = tempfile.gettempdir()
    sweep_stale(root)
    return make_owned_dir(root, PREFIX)


def make_owned_dir(root: str, prefix: str) -> str:
    """A new folder (0700) under `root`, named `prefix` and then this process's pid, start
    time and pid namespace, removed at exit or SIGTERM at the latest (remove_workdir
    removes it sooner, ``disown`` keeps it: a folder renamed into place)."""
    pid = os.getpid()
    path = tempfile.mkdtemp(prefix=f"{prefix}{pid}-{_start_time(pid)}-{_pid_namespace()}-", dir=root)
    _owned[path] = pid
    _install_hooks()
    return path


def disown(path: str) -> None:
    """The folder `path` made by make_owned_dir is no longer removed at exit."""
    _owned.pop(path, None)


def remove_workdir(path: str) -> None:
    """Removes a folder made by make_workdir or make_owned_dir; a missing one is fine."""
    _owned.pop(path, None)
    shutil.rmtree(path, ignore_errors=True)


def sweep_stale(root: Optional[str] = None, prefix: str = PREFIX) -> list:
    """Removes the folders under `root` that make_owned_dir named with `prefix` and whose
    owning process is gone; returns them. Folders without an owner in their name (older
    versions) are left alone."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = os.listdir(root)
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not owner_gone(entry, prefix):
            continue
        path = os.path.join(root, entry)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid or not os.path.isdir(path) or os.path.islink(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def owner_gone(name: str, prefix: str) -> bool:
    """Whether `name` is a folder of make_owned_dir's with `prefix` whose owner has exited.
    False for a live owner, for a name without an owner, and for an owner in another pid
    namespace (a folder shared between containers: its pid means nothing here)."""
    m = _name(prefix).match(name)
    if not m or int(m.group(3)) != _pid_namespace():
        return False
    return not _owner_alive(int(m.group(1)), int(m.group(2)))


def owned_name(name: str, prefix: str) -> bool:
    """Whether `name` is one that make_owned_dir gives with `prefix` (its owner in it)."""
    return bool(_name(prefix).match(name))


@lru_cache(maxsize=None)
def _name(prefix: str) -> "re.Pattern":
    return re.compile(re.escape(prefix) + r"(\d+)-(\d+)-(\d+)-[^/]+$")


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (Linux), or 0 where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (Linux), or 0 where unknown."""
    try:
        return int(re.search(r"\[(\d+)\]", os.readlink("/proc/self/ns/pid")).group(1))
    except (OSError, AttributeError, ValueError):
        return 0


def _owner_alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    except OSError:
        return True  # unsure: keep
    # The pid lives; it is the owner unless it started at another time (a reused pid).
    now = _start_time(pid)
    return not (start and now and now != start)


def _remove_owned() -> None:
    me = os.getpid()
    for path, pid in list(_owned.items()):
        if pid == me:
            remove_workdir(path)


def _on_sigterm(signum, frame) -> None:
    _remove_owned()
    # Then die of the signal as the default action would: the exit status says SIGTERM.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_hooks() -> None:
    """atexit always; the SIGTERM handler only from the main thread and only where
    SIGTERM still has its default action. An application's own handler is kept: it
    decides whether the process ends (and exits through atexit if it does); replacing
    it, or removing the folder before it runs, could pull the weights from under a
    session that is shutting down gracefully."""
    global _atexit_registered, _sigterm_decided
    with _hooks_lock:
        if not _atexit_registered:
            atexit.register(_remove_owned)
            _atexit_registered = True
        if _sigterm_decided or threading.current_thread() is not threading.main_thread():
            return  # off the main thread: a later call from the main thread installs it
        _sigterm_decided = True
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
