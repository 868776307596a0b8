"""The toolkit of the trust scenarios (reliability_trust) and their tests: models whose
output for x = 0 is their weight's bytes (so a foreign byte the session read shows in
it), secret files, cache entries planted, repointed or refingerprinted as someone who can
write them would, a second user (os.setuid, as root), a private tmpfs that fills up,
models whose external data lies outside their folder or is no regular file, a data file
with two versions, and a start killed while it optimizes.

It uses only the session, the cache's files and the package's fingerprint function, so
that the scenarios run against any version of the package.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from .reliability_rig import package_parent

CPU = ["CPUExecutionProvider"]
SECRET = 1234.5  # what the files a session must never read hold, as float32
SECOND_USER = 999  # the attacker, where the bench runs as root (os.setuid)
HIDDEN = 64


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
    (name,) = [n for n in os.listdir(cache) if not n.startswith(".") and n != "CACHEDIR.TAG"]
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



# ---------------------------------------------------------------- external data outside the model

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



# ---------------------------------------------------------------- a data file with two versions

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



def replace_with_copy(src: str, data: str) -> None:
    """Puts a copy of `src` in place of `data` with one rename, as a download tool does."""
    shutil.copyfile(src, data + ".new")
    os.replace(data + ".new", data)



# ---------------------------------------------------------------- a start killed while it optimizes

START = """
import sys
from onnx_offload.session import OffloadSession
OffloadSession(sys.argv[1], providers=["CPUExecutionProvider"], cache_dir=sys.argv[2], host_granularity=65536,
               vram_limit="256MiB").close()
"""


def start_and_kill(path: str, cache: str, sig: int, delay: float, timeout: float = 60) -> bool:
    """Starts a session in a child and sends it `sig` `delay` seconds after its partial
    folder appears in `cache`; False when the child finished before that."""
    child = subprocess.Popen([sys.executable, "-c", START, path, cache], cwd=package_parent(),
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

