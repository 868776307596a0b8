"""The command line: the environment decides what the user did not say."""
import os
import subprocess
import time

import pytest

from onnx_offload.errors import CacheNotMarked
from onnx_offload.tools import cli
from onnx_offload.loading import clear_cache
from onnx_offload.loading import workdir
from onnx_offload.loading.cache import hold_entry
from onnx_offload.loading.cache_marks import TAG, tagged
from onnx_offload.models import mlp_stack, save, weight_bytes


@pytest.fixture
def model_path(tmp_path):
    model = mlp_stack(layers=4, hidden=1024, batch=4)
    return save(model, str(tmp_path / "m.onnx")), weight_bytes(model)


def run(argv, capsys):
    rc = cli.main(argv)
    return rc, capsys.readouterr()


def test_the_environment_wins_where_no_flag_is_given(model_path, capsys, monkeypatch):
    path, weights = model_path
    monkeypatch.setenv("ONNX_GENAI_WEIGHT_OFFLOAD_POLICY", "lru")
    monkeypatch.setenv("ONNX_GENAI_WEIGHT_OFFLOAD_DEVICE_BYTES", str(weights // 2))
    rc, out = run(["run", path, "--cpu", "--steps", "1", "--vram-limit", "256MiB"], capsys)
    assert rc == 0, out.err
    assert "/ lru (vmm)" in out.out, out.out


def test_a_flag_wins_over_the_environment(model_path, capsys, monkeypatch):
    path, weights = model_path
    monkeypatch.setenv("ONNX_GENAI_WEIGHT_OFFLOAD_POLICY", "lru")
    monkeypatch.setenv("ONNX_GENAI_WEIGHT_OFFLOAD_VMM", "0")
    rc, out = run(["run", path, "--cpu", "--steps", "1", "--vram-limit", "256MiB", "--policy", "mru",
                   "--weight-bytes", str(weights // 2)], capsys)
    assert rc == 0, out.err
    assert "/ mru (plain)" in out.out, out.out


def test_the_commands_own_defaults_apply_without_flag_or_environment(model_path, capsys, monkeypatch):
    path, weights = model_path
    for var in ("ONNX_GENAI_WEIGHT_OFFLOAD", "ONNX_GENAI_WEIGHT_OFFLOAD_VMM", "ONNX_GENAI_WEIGHT_OFFLOAD_POLICY"):
        monkeypatch.delenv(var, raising=False)
    rc, out = run(["run", path, "--cpu", "--steps", "1", "--vram-limit", "256MiB",
                   "--weight-bytes", str(weights // 2)], capsys)
    assert rc == 0, out.err
    assert "/ planned (vmm)" in out.out, out.out


@pytest.mark.parametrize("var,flags", [
    ("ONNX_GENAI_VRAM_LIMIT", ["--vram-limit", "256MiB"]),
    ("ONNX_GENAI_WEIGHT_OFFLOAD_POLICY", ["--policy", "mru"]),
    ("ONNX_GENAI_WEIGHT_OFFLOAD", ["--offload"]),
    ("ONNX_GENAI_WEIGHT_OFFLOAD_VMM", ["--no-vmm"]),
    ("ONNX_GENAI_CUDA_GRAPH", ["--no-cuda-graph"]),
])
def test_a_flag_wins_over_an_invalid_variable_and_without_it_the_error_names_it(model_path, capsys, monkeypatch,
                                                                               var, flags):
    path, weights = model_path
    monkeypatch.setenv(var, "garbage")
    argv = ["run", path, "--cpu", "--steps", "1", "--weight-bytes", str(weights // 2)]
    if var != "ONNX_GENAI_VRAM_LIMIT":
        argv += ["--vram-limit", "256MiB"]
    rc, out = run(argv + flags, capsys)
    assert rc == 0, out.err
    rc, out = run(argv, capsys)
    assert rc == 2 and f"{var}='garbage' is not valid" in out.err, out.err


@pytest.mark.parametrize("flag", ["--kv-bytes", "--scratch-bytes"])
def test_a_reserve_of_0_is_taken_as_the_api_takes_it(model_path, capsys, flag):
    """kv_bytes=0 is the API's default (and scratch_bytes=0 the API takes): so are the flags,
    and the configuration takes "0" as a string; the weights' allowance is still positive."""
    from onnx_offload import OffloadConfig
    path, weights = model_path
    rc, out = run(["run", path, "--cpu", "--steps", "1", "--vram-limit", "256MiB", "--weight-bytes", str(weights // 2),
                   flag, "0"], capsys)
    assert rc == 0, out.err
    field = flag[2:].replace("-", "_")
    assert getattr(OffloadConfig(**{field: "0"}), field) == 0 and getattr(OffloadConfig(**{field: "0MiB"}), field) == 0
    rc, out = run(["run", path, "--cpu", "--steps", "1", "--weight-bytes", "0"], capsys)
    assert rc == 2 and "--weight-bytes='0' is not valid" in out.err, out.err


def test_help_names_the_variable_each_flag_overrides(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for var in ("ONNX_GENAI_VRAM_LIMIT", "ONNX_GENAI_WEIGHT_OFFLOAD_DEVICE_BYTES", "ONNX_GENAI_WEIGHT_OFFLOAD_POLICY",
                "ONNX_GENAI_WEIGHT_OFFLOAD", "ONNX_GENAI_WEIGHT_OFFLOAD_VMM", "ONNX_GENAI_CUDA_GRAPH"):
        assert f"overrides {var}" in text, var


def test_cache_info_lists_the_optimized_models_and_clear_removes_them(model_path, capsys, tmp_path):
    path, _ = model_path
    cache = str(tmp_path / "cache")
    rc, out = run(["cache", "--cache-dir", cache], capsys)
    assert rc == 0 and ": 0 optimized models" in out.out, out
    rc, out = run(["run", path, "--cpu", "--steps", "1", "--vram-limit", "256MiB", "--cache-dir", cache], capsys)
    assert rc == 0, out.err
    (entry,) = set(os.listdir(cache)) - {TAG}
    assert tagged(cache)  # the folder the session made is marked as a cache
    rc, out = run(["cache", "info", "--cache-dir", cache], capsys)
    assert rc == 0 and ": 1 optimized models" in out.out and entry[:12] in out.out, out
    assert os.path.abspath(path) in out.out  # the model it was made from, not only its key
    os.makedirs(os.path.join(cache, ".partial-live"))  # not marked as the package's: left alone
    reading = hold_entry(os.path.join(cache, entry))  # as a session does while it reads the entry
    rc, out = run(["cache", "clear", "--cache-dir", cache], capsys)
    assert rc == 0 and "removed 0 optimized models" in out.out and "kept 1" in out.out, out
    os.close(reading)
    rc, out = run(["cache", "clear", "--cache-dir", cache], capsys)
    assert rc == 0 and "removed 1 optimized models" in out.out and "left alone 1 " in out.out, out
    assert sorted(os.listdir(cache)) == [".partial-live", TAG]
    # The next run optimizes again and publishes a new entry.
    rc, out = run(["run", path, "--cpu", "--steps", "1", "--vram-limit", "256MiB", "--cache-dir", cache], capsys)
    assert rc == 0, out.err
    assert sorted(os.listdir(cache)) == sorted([".partial-live", TAG, entry])


def _users_folder(folder):
    """A folder of the user's that holds names the cache also gives: a folder named like an
    entry, like an entry set aside, like partial folders (one named as the cache names
    them, with a pid that is gone; one old), a link named like an entry."""
    folder.mkdir(mode=0o700)
    (folder / "5f8d0d55b54764421b7156c9").mkdir()
    (folder / "5f8d0d55b54764421b7156c9" / "f").write_text("x")
    (folder / ".stale-abcd1234").mkdir()
    (folder / ".partial-notes").mkdir()
    os.utime(folder / ".partial-notes", (time.time() - 7200,) * 2)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process is over, in this pid namespace
    named = folder / f".partial-{gone.pid}-1-{workdir._pid_namespace()}-abc"  # as the cache names its own
    named.mkdir()
    (named / "draft.txt").write_text("mine")
    os.symlink("/nonexistent", folder / ".stale-link")
    os.symlink("/tmp", folder / ("ab" * 12))
    (folder / "notes.txt").write_text("mine")
    return sorted(os.listdir(folder))


def test_cache_clear_refuses_a_folder_not_marked_as_the_cache_and_removes_nothing(capsys, tmp_path, monkeypatch):
    """A mistyped --cache-dir (a home folder) or ONNX_OFFLOAD_CACHE_DIR loses nothing:
    without CACHEDIR.TAG, a folder that holds what the package did not make is refused;
    `cache info` lists none of it as optimized models."""
    folder = tmp_path / "home"
    mine = _users_folder(folder)
    rc, out = run(["cache", "clear", "--cache-dir", str(folder)], capsys)
    assert rc == 2 and "CacheNotMarked" in out.err and "nothing was removed" in out.err, out
    assert "'5f8d0d55b54764421b7156c9'" in out.err and "CACHEDIR.TAG" in out.err, out.err
    assert sorted(os.listdir(folder)) == mine
    monkeypatch.setenv("ONNX_OFFLOAD_CACHE_DIR", str(folder))
    rc, out = run(["cache", "clear"], capsys)
    assert rc == 2 and "CacheNotMarked" in out.err, out
    assert sorted(os.listdir(folder)) == mine and (folder / "5f8d0d55b54764421b7156c9" / "f").read_text() == "x"
    rc, out = run(["cache", "info", "--cache-dir", str(folder)], capsys)
    assert rc == 0 and ": 0 optimized models" in out.out, out
    with pytest.raises(CacheNotMarked):
        clear_cache(str(folder))
    assert sorted(os.listdir(folder)) == mine


def test_cache_clear_in_a_marked_folder_removes_only_the_package_s_entries(model_path, capsys, tmp_path):
    """In a folder marked as the cache that also holds the user's things, `cache clear`
    removes the entries a session published there and nothing of the user's, whatever its
    name."""
    path, _ = model_path
    folder = tmp_path / "home"
    mine = _users_folder(folder)
    rc, out = run(["run", path, "--cpu", "--steps", "1", "--vram-limit", "256MiB", "--cache-dir", str(folder)],
                  capsys)
    assert rc == 0, out.err
    assert not tagged(str(folder))  # a folder that holds the user's things is not marked by a session
    (entry,) = set(os.listdir(folder)) - set(mine)
    rc, out = run(["cache", "info", "--cache-dir", str(folder)], capsys)
    assert rc == 0 and ": 1 optimized models" in out.out and "not marked" in out.out, out
    (folder / TAG).write_text("Signature: 8a477f597d28d172789f06886806bc55\n")  # the user marks it
    rc, out = run(["cache", "clear", "--cache-dir", str(folder)], capsys)
    assert rc == 0 and "removed 1 optimized models" in out.out and f"left alone {len(mine)} " in out.out, out
    assert sorted(os.listdir(folder)) == sorted(mine + [TAG])
    assert (folder / "5f8d0d55b54764421b7156c9" / "f").read_text() == "x"


@pytest.mark.parametrize("layout", ["keyed", "fingerprints only"])
def test_a_cache_an_older_version_filled_without_a_tag_is_marked_and_cleared(model_path, capsys, tmp_path, layout):
    """A cache folder holding only entries (whose manifests have no `made_by`, or hold only
    their files' fingerprints, as older versions wrote them) and no tag is recognised:
    tagged, and its entries cleared."""
    import json
    path, _ = model_path
    cache = tmp_path / "cache"
    rc, out = run(["run", path, "--cpu", "--steps", "1", "--vram-limit", "256MiB", "--cache-dir", str(cache)], capsys)
    assert rc == 0, out.err
    (entry,) = set(os.listdir(cache)) - {TAG}
    os.unlink(cache / TAG)
    manifest = json.loads((cache / entry / "manifest.json").read_text())
    del manifest["made_by"]
    (cache / entry / "manifest.json").write_text(json.dumps(manifest if layout == "keyed" else manifest["files"]))
    rc, out = run(["cache", "info", "--cache-dir", str(cache)], capsys)
    assert rc == 0 and ": 1 optimized models" in out.out, out
    rc, out = run(["cache", "clear", "--cache-dir", str(cache)], capsys)
    assert rc == 0 and "removed 1 optimized models" in out.out, out
    assert os.listdir(cache) == [TAG] and tagged(str(cache))


def test_an_empty_cache_variable_is_unset_for_the_cache_command_as_for_a_session(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ONNX_OFFLOAD_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rc, out = run(["cache", "info"], capsys)
    assert rc == 0 and str(tmp_path) in out.out, out


def test_cache_with_the_cache_off_says_so(capsys, monkeypatch):
    monkeypatch.setenv("ONNX_OFFLOAD_CACHE_DIR", "off")
    rc, out = run(["cache", "clear"], capsys)
    assert rc == 0 and "the cache is off" in out.out, out


def test_an_ort_error_on_the_feeds_is_one_line_and_exit_2(model_path, capsys, tmp_path):
    """ORT's own error types (InvalidArgument, Fail, ...) are no RuntimeErrors."""
    import numpy as np
    feeds = str(tmp_path / "feeds.npz")
    np.savez(feeds, x=np.zeros((4, 1000), np.float32))  # the model takes [4, 1024]
    rc, out = run(["run", model_path[0], "--vram-limit", "256MiB", "--inputs", feeds], capsys)
    assert rc == 2 and "Traceback" not in out.err, out.err
    assert out.err.startswith("onnx-offload: ") and len(out.err.strip().splitlines()) == 1, out.err


def test_the_cache_command_reads_only_the_cache_s_own_variable(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ONNX_GENAI_VRAM_LIMIT", "garbage")  # configures sessions, not the cache
    monkeypatch.setenv("ONNX_OFFLOAD_CACHE_DIR", str(tmp_path))
    assert cli.main(["cache", "info"]) == 0
    assert str(tmp_path) in capsys.readouterr().out


def test_the_demo_says_what_it_measured_and_leaves_no_cache_entry_behind(tmp_path, capsys, monkeypatch):
    """On the CPU: the budget, that the host backend saves no RAM, the step against its
    bound (the resident step, or the streamed bytes at the measured link), what to try."""
    import re
    cache = tmp_path / "cache"
    monkeypatch.setenv("ONNX_OFFLOAD_CACHE_DIR", str(cache))
    rc, out = run(["demo", "--cpu"], capsys)
    assert rc == 0, out.err
    assert not cache.exists() or not any(cache.iterdir())
    text = out.out
    assert "budget: 16.02 MiB;" in text and "for the model's 64.06 MiB of weights" in text, text
    assert "saved: no RAM: on the CPU the host backend plays the GPU in host memory" in text, text
    plain = float(re.search(r"plain ORT, every weight in memory: +([0-9.]+) ms", text).group(1))
    step, bound, ratio, link = re.search(r"a step: ([0-9.]+) ms against its bound of ([0-9.]+) ms \(([0-9.]+)x\): "
                                         r"60.05 MiB over the link at [0-9.]+ GB/s \(measured\) take ([0-9.]+) ms",
                                         text).groups()
    assert float(bound) == pytest.approx(max(plain, float(link)), abs=0.011)
    assert float(ratio) == pytest.approx(float(step) / float(bound), rel=0.05, abs=0.06)
    assert "plain onnxruntime runs a model that fits in RAM faster" in text, text


def test_a_test_run_takes_its_cache_folder_with_it(tmp_path):
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TMPDIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          os.path.join(here, "test_config.py"), "-k", "parse_bytes"], cwd=here, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:]
    assert not list(tmp_path.glob("onnx-offload-tests-cache-*"))


def test_bench_gives_its_child_processes_an_absolute_out_folder(tmp_path, capsys, monkeypatch):
    """The benchmarks start child processes in another folder: a relative --out would
    be another folder there."""
    from onnx_offload.tools import bench_decode
    seen = {}

    def fake(kind, out):
        seen["out"] = out
        raise RuntimeError("stop here")
    monkeypatch.setattr(bench_decode, "bench_decode", fake)
    monkeypatch.chdir(tmp_path)
    rc, _ = run(["bench", "decode", "--cpu", "--out", "rel"], capsys)
    assert rc == 2
    assert seen["out"] == str(tmp_path / "rel")
