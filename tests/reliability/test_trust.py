"""Nothing the session did not write is trusted: cache entries another user planted, or
that others could have written, links inside the cache, entries that read special files,
external data that is not a regular file, a save that fails, a full disk, and starts
killed half-way.

The second user is uid 999, taken with os.setuid in a forked child (the tests must run as
root for that, else they skip). What can hang (a FIFO, /dev/zero) or needs a process of
its own (a file size limit, a mount namespace with a full disk) runs as a child process of
this file."""
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import warnings

import numpy as np
import pytest

from onnx_offload import OffloadWarning
from onnx_offload.loading.cache_marks import TAG
from onnx_offload.loading.fingerprints import MANIFEST
from onnx_offload.loading.optimize import OPTIMIZED, OPTIMIZED_DATA
from onnx_offload.tools import reliability_trust_kit as trust
from onnx_offload.tools.reliability_trust import SCENARIOS

SECOND_USER, NO_SECOND_USER = trust.attacker()
second_user = pytest.mark.skipif(SECOND_USER is None, reason=NO_SECOND_USER)


def listed(cache):
    """What `cache` holds besides its CACHEDIR.TAG, sorted."""
    return sorted(set(os.listdir(cache)) - {TAG})


@pytest.fixture
def world():
    """A folder every user can reach; the second user plants from there."""
    base = trust.world()
    yield base
    shutil.rmtree(base, ignore_errors=True)


def zero_output(path, cache):
    with trust.session(path, cache) as s:
        return s.run(None, trust.zeros())[0]


def honest_entry(path, cache) -> str:
    """The entry a first session of `path` publishes in `cache`."""
    zero_output(path, cache)
    return trust.the_entry(cache)


def assert_not_served(got, w):
    assert not np.any(got == trust.SECRET), "the session returned the bytes of a file it must never read"
    np.testing.assert_array_equal(got, w, err_msg="the session ran another model's weights")


# ---------------------------------------------------------------- another user's entries

def _staged(world, w):
    """The model, and an honest entry of it staged where the second user can copy it (anyone
    with the same public model can make one)."""
    models = os.path.join(world, "model")
    os.mkdir(models)
    path = trust.add_model(models, w)
    entry = honest_entry(path, os.path.join(world, "private"))
    staged = os.path.join(world, "staged")
    shutil.copytree(entry, staged)
    trust.open_to_all(models)
    trust.open_to_all(staged)
    return path, os.path.basename(entry), staged, trust.secret_file(os.path.join(world, "secret.bin"))


@second_user
@pytest.mark.parametrize("mode", [0o777, 0o1777], ids=["world-writable", "sticky"])
def test_an_entry_planted_in_a_cache_folder_others_can_write_is_not_served(world, mode):
    """The cache folder is shared with uid 999, who plants an entry under the key of a public
    model whose weight reads a root-only file (and writes the manifest too): the folder is
    not used, with a warning, and the session runs the model's own weights."""
    w = trust.weight(1)
    path, key, staged, secret = _staged(world, w)
    shared = os.path.join(world, "shared")
    os.mkdir(shared)
    os.chmod(shared, mode)
    trust.as_user(SECOND_USER, trust.plant, staged, os.path.join(shared, key), secret)
    with pytest.warns(OffloadWarning, match="writable by others"):
        assert_not_served(zero_output(path, shared), w)
    assert os.stat(os.path.join(shared, key)).st_uid == SECOND_USER  # not ours to touch: left as it is


@second_user
def test_an_entry_another_user_owns_is_not_served(world):
    """An entry uid 999 planted while this user's cache folder was open to others (then
    closed again) is set aside with a warning and made again, by this user."""
    w = trust.weight(2)
    path, key, staged, secret = _staged(world, w)
    cache = os.path.join(world, "cache")
    os.mkdir(cache, 0o700)
    os.chmod(cache, 0o777)
    trust.as_user(SECOND_USER, trust.plant, staged, os.path.join(cache, key), secret)
    os.chmod(cache, 0o700)
    with pytest.warns(OffloadWarning, match=f"owned by uid {SECOND_USER}"):
        assert_not_served(zero_output(path, cache), w)
    assert listed(cache) == [key] and os.stat(os.path.join(cache, key)).st_uid == os.getuid()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the entry made again is this user's: used as it is
        assert_not_served(zero_output(path, cache), w)


@pytest.mark.parametrize("mode", [0o777, 0o1777], ids=["writable", "sticky"])
def test_a_cache_below_a_folder_others_can_write_is_used_only_below_a_sticky_one(tmp_path, mode):
    """A folder above the cache that others can write lets them rename the cache folder away
    and put their own in its place: the cache is not used, with a warning. A sticky one (as
    /tmp) lets nobody rename what is not theirs: the cache is used."""
    w = trust.weight(3)
    path = trust.add_model(str(tmp_path), w)
    above = tmp_path / "above"
    above.mkdir()
    os.chmod(above, mode)
    cache = str(above / "cache")
    if mode & 0o1000:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_not_served(zero_output(path, cache), w)
        assert len(listed(cache)) == 1
        assert os.stat(cache).st_mode & 0o777 == 0o700 and os.stat(trust.the_entry(cache)).st_mode & 0o777 == 0o700
    else:
        with pytest.warns(OffloadWarning, match="writable by others"):
            assert_not_served(zero_output(path, cache), w)
        assert not os.path.isdir(cache) or not os.listdir(cache)


@second_user
@pytest.mark.parametrize("where", ["cache", "above"])
def test_a_cache_folder_another_user_owns_or_owns_a_folder_above_is_not_used(tmp_path, where):
    """The cache folder, or a folder above it, owned by uid 999 and writable by nobody
    else: that user could still change what the session reads, so the cache is not used,
    with a warning, and the session runs from its own folder."""
    w = trust.weight(5)
    path = trust.add_model(str(tmp_path), w)
    above = tmp_path / "above"
    above.mkdir(mode=0o755)
    cache = above / "cache"
    cache.mkdir(mode=0o700)
    os.chown(cache if where == "cache" else above, SECOND_USER, SECOND_USER)
    expect = ("" if where == "cache" else "a folder above it, ") + f"is owned by uid {SECOND_USER}"
    with pytest.warns(OffloadWarning, match=re.escape(expect)):
        assert_not_served(zero_output(path, str(cache)), w)
    assert os.listdir(cache) == []

def test_entries_moved_to_another_models_key_are_not_served(tmp_path):
    """Two entries of this user's, each moved under the other model's key: every file is as
    its manifest says, but the manifest names the key the entry was made for."""
    cache = str(tmp_path / "cache")
    wa, wb = trust.weight(4), trust.weight(5)
    a = trust.add_model(str(tmp_path), wa, name="a.onnx")
    ea = honest_entry(a, cache)
    zero_output(trust.add_model(str(tmp_path), wb, name="b.onnx"), cache)
    (eb,) = {os.path.join(cache, n) for n in listed(cache)} - {ea}
    os.rename(ea, ea + ".x")
    os.rename(eb, ea)
    os.rename(ea + ".x", eb)
    with pytest.warns(OffloadWarning, match="another model"):
        assert_not_served(zero_output(a, cache), wa)


def test_an_entry_file_others_can_write_is_not_served(tmp_path):
    cache = str(tmp_path / "cache")
    w = trust.weight(6)
    path = trust.add_model(str(tmp_path), w)
    entry = honest_entry(path, cache)
    data = os.path.join(entry, OPTIMIZED_DATA)
    with open(data, "r+b") as f:
        f.write(np.full(w.shape, trust.SECRET, np.float32).tobytes())
    os.chmod(data, 0o666)
    trust.refresh_manifest(entry)
    with pytest.warns(OffloadWarning, match="writable by others"):
        assert_not_served(zero_output(path, cache), w)


# ---------------------------------------------------------------- links and special files

@pytest.mark.parametrize("where", ["entry", "data file"])
def test_no_symbolic_link_inside_the_cache_is_followed(tmp_path, where):
    """A link under the entry's key to an entry outside the cache, or in place of the entry's
    data file: never followed (the manifest, rewritten through the link, matches)."""
    cache = str(tmp_path / "cache")
    w = trust.weight(7)
    path = trust.add_model(str(tmp_path), w)
    entry = honest_entry(path, cache)
    elsewhere = str(tmp_path / "elsewhere")
    shutil.copytree(entry, elsewhere)
    with open(os.path.join(elsewhere, OPTIMIZED_DATA), "r+b") as f:
        f.write(np.full(w.shape, trust.SECRET, np.float32).tobytes())
    trust.refresh_manifest(elsewhere)
    if where == "entry":
        shutil.rmtree(entry)
        os.symlink(elsewhere, entry)
    else:
        os.remove(os.path.join(entry, OPTIMIZED_DATA))
        os.symlink(os.path.join(elsewhere, OPTIMIZED_DATA), os.path.join(entry, OPTIMIZED_DATA))
        trust.refresh_manifest(entry)
    with pytest.warns(OffloadWarning, match="symbolic link"):
        assert_not_served(zero_output(path, cache), w)
    assert not os.path.islink(entry) and os.path.isdir(elsewhere)  # the link set aside, not what it names
    assert sorted(os.listdir(elsewhere)) == sorted([MANIFEST, OPTIMIZED, OPTIMIZED_DATA])


def test_cache_clear_removes_entries_and_the_partial_folders_of_dead_starts_and_no_link(tmp_path, capsys):
    """`cache clear` removes entries and the partial folder of a start that was killed, at
    once; it removes no symbolic link (whatever its name, the package makes none) and never
    what a link points at, and a partial folder the package did not mark stays."""
    import onnx

    from onnx_offload.tools import cli
    from onnx_offload.loading import clear_cache
    from onnx_offload.models import mlp_stack
    cache = str(tmp_path / "cache")
    entry = honest_entry(trust.add_model(str(tmp_path), trust.weight(8)), cache)
    path = str(tmp_path / "mlp.onnx")
    onnx.save(mlp_stack(layers=8, hidden=512, batch=4), path)
    assert trust.start_and_kill(path, cache, signal.SIGKILL, 0.0), "the start finished before it could be killed"
    assert trust.leftovers(cache) == 1
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(entry, elsewhere)
    os.symlink(elsewhere, os.path.join(cache, "0" * 24))
    os.symlink(elsewhere, os.path.join(cache, "stray"))
    os.makedirs(os.path.join(cache, ".partial-live"))  # not marked as the package's
    cleared = clear_cache(cache)
    assert listed(cache) == [".partial-live", "0" * 24, "stray"]
    assert (cleared.removed, cleared.kept, cleared.partials, cleared.busy) == (1, 3, 1, 0), cleared
    assert sorted(os.listdir(elsewhere)) == sorted([MANIFEST, OPTIMIZED, OPTIMIZED_DATA])
    assert cli.main(["cache", "clear", "--cache-dir", cache]) == 0
    assert "removed 0 optimized models" in capsys.readouterr().out
    assert listed(cache) == [".partial-live", "0" * 24, "stray"]


def test_an_entry_whose_weight_reads_dev_zero_is_not_served(tmp_path):
    """An entry (this user's, its manifest in order) whose optimized model names /dev/zero for
    a weight: a location is the entry's own data file or one of the model's files."""
    cache = str(tmp_path / "cache")
    w = trust.weight(9)
    path = trust.add_model(str(tmp_path), w)
    entry = honest_entry(path, cache)
    trust.repoint(entry, "/dev/zero")
    trust.refresh_manifest(entry, "/dev/zero")
    with pytest.warns(OffloadWarning, match="neither"):
        assert_not_served(zero_output(path, cache), w)


def child_fifo_entry() -> dict:
    base = trust.world()
    try:
        cache = os.path.join(base, "cache")
        w = trust.weight(10)
        path = trust.add_model(base, w)
        entry = honest_entry(path, cache)
        os.mkfifo(os.path.join(entry, "pipe"))
        with open(os.path.join(entry, MANIFEST)) as f:
            manifest = json.load(f)
        (manifest["files"] if "files" in manifest else manifest)["pipe"] = "00" * 32
        with open(os.path.join(entry, MANIFEST), "w") as f:
            json.dump(manifest, f)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = zero_output(path, cache)
        return dict(correct=bool(np.array_equal(got, w)), warnings=[str(x.message) for x in seen])
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_an_entry_that_lists_a_fifo_does_not_block(child):
    res = child(__file__, "fifo_entry", timeout=60).data
    assert res["correct"]
    assert any("not a regular file" in m for m in res["warnings"]), res["warnings"]


def child_special_external(case: str) -> dict:
    """The hostile model of `case`, by path and as bytes, the cache off and on: what plain
    ORT raises and what the session did."""
    base = trust.world()
    home = base
    try:
        locations, home = trust.hostile_folder(base)
        out = {}
        for how in ("path", "bytes"):
            for cache in (None, os.path.join(base, "cache")):
                out[f"{how}, cache {'on' if cache else 'off'}"] = trust.external_attempt(
                    os.path.join(home, "m"), locations[case], how, cache)
        return out
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("case", trust.SPECIAL)
def test_external_data_that_is_not_a_regular_file_fails_as_ort_fails(child, case):
    """ORT fails at once on these (Fail: an absolute location, one that escapes the folder,
    one that is no regular file); the session raises ORT's type too, and never reads them."""
    res = child(__file__, "special_external", case, timeout=90).data
    for variant, (outcome, detail) in res.items():
        assert outcome == "same", f"{case}, {variant}: {outcome} {detail}"


# ---------------------------------------------------------------- failed saves, full disks, killed starts

def child_file_size_limit() -> dict:
    import resource

    import onnx
    import onnxruntime as ort

    from onnx_offload.models import mlp_stack
    base = trust.world()
    try:
        path = os.path.join(base, "mlp.onnx")
        onnx.save(mlp_stack(layers=8, hidden=512, batch=4), path)
        cache = os.path.join(base, "cache")
        resource.setrlimit(resource.RLIMIT_FSIZE, (150 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        ort.InferenceSession(path, providers=trust.CPU)  # plain ORT runs it: it writes nothing
        out = {}
        for where in (cache, "off"):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    trust.session(path, where).close()
                out[where] = dict(ran=True)
            except Exception as e:  # noqa: BLE001 - reported
                out[where] = dict(ran=False, types=[c.__name__ for c in type(e).__mro__],
                                  errno=getattr(e, "errno", None), message=str(e))
        out["cache left"] = listed(cache) if os.path.isdir(cache) else []
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_file_size_limit_refuses_with_an_error_about_the_disk(child):
    """Under ``ulimit -f 150K`` no folder holds the optimized model: the session says that
    (OSError EFBIG, also an OffloadError), not ORT's later "No graph was found in the
    protobuf", and publishes nothing."""
    import errno
    res = child(__file__, "file_size_limit", timeout=90).data
    for key, r in res.items():
        if key == "cache left":
            continue
        assert not r["ran"]
        assert {"OSError", "OffloadError"} <= set(r["types"]), r
        assert r["errno"] == errno.EFBIG and "file size limit" in r["message"], r
        assert "protobuf" not in r["message"].lower(), r
    assert res["cache left"] == [], res["cache left"]


def child_full_disk(which: str) -> dict:
    import onnx
    import onnxruntime as ort

    from onnx_offload.models import mlp_stack
    base = trust.world()
    full = os.path.join(base, "full")
    os.mkdir(full)
    try:
        why = trust.private_tmpfs(full, "1m")
        if why:
            return dict(skipped=why)
        path = os.path.join(base, "mlp.onnx")
        onnx.save(mlp_stack(layers=8, hidden=512, batch=4), path)
        feeds = {"x": np.random.default_rng(9).standard_normal((4, 512)).astype(np.float32)}
        want = ort.InferenceSession(path, providers=trust.CPU).run(None, feeds)[0]
        cache = os.path.join(full, "cache") if which == "cache" else "off"
        if which == "tmpdir":
            tempfile.tempdir = full
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                with trust.session(path, cache) as s:
                    out = dict(ran=True, correct=bool(np.allclose(s.run(None, feeds)[0], want, rtol=1e-5, atol=1e-5)))
            except Exception as e:  # noqa: BLE001 - reported
                out = dict(ran=False, types=[c.__name__ for c in type(e).__mro__], errno=getattr(e, "errno", None),
                           message=str(e))
        out["warnings"] = [str(x.message) for x in seen if issubclass(x.category, OffloadWarning)]
        out["left"] = sorted(os.listdir(full))
        return out
    finally:
        tempfile.tempdir = None
        shutil.rmtree(base, ignore_errors=True)


def test_a_cache_folder_on_a_full_disk_is_skipped_with_a_warning(child):
    res = child(__file__, "full_disk", "cache", timeout=90).data
    if "skipped" in res:
        pytest.skip(res["skipped"])
    assert res["ran"] and res["correct"], res
    assert any("cannot be used" in m and "No space left" in m for m in res["warnings"]), res["warnings"]
    assert res["left"] in ([], ["cache"]), res["left"]


def test_a_full_temporary_folder_with_the_cache_off_refuses_with_an_error_about_the_disk(child):
    import errno
    res = child(__file__, "full_disk", "tmpdir", timeout=90).data
    if "skipped" in res:
        pytest.skip(res["skipped"])
    assert not res["ran"], res
    assert {"OSError", "OffloadError"} <= set(res["types"]) and res["errno"] == errno.ENOSPC, res
    assert "protobuf" not in res["message"].lower() and "No space left" in res["message"], res
    assert res["left"] == [], res["left"]


@pytest.fixture
def big_model(tmp_path):
    """A model whose optimization pass lasts long enough to be killed inside it."""
    import onnx

    from onnx_offload.models import mlp_stack
    path = str(tmp_path / "mlp.onnx")
    onnx.save(mlp_stack(layers=8, hidden=512, batch=4), path)
    return path


def test_a_start_killed_by_sigterm_leaves_no_partial_folder(tmp_path, big_model):
    import random
    rng = random.Random(1)
    killed = 0
    for attempt in range(4):
        cache = str(tmp_path / f"cache{attempt}")
        if trust.start_and_kill(big_model, cache, signal.SIGTERM, rng.uniform(0, 0.06)):
            killed += 1
            assert trust.leftovers(cache) == 0, os.listdir(cache)
    assert killed, "every start finished before it could be killed"


def test_the_partial_folder_of_a_start_killed_by_sigkill_goes_with_the_next_start(tmp_path, big_model):
    cache = str(tmp_path / "cache")
    assert trust.start_and_kill(big_model, cache, signal.SIGKILL, 0.0), "the start finished before it could be killed"
    assert trust.leftovers(cache) == 1
    other = trust.add_model(str(tmp_path), trust.weight(11))
    zero_output(other, cache)  # another model's start: it sweeps what dead starts left
    assert trust.leftovers(cache) == 0, os.listdir(cache)


# ---------------------------------------------------------------- the bench's rows

@pytest.mark.parametrize("label,scenario,args,timeout", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_the_trust_scenarios_of_the_bench_hold(label, scenario, args, timeout):
    from onnx_offload.tools.reliability import run_scenario
    r = run_scenario(scenario, args, timeout)
    assert (r["wrong_outputs"], r["leaks"], r["hangs"], r["crashes"]) == (0, 0, 0, 0), r


CHILDREN = {"fifo_entry": child_fifo_entry, "special_external": child_special_external,
            "file_size_limit": child_file_size_limit, "full_disk": child_full_disk}

if __name__ == "__main__":
    import conftest as h  # this folder's: the script's folder leads sys.path
    h.emit(CHILDREN[sys.argv[1]](*sys.argv[2:]))
