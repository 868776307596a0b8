"""int4 (MatMulNBits) decoders as onnxruntime-genai's builder writes them, on the CPU host
backend: all resident, ORT prepacks their weights as plain ORT does, and the tokens are
those of plain ORT with its defaults; streamed, the weights are read from their slots
each step (a prepacked copy would keep what a slot held when the session was made), and
the tokens are those of ORT's kernels without prepacking."""
import numpy as np
import pytest

from onnx_offload import OffloadSession
from onnx_offload.models import decoder_lm, int4, weight_bytes

from conftest import reference_greedy

CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def model():
    return int4(decoder_lm("gqa", layers=2, hidden=256, heads=4, kv_heads=2, intermediate=768, vocab=1024,
                           max_length=256))


def test_the_int4_model_is_the_builder_s_kind(model):
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    assert "MatMul" not in ops


def test_all_resident_gives_plain_ort_s_tokens_with_its_defaults(model):
    ids = np.random.default_rng(0).integers(0, 1024, (2, 9))
    want = reference_greedy(model, ids, 16)
    # ORT's prepacked int8 kernels (accuracy_level 4) and its unpacked ones round differently:
    # the test tells them apart.
    assert not np.array_equal(want, reference_greedy(model, ids, 16, prepack=False))
    with OffloadSession(model.SerializeToString(), providers=CPU, cache_dir="off") as s:
        assert len(s.segments) == 1
        np.testing.assert_array_equal(s.generate(ids, 16), want)


def test_streamed_weights_are_read_from_their_slots(model):
    ids = np.random.default_rng(0).integers(0, 1024, (2, 9))
    with OffloadSession(model.SerializeToString(), providers=CPU, cache_dir="off", offload=True, vmm=True,
                        weight_bytes=weight_bytes(model) // 3, host_granularity=4096, vram_limit="64MiB") as s:
        assert len(s.segments) > 1
        np.testing.assert_array_equal(s.generate(ids, 16), reference_greedy(model, ids, 16, prepack=False))
        assert s.stats().counters.page_ins > 0


def test_a_bench_row_runs_in_a_process_of_its_own(model, tmp_path):
    """The benchmarks run each row in a fresh Python (bench_decode.in_process_of_its_own),
    which finds the row's function by the tools module's name."""
    import onnx

    from onnx_offload.tools.bench_decode import in_process_of_its_own
    path = str(tmp_path / "model.onnx")
    onnx.save(model, path)
    ids = np.random.default_rng(1).integers(0, 1024, (1, 5))
    row = in_process_of_its_own("bench_int4", "resident_row", path=path, ids=ids.tolist(), new=6, kind="cpu")
    assert row["segments"] == 1 and row["ms_per_token"] > 0
    np.testing.assert_array_equal(np.concatenate([ids, row["tokens"]], 1), reference_greedy(model, ids, 6))


def _dequantize_matmul(elem):
    """x [1, 256] @ DequantizeLinear(w [256, 256] of `elem`, blocks of 32 along K, no zero
    point): ORT's optimizations fuse the pair into a MatMulNBits node."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    lo, hi = (-8, 7) if elem == TensorProto.INT4 else (0, 15)
    w = helper.make_tensor("w", elem, [256, 256], rng.integers(lo, hi + 1, 256 * 256).tolist())
    scale = numpy_helper.from_array((0.01 * (1 + rng.random((8, 256)))).astype(np.float32), "scale")
    nodes = [helper.make_node("DequantizeLinear", ["w", "scale"], ["wd"], axis=0, block_size=32),
             helper.make_node("MatMul", ["x", "wd"], ["y"])]
    graph = helper.make_graph(nodes, "dq_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])], [w, scale])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize("elem", ["INT4", "UINT4"])
@pytest.mark.parametrize("weights", ["resident", "streamed"])
def test_an_int4_initializer_dequantized_into_a_matmul_gives_plain_orts_outputs_bitwise(elem, weights):
    import onnxruntime as ort
    from onnx import TensorProto
    model = _dequantize_matmul(getattr(TensorProto, elem))
    x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    so = ort.SessionOptions()
    if weights == "streamed":  # a slot's weight is read where it is, never prepacked (see the module's note)
        so.add_session_config_entry("session.disable_prepacking", "1")
    want = ort.InferenceSession(model, so, providers=CPU).run(None, {"x": x})[0]
    kw = dict(weight_bytes=1, host_granularity=4096) if weights == "streamed" else {}
    with OffloadSession(model, providers=CPU, cache_dir="off", offload=True, vmm=True, **kw) as s:
        assert any(n.op_type == "MatMulNBits" for seg in s.segments for n in seg.model.graph.node)
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], want)
        if weights == "streamed":
            assert s.stats().counters.page_ins > 0
