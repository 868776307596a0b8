"""A script written for onnxruntime.InferenceSession runs unchanged with OffloadSession
in its place, split into segments by the environment (the second way users turn
offload on), and gives the same answers."""
import json
import pickle
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_offload import CorruptModel, OffloadSession, StateError
from onnx_offload.models import mlp_stack, weight_bytes


def script(cls, path, x, prefix):
    """What an InferenceSession user writes; `cls` is the only thing that changes."""
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = prefix
    sess = cls(path, so, providers=["CPUExecutionProvider"])
    inputs = [(i.name, i.type, i.shape) for i in sess.get_inputs()]
    outputs = [(o.name, o.type) for o in sess.get_outputs()]
    y = sess.run(None, {"x": x})[0]
    y_ov = sess.run_with_ort_values(["y"], {"x": ort.OrtValue.ortvalue_from_numpy(x)})[0].numpy()
    io = sess.io_binding()
    io.bind_cpu_input("x", x)
    io.bind_output("y")
    sess.run_with_iobinding(io)
    y_io = io.copy_outputs_to_cpu()[0]
    meta = sess.get_modelmeta()
    done, got = threading.Event(), {}

    def callback(results, user_data, err):
        got.update(results=results, user_data=user_data, err=err)
        done.set()

    sess.run_async(None, {"x": x}, callback, "token")
    assert done.wait(30)
    sess.disable_fallback()
    sess.enable_fallback()
    options = sess.get_provider_options()
    start = sess.get_profiling_start_time_ns()
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    return dict(inputs=inputs, outputs=outputs, y=y, y_ov=y_ov, y_io=y_io, async_y=got["results"][0],
                async_user=got["user_data"], async_err=got["err"], providers=sess.get_providers(),
                cpu_options="CPUExecutionProvider" in options, started=start > 0,
                meta=(meta.producer_name, meta.graph_name, meta.version, meta.custom_metadata_map),
                overridable=[i.name for i in sess.get_overridable_initializers()],
                kernel_events=sum(1 for e in events if e.get("cat") == "Node"),
                segments=len(getattr(sess, "segments", [None])))


def test_an_inference_session_script_runs_unchanged(tmp_path, monkeypatch):
    model = mlp_stack(layers=6, hidden=1024, batch=4)  # 4 MiB weights: a third of them is several segments
    model.producer_name, model.model_version = "a test", 7
    onnx.helper.set_model_props(model, {"owner": "onnx-offload"})
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    x = np.random.default_rng(0).standard_normal((4, 1024)).astype(np.float32)
    want = script(ort.InferenceSession, path, x, str(tmp_path / "plain"))
    monkeypatch.setenv("ONNX_GENAI_WEIGHT_OFFLOAD", "1")
    monkeypatch.setenv("ONNX_GENAI_WEIGHT_OFFLOAD_VMM", "1")
    monkeypatch.setenv("ONNX_GENAI_WEIGHT_OFFLOAD_DEVICE_BYTES", str(weight_bytes(model) // 3))
    got = script(OffloadSession, path, x, str(tmp_path / "offload"))
    for key in ("inputs", "outputs", "providers", "cpu_options", "started", "meta", "overridable", "async_user",
                "async_err"):
        assert got[key] == want[key], key
    for key in ("y", "y_ov", "y_io", "async_y"):
        np.testing.assert_allclose(got[key], want["y"], rtol=1e-5, atol=1e-6, err_msg=key)
    # Every segment's kernels are in the one merged profile.
    assert got["segments"] > 1
    assert got["kernel_events"] >= want["kernel_events"] > 0
    assert len(list(tmp_path.glob("offload*.json"))) == 1


def test_what_cannot_work_under_offload_says_why():
    model = mlp_stack(layers=2, hidden=64, batch=2)
    with OffloadSession(model.SerializeToString()) as s:
        with pytest.raises(StateError, match="providers are fixed"):
            s.set_providers(["CPUExecutionProvider"])
        done, got = threading.Event(), {}
        with pytest.raises(Exception, match="nope"):  # a bad name is refused at the call, as ORT does
            s.run_async(None, {"nope": np.zeros(1)}, lambda r, u, e: None, None)
        x = np.ones((2, 64), np.float32)
        s.run_async(None, {"x": x}, lambda r, u, e: (got.update(r=r, u=u, e=e), done.set()), "mine")
        assert done.wait(30) and got["e"] == "" and got["u"] == "mine" and got["r"][0].shape == (2, 64)


@pytest.mark.parametrize("cls", [ort.InferenceSession, OffloadSession])
def test_run_async_hands_errors_to_the_callback_as_ort_does(cls):
    model = mlp_stack(layers=2, hidden=64, batch=2)
    s = cls(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="missing from input feed"):
        s.run_async(None, {}, lambda r, u, e: None, None)
    for feed, names, why in [({"x": np.ones((2, 64), np.float64)}, None, "Unexpected input data type"),
                             ({"x": np.ones((3, 64), np.float32)}, None, "invalid dimensions"),
                             ({"x": np.ones((2, 64), np.float32)}, ["nope"], "Invalid output name")]:
        done, got = threading.Event(), {}
        s.run_async(names, feed, lambda r, u, e: (got.update(r=r, u=u, e=e), done.set()), "mine")
        assert done.wait(30) and why in got["e"] and got["u"] == "mine" and not got["r"], got


def test_errors_while_a_split_model_runs_are_of_ort_types():
    """A kernel that fails (Reshape: Fail; Gather out of range: InvalidArgument), and a
    terminate flag, come out of run() and run_with_ort_values() as ORT's typed errors, as
    from InferenceSession, also when the model runs in segments; out of
    run_with_iobinding() as a RuntimeError, as ORT's IOBinding run raises them."""
    rng = np.random.default_rng(0)
    ws = [onnx.numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), f"W{i}") for i in range(2)]
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W0"], ["a"]), onnx.helper.make_node("MatMul", ["a", "W1"], ["b"]),
         onnx.helper.make_node("Gather", ["b", "rows"], ["c"], axis=0),
         onnx.helper.make_node("Reshape", ["c", "shape"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 256]),
         onnx.helper.make_tensor_value_info("rows", onnx.TensorProto.INT64, [2]),
         onnx.helper.make_tensor_value_info("shape", onnx.TensorProto.INT64, [2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], ws)
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    errors = ort.capi.onnxruntime_pybind11_state
    good = {"x": np.ones((2, 256), np.float32), "rows": np.array([1, 0], np.int64),
            "shape": np.array([4, 128], np.int64)}
    stop = ort.RunOptions()
    stop.terminate = True
    for s in (ort.InferenceSession(model, providers=["CPUExecutionProvider"]),
              OffloadSession(model, providers=["CPUExecutionProvider"], offload=True, vmm=True,
                             host_granularity=64 << 10, weight_bytes=256 * 256 * 4)):
        assert not isinstance(s, OffloadSession) or len(s.segments) >= 2
        for bad, kind, where in [(dict(good, shape=np.array([3, 5], np.int64)), errors.Fail, "Reshape"),
                                 (dict(good, rows=np.array([0, 9], np.int64)), errors.InvalidArgument, "Gather")]:
            with pytest.raises(kind, match=where):
                s.run(None, bad)
            with pytest.raises(kind, match=where):
                s.run_with_ort_values(None, {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in bad.items()})
            io = s.io_binding()
            for k, v in bad.items():
                io.bind_cpu_input(k, v)
            io.bind_output("y")
            with pytest.raises(RuntimeError, match=where):
                s.run_with_iobinding(io)
        with pytest.raises(errors.Fail, match="terminate"):
            s.run(None, good, stop)
        assert s.run(None, good)[0].shape == (4, 128)


def test_a_failed_run_runs_the_model_once_as_ort_does():
    """After a failure inside the model, the next run's seeded random values are the ones
    ORT gives: the failed step ran the model once, not again without fixed buffers."""
    rng = np.random.default_rng(0)
    ws = [onnx.numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), f"W{i}") for i in range(2)]
    h = onnx.helper
    g = h.make_graph(
        [h.make_node("MatMul", ["x", "W0"], ["a"]), h.make_node("MatMul", ["a", "W1"], ["b"]),
         h.make_node("RandomNormal", [], ["noise"], shape=[2, 256], seed=3.0, dtype=1),
         h.make_node("Add", ["b", "noise"], ["d"]), h.make_node("Gather", ["d", "rows"], ["y"], axis=0)], "g",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 256]),
         h.make_tensor_value_info("rows", onnx.TensorProto.INT64, [2])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], ws)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=8).SerializeToString()
    good = {"x": np.zeros((2, 256), np.float32), "rows": np.array([0, 1], np.int64)}
    bad = dict(good, rows=np.array([0, 9], np.int64))
    outs = []
    for s in (ort.InferenceSession(model, providers=["CPUExecutionProvider"]),
              OffloadSession(model, providers=["CPUExecutionProvider"], offload=True, vmm=True,
                             host_granularity=64 << 10, weight_bytes=256 * 256 * 4)):
        got = [s.run(None, good)[0]]
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument):
            s.run(None, bad)
        outs.append(got + [s.run(None, good)[0], s.run(None, good)[0]])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_an_optional_input_may_be_left_out_as_in_ort():
    rng = np.random.default_rng(0)
    ws = [onnx.numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), f"W{i}") for i in range(2)]
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W0"], ["a"]), onnx.helper.make_node("MatMul", ["a", "W1"], ["y"]),
         onnx.helper.make_node("OptionalHasElement", ["o"], ["has"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 256]),
         onnx.helper.make_value_info("o", onnx.helper.make_optional_type_proto(
             onnx.helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, [2])))],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 256]),
         onnx.helper.make_tensor_value_info("has", onnx.TensorProto.BOOL, [])], ws)
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=8).SerializeToString()
    x = np.ones((2, 256), np.float32)
    listed = [(i.name, i.type) for i in ort.InferenceSession(model, providers=["CPUExecutionProvider"]).get_inputs()]
    assert listed == [("x", "tensor(float)"), ("o", "optional(tensor(float))")]
    for s in (ort.InferenceSession(model, providers=["CPUExecutionProvider"]),
              OffloadSession(model, providers=["CPUExecutionProvider"])):
        assert [(i.name, i.type) for i in s.get_inputs()] == listed
        assert not s.run(None, {"x": x})[1]
        done, got = threading.Event(), {}
        s.run_async(None, {"x": x}, lambda r, u, e: (got.update(r=r, e=e), done.set()), None)
        assert done.wait(30) and got["e"] == "" and not got["r"][1]


@pytest.mark.parametrize("cls", [ort.InferenceSession, OffloadSession])
def test_the_optimized_model_is_written_where_the_options_say(cls, tmp_path):
    model = mlp_stack(layers=2, hidden=64, batch=2)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    x = np.ones((2, 64), np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    s = cls(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    written = onnx.load(so.optimized_model_filepath)
    assert "Gemm" in {n.op_type for n in written.graph.node}  # MatMul + Add, fused as ORT fuses them
    again = ort.InferenceSession(so.optimized_model_filepath, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(again.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    so.optimized_model_filepath = str(tmp_path / "no" / "such" / "folder" / "optimized.onnx")
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument) as e:
        cls(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    if cls is OffloadSession:  # also the OSError it is, which pickles with its file name
        back = pickle.loads(pickle.dumps(e.value))
        assert isinstance(back, FileNotFoundError) and back.filename == so.optimized_model_filepath


def test_session_options_as_given():
    """Every readable setting of the caller's SessionOptions reaches the ORT sessions that
    run the model, and get_session_options() reports the caller's, not the package's."""
    from onnx_offload.loading.ort_options import copy_options
    so = ort.SessionOptions()
    so.intra_op_num_threads = 3
    so.use_per_session_threads = False
    so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.set_denormal_as_zero", "1")
    copied = copy_options(so)
    assert copied.intra_op_num_threads == 3 and copied.use_per_session_threads is False
    assert copied.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert copied.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert copied.get_session_config_entry("session.set_denormal_as_zero") == "1"
    model = mlp_stack(layers=2, hidden=64, batch=2)
    so.use_per_session_threads = True  # without, ORT itself needs an environment with global pools
    with OffloadSession(model.SerializeToString(), so) as s:
        got = s.get_session_options()
        assert got.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        assert got.intra_op_num_threads == 3
        x = np.ones((2, 64), np.float32)
        np.testing.assert_allclose(s.run(None, {"x": x})[0],
                                   ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-6)


def _batch_model(path):
    w = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 64])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 64])], [w])
    onnx.save(onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8), path)
    return path


@pytest.mark.parametrize("cls", [ort.InferenceSession, OffloadSession])
def test_free_dimension_overrides_as_inference_session_takes_them(tmp_path, cls):
    """ORT has no getter for free-dimension overrides: the package records them on the
    caller's SessionOptions and the overridden graph is what runs, and what is cached."""
    path = _batch_model(str(tmp_path / "batch.onnx"))
    x3 = np.ones((3, 64), np.float32)
    with OffloadSession(path) as plain:  # caches the graph with the batch left free
        assert plain.get_inputs()[0].shape == ["batch", 64] and plain.run(None, {"x": x3})[0].shape == (3, 64)
    for by in ("name", "denotation"):
        so = ort.SessionOptions()
        if by == "name":
            so.add_free_dimension_override_by_name("batch", 2)
        else:
            so.add_free_dimension_override_by_denotation("DATA_BATCH", 2)
            model = onnx.load(path)
            model.graph.input[0].type.tensor_type.shape.dim[0].denotation = "DATA_BATCH"
            path = str(tmp_path / "denoted.onnx")
            onnx.save(model, path)
        s = cls(path, so, providers=["CPUExecutionProvider"])
        assert s.get_inputs()[0].shape == [2, 64] and s.get_outputs()[0].shape == [2, 64]
        assert s.run(None, {"x": np.ones((2, 64), np.float32)})[0].shape == (2, 64)
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="Expected: 2"):
            s.run(None, {"x": x3})


def test_custom_op_libraries_reach_every_session(tmp_path):
    """A model with an op from a custom-op library (onnxruntime-extensions' NegPos) between
    two weights, split into segments: the library the caller registered reaches the
    optimization pass and every segment session; without it, the model is refused as
    ORT refuses it."""
    extensions = pytest.importorskip("onnxruntime_extensions", reason="the test extra installs onnxruntime-extensions")
    rng = np.random.default_rng(0)
    ws = [onnx.numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), f"w{i}") for i in range(2)]
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w0"], ["h"]),
         onnx.helper.make_node("NegPos", ["h"], ["neg", "pos"], domain="ai.onnx.contrib"),
         onnx.helper.make_node("MatMul", ["pos", "w1"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 256])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 256]),
         onnx.helper.make_tensor_value_info("neg", onnx.TensorProto.FLOAT, [2, 256])], ws)
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17),
                                                     onnx.helper.make_opsetid("ai.onnx.contrib", 1)], ir_version=8)
    path = str(tmp_path / "custom.onnx")
    onnx.save(model, path)
    so = ort.SessionOptions()
    so.register_custom_ops_library(extensions.get_library_path())
    x = rng.standard_normal((2, 256)).astype(np.float32)
    want = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    with OffloadSession(path, so, providers=["CPUExecutionProvider"], offload=True, vmm=True,
                        weight_bytes=256 * 256 * 4, host_granularity=64 << 10) as s:
        assert len(s.segments) >= 2
        for got, exp in zip(s.run(None, {"x": x}), want):
            # Unpacked weights (prepacking is off for weights in slots) sum in another order.
            np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-3)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="NegPos"):
        ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    with pytest.raises(CorruptModel, match="NegPos"):
        OffloadSession(path, providers=["CPUExecutionProvider"])


def test_a_save_format_setting_does_not_reach_the_optimized_model(tmp_path):
    # The package saves its optimized model as ONNX, whatever format the caller's
    # optimized models are saved in.
    path = _batch_model(str(tmp_path / "m.onnx"))
    so = ort.SessionOptions()
    so.add_session_config_entry("session.save_model_format", "ORT")
    x = np.ones((2, 64), np.float32)
    want = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with OffloadSession(path, so, cache_dir=str(tmp_path / "cache")) as s:
        np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-6, atol=1e-5)


def test_options_made_before_the_import_are_named_in_a_warning(tmp_path):
    import subprocess
    import sys
    path = _batch_model(str(tmp_path / "m.onnx"))
    code = ("import warnings, onnxruntime as ort\n"
            "so = ort.SessionOptions()\n"
            "so.add_free_dimension_override_by_name('batch', 2)\n"
            "from onnx_offload import OffloadSession\n"
            "from onnx_offload.errors import OffloadWarning\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            f"    OffloadSession({path!r}, so).close()\n"
            "    OffloadSession({path!r}, ort.SessionOptions()).close()\n".replace("{path!r}", repr(path))
            + "print([str(x.message)[:60] for x in w if issubclass(x.category, OffloadWarning)])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("made before onnx_offload was impor") == 1, r.stdout


def test_every_recorded_setting_is_copied_and_initializers_in_options_are_refused(tmp_path):
    from onnx_offload.loading.ort_options import copy_options
    so = ort.SessionOptions()
    so.add_session_config_entry("custom.key.the.package.does.not.know", "42")
    so.add_free_dimension_override_by_name("batch", 4)
    assert copy_options(so).get_session_config_entry("custom.key.the.package.does.not.know") == "42"
    so.add_initializer("w", ort.OrtValue.ortvalue_from_numpy(np.zeros((64, 64), np.float32)))
    with pytest.raises(ValueError, match="SessionOptions.add_initializer"):
        OffloadSession(_batch_model(str(tmp_path / "m.onnx")), so)


@pytest.mark.parametrize("type_str,name", [("tensor(float)", "float32"), ("tensor(bfloat16)", "bfloat16"),
                                           ("tensor(float8e4m3fn)", "float8_e4m3fn"), ("tensor(int4)", "int4"),
                                           ("tensor(bool)", "bool"), ("tensor(double)", "float64")])
def test_ort_types_map_through_onnx_float8_and_int4_included(type_str, name):
    from onnx_offload.engines.ortvalues import _type_string, numpy_dtype
    assert numpy_dtype(type_str).name == name
    assert _type_string(numpy_dtype(type_str)) == type_str


def test_disabled_optimizers_as_inference_session_takes_them():
    model = mlp_stack(layers=2, hidden=64, batch=2)
    x = np.ones((2, 64), np.float32)
    want = ort.InferenceSession(model.SerializeToString(), disabled_optimizers=["MatMulAddFusion"]).run(None, {"x": x})
    with OffloadSession(model.SerializeToString()) as s:
        assert "Gemm" in {n.op_type for n in s.segments[0].model.graph.node}
    with OffloadSession(model.SerializeToString(), disabled_optimizers=["MatMulAddFusion"]) as s:
        ops = {n.op_type for n in s.segments[0].model.graph.node}
        assert "MatMul" in ops and "Gemm" not in ops
        np.testing.assert_allclose(s.run(None, {"x": x})[0], want[0], rtol=1e-6, atol=1e-6)


def test_every_inference_session_member_is_there():
    """OffloadSession has every public member of InferenceSession; where a member cannot
    pass through segments it says why."""
    missing = {m for m in dir(ort.InferenceSession) if not m.startswith("_")} - set(dir(OffloadSession))
    assert not missing, missing
    model = mlp_stack(layers=6, hidden=1024, batch=4)
    with OffloadSession(model.SerializeToString()) as whole:  # one plain ORT session: members pass through
        assert len(whole.get_input_memory_infos()) == 1 and len(whole.get_output_memory_infos()) == 1
        v = whole.create_ortvalue_from_shape_and_type([2, 3], np.float32, "cpu")
        assert v.shape() == [2, 3]
    with OffloadSession(model.SerializeToString(), offload=True, vmm=True,
                        weight_bytes=weight_bytes(model) // 3) as split:
        assert len(split.segments) > 1
        with pytest.raises(StateError, match="segment"):
            split.get_output_memory_infos()
        with pytest.raises(StateError, match="run_with_ort_values"):
            split.run_with_ortvaluevector(None, [], None, [], None, [])
        with pytest.raises(StateError, match="get_outputs"):
            split.io_binding().get_outputs_as_ortvaluevector()
        assert split.get_tuning_results() == []


def test_results_and_refusals_on_split_sessions(tmp_path):
    """run_with_ort_values' results own their memory; an overridable initializer is
    refused rather than ignored; offload without stable addresses runs a model that fits."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx_offload.engines.ortvalues import InvalidArgument
    model = mlp_stack(layers=6, hidden=1024, batch=4)
    x = np.random.default_rng(1).standard_normal((4, 1024)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    with OffloadSession(model.SerializeToString(), offload=True, vmm=True,
                        weight_bytes=weight_bytes(model) // 3) as s:
        assert len(s.segments) > 1
        for _ in range(3):  # each result a view of its own OrtValue's memory, which stays valid
            y = s.run_with_ort_values(["y"], {"x": ort.OrtValue.ortvalue_from_numpy(x)})[0].numpy()
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    with OffloadSession(model.SerializeToString(), offload=True, vmm=False) as s:  # fits: one session
        np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    # A model whose weight is also an input (overridable).
    w = numpy_helper.from_array(np.ones((1024, 1024), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 1024]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [1024, 1024])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1024])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with OffloadSession(m.SerializeToString(), offload=True, vmm=True, weight_bytes=1 << 20) as s:
        assert [i.name for i in s.get_overridable_initializers()] == ["w"]
        with pytest.raises(InvalidArgument, match="override"):
            s.run(None, {"x": x, "w": np.zeros((1024, 1024), np.float32)})
        np.testing.assert_allclose(s.run(None, {"x": x})[0], x @ np.ones((1024, 1024), np.float32), rtol=1e-5)


def _split_model_with_extra_outputs():
    """Six MatMuls (split at a third of the weights), and as further graph outputs a
    0-d constant (too small to be a weight: it stays inside the model) and the result
    cast to bfloat16, which numpy has only through ml_dtypes."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    nodes, inits, cur = [], [], "x"
    for i in range(6):
        inits.append(numpy_helper.from_array(rng.standard_normal((128, 128)).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [cur, f"w{i}"], [f"h{i}"]))
        cur = f"h{i}"
    nodes.append(helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.float32(3.5))))
    nodes.append(helper.make_node("Cast", [cur], ["yb"], to=TensorProto.BFLOAT16))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 128])],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, [4, 128]),
                           helper.make_tensor_value_info("c", TensorProto.FLOAT, []),
                           helper.make_tensor_value_info("yb", TensorProto.BFLOAT16, [4, 128])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), cur


def test_a_split_model_returns_small_constants_and_bfloat16_as_ort_does():
    model, y = _split_model_with_extra_outputs()
    x = np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = plain.run_with_ort_values(None, {"x": ort.OrtValue.ortvalue_from_numpy(x)})
    with OffloadSession(model.SerializeToString(), providers=["CPUExecutionProvider"], offload=True, vmm=True,
                        weight_bytes=weight_bytes(model) // 3, host_granularity=64 << 10) as s:
        assert len(s.segments) > 1
        c = s.run(["c"], {"x": x})[0]
        assert c.shape == () and c == np.float32(3.5)
        got = s.run_with_ort_values(None, {"x": ort.OrtValue.ortvalue_from_numpy(x)})
        io = s.io_binding()
        io.bind_cpu_input("x", x)
        for name in (y, "c", "yb"):
            io.bind_output(name)
        s.run_with_iobinding(io)
        for values in (got, io.get_outputs()):
            assert [v.data_type() for v in values] == [v.data_type() for v in want]
            assert [v.shape() for v in values] == [v.shape() for v in want]
            np.testing.assert_allclose(values[0].numpy(), want[0].numpy(), rtol=1e-4, atol=1e-4)
            assert values[1].numpy() == np.float32(3.5)
            # bfloat16, compared as floats: its bits are the top half of a float32's
            np.testing.assert_allclose(bf16_as_float(values[2]), bf16_as_float(want[2]), rtol=1e-2, atol=1e-2)


def bf16_as_float(value) -> np.ndarray:
    import ctypes
    bits = np.ctypeslib.as_array(ctypes.cast(value.data_ptr(), ctypes.POINTER(ctypes.c_uint16)), value.shape())
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_a_split_binding_checks_names_as_ort_does():
    model = mlp_stack(layers=6, hidden=256, batch=4)
    x = np.ones((4, 256), np.float32)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with OffloadSession(model.SerializeToString(), providers=["CPUExecutionProvider"], offload=True, vmm=True,
                        weight_bytes=weight_bytes(model) // 3, host_granularity=64 << 10) as s:
        assert len(s.segments) > 1
        for sess in (plain, s):
            io = sess.io_binding()
            with pytest.raises(RuntimeError, match="Failed to find NodeArg with name: bogus"):
                io.bind_cpu_input("bogus", x)
            for setup, needle in ((lambda io: io.bind_output("nope"), "Invalid output name: nope"),
                                  (lambda io: io.bind_output("x"), "Invalid output name: x"),
                                  (lambda io: None, "At least one output should be requested")):
                io = sess.io_binding()
                io.bind_cpu_input("x", x)
                setup(io)
                with pytest.raises(RuntimeError, match=needle):
                    sess.run_with_iobinding(io)
            io = sess.io_binding()
            io.bind_output("y")
            with pytest.raises(RuntimeError):  # ORT's message names the node that lacks it
                sess.run_with_iobinding(io)
        io = s.io_binding()  # and the session runs on
        io.bind_cpu_input("x", x)
        io.bind_output("y")
        s.run_with_iobinding(io)
        np.testing.assert_allclose(io.copy_outputs_to_cpu()[0], plain.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
    assert s.stats().ledger.committed == 0


@pytest.mark.parametrize("version", [None, 0, 7])
def test_model_metadata_version_as_ort_reads_it(version):
    m = mlp_stack(layers=2, hidden=64, batch=2)
    m.ClearField("model_version")
    if version is not None:
        m.model_version = version
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).get_modelmeta()
    with OffloadSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) as s:
        assert s.get_modelmeta().version == ref.version


def test_feeds_ort_cannot_convert_raise_what_ort_raises_on_a_split_session():
    from onnx_offload.models.decoder import decoder_lm
    m = decoder_lm("gqa", max_length=64)
    good = {"input_ids": np.ones((2, 3), np.int64), "attention_mask": np.ones((2, 3), np.int64)}
    for i in range(2):
        for kv in ("key", "value"):
            good[f"past_key_values.{i}.{kv}"] = np.zeros((2, 2, 0, 16), np.float32)
    plain = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    with OffloadSession(m.SerializeToString(), providers=["CPUExecutionProvider"], offload=True, vmm=True,
                        weight_bytes=weight_bytes(m) // 3, host_granularity=64 << 10) as s:
        assert len(s.segments) > 1
        for outs, feeds in ((None, {**good, "input_ids": np.int64(3)}), (None, {**good, "input_ids": "abc"}),
                            (None, {**good, "input_ids": 3}), (None, {**good, "input_ids": ((1, 2, 3), (4, 5, 6))}),
                            ("logits", good)):
            raised = []
            for sess in (plain, s):
                with pytest.raises(Exception) as e:
                    sess.run(outs, feeds)
                raised.append(e.type)
            assert raised[1] is raised[0], raised
        listed = {**good, "input_ids": [[1, 2, 3], [4, 5, 6]]}  # lists ORT converts
        np.testing.assert_array_equal(s.run(["logits"], listed)[0], s.run(["logits"], {
            **good, "input_ids": np.array([[1, 2, 3], [4, 5, 6]])})[0])
        assert s.run(["logits"], good)[0].shape == plain.run(["logits"], good)[0].shape


@pytest.mark.parametrize("call", ["run", "run_with_ort_values", "run_with_iobinding"])
def test_output_names_and_run_options_of_the_wrong_type_raise_what_ort_raises(call):
    """Checked against plain ORT, for a session in segments and for a plain one."""
    model = mlp_stack(layers=4, hidden=256, batch=4)
    x = np.ones((4, 256), np.float32)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def raised(sess, outs, run_options):
        with pytest.raises(Exception) as e:
            if call == "run":
                sess.run(outs, {"x": x}, run_options)
            elif call == "run_with_ort_values":
                sess.run_with_ort_values(outs, {"x": ort.OrtValue.ortvalue_from_numpy(x)}, run_options)
            else:
                io = sess.io_binding()
                io.bind_cpu_input("x", x)
                io.bind_output("y")
                sess.run_with_iobinding(io, run_options)
        return e.type

    cases = [(None, 5), (None, "opts")] + ([([None], None), ([3], None)] if call != "run_with_iobinding" else [])
    for kw in (dict(offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3, host_granularity=64 << 10),
               dict()):
        with OffloadSession(model.SerializeToString(), providers=["CPUExecutionProvider"], **kw) as s:
            assert (len(s.segments) > 1) == bool(kw)
            for outs, run_options in cases:
                want = raised(plain, outs, run_options)
                assert raised(s, outs, run_options) is want, (kw, outs, run_options, want)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], plain.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_a_session_is_not_copied_and_a_refused_copy_leaves_it_working():
    """copy.copy would share the session's device memory and ORT sessions, and the copy's
    close() would free them under the original: a copy is refused (TypeError, as for
    other owners of native resources), and so are deepcopy and pickle."""
    import copy
    model = mlp_stack(layers=4, hidden=256, batch=4)
    x = np.ones((4, 256), np.float32)
    with OffloadSession(model.SerializeToString(), providers=["CPUExecutionProvider"], offload=True, vmm=True,
                        weight_bytes=weight_bytes(model) // 3, host_granularity=64 << 10) as s:
        want = s.run(None, {"x": x})[0]
        for make in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot be copied or pickled"):
                make(s)
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], want)
