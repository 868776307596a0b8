"""The trust scenarios of the reliability bench: files the session did not write itself.

A cache entry another user planted (in a cache folder others can write, or owned by
them), a symbolic link inside the cache, an entry whose weight reads /dev/zero or whose
manifest lists a FIFO, external data outside the model's folder, a data file renamed
while a session loads, a save that fails (a file size limit, a full disk) and starts
killed by SIGTERM or SIGKILL.

Each scenario is a child of ``python -m onnx_offload.tools.reliability`` and returns the
counts of ``reliability_rig.result``: a served planted entry or a returned foreign byte is
a wrong output, and so is an error of another type than the one plain ORT raises for
the same model; a folder left behind is a leak; the parent's timeout counts a hang.
They use only the session, the cache's files, ``cache clear``, and (to time a rename)
HostStore.fill_from_file and model._optimize, so they run against any version of the
package: an old one's row counts what it got wrong. Their tools are in reliability_trust_kit.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import tempfile
import warnings
from typing import Callable, Dict, List

import numpy as np

from .reliability_rig import result
from .reliability_trust_kit import (CPU, HIDDEN, OUTSIDE, SECRET, SPECIAL, add_model, as_user, attacker,
                                    cached_model, external_attempt, hostile_folder, leftovers, open_to_all, output,
                                    plant, private_tmpfs, refresh_manifest, replace_with_copy, repoint, secret_file,
                                    session, start_and_kill, the_entry, versions, weight, world)


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
        first = set(os.listdir(swap)) - {"CACHEDIR.TAG"}
        output(other, swap)
        (a,), (b,) = first, set(os.listdir(swap)) - first - {"CACHEDIR.TAG"}
        a, b = os.path.join(swap, a), os.path.join(swap, b)
        os.rename(a, a + ".x")
        os.rename(b, a)
        os.rename(a + ".x", b)
        attempts += 1
        wrong += not np.array_equal(output(path, swap), w)
        leaks += leftovers(swap)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return result(attempts, 0, wrong, leaks, **({"second_user": why} if why else {}))


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

        # `cache clear` removes no link (the package makes none), nor what a link points at.
        if os.path.islink(entry) or not os.path.lexists(entry):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry)
        else:
            shutil.rmtree(entry)
        os.symlink(elsewhere, entry)
        attempts += 1
        clear_cache(cache)
        leaks += leftovers(cache)
        wrong += not os.path.islink(entry) or not os.path.isdir(elsewhere)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return result(attempts, 0, wrong, leaks)


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
    return result(1, 0, wrong, leaks)



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
    return result(attempts, clear, wrong, 0, outcomes=what)



def consistent(got: np.ndarray, want: list) -> bool:
    return any(np.allclose(got, w, rtol=1e-5, atol=1e-5) for w in want)


def run_once(path: str, cache: str, feeds: dict) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with session(path, cache, min_weight_bytes=1024) as s:
            return s.run(None, feeds)[0]



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
    return result(attempts, 0, wrong, 0)


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
        leaks += leftovers(cache) + (os.path.isdir(cache) and sum(not n.startswith(".") and n != "CACHEDIR.TAG"
                                                                           for n in os.listdir(cache)))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return result(attempts, clear, wrong, leaks)



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
    return result(attempts, 0, 0, leaks)


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
            return result(0, skipped=why)
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
    return result(attempts, clear, wrong, leaks)


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
