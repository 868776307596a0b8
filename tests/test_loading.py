"""Loading models: graphs with no weights, external data and the optimized-model cache,
initializers local to subgraphs, and the session's temporary folder."""
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_offload import CorruptModel, OffloadSession
from onnx_offload.loading.cache_marks import TAG

CPU = ["CPUExecutionProvider"]
MiB = 1 << 20
F = TensorProto.FLOAT


def listed(cache):
    """What the cache folder holds besides its CACHEDIR.TAG, sorted."""
    return sorted(set(os.listdir(cache)) - {TAG})


def make_model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    # IR 9 / opset 17: what ORT 1.31 loads (onnx's default IR version is newer).
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def tensor(name, shape, dtype=F):
    return helper.make_tensor_value_info(name, dtype, shape)


def offloaded(model, **kw):
    kw.setdefault("vram_limit", 256 * MiB)
    src = model if isinstance(model, str) else model.SerializeToString()
    kw.setdefault("host_granularity", 64 << 10)
    return OffloadSession(src, providers=CPU, offload=True, vmm=True, **kw)


def reference(model, feeds):
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, providers=CPU).run(None, feeds)


def assert_same(model, feeds, **kw):
    want = reference(model, feeds)
    s = offloaded(model, **kw)
    try:
        got = s.run(None, feeds)
        stats = s.stats()
    finally:
        s.close()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    return stats


# ---------------------------------------------------------------- 1. no weight crosses the threshold
def relu_only():
    return make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor("x", [2, 3])], [tensor("y", [2, 3])]), \
        {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}


def tiny_mlp():
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("w1", (8, 16)), ("b1", (16,)), ("w2", (16, 4)), ("b2", (4,)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h2"]), helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
             helper.make_node("Add", ["h3", "b2"], ["y"])]
    return make_model(nodes, [tensor("x", [3, 8])], [tensor("y", [3, 4])], inits), \
        {"x": rng.standard_normal((3, 8)).astype(np.float32)}


def many_small_initializers():
    n = 5000
    inits = [numpy_helper.from_array(np.full(4, i * 1e-3, np.float32), f"c{i}") for i in range(n)]
    nodes = [helper.make_node("Add", ["x" if i == 0 else f"a{i - 1}", f"c{i}"], ["y" if i == n - 1 else f"a{i}"])
             for i in range(n)]
    return make_model(nodes, [tensor("x", [4])], [tensor("y", [4])], inits), \
        {"x": np.random.default_rng(2).standard_normal(4).astype(np.float32)}


def ort_cuda_graph_test_model():
    # onnxruntime's CUDA-graph test model: Y = MatMul(X, W), W float [2, 1].
    w = numpy_helper.from_array(np.array([[2.0], [3.0]], np.float32), "W")
    return make_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [tensor("X", [3, 2])], [tensor("Y", [3, 1])],
                      [w]), {"X": np.array([[1, 2], [3, 4], [5, 6]], np.float32)}


@pytest.mark.parametrize("build", [relu_only, tiny_mlp, many_small_initializers, ort_cuda_graph_test_model])
def test_model_without_weights_loads(build, tmp_path):
    model, feeds = build()
    stats = assert_same(model, feeds)
    assert stats.weights == 0 and stats.weight_bytes == 0
    # Twice through the cache: optimized, then reused.
    for _ in range(2):
        assert_same(model, feeds, cache_dir=str(tmp_path / "cache"))
    assert len(listed(tmp_path / "cache")) == 1


# ---------------------------------------------------------------- 2. the cache sees every file the model reads
def external(t: onnx.TensorProto, path: str, location: str) -> onnx.TensorProto:
    """Moves `t`'s data to the end of the file `location` beside the model."""
    data = numpy_helper.to_array(t).tobytes()
    full = os.path.join(path, location)
    offset = os.path.getsize(full) if os.path.exists(full) else 0
    with open(full, "ab") as f:
        f.write(data)
    onnx.external_data_helper.set_external_data(t, location, offset, len(data))
    t.ClearField("raw_data")
    t.ClearField("float_data")
    t.data_location = TensorProto.EXTERNAL
    return t


def if_model(rng, outer_name="W_outer", then_name="W_then", else_name="W_else", store=None, bool_input=True):
    """y = If(c, x0 @ W_outer @ W_then, x0 @ W_outer @ W_else): each weight 16 KiB.
    With `store=(dir, {name: location})`, those weights are written to external files.
    With bool_input=False: y = If(s > 0, x0 @ W_then, x0 @ W_else) @ W_outer, where s is
    a float input (a streamed split gives every segment input a DLPack buffer, and ORT
    1.31 takes no bool DLPack tensors)."""
    arrays = {n: rng.standard_normal((64, 64)).astype(np.float32) for n in (outer_name, then_name, else_name)}
    tensors = {n: numpy_helper.from_array(a, n) for n, a in arrays.items()}
    if store is not None:
        where, locations = store
        for n, loc in locations.items():
            external(tensors[n], where, loc)
    x = "x" if bool_input else "x0"

    def branch(tag, w):
        out = f"{tag}_y"
        return helper.make_graph([helper.make_node("MatMul", [x, w], [out])], tag, [], [tensor(out, [4, 64])],
                                 initializer=[tensors[w]])

    outer = helper.make_node("MatMul", ["x0", outer_name], ["x"]) if bool_input else \
        helper.make_node("MatMul", ["z", outer_name], ["y"])
    if_node = helper.make_node("If", ["c"], ["y" if bool_input else "z"], then_branch=branch("then", then_name),
                               else_branch=branch("else", else_name))
    if bool_input:
        nodes, cond = [outer, if_node], tensor("c", [], TensorProto.BOOL)
    else:
        zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
        nodes = [helper.make_node("Greater", ["s", "zero"], ["c"]), if_node, outer]
        cond = tensor("s", [])
    inits = [tensors[outer_name]] + ([] if bool_input else [zero])
    return make_model(nodes, [tensor("x0", [4, 64]), cond], [tensor("y", [4, 64])], inits)


def replace_keeping_stat(path: str, data: bytes) -> None:
    """Rewrites `path` in place with same-size content and restores its mtime, as a
    replacement within the file system's timestamp granularity would look."""
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("location", ["main", "subgraph"])
def test_cache_sees_replaced_external_data(location, tmp_path):
    """The cache key covers the external data files, including one read only by a
    subgraph initializer, not just the .onnx file."""
    where = tmp_path / "model"
    where.mkdir()
    if location == "main":
        names = {"W": "main.data"}
        w = external(numpy_helper.from_array(np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32),
                                             "W"), str(where), "main.data")
        model = make_model([helper.make_node("MatMul", ["x0", "W"], ["y"])], [tensor("x0", [4, 64])],
                           [tensor("y", [4, 64])], [w])
    else:
        names = {"W_then": "branch.data", "W_else": "branch.data"}
        model = if_model(np.random.default_rng(3), store=(str(where), names))
    path = str(where / "model.onnx")
    onnx.save(model, path)
    feeds = {"x0": np.random.default_rng(4).standard_normal((4, 64)).astype(np.float32)}
    if location == "subgraph":
        feeds["c"] = np.array(True)
    cache = str(tmp_path / "cache")
    first = reference(path, feeds)[0]
    assert_same(path, feeds, cache_dir=cache)

    data_file = str(where / names[next(iter(names))])
    old = np.fromfile(data_file, dtype=np.float32)
    replace_keeping_stat(data_file, (old * -2.0 + 1.0).astype(np.float32).tobytes())
    second = reference(path, feeds)[0]
    assert not np.array_equal(first, second)
    assert_same(path, feeds, cache_dir=cache)
    assert len(listed(cache)) == 2


def test_weights_optimization_leaves_unchanged_are_read_from_the_models_own_file(tmp_path):
    """A cache entry holds no second copy of a weight that optimization left as it was:
    its optimized model names the caller's data file for it, and only weights that
    optimization made (a folded transpose) are in the entry's data file."""
    rng = np.random.default_rng(5)
    where = tmp_path / "model"
    where.mkdir()
    w0 = external(numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w0"), str(where), "m.data")
    w1 = external(numpy_helper.from_array(rng.standard_normal((32, 64)).astype(np.float32), "w1"), str(where), "m.data")
    model = make_model([helper.make_node("MatMul", ["x0", "w0"], ["h"]),
                        helper.make_node("Transpose", ["w1"], ["w1t"], perm=[1, 0]),
                        helper.make_node("MatMul", ["h", "w1t"], ["y"])],
                       [tensor("x0", [4, 64])], [tensor("y", [4, 32])], [w0, w1])
    path = str(where / "model.onnx")
    onnx.save(model, path)
    feeds = {"x0": rng.standard_normal((4, 64)).astype(np.float32)}
    cache = str(tmp_path / "cache")
    stats = assert_same(path, feeds, cache_dir=cache, min_weight_bytes=1024)
    (entry,) = listed(cache)
    optimized = onnx.load(os.path.join(cache, entry, "optimized.onnx"), load_external_data=False)
    locations = {t.name: {e.key: e.value for e in t.external_data}["location"]
                 for t in optimized.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert locations["w0"] == os.path.abspath(str(where / "m.data")), locations
    folded = [n for n, loc in locations.items() if loc == "optimized.onnx.data"]
    assert folded and "w0" not in folded
    assert os.path.getsize(os.path.join(cache, entry, "optimized.onnx.data")) == 32 * 64 * 4 * len(folded)
    assert any("model's own data files" in n for n in stats.notes), stats.notes
    assert_same(path, feeds, cache_dir=cache, min_weight_bytes=1024)  # read back from the entry
    assert listed(cache) == [entry]


def _one_weight_model(folder, seed):
    folder.mkdir()
    w = external(numpy_helper.from_array(np.random.default_rng(seed).standard_normal((64, 64)).astype(np.float32),
                                         "W"), str(folder), "m.data")
    model = make_model([helper.make_node("MatMul", ["x0", "W"], ["y"])], [tensor("x0", [4, 64])],
                       [tensor("y", [4, 64])], [w])
    onnx.save(model, str(folder / "model.onnx"))
    return str(folder / "model.onnx")


def test_a_copy_of_the_model_elsewhere_reads_its_own_files(tmp_path):
    """An entry that reads a weight from the model's own file is keyed by where that file
    is: a copy of the model in another folder, or a link switched to another version,
    never reads the first folder's file."""
    import shutil
    feeds = {"x0": np.random.default_rng(4).standard_normal((4, 64)).astype(np.float32)}
    cache = str(tmp_path / "cache")
    a = _one_weight_model(tmp_path / "a", 1)
    assert_same(a, feeds, cache_dir=cache)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    old = np.fromfile(str(tmp_path / "a" / "m.data"), dtype=np.float32)
    replace_keeping_stat(str(tmp_path / "a" / "m.data"), (old * -2.0).astype(np.float32).tobytes())
    assert_same(str(tmp_path / "b" / "model.onnx"), feeds, cache_dir=cache)
    assert_same(a, feeds, cache_dir=cache)
    # current -> v1, then current -> v2 (same content as v1's first version), then v1 by its own path.
    v1, v2 = _one_weight_model(tmp_path / "v1", 2), _one_weight_model(tmp_path / "v2", 3)
    current = tmp_path / "current"
    current.symlink_to(tmp_path / "v1")
    assert_same(str(current / "model.onnx"), feeds, cache_dir=cache)
    current.unlink()
    current.symlink_to(tmp_path / "v2")
    assert_same(str(current / "model.onnx"), feeds, cache_dir=cache)
    assert_same(v1, feeds, cache_dir=cache)
    assert_same(v2, feeds, cache_dir=cache)


def test_an_entry_missing_a_file_is_made_again_and_published_whole(tmp_path):
    feeds = {"x0": np.random.default_rng(4).standard_normal((4, 64)).astype(np.float32)}
    cache = str(tmp_path / "cache")
    path = _one_weight_model(tmp_path / "m", 1)
    assert_same(path, feeds, cache_dir=cache)
    (entry,) = listed(cache)
    os.remove(os.path.join(cache, entry, "optimized.onnx"))
    assert_same(path, feeds, cache_dir=cache)
    assert listed(cache) == [entry]  # made again under its key; nothing set aside is left
    assert os.path.exists(os.path.join(cache, entry, "optimized.onnx"))


@pytest.mark.parametrize("damage", ["garbled", "truncated", "added"])
def test_an_entry_changed_on_disk_is_made_again_never_trusted(tmp_path, damage):
    """Bytes of the entry's data file rewritten, the file cut short, a file added: the
    entry no longer matches the fingerprints it was published with, so it is made again
    (with a warning), and outputs stay ORT's."""
    from onnx_offload import OffloadWarning
    rng = np.random.default_rng(5)
    ws = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w{i}") for i in range(2)]
    model = make_model([helper.make_node("MatMul", ["x", "w0"], ["h"]), helper.make_node("MatMul", ["h", "w1"], ["y"])],
                       [tensor("x", [4, 64])], [tensor("y", [4, 64])], ws)
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)  # the weights inside the .onnx: the entry holds its own copy
    feeds = {"x": rng.standard_normal((4, 64)).astype(np.float32)}
    cache = str(tmp_path / "cache")
    assert_same(path, feeds, cache_dir=cache)
    (entry,) = listed(cache)
    data = os.path.join(cache, entry, "optimized.onnx.data")
    if damage == "garbled":
        with open(data, "r+b") as f:
            f.seek(8192)
            f.write(np.full(1024, 0.5, np.float32).tobytes())
    elif damage == "truncated":
        os.truncate(data, os.path.getsize(data) // 2)
    else:
        open(os.path.join(cache, entry, "stray"), "w").close()
    with pytest.warns(OffloadWarning, match="not as it was made"):
        assert_same(path, feeds, cache_dir=cache)
    assert listed(cache) == [entry]
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadWarning)  # the entry made again is used as it is
        assert_same(path, feeds, cache_dir=cache)


def test_cache_key_ignores_unrelated_stat_changes(tmp_path):
    """Touching the model without changing it still hits the cache."""
    model, feeds = tiny_mlp()
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    cache = str(tmp_path / "cache")
    assert_same(path, feeds, cache_dir=cache)
    os.utime(path, ns=(0, 10**18))
    assert_same(path, feeds, cache_dir=cache)
    assert len(listed(cache)) == 1


# ---------------------------------------------------------------- 3. initializers local to a subgraph
@pytest.mark.parametrize("cond", [True, False])
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("same_names", [False, True])
def test_subgraph_initializers_are_weights(cond, cached, same_names, tmp_path):
    names = dict(then_name="W", else_name="W") if same_names else {}
    model = if_model(np.random.default_rng(5), **names)
    feeds = {"x0": np.random.default_rng(6).standard_normal((4, 64)).astype(np.float32), "c": np.array(cond)}
    kw = {"cache_dir": str(tmp_path / "cache")} if cached else {}
    stats = assert_same(model, feeds, **kw)
    # All three 16 KiB weights have slots under the ledger, not only the main graph's.
    assert stats.weights == 3
    assert stats.weight_bytes == 3 * 64 * 64 * 4


def test_subgraph_weights_stream(tmp_path):
    """Under a budget that splits the graph, the If node's segment pages in its branch
    weights."""
    model = if_model(np.random.default_rng(7), bool_input=False)
    for s in (1.0, -1.0):
        feeds = {"x0": np.random.default_rng(8).standard_normal((4, 64)).astype(np.float32),
                 "s": np.array(s, np.float32)}
        stats = assert_same(model, feeds, host_granularity=4096, weight_bytes=32 << 10, segment_bytes=32 << 10,
                            cache_dir=str(tmp_path / "cache"))
        assert stats.weights == 3 and stats.segments == 2


def branch_returns_a_weight(rng):
    """Both branches return a 16 KiB weight; ORT's constant folding turns else's Neg(W)
    into an initializer that is the branch's output, and both are named W."""
    w = lambda: numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W")  # noqa: E731
    then = helper.make_graph([], "then", [], [tensor("W", [64, 64])], initializer=[w()])
    other = helper.make_graph([helper.make_node("Neg", ["W"], ["e"])], "else", [], [tensor("e", [64, 64])],
                              initializer=[w()])
    nodes = [helper.make_node("If", ["c"], ["w"], then_branch=then, else_branch=other),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    return make_model(nodes, [tensor("x", [4, 64]), tensor("c", [], TensorProto.BOOL)], [tensor("y", [4, 64])]), \
        {"c2": [None]}


def nested_ifs(rng):
    """An If inside an If branch, with weights named V at two depths."""
    def w(n):
        return numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), n)

    def matmul_branch(tag, name):
        return helper.make_graph([helper.make_node("MatMul", ["x", name], [tag])], tag, [], [tensor(tag, [4, 64])],
                                 initializer=[w(name)])

    outer_then = helper.make_graph([helper.make_node("If", ["c2"], ["ot"], then_branch=matmul_branch("it", "V"),
                                                     else_branch=matmul_branch("ie", "U"))],
                                   "ot", [], [tensor("ot", [4, 64])])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=outer_then, else_branch=matmul_branch("oe", "V"))]
    inputs = [tensor("x", [4, 64]), tensor("c", [], TensorProto.BOOL), tensor("c2", [], TensorProto.BOOL)]
    return make_model(nodes, inputs, [tensor("y", [4, 64])]), {"c2": [True, False]}


@pytest.mark.parametrize("build,weights", [(branch_returns_a_weight, 2), (nested_ifs, 3)])
def test_subgraph_weights_in_awkward_places(build, weights, tmp_path):
    rng = np.random.default_rng(9)
    model, variants = build(rng)
    for c in (True, False):
        for c2 in variants["c2"]:
            feeds = {"x": rng.standard_normal((4, 64)).astype(np.float32), "c": np.array(c)}
            if c2 is not None:
                feeds["c2"] = np.array(c2)
            stats = assert_same(model, feeds, cache_dir=str(tmp_path / "cache"))
            assert stats.weights == weights


# ---------------------------------------------------------------- 4. the temporary folder
def run_child(code: str, tmp_path, wait_for_line: bool = True):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=str(tmp_path),
                             stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline().strip() if wait_for_line else ""
    return child, line


# The child waits in short sleeps: a process-directed SIGTERM may be taken by any of its
# threads that does not block it (ORT's pool, the host backend's stream workers), and then
# Python runs the handler only when the main thread next runs bytecode, which one long
# sleep would put off until it ends.
WAIT = "for _ in range(600): time.sleep(0.1)"

MAKE_AND_WAIT = """
    import sys, time
    from onnx_offload.loading.workdir import make_workdir
    path = make_workdir()
    open(path + "/weights.bin", "wb").write(b"x" * 1000)
    print(path, flush=True)
    {then}
"""


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """This process's temp dir is `tmp_path` too, so sweeps touch nothing else."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_workdir_records_pid_and_is_removed(private_tmp):
    from onnx_offload.loading.workdir import make_workdir, remove_workdir
    path = make_workdir()
    assert os.path.dirname(path) == str(private_tmp)
    assert os.path.basename(path).startswith(f"onnx-offload-{os.getpid()}-")
    remove_workdir(path)
    assert not os.path.exists(path)
    remove_workdir(path)  # twice is fine


def test_sigterm_removes_the_workdir(private_tmp):
    child, path = run_child(MAKE_AND_WAIT.format(then=WAIT), private_tmp)
    assert os.path.isdir(path)
    child.send_signal(signal.SIGTERM)
    child.communicate(timeout=30)
    assert child.returncode == -signal.SIGTERM  # still dies by the signal
    assert not os.path.exists(path)


def test_normal_exit_removes_the_workdir(private_tmp):
    child, path = run_child(MAKE_AND_WAIT.format(then="sys.exit(3)"), private_tmp)
    child.communicate(timeout=30)
    assert child.returncode == 3
    assert not os.path.exists(path)


def test_existing_sigterm_handler_is_kept(private_tmp):
    code = MAKE_AND_WAIT.replace("import sys, time", textwrap.dedent("""\
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))""").replace("\n", "\n    "))
    child, path = run_child(code.format(then=WAIT), private_tmp)
    child.send_signal(signal.SIGTERM)
    child.communicate(timeout=30)
    assert child.returncode == 7  # the application's handler ran; atexit cleaned up
    assert not os.path.exists(path)


def test_stale_workdirs_are_swept_and_live_ones_kept(private_tmp):
    from onnx_offload.loading.workdir import make_workdir, remove_workdir
    dead, dead_path = run_child(MAKE_AND_WAIT.format(then="os._exit(0)").replace("import sys", "import os, sys"),
                                private_tmp)
    dead.communicate(timeout=30)
    assert os.path.isdir(dead_path)  # os._exit runs no cleanup
    live, live_path = run_child(MAKE_AND_WAIT.format(then=WAIT), private_tmp)
    foreign = private_tmp / "onnx-offload-notours"
    foreign.mkdir()
    try:
        mine = make_workdir()
        assert not os.path.exists(dead_path)
        assert os.path.isdir(live_path)
        assert foreign.is_dir()
        remove_workdir(mine)
    finally:
        live.kill()
        live.communicate(timeout=30)


SESSION_CHILD = """
    import os, sys, time
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnx_offload import OffloadSession
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])], initializer=[w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    s = OffloadSession(m.SerializeToString(), providers=["CPUExecutionProvider"], offload=True, vmm=True,
                       vram_limit=64 << 20, host_granularity=64 << 10)
    s.run(None, {{"x": np.ones((4, 64), np.float32)}})
    print(s._workdir, flush=True)
    {then}
"""


def session_workdir_or_skip(path: str) -> str:
    if not os.path.basename(path).startswith("onnx-offload-") or not os.path.basename(path).split("-")[2].isdigit():
        pytest.skip("session.py does not create its folder with onnx_offload.loading.workdir.make_workdir yet")
    return path


@pytest.mark.parametrize("how", ["sigterm", "os._exit"])
def test_session_folder_does_not_outlive_its_process(how, private_tmp):
    """Needs session.py to create its folder with make_workdir (skips until then)."""
    from onnx_offload.loading.workdir import make_workdir, remove_workdir
    then = WAIT if how == "sigterm" else "os._exit(0)"
    child, path = run_child(SESSION_CHILD.format(then=then), private_tmp)
    if how == "sigterm":
        child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert path, err
    session_workdir_or_skip(path)
    if how == "sigterm":
        assert child.returncode == -signal.SIGTERM
        assert not os.path.exists(path)
    else:
        assert os.path.isdir(path)
        remove_workdir(make_workdir())
        assert not os.path.exists(path)


def test_a_model_given_as_bytes_finds_its_external_data_where_ort_would(tmp_path, monkeypatch):
    """ORT reads the external data of a model given as bytes from the working directory,
    or from the folder SessionOptions names; so does OffloadSession."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnx_offload import CorruptModel, OffloadSession
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save(m, str(folder / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.data", size_threshold=0)
    data = (folder / "m.onnx").read_bytes()
    x = np.ones((2, 64), np.float32)
    monkeypatch.chdir(folder)
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with OffloadSession(data) as s:
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], want)
    monkeypatch.chdir(tmp_path)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    with OffloadSession(data, so) as s:
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], want)
    with pytest.raises(FileNotFoundError, match="working directory"):
        OffloadSession(data)  # neither here nor named: ORT fails too
    escaping = onnx.load_from_string(data)
    for e in escaping.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = "../m.data"
    m = escaping
    with pytest.raises(CorruptModel, match="outside the folder"):
        OffloadSession(m.SerializeToString())


def test_optimized_models_are_kept_in_the_user_cache_by_default(tmp_path, monkeypatch):
    """The second session of a model reuses the optimized model of the first: ORT's
    optimization pass runs once per content, in the user cache directory unless
    ONNX_OFFLOAD_CACHE_DIR (or cache_dir=) says otherwise."""
    import onnx_offload.loading.optimize as optimize_module
    from onnx_offload import OffloadConfig, OffloadSession
    from onnx_offload.config import default_cache_dir
    from onnx_offload.models import mlp_stack
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert OffloadConfig().cache_path == default_cache_dir() == str(tmp_path / "xdg" / "onnx-offload")
    assert OffloadConfig.from_env({"ONNX_OFFLOAD_CACHE_DIR": "off"}).cache_path is None
    assert OffloadConfig.from_env({"ONNX_OFFLOAD_CACHE_DIR": str(tmp_path / "c")}).cache_path == str(tmp_path / "c")
    passes = []
    real = optimize_module._optimize
    monkeypatch.setattr(optimize_module, "_optimize", lambda *a, **k: (passes.append(a[0]), real(*a, **k))[1])
    model = mlp_stack(layers=3, hidden=128, batch=2)
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    x = np.ones((2, 128), np.float32)
    outs = []
    for _ in range(2):
        with OffloadSession(path) as s:
            outs.append(s.run(None, {"x": x})[0])
    assert len(passes) == 1
    np.testing.assert_array_equal(outs[0], outs[1])
    assert len(listed(default_cache_dir())) == 1
    with OffloadSession(path, cache_dir="off") as s:  # off: the pass runs in the session's own folder
        s.run(None, {"x": x})
    assert len(passes) == 2


def test_progress_covers_the_whole_load(tmp_path):
    """With progress=True, the load shows its phases on stderr (tqdm); a callable still
    receives the weights' bytes as they are read."""
    import contextlib
    import io
    from onnx_offload import OffloadSession
    from onnx_offload.models import mlp_stack
    model = mlp_stack(layers=4, hidden=256, batch=2)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        with OffloadSession(model.SerializeToString(), progress=True, cache_dir="off"):
            pass
    text = err.getvalue()
    for phase in ("optimizing the model", "reading weights", "creating ORT sessions"):
        assert phase in text, text
    assert "0it" not in text and "?it/s" not in text, text  # a phase without a count shows its time
    seen = []
    with OffloadSession(model.SerializeToString(), progress=lambda done, total: seen.append((done, total))):
        pass
    assert seen and seen[-1][0] == seen[-1][1] > 0


def test_cache_given_as_none_is_off_and_an_unusable_one_is_skipped_with_a_warning(tmp_path):
    import pathlib
    from onnx_offload import OffloadConfig, OffloadSession
    from onnx_offload.errors import OffloadWarning
    from onnx_offload.models import mlp_stack
    assert OffloadConfig.from_env({}, cache_dir=None).cache_path is None
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    model = mlp_stack(layers=2, hidden=64, batch=2)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    x = np.ones((2, 64), np.float32)
    with pytest.warns(OffloadWarning, match="cannot be used"):
        with OffloadSession(pathlib.Path(path), cache_dir=str(blocker / "cache")) as s:  # a path object, too
            s.run(None, {"x": x})
    # A model that parses but that ORT cannot load fails in the optimization pass, which
    # leaves no partial folder in the cache.
    from onnx import TensorProto, helper
    from onnx_offload import CorruptModel
    g = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    bad = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(bad))
    cache = tmp_path / "c2"
    for _ in range(2):
        with pytest.raises(CorruptModel):
            OffloadSession(str(bad), cache_dir=str(cache))
    assert cache.is_dir() and not listed(cache)


# ---------------------------------------------------------------- 5. nothing the session did not write is trusted
def test_a_save_that_failed_is_not_an_optimized_model(tmp_path):
    """A full disk or a file size limit leaves an empty optimized.onnx, or a data file
    shorter than its tensors: neither is an optimized model to run."""
    import shutil
    from onnx_offload.loading.optimize import OPTIMIZED, OPTIMIZED_DATA, optimized_exists
    model, feeds = tiny_mlp()
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    cache = str(tmp_path / "cache")
    assert_same(path, feeds, cache_dir=cache, min_weight_bytes=64)
    (entry,) = listed(cache)
    honest = tmp_path / "honest"
    shutil.copytree(os.path.join(cache, entry), honest)
    assert optimized_exists(str(honest / OPTIMIZED))
    for damage in ("empty model", "short data"):
        bad = tmp_path / damage.replace(" ", "-")
        shutil.copytree(honest, bad)
        if damage == "empty model":
            open(bad / OPTIMIZED, "wb").close()
        else:
            os.truncate(bad / OPTIMIZED_DATA, os.path.getsize(bad / OPTIMIZED_DATA) - 4)
        assert not optimized_exists(str(bad / OPTIMIZED)), damage


@pytest.mark.parametrize("case", ["absolute", "../outside.data", "link to another file system"])
def test_external_data_outside_the_models_folder_is_refused_as_ort_refuses_it(case):
    """ORT refuses an absolute location and one that leaves the model's folder (for bytes,
    the working folder) once links are resolved, with its Fail: so does the session, by
    path and as bytes, the cache off and on, and it never reads the file."""
    import shutil
    from onnx_offload.tools import reliability_trust_kit as trust
    base = trust.world()
    home = base
    try:
        locations, home = trust.hostile_folder(base)
        for how in ("path", "bytes"):
            for cache in (None, os.path.join(base, "cache")):
                outcome, detail = trust.external_attempt(os.path.join(home, "m"), locations[case], how, cache)
                assert outcome == "same", f"{how}, cache {'on' if cache else 'off'}: {outcome} {detail}"
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def _versions_run(path, cache, feeds):
    with OffloadSession(path, providers=CPU, offload=True, vmm=True, vram_limit=256 * MiB, host_granularity=64 << 10,
                        cache_dir=cache) as s:
        return s.run(None, feeds)[0]


def test_weights_are_read_from_the_files_the_cache_key_fingerprinted(tmp_path, monkeypatch):
    """The data file replaced by a rename between the cache lookup and the read of the
    weights: the session runs the version it looked up, whole (the weight optimization
    folded from its entry, the one it left as it was from the file it fingerprinted)."""
    from onnx_offload.memory import host_store
    from onnx_offload.tools.reliability_trust_kit import replace_with_copy, versions
    path, data, v2, feeds, want = versions(str(tmp_path))
    cache = str(tmp_path / "cache")
    np.testing.assert_allclose(_versions_run(path, cache, feeds), want[0], rtol=1e-5, atol=1e-5)
    fill = host_store.HostStore.fill_from_file

    def rename_then_fill(self, *args, **kw):
        replace_with_copy(v2, data)
        return fill(self, *args, **kw)

    monkeypatch.setattr(host_store.HostStore, "fill_from_file", rename_then_fill)
    np.testing.assert_allclose(_versions_run(path, cache, feeds), want[0], rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    np.testing.assert_allclose(_versions_run(path, cache, feeds), want[1], rtol=1e-5, atol=1e-5)  # the new version


def test_no_entry_is_published_from_files_that_changed_during_the_optimization_pass(tmp_path, monkeypatch):
    """The data file replaced while ORT optimizes the model: what ORT read is not the version
    the key names, so no entry is published under it (a warning says so) and the session
    runs one version whole. Put back, the first version runs as it is."""
    import shutil
    from onnx_offload import OffloadWarning
    from onnx_offload.loading import optimize as optimize_module
    from onnx_offload.tools.reliability_trust_kit import replace_with_copy, versions
    path, data, v2, feeds, want = versions(str(tmp_path))
    v1 = str(tmp_path / "v1.data")
    shutil.copyfile(data, v1)
    cache = str(tmp_path / "cache")
    optimize, calls = optimize_module._optimize, []

    def rename_then_optimize(*args, **kw):
        if not calls:
            replace_with_copy(v2, data)
        calls.append(args[0])
        return optimize(*args, **kw)

    monkeypatch.setattr(optimize_module, "_optimize", rename_then_optimize)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _versions_run(path, cache, feeds)
    monkeypatch.undo()
    assert any(np.allclose(got, w, rtol=1e-5, atol=1e-5) for w in want), "the session mixed two versions"
    replace_with_copy(v1, data)
    np.testing.assert_allclose(_versions_run(path, cache, feeds), want[0], rtol=1e-5, atol=1e-5)
    assert any(issubclass(w.category, OffloadWarning) and "changed while" in str(w.message) for w in seen), \
        [str(w.message) for w in seen]


@pytest.mark.parametrize("stored", ["inside", "external"])
def test_two_initializers_of_one_name_are_refused_by_name(stored, tmp_path):
    """ORT 1.31 runs such a model on the first where the data is inside the model and on
    the last where it is external data: the session refuses it (CorruptModel, as ONNX's
    checker does), and plain ORT sessions keep working."""
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(2))
    model = make_model([helper.make_node("MatMul", ["x", "W"], ["y"])], [tensor("x", [2, 64])], [tensor("y", [2, 64])],
                       [numpy_helper.from_array(a, "W"), numpy_helper.from_array(b, "W")])
    path = str(tmp_path / "twice.onnx")
    if stored == "external":
        onnx.save(model, path, save_as_external_data=True, location="twice.data", size_threshold=0)
    else:
        onnx.save(model, path)
    for src in (path, model):  # a path, and bytes
        with pytest.raises(CorruptModel, match="names two initializers 'W'"):
            offloaded(src)
    with pytest.raises(CorruptModel, match="names two initializers 'W'"):
        OffloadSession(path, providers=CPU, cache_dir=str(tmp_path / "cache"))
    x = np.ones((2, 64), np.float32)
    so = ort.SessionOptions()
    so.log_severity_level = 3  # ORT warns of the repeated name
    assert ort.InferenceSession(path, so, providers=CPU).run(None, {"x": x})[0].shape == (2, 64)
