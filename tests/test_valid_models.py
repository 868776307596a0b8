"""Valid models that a split session must load and run like plain ORT."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_offload import OffloadSession, StateError
from onnx_offload.models.generators import build_model

CPU = ["CPUExecutionProvider"]
MiB = 1 << 20


def weight(name, shape, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(dtype), name)


def both(model, feeds, runs=3, **kw):
    """Runs the model `runs` times split and plain; returns the split session's outputs."""
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)
    kw.setdefault("vram_limit", "256MiB")
    with OffloadSession(model.SerializeToString(), providers=CPU, offload=True, vmm=True, **kw) as s:
        for _ in range(runs):
            got = s.run(None, feeds)
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)  # GEMM rounding: no prepacking
        return s.stats(), got


def test_one_segment_over_its_allowance_streams():
    # One 256 KiB weight under a 128 KiB weights allowance: it plans into one segment,
    # which streams through the transient zone.
    w = weight("w", (256, 256), 1)
    m = build_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 256])], [w], "one")
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    st, _ = both(m, {"x": x}, weight_bytes="128KiB", vram_limit="64MiB")
    assert st.counters.page_ins >= 3  # every step streams it


def value_dependent_model():
    """Two segments (W1's and W2's) joined by a boundary of shape [4, k] or [k, 1024],
    whichever order ORT puts the nodes in, where k is an input value."""
    w1, w2 = weight("w1", (1024, 1024), 2), weight("w2", (1024, 1024), 3)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Slice", ["r", "zero", "k", "one"], ["s"]),
        helper.make_node("Slice", ["w2", "zero", "k", "zero"], ["w2k"]),
        helper.make_node("MatMul", ["s", "w2k"], ["y"]),
    ]
    consts = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
              numpy_helper.from_array(np.array([1], np.int64), "one")]
    return build_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 1024]),
                               helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1024])], [w1, w2] + consts, "vd")


def test_a_boundary_whose_shape_depends_on_an_input_value():
    m = value_dependent_model()
    x = np.random.default_rng(0).standard_normal((4, 1024)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=CPU)
    with OffloadSession(m.SerializeToString(), providers=CPU, offload=True, vmm=True, vram_limit="256MiB",
                        weight_bytes=6 * MiB) as s:
        assert len(s.segments) == 2
        for k in (3, 3, 5, 7, 3, 900):
            feeds = {"x": x, "k": np.array([k], np.int64)}
            np.testing.assert_allclose(s.run(None, feeds)[0], want.run(None, feeds)[0], rtol=1e-4, atol=1e-4)


def mlp(batch):
    from onnx_offload.models import mlp_stack
    return mlp_stack(layers=4, hidden=1024, batch=batch)


def test_a_batch_of_zero():
    m = mlp(None)
    st, got = both(m, {"x": np.zeros((0, 1024), np.float32)}, weight_bytes=6 * MiB)
    assert st.segments > 1 and got[0].shape == (0, 1024)


def test_graph_outputs_that_are_an_input_or_a_weight():
    w1, w2 = weight("w1", (1024, 1024), 4), weight("w2", (1024, 1024), 5)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])]
    m = build_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1024])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1024]),
                     helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1024]),
                     helper.make_tensor_value_info("w2", TensorProto.FLOAT, [1024, 1024])], [w1, w2], "passthrough")
    x = np.random.default_rng(1).standard_normal((2, 1024)).astype(np.float32)
    st, got = both(m, {"x": x}, weight_bytes=6 * MiB)
    assert st.segments > 1
    np.testing.assert_array_equal(got[1], x)


def test_bool_weights_and_a_bool_boundary():
    # A bool weight of 64 KiB, and a bool value computed in one segment and read in the next.
    w1, w2 = weight("w1", (1024, 1024), 6), weight("w2", (1024, 1024), 7)
    mask = numpy_helper.from_array(np.random.default_rng(8).random((64, 1024)) > 0.5, "mask")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Greater", ["h", "zero"], ["pos"]),
        helper.make_node("MatMul", ["x", "w2"], ["t"]),
        helper.make_node("And", ["pos", "mask"], ["both"]),
        helper.make_node("Where", ["both", "t", "h"], ["y"]),
    ]
    zero = numpy_helper.from_array(np.array(0, np.float32), "zero")
    m = build_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 1024])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 1024])], [w1, w2, mask, zero], "bools")
    x = np.random.default_rng(9).standard_normal((64, 1024)).astype(np.float32)
    st, _ = both(m, {"x": x}, weight_bytes=6 * MiB)
    assert st.segments > 1 and st.weights == 3


def test_wrong_names_raise_what_ort_raises_and_the_session_stays_usable():
    m = mlp(4)
    x = np.ones((4, 1024), np.float32)
    with OffloadSession(m.SerializeToString(), providers=CPU, offload=True, vmm=True, vram_limit="256MiB",
                        weight_bytes=6 * MiB) as s:
        assert len(s.segments) > 1
        with pytest.raises(Exception, match="Invalid input name: nope") as e:
            s.run(None, {"x": x, "nope": x})
        assert type(e.value).__name__ == "InvalidArgument"
        with pytest.raises(ValueError, match=r"Required inputs \(\['x'\]\) are missing"):
            s.run(None, {"nope": x})  # ORT names the missing input first
        with pytest.raises(ValueError, match=r"Required inputs \(\['x'\]\) are missing"):
            s.run(None, {})
        with pytest.raises(Exception, match="Invalid output name: nope"):
            s.run(["nope"], {"x": x})
        s.run(None, {"x": x})
    with pytest.raises(StateError, match="closed"):
        s.get_inputs()


def test_an_empty_provider_list_means_the_cpu():
    m = mlp(4)
    with OffloadSession(m.SerializeToString(), providers=[], vram_limit="256MiB") as s:
        assert s.get_providers() == ["CPUExecutionProvider"]


def test_float8_weights_stay_inside_the_model():
    import ml_dtypes
    w = np.random.default_rng(0).standard_normal((64, 128)).astype(ml_dtypes.float8_e4m3fn)
    t = helper.make_tensor("w8", TensorProto.FLOAT8E4M3FN, [64, 128], w.view(np.uint8).tobytes(), raw=True)
    nodes = [helper.make_node("Cast", ["w8"], ["wf"], to=TensorProto.FLOAT), helper.make_node("MatMul", ["x", "wf"], ["y"])]
    g = helper.make_graph(nodes, "f8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 128])], [t])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    x = np.ones((2, 64), np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=CPU).run(None, {"x": x})[0]
    # Without optimizations the Cast is not folded away: the float8 tensor reaches the session.
    with OffloadSession(m.SerializeToString(), providers=CPU, vram_limit="64MiB", optimization_level="disable") as s:
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], want)
        assert any("stay inside the model" in n for n in s.stats().notes)


def _sequence_model():
    rng = np.random.default_rng(0)
    ws = [numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), f"W{i}") for i in range(3)]
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W0"], ["a"]),
         helper.make_node("SplitToSequence", ["a"], ["seq"], axis=0),
         helper.make_node("ConcatFromSequence", ["seq"], ["b"], axis=0),
         helper.make_node("MatMul", ["b", "W1"], ["c"]),
         helper.make_node("MatMul", ["c", "W2"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 256]),
         helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)], ws)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_sequence_output_is_listed_and_returned_as_ort_returns_it():
    m = _sequence_model()
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    with OffloadSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) as s:
        assert [(o.name, o.type, o.shape) for o in s.get_outputs()] == \
            [(o.name, o.type, o.shape) for o in ref.get_outputs()]
        x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
        got, want = s.run(None, {"x": x}), ref.run(None, {"x": x})
        assert isinstance(got[1], list) and len(got[1]) == len(want[1]) == 3
        for a, b in zip([got[0]] + got[1], [want[0]] + want[1]):
            # Values up to 1e4, summed in another order (prepacking is off for weights in slots).
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(np.abs(b).max()))


def test_a_sequence_crossing_segments_is_refused_with_the_reason():
    from onnx_offload.errors import UnsupportedModel
    m = _sequence_model()
    with pytest.raises(UnsupportedModel, match="'seq' .seq.tensor.float... would cross"):
        OffloadSession(m.SerializeToString(), providers=["CPUExecutionProvider"], offload=True, vmm=True,
                       host_granularity=64 << 10, weight_bytes=256 * 256 * 4)


def test_a_sequence_input_to_a_split_model_is_refused_with_the_reason():
    from onnx_offload.errors import UnsupportedModel
    rng = np.random.default_rng(0)
    ws = [numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), f"W{i}") for i in range(2)]
    g = helper.make_graph(
        [helper.make_node("ConcatFromSequence", ["s"], ["x"], axis=0),
         helper.make_node("MatMul", ["x", "W0"], ["a"]), helper.make_node("MatMul", ["a", "W1"], ["y"])], "g",
        [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [1, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], ws)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(UnsupportedModel, match="input 's' .seq.tensor.float... would enter"):
        OffloadSession(m.SerializeToString(), providers=["CPUExecutionProvider"], offload=True, vmm=True,
                       host_granularity=64 << 10, weight_bytes=256 * 256 * 4)


def _two_matmuls(outputs, inputs=(), initializer_inputs=()):
    """x @ w1 -> h, h @ w2 -> y, with graph outputs `outputs` (names, repeats allowed),
    extra graph inputs `inputs` (value infos) and initializers also listed as inputs."""
    ws = [weight("w1", (256, 256), 1), weight("w2", (256, 256), 2)]
    listed = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [256, 256]) for n in initializer_inputs]
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 256])] + listed + list(inputs),
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], ws)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _plain(model, feeds):
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(model.SerializeToString(), so, providers=CPU).run(None, feeds)


# Weights bound as inputs (vmm=False), one segment; a split session (vmm=True, half the weights).
LAYOUTS = [dict(vmm=False), dict(vmm=True, weight_bytes=256 * 256 * 4)]


@pytest.mark.parametrize("kw", LAYOUTS)
def test_an_output_listed_twice_then_another_is_returned_as_ort_returns_it(kw):
    m = _two_matmuls(["h", "h", "y"])
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    want = _plain(m, {"x": x})
    with OffloadSession(m.SerializeToString(), providers=CPU, offload=True, host_granularity=64 << 10, **kw) as s:
        for _ in range(2):
            got = s.run(None, {"x": x})
            assert len(got) == 3
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
        final = s.close()
    assert final.committed == 0


@pytest.mark.parametrize("kw", LAYOUTS)
def test_an_initializer_listed_as_an_input_runs_and_refuses_an_override(kw):
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument
    m = _two_matmuls(["y"], initializer_inputs=["w2"])
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    want = _plain(m, {"x": x})
    with OffloadSession(m.SerializeToString(), providers=CPU, offload=True, host_granularity=64 << 10, **kw) as s:
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], want[0])
        with pytest.raises(InvalidArgument, match="'w2' is an initializer the model lets callers override"):
            s.run(None, {"x": x, "w2": np.zeros((256, 256), np.float32)})
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], want[0])
        final = s.close()
    assert final.committed == 0


def test_values_iobinding_cannot_hold_are_refused_when_the_session_is_made():
    from onnx_offload.errors import UnsupportedModel
    optional = helper.make_value_info("o", helper.make_optional_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, [256])))
    m = _two_matmuls(["y"], inputs=[optional])
    m.graph.node.append(helper.make_node("OptionalHasElement", ["o"], ["has"]))
    m.graph.output.append(helper.make_tensor_value_info("has", TensorProto.BOOL, []))
    m.opset_import[0].version = 18
    with pytest.raises(UnsupportedModel, match="'o' .optional.tensor.float... would enter.*vmm=False"):
        OffloadSession(m.SerializeToString(), providers=CPU, offload=True, vmm=False)
    # A string output: refused split and with the weights as inputs, run unsplit otherwise.
    vocab = numpy_helper.from_array(np.array(["a", "b", "c"], dtype=object), "vocab")
    m = _two_matmuls(["y"])
    m.graph.initializer.append(vocab)
    m.graph.input.append(helper.make_tensor_value_info("i", TensorProto.INT64, [2]))
    m.graph.node.append(helper.make_node("Gather", ["vocab", "i"], ["word"]))
    m.graph.output.append(helper.make_tensor_value_info("word", TensorProto.STRING, [2]))
    for kw in LAYOUTS:
        with pytest.raises(UnsupportedModel, match="'word' .tensor.string.. would cross"):
            OffloadSession(m.SerializeToString(), providers=CPU, offload=True, host_granularity=64 << 10, **kw)
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    with OffloadSession(m.SerializeToString(), providers=CPU, offload=True, vmm=True) as s:
        got = s.run(None, {"x": x, "i": np.array([2, 0])})
        assert list(got[1]) == ["c", "a"]


def _cnn():
    """Convolutions over symbolic sizes, on which ORT's symbolic shape inference gives up."""
    rng = np.random.default_rng(0)
    C = 32

    def w(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(np.float32), name)

    nodes, inits, h = [], [], "x"
    for i in range(3):
        p = f"c{i}_"
        inits += [w(p + "w", (C, C if i else 3, 3, 3)), w(p + "b", (C,)), w(p + "g", (C,)), w(p + "beta", (C,)),
                  w(p + "m", (C,)), numpy_helper.from_array((rng.random(C) + 0.5).astype(np.float32), p + "v")]
        nodes += [helper.make_node("Conv", [h, p + "w", p + "b"], [p + "o"], pads=[1, 1, 1, 1]),
                  helper.make_node("BatchNormalization", [p + "o", p + "g", p + "beta", p + "m", p + "v"], [p + "bn"]),
                  helper.make_node("Relu", [p + "bn"], [p + "r"])]
        h = p + "r"
    inits += [w("dw", (C, 16, 2, 2)), w("gw", (C, 1, 3, 3)), w("fc", (16, 10))]
    nodes += [helper.make_node("Conv", [h, "gw"], ["dwc"], group=C, pads=[1, 1, 1, 1]),
              helper.make_node("ConvTranspose", ["dwc", "dw"], ["up"], strides=[2, 2]),
              helper.make_node("GlobalAveragePool", ["up"], ["gap"]), helper.make_node("Flatten", ["gap"], ["f"]),
              helper.make_node("MatMul", ["f", "fc"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_splitting_writes_nothing_in_the_working_folder(tmp_path, monkeypatch):
    m = _cnn()
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    want = _plain(m, {"x": x})
    monkeypatch.chdir(tmp_path)
    with OffloadSession(m.SerializeToString(), providers=CPU, offload=True, vmm=True, weight_bytes="64KiB",
                        host_granularity=64 << 10, cache_dir="off") as s:
        assert len(s.segments) > 1
        np.testing.assert_allclose(s.run(None, {"x": x})[0], want[0], rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("offload", [False, True])
def test_shape_tensors_stay_in_the_model_whatever_the_smallest_weight(offload):
    m = _two_matmuls(["r"])
    m.graph.initializer.append(numpy_helper.from_array(np.array([-1, 16, 16], np.int64), "shape"))
    m.graph.node.append(helper.make_node("Reshape", ["y", "shape"], ["r"]))
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    want = _plain(m, {"x": x})
    kw = dict(offload=True, weight_bytes=256 * 256 * 4, host_granularity=64 << 10) if offload else dict(offload=False)
    with OffloadSession(m.SerializeToString(), providers=CPU, min_weight_bytes=0, cache_dir="off", **kw) as s:
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], want[0])


def test_a_failure_inside_the_model_has_ort_s_type_with_the_weights_as_inputs():
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail
    m = _two_matmuls(["r"], inputs=[helper.make_tensor_value_info("shape", TensorProto.INT64, [2])])
    m.graph.node.append(helper.make_node("Reshape", ["y", "shape"], ["r"]))
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    with OffloadSession(m.SerializeToString(), providers=CPU, offload=True, vmm=False) as s:
        with pytest.raises(Fail):
            s.run(None, {"x": x, "shape": np.array([3, 256])})
        assert s.run(None, {"x": x, "shape": np.array([2, 512])})[0].shape == (2, 512)


@pytest.mark.parametrize("vmm", [True, False])
@pytest.mark.parametrize("kw", [dict(segment_bytes=1), dict(min_weight_bytes=256)], ids=["segment_bytes=1",
                                                                                         "min_weight_bytes=256"])
def test_a_float16_gemm_chain_split_before_its_first_weight_runs(vmm, kw):
    # On the CPU, ORT runs an fp16 Gemm in float: the optimized model starts with a Cast
    # of the input and no weight. Alone in a segment, that Cast is computed again by the
    # next one (a cheap value of the inputs), and the segment would have no outputs.
    nodes, inits, prev = [], [], "x"
    for i in range(3):
        inits += [weight(f"w{i}", (64, 64), i, np.float16), weight(f"b{i}", (64,), 10 + i, np.float16)]
        nodes.append(helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [f"h{i}"]))
        prev = f"h{i}"
    m = build_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 64])],
                    [helper.make_tensor_value_info(prev, TensorProto.FLOAT16, [4, 64])], inits, "fp16_gemm")
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float16)
    want = ort.InferenceSession(m.SerializeToString(), providers=CPU).run(None, {"x": x})
    with OffloadSession(m.SerializeToString(), providers=CPU, offload=True, vmm=vmm, weight_bytes=20000,
                        vram_limit="64MiB", **kw) as s:
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], want[0])


@pytest.mark.parametrize("vmm", [True, False])
@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_a_big_endian_input_runs_on_its_values(vmm, split):
    from onnx_offload.models import mlp_stack
    data = mlp_stack(layers=4, hidden=256, batch=4).SerializeToString()
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    want = ort.InferenceSession(data, providers=CPU).run(None, {"x": x})[0]
    kw = dict(weight_bytes=300000) if split else {}
    with OffloadSession(data, providers=CPU, offload=True, vmm=vmm, vram_limit="64MiB", **kw) as s:
        np.testing.assert_allclose(s.run(None, {"x": x.astype(">f4")})[0], want, rtol=1e-5, atol=1e-5)
        if split:
            binding = s.io_binding()
            binding.bind_cpu_input("x", x.astype(">f4"))
            binding.bind_output(s.get_outputs()[0].name)
            s.run_with_iobinding(binding)
            np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vmm", [True, False])
@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_an_initializer_named_twice_is_refused(vmm, split):
    """ORT 1.31 runs it on the first where the data is inside the model (as here) and on
    the last where it is external data (see test_loading): refused by name, whatever the
    configuration."""
    from onnx_offload import CorruptModel
    first, second = weight("w", (256, 256), 1), weight("w", (256, 256), 2)
    m = build_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 256])], [first, second], "twice")
    kw = dict(weight_bytes="128KiB") if split else {}
    with pytest.raises(CorruptModel, match="names two initializers 'w'"):
        OffloadSession(m.SerializeToString(), providers=CPU, offload=True, vmm=vmm, vram_limit="64MiB", **kw)
