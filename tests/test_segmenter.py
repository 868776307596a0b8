"""Segmenter equivalence: running the segments in order equals the unsplit model."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnx_offload.models import mlp_stack, residual_mlp, transformer_block
from onnx_offload.loading.segmenter import plan_segments, split

CPU = ["CPUExecutionProvider"]


def run_split(model, target, feeds, min_weight=4096):
    sizes = {t.name: numpy_helper.to_array(t).nbytes for t in model.graph.initializer}
    is_weight = lambda n: sizes.get(n, 0) >= min_weight  # noqa: E731
    groups = plan_segments(model, lambda ns: sum(sizes[n] for n in ns), is_weight, target)
    segments = split(model, groups, is_weight)
    values = dict(feeds)
    for seg in segments:
        sess = ort.InferenceSession(seg.model.SerializeToString(), providers=CPU)
        outs = sess.run(seg.outputs, {n: values[n] for n in seg.inputs})
        values.update(zip(seg.outputs, outs))
    return segments, [values[o.name] for o in model.graph.output]


def reference(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)


@pytest.mark.parametrize("target", [1, 300_000, 10**9])
def test_chain(target):
    m = mlp_stack(layers=6, hidden=192, batch=3)
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 192)).astype(np.float32)}
    segments, outs = run_split(m, target, feeds)
    assert len(segments) == (6 if target == 1 else 1 if target == 10**9 else 3)
    np.testing.assert_array_equal(outs[0], reference(m, feeds)[0])


def test_residuals_shared_weight_and_several_outputs():
    m = residual_mlp(layers=6, hidden=128, batch=4)
    feeds = {"x": np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)}
    segments, outs = run_split(m, 1, feeds)
    assert len(segments) == 6
    readers = [s.index for s in segments if "shared" in s.weights]
    assert readers == [0, 5]  # one weight, used by two segments
    assert "x" in segments[1].inputs or "r0" in segments[1].inputs
    for got, want in zip(outs, reference(m, feeds)):
        np.testing.assert_array_equal(got, want)


def test_transformer_blocks():
    m = transformer_block(hidden=64, heads=4, seq=8, batch=2, ffn=128, blocks=3)
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 8, 64)).astype(np.float32)}
    segments, outs = run_split(m, 40_000, feeds)
    assert len(segments) > 3
    np.testing.assert_array_equal(outs[0], reference(m, feeds)[0])


def test_boundaries_are_minimal():
    m = mlp_stack(layers=4, hidden=64, batch=2)
    sizes = {t.name: numpy_helper.to_array(t).nbytes for t in m.graph.initializer}
    groups = plan_segments(m, lambda ns: sum(sizes[n] for n in ns), lambda n: sizes.get(n, 0) >= 4096, 1)
    segments = split(m, groups, lambda n: sizes.get(n, 0) >= 4096)
    for seg in segments[1:]:
        assert len(seg.inputs) == 1  # only the running activation crosses a cut
    for seg in segments[:-1]:
        assert len(seg.outputs) == 1
    onnx.checker.check_model(segments[0].model)
    # Between segments, a value keeps its rank and declares no sizes (inference may merge
    # one wrong, and ORT refuses a value whose size differs); the model's own input keeps its.
    assert [d.HasField("dim_value") for d in segments[1].model.graph.input[0].type.tensor_type.shape.dim] == [False] * 2
    assert [d.dim_value for d in segments[0].model.graph.input[0].type.tensor_type.shape.dim] == [2, 64]


def test_boundary_types_of_contrib_ops_come_from_ort_s_own_inference():
    """MatMulInteger16 (a contrib op) takes int16 and gives int32: a boundary after it is
    typed int32, as ORT's symbolic shape inference says, not as its first input."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx_offload.loading.segmenter import value_types
    w = numpy_helper.from_array(np.ones((8, 8), np.int16), "w")
    g = helper.make_graph([helper.make_node("MatMulInteger16", ["x", "w"], ["y"], domain="com.microsoft"),
                           helper.make_node("Cast", ["y"], ["z"], to=TensorProto.FLOAT)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.INT16, [2, 8])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 8])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                          ir_version=8)
    assert value_types(m)["y"].tensor_type.elem_type == TensorProto.INT32


def test_a_graph_input_of_unknown_sizes_keeps_them_unknown_where_inference_merges_them():
    """A mask [b, 1, s, t] fed with no sizes, added to scores of 4 heads: ORT's symbolic
    inference merges the mask's second dimension with the heads (4), and a segment that
    declared it so would refuse every mask of one head."""
    from onnx import TensorProto, helper
    rng = np.random.default_rng(0)
    w0, w1 = (numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), n) for n in ("w0", "w1"))
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"]),
             helper.make_node("Add", ["h", "mask"], ["scores"]),
             helper.make_node("MatMul", ["scores", "w1"], ["y"])]
    m = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4, "s", 32]),
                     helper.make_tensor_value_info("mask", TensorProto.FLOAT, [None, None, None, None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4, "s", 32])], initializer=[w0, w1]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": rng.standard_normal((2, 4, 3, 32)).astype(np.float32),
             "mask": rng.standard_normal((2, 1, 3, 32)).astype(np.float32)}
    segments, outs = run_split(m, 1, feeds)
    assert len(segments) == 2 and "mask" in segments[0].inputs
    declared = next(i for i in segments[0].model.graph.input if i.name == "mask")
    assert [d.HasField("dim_value") for d in declared.type.tensor_type.shape.dim] == [False] * 4
    np.testing.assert_array_equal(outs[0], reference(m, feeds)[0])
