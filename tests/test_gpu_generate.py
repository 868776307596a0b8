"""generate() on the H200: the tokens of a plain-ORT greedy loop on the CUDA EP, for both
export layouts, resident and streamed, and decode steps that replay captured graphs."""
import numpy as np
import pytest

from onnx_offload import OffloadSession
from onnx_offload.generation.steps import CHUNK_NOTE
from onnx_offload.models import longrope_lm, weight_bytes
from onnx_offload.models.decoder import decoder_lm

from conftest import reference_greedy

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
_MODELS = {}


def model_of(layout):
    # fp16: ORT's CUDA GroupQueryAttention takes fp16 and bf16 only. "exact": the standard
    # layout without position_ids, whose past is fed at its exact length.
    if layout not in _MODELS:
        _MODELS[layout] = decoder_lm("standard" if layout == "exact" else layout, layers=3, hidden=256, heads=8,
                                     kv_heads=2, intermediate=512, vocab=512, max_length=512, dtype=np.float16,
                                     position_ids=layout != "exact")
    return _MODELS[layout]


def session(model, weights, capture=None):
    kw = {} if weights == "resident" else dict(offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3)
    return OffloadSession(model.SerializeToString(), providers=[CUDA], vram_limit="2GiB", cuda_graph=capture, **kw)


@pytest.mark.parametrize("layout", ["gqa", "standard", "exact"])
@pytest.mark.parametrize("weights", ["resident", "a third"])
@pytest.mark.parametrize("capture", [None, False])
def test_greedy_tokens_equal_a_plain_ort_loop(layout, weights, capture):
    model = model_of(layout)
    ids = np.random.default_rng(1).integers(0, 512, (2, 7))
    want = reference_greedy(model, ids, 24, providers=[CUDA])
    with session(model, weights, capture) as s:
        streamed = weights != "resident"
        # Streamed weights run in segments with graphs off, and here with them on too: a
        # third of these weights is less than the one granule the engine's ring needs, and
        # the exact layout's decode steps change shape every step.
        assert s.engine == "segments"
        if streamed and capture is None:
            why = "exact length" if layout == "exact" else "ring"
            assert any("segments" in n and why in n for n in s.stats().notes), s.stats().notes
        assert (len(s.segments) > 1) == (streamed and s.engine == "segments")
        assert s.graph_capture.enabled == (capture is None), s.graph_capture
        np.testing.assert_array_equal(s.generate(ids, 24), want)
        s.free_generation_cache()  # the buffers kept for the next generation of this shape
        assert s.device.ledger.snapshot().zones["kv"].committed.current == 0
        final = s.close()
    assert final.committed == 0


@pytest.mark.parametrize("weights", ["resident", "a third"])
def test_every_decode_step_replays_a_captured_graph(weights):
    model = model_of("gqa")
    ids = np.random.default_rng(2).integers(0, 512, (1, 16))
    want = reference_greedy(model, ids, 128, providers=[CUDA])
    with session(model, weights) as s:
        assert s.graph_capture.enabled and (s.graph_capture.decode_only or s.engine == "graph"), s.graph_capture
        before = s.stats().graph_steps
        got = s.generate(ids, 128)
        # 128 new tokens: the first comes from the prompt step, each of the other 127 from
        # a decode step run under its plan's graph (captured on the first). The
        # streaming engine runs the prompt step as a graph too.
        assert s.stats().graph_steps - before == (128 if s.engine == "graph" else 127)
        np.testing.assert_array_equal(got, want)


def test_decode_steps_replay_after_a_batch_s_prompt_in_chunks():
    # The prompt of 4 rows in chunks runs row by row (8 shapes): with every weight
    # resident, the segment runner keeps its captured shapes for the decode step.
    model = model_of("gqa")
    ids = np.random.default_rng(4).integers(0, 512, (4, 40))
    with OffloadSession(model.SerializeToString(), providers=[CUDA], vram_limit="2GiB", prefill_chunk=16) as s:
        assert s.engine == "segments" and s.graph_capture.decode_only, (s.engine, s.graph_capture)
        for _ in range(2):
            before = s.stats().graph_steps
            s.generate(ids, 24)
            assert s.stats().graph_steps - before == 23  # every decode step, none of the prompt's
        assert CHUNK_NOTE in s.stats().notes


@pytest.mark.parametrize("weights", ["resident", "a third"])
def test_decode_steps_on_both_sides_of_a_length_threshold_give_plain_orts_tokens(weights):
    # The builder's Phi-3.5 LongRoPE: the rotary tables switch past 64 positions. The prompt
    # of 40 runs in one step; the decode steps feed a mask on the side of 64 that plain
    # ORT's loop does, one shape (one captured graph) on each side.
    model = longrope_lm("gqa", original=64, max_length=512, layers=3, hidden=256, heads=8, kv_heads=2,
                        intermediate=512, vocab=512, dtype=np.float16)
    ids = np.random.default_rng(6).integers(0, 512, (2, 40))
    want = reference_greedy(model, ids, 48, providers=[CUDA])
    with session(model, weights) as s:
        assert s.decoder_spec.length_thresholds == (64,)
        np.testing.assert_array_equal(s.generate(ids, 48), want)
        np.testing.assert_array_equal(s.generate(ids, 48), want)  # replayed


def test_a_prefill_chunk_of_the_prompt_s_length_runs_it_in_one_step_as_plain_ort():
    model = model_of("gqa")
    ids = np.random.default_rng(5).integers(0, 512, (2, 40))
    want = reference_greedy(model, ids, 16, providers=[CUDA])
    with OffloadSession(model.SerializeToString(), providers=[CUDA], vram_limit="2GiB", prefill_chunk=40) as s:
        np.testing.assert_array_equal(s.generate(ids, 16), want)
        assert CHUNK_NOTE not in s.stats().notes


@pytest.mark.parametrize("layout", ["standard", "exact"])
def test_left_padded_prompts_generate_as_a_plain_ort_loop(layout):
    model = model_of(layout)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 512, (3, 12))
    mask = np.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :11] = 0
    want = reference_greedy(model, ids, 20, providers=[CUDA], attention_mask=mask)
    with session(model, "a third") as s:
        np.testing.assert_array_equal(s.generate(ids, 20, attention_mask=mask), want)
        assert s.close().committed == 0


# Streamed, the decoder runs in segments; a later segment takes the attention mask as an
# input that ORT reads in host memory (the nodes that derive the lengths from it run on the
# CPU). IOBinding copies such an input when it is bound, so a binding kept from step to step
# binds it again, and such a segment runs uncaptured (a replay would not read it again).
# The reference is plain ORT's loop without CUDA graphs: in the Run that captures a graph,
# ORT runs the step twice, and a window-sized cache evicts twice (engines/step_state.py).
@pytest.mark.parametrize("weights", ["resident", "a third"])
def test_window_sized_caches_give_plain_orts_tokens_and_decode_steps_replay(weights, tmp_path):
    # ORT's CUDA GroupQueryAttention takes a window-sized cache (sliding_window_cache=1) of
    # exactly local_window_size positions, past and present one buffer: plain ORT's loop is
    # bench decode's anchor. A prompt longer than the window, and tokens past it.
    from onnx_offload.models.decoder import save_decoder
    from onnx_offload.tools.bench_decode import anchor
    shape = dict(layers=3, hidden=256, heads=8, kv_heads=2, intermediate=512, vocab=512, max_length=512,
                 dtype="float16")
    model = decoder_lm("gqa", **{**shape, "dtype": np.float16}, window_cache=32)
    ids = np.random.default_rng(3).integers(0, 512, (1, 40))
    want = anchor(save_decoder(model, str(tmp_path / "m")), shape, ids, 48, "cuda", graphs=False)["tokens"]
    with session(model, weights) as s:
        assert s.decoder_spec.window_caches == ((0, 32), (2, 32))
        before = s.stats().graph_steps
        np.testing.assert_array_equal(s.generate(ids, 48)[:, 40:], want)
        # The decode steps replay, but for the first of the streamed session's, which is not
        # run twice: its window-sized caches evict a position each run.
        assert s.stats().graph_steps - before >= 46
        final = s.close()
    assert final.committed == 0
