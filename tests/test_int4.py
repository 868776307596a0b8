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
