"""The trust scenarios of the reliability bench: files the session did not write itself.

A cache entry another user planted (in a cache folder others can write, or owned by
them), a symbolic link inside the cache, an entry whose weight reads /dev/zero or whose
manifest lists a FIFO, external data outside the model's folder, a data file renamed
while a session loads, a save that fails (a file size limit, a full disk) and starts
killed by SIGTERM or SIGKILL.

Each scenario is a child of ``python -m onnx_offload.tools.reliability`` and returns the
counts of ``reliability._result``: a served planted entry or a returned foreign byte is
a wrong output, and so is an error of another type than the one plain ORT raises for
the same model; a folder left behind is a leak; the parent's timeout counts a hang.
They use only the session, the cache's files, ``cache clear``, and (to time a rename)
HostStore.fill_from_file and model._optimize, so they run against any version of the
package: an old one's row counts what it got wrong.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

CPU = ["CPUExecutionProvider"]
SECRET = 1234.5  # what the files a session must never read hold, as float32
SECOND_USER = 999  # the attacker, where the bench runs as root (os.setuid)
HIDDEN = 64


def _result(attempts=0, clear_errors=0, wrong_outputs=0, leaks=0, **notes) -> dict:
    from .reliability import _result as result
    return result(attempts, clear_errors, wrong_outputs, leaks, **notes)


# ---------------------------------------------------------------- models and planted files

def weight(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((HIDDEN, HIDDEN)).astype(np.float32)


def add_model(folder: str, w: np.ndarray, location: Optional[str] = None, name: str = "m.onnx") -> str:
    """y = x + W, saved as `folder`/`name`: with x = 0 the output is the weight's bytes, so
    a foreign byte the session read shows in it. With `location`, W is external data there
    (written into `folder` when it names no file yet)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    t = numpy_helper.from_array(w, "W")
    if location is not None:
        target = os.path.join(folder, location)
        if not os.path.lexists(target):
            with open(target, "wb") as f:
                f.write(w.tobytes())
        point_at(t, location, w.nbytes)
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [HIDDEN, HIDDEN]) for n in ("x", "y")]
    graph = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "g", io[:1], io[1:], [t])
    path = os.path.join(folder, name)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


def point_at(t, location: str, length: int, offset: int = 0) -> None:
    """Makes the tensor `t` external data at `location`."""
    from onnx import TensorProto
    t.ClearField("raw_data")
    t.ClearField("float_data")
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        t.external_data.add(key=k, value=v)


def secret_file(path: str) -> str:
    """A file only its owner may read, that no session of the model has any business reading."""
    with open(path, "wb") as f:
        f.write(np.full((HIDDEN, HIDDEN), SECRET, np.float32).tobytes())
    os.chmod(path, 0o600)
    return path


def zeros() -> dict:
    return {"x": np.zeros((HIDDEN, HIDDEN), np.float32)}


def session(path_or_bytes, cache, **kw):
    from ..session import OffloadSession
    return OffloadSession(path_or_bytes, providers=CPU, offload=True, vmm=True, vram_limit="256MiB",
                          host_granularity=64 << 10, cache_dir=cache, **kw)


def output(path_or_bytes, cache, **kw) -> np.ndarray:
    """The model's output for x = 0 (warnings are the scenario's to count, not to print)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = session(path_or_bytes, cache, **kw)
        try:
            return s.run(None, zeros())[0]
        finally:
            s.close()


def cached_model(base: str, seed: int) -> Tuple[np.ndarray, str, str, str]:
    """A model under `base` whose session made its cache entry: (its weight, its path,
    the cache folder, the entry)."""
    w = weight(seed)
    path = add_model(base, w)
    cache = os.path.join(base, "cache")
    output(path, cache)
    return w, path, cache, the_entry(cache)


def the_entry(cache: str) -> str:
    """The one published entry in `cache`."""
    (name,) = [n for n in os.listdir(cache) if not n.startswith(".")]
    return os.path.join(cache, name)


def refresh_manifest(entry: str, source: Optional[str] = None) -> None:
    """What someone who can write an entry does after changing its files: fingerprints them
    again with the package's own function, and lists `source` among the model files the
    entry reads (the manifests that keep such a list)."""
    from ..loading.fingerprints import MANIFEST, _fingerprint
    with open(os.path.join(entry, MANIFEST)) as f:
        manifest = json.load(f)
    files = manifest["files"] if "files" in manifest else manifest
    for rel in files:
        files[rel] = _fingerprint(os.path.join(entry, rel)).hex()
    if source is not None and isinstance(manifest.get("sources"), list):
        manifest["sources"].append(source)
    with open(os.path.join(entry, MANIFEST), "w") as f:
        json.dump(manifest, f)


def repoint(entry: str, location: str) -> None:
    """Rewrites an entry's optimized model so that its weight W reads `location`."""
    import onnx

    from ..loading import OPTIMIZED
    path = os.path.join(entry, OPTIMIZED)
    model = onnx.load(path, load_external_data=False)
    (t,) = [t for t in model.graph.initializer if t.name == "W"]
    point_at(t, location, HIDDEN * HIDDEN * 4)
    onnx.save(model, path)


def plant(staged: str, entry: str, location: str) -> None:
    """A copy of an honest entry (`staged`) at `entry`, its weight pointed at `location`."""
    shutil.copytree(staged, entry)
    repoint(entry, location)
    refresh_manifest(entry, location)


def as_user(uid: int, fn: Callable, *args) -> None:
    """Runs fn(*args) in a forked child as user (and group) `uid`; raises if it failed."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            fn(*args)
            code = 0
        except BaseException:  # noqa: BLE001 - reported through the exit status
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{fn.__name__} as uid {uid} failed (status {status})")


def attacker() -> Tuple[Optional[int], str]:
    """The second user, or None with the reason when this process cannot become one."""
    if os.geteuid() != 0:
        return None, "a second user needs os.setuid, which only root may call"
    return SECOND_USER, ""


def world() -> str:
    """A folder every user can reach (the second user plants from there)."""
    base = tempfile.mkdtemp(prefix="onnx-offload-trust-")
    os.chmod(base, 0o755)
    return base


def open_to_all(path: str) -> None:
    """Lets every user read `path` and what it holds."""
    for root, dirs, files in os.walk(path):
        os.chmod(root, 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)


def leftovers(cache: str) -> int:
    """Partial and set-aside folders left in `cache`."""
    try:
        return sum(n.startswith((".partial-", ".stale-")) for n in os.listdir(cache))
    except FileNotFoundError:
        return 0


_MS_REC, _MS_PRIVATE, _CLONE_NEWNS = 16384, 1 << 18, 0x00020000


def private_tmpfs(target: str, size: str = "1m") -> str:
    """Mounts a tmpfs of `size` at `target`, seen by this process alone (a mount namespace
    of its own, so it goes when the process does): a disk that fills up. '' once done,
    else why it could not be."""
    libc = ctypes.CDLL(None, use_errno=True)
    steps = [("unshare", lambda: libc.unshare(_CLONE_NEWNS)),
             ("mount --make-rprivate /", lambda: libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None)),
             ("mount tmpfs", lambda: libc.mount(b"tmpfs", target.encode(), b"tmpfs", 0, f"size={size}".encode()))]
    for what, call in steps:
        if call() != 0:
            return f"{what} failed: {os.strerror(ctypes.get_errno())} (needs root, or CAP_SYS_ADMIN)"
    return ""


# ---------------------------------------------------------------- the scenarios

def trust_planted() -> dict:
    """Entries planted by someone else: in a cache folder others can write, owned by another
    user inside this user's cache folder, and this user's own entries swapped between keys."""
    uid, why = attacker()
    base = world()
    attempts = wrong = leaks = 0
    try:
        models = os.path.join(base, "model")
        os.mkdir(models)
        w = weight(1)
        path = add_model(models, w)
        secret = secret_file(os.path.join(base, "secret.bin"))
        private = os.path.join(base, "private")
        output(path, private)  # an honest entry, as anyone with the same public model makes it
        honest = the_entry(private)
        key = os.path.basename(honest)
        staged = os.path.join(base, "staged")
        shutil.copytree(honest, staged)
        open_to_all(models)
        open_to_all(staged)
        planter = (lambda fn, *a: as_user(uid, fn, *a)) if uid is not None else (lambda fn, *a: fn(*a))

        shared = os.path.join(base, "shared")  # a cache folder others can write
        os.mkdir(shared)
        os.chmod(shared, 0o777)
        planter(plant, staged, os.path.join(shared, key), secret)
        attempts += 1
        wrong += not np.array_equal(output(path, shared), w)
        leaks += leftovers(shared)

        if uid is not None:  # an entry another user owns, in this user's own folder
            own = os.path.join(base, "own")
            os.mkdir(own, 0o700)
            os.chmod(own, 0o777)
            as_user(uid, plant, staged, os.path.join(own, key), secret)
            os.chmod(own, 0o700)
            attempts += 1
            wrong += not np.array_equal(output(path, own), w)
            leaks += leftovers(own)

        # This user's entries of two models, each moved under the other's key.
        swap = os.path.join(base, "swap")
        other = add_model(models, weight(2), name="other.onnx")
        output(path, swap)
        first = set(os.listdir(swap))
        output(other, swap)
        (a,), (b,) = first, set(os.listdir(swap)) - first
        a, b = os.path.join(swap, a), os.path.join(swap, b)
        os.rename(a, a + ".x")
        os.rename(b, a)
        os.rename(a + ".x", b)
        attempts += 1
        wrong += not np.array_equal(output(path, swap), w)
        leaks += leftovers(swap)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return _result(attempts, 0, wrong, leaks, **({"second_user": why} if why else {}))


def trust_links() -> dict:
    """A symbolic link under an entry's key (to an entry outside the cache), one in place of
    an entry's data file, and `cache clear` with a link in the cache."""
    from ..loading import OPTIMIZED_DATA
    from ..loading import clear_cache
    base = world()
    attempts = wrong = leaks = 0
    try:
        w, path, cache, entry = cached_model(base, 3)
        elsewhere = os.path.join(base, "elsewhere")
        shutil.copytree(entry, elsewhere)
        with open(os.path.join(elsewhere, OPTIMIZED_DATA), "r+b") as f:
            f.write(np.full((HIDDEN, HIDDEN), SECRET, np.float32).tobytes())
        refresh_manifest(elsewhere)
        saved = os.path.join(base, "saved")
        shutil.copytree(entry, saved)

        shutil.rmtree(entry)
        os.symlink(elsewhere, entry)
        attempts += 1
        wrong += not np.array_equal(output(path, cache), w)

        if os.path.islink(entry):
            os.unlink(entry)
        shutil.rmtree(entry, ignore_errors=True)
        shutil.copytree(saved, entry)
        os.remove(os.path.join(entry, OPTIMIZED_DATA))
        os.symlink(os.path.join(elsewhere, OPTIMIZED_DATA), os.path.join(entry, OPTIMIZED_DATA))
        refresh_manifest(entry)
        attempts += 1
        wrong += not np.array_equal(output(path, cache), w)

        # `cache clear` removes a link it finds, never what the link points at.
        if os.path.islink(entry) or not os.path.lexists(entry):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry)
        else:
            shutil.rmtree(entry)
        os.symlink(elsewhere, entry)
        attempts += 1
        clear_cache(cache)
        leaks += os.path.lexists(entry) + leftovers(cache)
        wrong += not os.path.isdir(elsewhere)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return _result(attempts, 0, wrong, leaks)


def trust_special_entry(which: str = "zero") -> dict:
    """An entry (this user's, its manifest in order) whose weight reads /dev/zero (`zero`),
    or whose manifest lists a FIFO (`fifo`: the session must not wait on it)."""
    from ..loading import MANIFEST
    base = world()
    wrong = leaks = 0
    try:
        w, path, cache, entry = cached_model(base, 4)
        if which == "zero":
            repoint(entry, "/dev/zero")
            refresh_manifest(entry, "/dev/zero")
        else:
            os.mkfifo(os.path.join(entry, "pipe"))
            with open(os.path.join(entry, MANIFEST)) as f:
                manifest = json.load(f)
            files = manifest["files"] if "files" in manifest else manifest
            files["pipe"] = "00" * 32
            with open(os.path.join(entry, MANIFEST), "w") as f:
                json.dump(manifest, f)
        wrong += not np.array_equal(output(path, cache), w)
        leaks += leftovers(cache)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return _result(1, 0, wrong, leaks)


OUTSIDE = ("absolute", "../outside.data", "link to another file system")
SPECIAL = ("/dev/zero", "../../../../dev/zero", "fifo.data")


def hostile_folder(base: str) -> Tuple[Dict[str, str], str]:
    """A model's folder with a FIFO in it and a link to a file outside it, on another file
    system than the session's temporary folder where /dev/shm is one (so that a model given
    as bytes cannot have its files hard-linked there). Returns each case's location, and the
    folder that holds the model's folder (for the caller to remove)."""
    home = base
    if os.path.isdir("/dev/shm") and os.stat("/dev/shm").st_dev != os.stat(tempfile.gettempdir()).st_dev:
        home = tempfile.mkdtemp(prefix="onnx-offload-trust-", dir="/dev/shm")
    folder = os.path.join(home, "m")
    os.mkdir(folder)
    os.symlink(secret_file(os.path.join(base, "far.data")), os.path.join(folder, "link.data"))
    os.mkfifo(os.path.join(folder, "fifo.data"))
    return {"absolute": secret_file(os.path.join(home, "outside.data")), "../outside.data": "../outside.data",
            "link to another file system": "link.data", "/dev/zero": "/dev/zero",
            "../../../../dev/zero": "../../../../dev/zero", "fifo.data": "fifo.data"}, home


def external_attempt(folder: str, location: str, how: str, cache: Optional[str]) -> Tuple[str, str]:
    """One hostile model, loaded by plain ORT and by the session: ('same', '') when the
    session raises what ORT raises, else what happened instead."""
    import onnx
    import onnxruntime as ort
    path = add_model(folder, weight(5), location)
    data = onnx.load(path, load_external_data=False).SerializeToString()
    here = os.getcwd()
    os.chdir(folder)  # where ORT reads the external data of a model given as bytes
    try:
        try:
            ort.InferenceSession(path if how == "path" else data, providers=CPU)
            return "ort ran it", ""
        except Exception as e:  # noqa: BLE001 - ORT raises its own types
            theirs = type(e)
        try:
            got = output(path if how == "path" else data, cache)
        except Exception as e:  # noqa: BLE001 - compared with ORT's
            return ("same", "") if isinstance(e, theirs) else ("other error", f"{type(e).__name__}: {e}"[:300])
        return ("foreign bytes" if np.any(got == SECRET) else "ran"), ""
    finally:
        os.chdir(here)
        os.remove(path)


def trust_external(kind: str = "outside") -> dict:
    """External data outside the model's folder (`outside`: an absolute path, ../, a link
    to another file system) or not a regular file (`special`: /dev/zero, a FIFO), in a
    model given by path and as bytes, with the cache on and off."""
    base = world()
    attempts = clear = wrong = 0
    what: Dict[str, int] = {}
    home = base
    try:
        locations, home = hostile_folder(base)
        for case in OUTSIDE if kind == "outside" else SPECIAL:
            for how in ("path", "bytes"):
                for cache in (None, os.path.join(base, "cache")):
                    attempts += 1
                    outcome, _ = external_attempt(os.path.join(home, "m"), locations[case], how, cache)
                    clear += outcome == "same"
                    wrong += outcome != "same"
                    what[outcome] = what.get(outcome, 0) + 1
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    return _result(attempts, clear, wrong, 0, outcomes=what)


def two_weight_model(folder: str, seed: int, name: str = "m.data") -> Tuple[str, str]:
    """y = (x @ W0) @ Transpose(W1), both in `name`: optimization folds the transpose into a
    weight of its own and leaves W0 as it is (read from the model's file). Returns the
    model's path and its data file."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    ws = [numpy_helper.from_array(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), f"W{i}") for i in (0, 1)]
    data = os.path.join(folder, name)
    with open(data, "wb") as f:
        for i, t in enumerate(ws):
            f.write(t.raw_data)
            point_at(t, name, HIDDEN * HIDDEN * 4, i * HIDDEN * HIDDEN * 4)
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, HIDDEN]) for n in ("x", "y")]
    nodes = [helper.make_node("MatMul", ["x", "W0"], ["h"]),
             helper.make_node("Transpose", ["W1"], ["W1t"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "W1t"], ["y"])]
    path = os.path.join(folder, "m.onnx")
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", io[:1], io[1:], ws),
                                opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path, data


def versions(base: str) -> Tuple[str, str, str, dict, list]:
    """A two-weight model whose data file has two versions: (model, data file, version 2's
    file beside it, feeds, [version 1's output, version 2's])."""
    import onnxruntime as ort
    folder = os.path.join(base, "model")
    os.mkdir(folder)
    path, data = two_weight_model(folder, 6)
    spare = os.path.join(base, "v2")
    os.mkdir(spare)
    _, v2 = two_weight_model(spare, 7)
    feeds = {"x": np.random.default_rng(8).standard_normal((4, HIDDEN)).astype(np.float32)}
    want = [ort.InferenceSession(p, providers=CPU).run(None, feeds)[0] for p in (path, os.path.join(spare, "m.onnx"))]
    return path, data, v2, feeds, want


def consistent(got: np.ndarray, want: list) -> bool:
    return any(np.allclose(got, w, rtol=1e-5, atol=1e-5) for w in want)


def run_once(path: str, cache: str, feeds: dict) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with session(path, cache, min_weight_bytes=1024) as s:
            return s.run(None, feeds)[0]


def replace_with_copy(src: str, data: str) -> None:
    """Puts a copy of `src` in place of `data` with one rename, as a download tool does."""
    shutil.copyfile(src, data + ".new")
    os.replace(data + ".new", data)


def trust_rename() -> dict:
    """The data file replaced by a rename between the cache lookup and the read of the
    weights, and during the optimization pass (then put back): every run must be one
    version's, never a mix."""
    from ..memory import host_store
    from ..loading import optimize as optimize_module
    base = world()
    attempts = wrong = 0
    try:
        path, data, v2, feeds, want = versions(base)
        v1 = shutil.copyfile(data, os.path.join(base, "v1.data"))
        cache = os.path.join(base, "cache")
        run_once(path, cache, feeds)  # publishes version 1's entry
        fill = host_store.HostStore.fill_from_file

        def rename_then_fill(self, *a, **k):
            host_store.HostStore.fill_from_file = fill
            replace_with_copy(v2, data)
            return fill(self, *a, **k)

        host_store.HostStore.fill_from_file = rename_then_fill
        try:
            attempts += 1
            wrong += not consistent(run_once(path, cache, feeds), want)
        finally:
            host_store.HostStore.fill_from_file = fill

        replace_with_copy(v1, data)
        shutil.rmtree(cache)
        optimize = optimize_module._optimize

        def rename_then_optimize(*a, **k):
            optimize_module._optimize = optimize
            replace_with_copy(v2, data)
            return optimize(*a, **k)

        optimize_module._optimize = rename_then_optimize
        try:
            attempts += 1
            wrong += not consistent(run_once(path, cache, feeds), want)
        finally:
            optimize_module._optimize = optimize
        replace_with_copy(v1, data)  # version 1 again: a session of it runs version 1
        attempts += 1
        wrong += not consistent(run_once(path, cache, feeds), want[:1])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return _result(attempts, 0, wrong, 0)


def _disk_error(e: BaseException) -> bool:
    """A clear error about the disk: an OSError (the package's or plain) whose message is
    not a protobuf parser's."""
    return isinstance(e, OSError) and "protobuf" not in str(e).lower()


def trust_failed_save() -> dict:
    """A file size limit (``ulimit -f 150K``) under which the optimized model cannot be
    saved anywhere: a clear error about the disk, never a protobuf error from a later
    stage, and nothing published in the cache."""
    import resource

    import onnx

    from ..models import mlp_stack
    base = world()
    attempts = clear = wrong = leaks = 0
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        path = os.path.join(base, "mlp.onnx")
        onnx.save(mlp_stack(layers=8, hidden=512, batch=4), path)
        cache = os.path.join(base, "cache")
        resource.setrlimit(resource.RLIMIT_FSIZE, (150 << 10, limit[1]))
        try:
            for where in (cache, "off"):
                attempts += 1
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        session(path, where).close()
                    wrong += 1  # ORT runs it; the session cannot have saved 8 MiB of weights
                except Exception as e:  # noqa: BLE001 - judged below
                    clear += _disk_error(e)
                    wrong += not _disk_error(e)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        leaks += leftovers(cache) + (os.path.isdir(cache) and sum(not n.startswith(".") for n in os.listdir(cache)))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return _result(attempts, clear, wrong, leaks)


START = """
import sys
from onnx_offload.session import OffloadSession
OffloadSession(sys.argv[1], providers=["CPUExecutionProvider"], cache_dir=sys.argv[2], host_granularity=65536,
               vram_limit="256MiB").close()
"""


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_and_kill(path: str, cache: str, sig: int, delay: float, timeout: float = 60) -> bool:
    """Starts a session in a child and sends it `sig` `delay` seconds after its partial
    folder appears in `cache`; False when the child finished before that."""
    child = subprocess.Popen([sys.executable, "-c", START, path, cache], cwd=_package_root(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while child.poll() is None and time.monotonic() < deadline:
            if os.path.isdir(cache) and any(n.startswith(".partial-") for n in os.listdir(cache)):
                time.sleep(delay)
                child.send_signal(sig)
                child.wait(timeout)
                return True
            time.sleep(0.005)
        return False
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def trust_killed_starts(count: str = "4") -> dict:
    """Starts killed by SIGTERM at random points of the optimization pass leave no partial
    folder in the cache; one killed by SIGKILL leaves one that the next start removes."""
    import onnx

    from ..models import mlp_stack
    rng = random.Random(0)
    base = world()
    attempts = leaks = 0
    try:
        path = os.path.join(base, "mlp.onnx")
        onnx.save(mlp_stack(layers=8, hidden=512, batch=4), path)
        cache = os.path.join(base, "cache")
        for _ in range(int(count)):
            shutil.rmtree(cache, ignore_errors=True)
            if start_and_kill(path, cache, signal.SIGTERM, rng.uniform(0, 0.06)):
                attempts += 1
                leaks += leftovers(cache)
        shutil.rmtree(cache, ignore_errors=True)
        if start_and_kill(path, cache, signal.SIGKILL, 0.0):
            attempts += 1
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                session(path, cache).close()
            leaks += leftovers(cache)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return _result(attempts, 0, 0, leaks)


def trust_full_disk() -> dict:
    """The cache folder on a full disk: the session runs without it. The session's own
    folder on a full disk, the cache off: a clear error about the disk."""
    import onnx
    import onnxruntime as ort

    from ..models import mlp_stack
    base = world()
    attempts = clear = wrong = leaks = 0
    try:
        full = os.path.join(base, "full")
        os.mkdir(full)
        why = private_tmpfs(full, "1m")
        if why:
            return _result(0, skipped=why)
        path = os.path.join(base, "mlp.onnx")
        model = mlp_stack(layers=8, hidden=512, batch=4)
        onnx.save(model, path)
        feeds = {"x": np.random.default_rng(9).standard_normal((4, 512)).astype(np.float32)}
        want = ort.InferenceSession(path, providers=CPU).run(None, feeds)[0]
        attempts += 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with session(path, os.path.join(full, "cache")) as s:
                    wrong += not np.allclose(s.run(None, feeds)[0], want, rtol=1e-5, atol=1e-5)
        except Exception:  # noqa: BLE001 - ORT runs it: any error is wrong
            wrong += 1
        leaks += leftovers(os.path.join(full, "cache"))
        attempts += 1
        tempdir, tempfile.tempdir = tempfile.tempdir, full
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                session(path, "off").close()
            wrong += 1
        except Exception as e:  # noqa: BLE001 - judged below
            clear += _disk_error(e)
            wrong += not _disk_error(e)
        finally:
            tempfile.tempdir = tempdir
    finally:
        with contextlib.suppress(OSError):
            ctypes.CDLL(None).umount2(os.path.join(base, "full").encode(), 2)
        shutil.rmtree(base, ignore_errors=True)
    return _result(attempts, clear, wrong, leaks)


CHILDREN: List[Callable[..., dict]] = [trust_planted, trust_links, trust_special_entry, trust_external, trust_rename,
                                       trust_failed_save, trust_killed_starts, trust_full_disk]

# (row label, child, its arguments, timeout in seconds)
SCENARIOS = [
    ("trust: planted cache entries", "trust_planted", (), 60),
    ("trust: links in the cache", "trust_links", (), 60),
    ("trust: entry reads /dev/zero", "trust_special_entry", ("zero",), 60),
    ("trust: entry lists a FIFO", "trust_special_entry", ("fifo",), 30),
    ("trust: external data outside", "trust_external", ("outside",), 90),
    ("trust: external data special", "trust_external", ("special",), 30),
    ("trust: data file renamed", "trust_rename", (), 60),
    ("trust: save fails (ulimit -f)", "trust_failed_save", (), 60),
    ("trust: starts killed", "trust_killed_starts", (), 120),
    ("trust: full disk", "trust_full_disk", (), 60),
]
