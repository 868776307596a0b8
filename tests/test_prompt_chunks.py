"""A prompt fed in chunks (prefill_chunk shorter than the prompt) gives the tokens of plain
ORT's loop, which feeds the whole prompt in one step: every row of a batch its own, down
to chunks of one token, and for a graph that chooses by the sequence's total length (the
builder's Phi-3.5) the choice of one step over the prompt, then of each decode step's own
length."""
import os

import numpy as np
import pytest
from onnx import helper, numpy_helper

from onnx_offload import OffloadSession
from onnx_offload.generation.loop import fed_length, prompt_chunk, prompt_pieces
from onnx_offload.loading import length_thresholds
from onnx_offload.models import gpt_oss, longrope_lm, weight_bytes
from onnx_offload.models.decoder import decoder_lm

from conftest import reference_greedy

CPU = ["CPUExecutionProvider"]
MODELS = {"gqa": lambda: decoder_lm("gqa", max_length=64),
          "gqa windows": lambda: decoder_lm("gqa", max_length=64, window_cache=4),
          "gpt-oss": lambda: gpt_oss(max_length=64)}
_MADE = {}


def model_of(name):
    if name not in _MADE:
        _MADE[name] = MODELS[name]()
    return _MADE[name]


def session(model, **kw):
    return OffloadSession(model.SerializeToString(), providers=CPU, host_granularity=4096, vram_limit="64MiB", **kw)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("weights", ["resident", "streamed"])
@pytest.mark.parametrize("chunk", [1, 2])
def test_each_row_of_a_batch_prompt_in_chunks_gets_its_own_tokens(name, weights, chunk):
    # The builder layout runs a chunked prompt one row at a time: each row's last logits
    # must be its own, not a view of the buffer the next row's chunks write.
    model = model_of(name)
    ids = np.random.default_rng(1).integers(0, 97, (3, 5))
    want = reference_greedy(model, ids, 6)
    assert len({tuple(r) for r in want[:, 5:]}) == 3  # the rows' tokens differ
    kw = {} if weights == "resident" else dict(offload=True, vmm=True, weight_bytes=weight_bytes(model) // 2)
    with session(model, prefill_chunk=chunk, **kw) as s:
        assert (len(s.segments) > 1) == (weights == "streamed")
        np.testing.assert_array_equal(s.generate(ids, 6), want)
        np.testing.assert_array_equal(s.generate(ids, 6), want)  # on the kept buffers too


def _unread(model):
    """`model` with its If choosing by twice the mask's length: the same choice, in a form
    length_thresholds does not read."""
    g = model.graph
    greater = next(n for n in g.node if n.op_type == "Greater")
    g.initializer.append(numpy_helper.from_array(np.array(2, np.int64), "two"))
    g.initializer.append(numpy_helper.from_array(np.array(32, np.int64), "twice_original"))
    at = list(g.node).index(greater)
    g.node.insert(at, helper.make_node("Mul", [greater.input[0], "two"], ["/twice"]))
    greater.input[:] = ["/twice", "twice_original"]
    return model


LONGROPE = {"gqa": lambda: longrope_lm("gqa", original=16, max_length=64),
            "standard": lambda: longrope_lm("standard", original=16, max_length=64),
            "gqa unread": lambda: _unread(longrope_lm("gqa", original=16, max_length=64))}


def test_the_lengths_a_graph_chooses_by_are_read_from_it():
    assert length_thresholds(longrope_lm("gqa", original=16, max_length=64)) == (16,)
    assert length_thresholds(longrope_lm("standard", original=24, max_length=64)) == (24,)
    assert length_thresholds(decoder_lm("gqa")) == () and length_thresholds(decoder_lm("standard")) == ()
    assert length_thresholds(_unread(longrope_lm("gqa", original=16, max_length=64))) is None
    # Optimum's causal masks compare positions, not the length with a constant: nothing to read
    assert length_thresholds(decoder_lm("standard", sliding_window=8)) == ()


@pytest.mark.parametrize("name", LONGROPE)
@pytest.mark.parametrize("weights", ["resident", "streamed"])
@pytest.mark.parametrize("chunk", [1, 4])
def test_a_graph_that_chooses_its_rotary_tables_by_the_length_gives_plain_orts_tokens_in_chunks(name, weights, chunk):
    # Phi-3.5's LongRoPE as the builder writes it: the short factors up to 16 positions, the
    # long ones past it. Prompts below the threshold, crossing it, and crossing it only
    # while decoding; one row and several.
    model = LONGROPE[name]()
    kw = {} if weights == "resident" else dict(offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3)
    with session(model, prefill_chunk=chunk, **kw) as s:
        assert s.decoder_spec.layout == ("exact" if name == "standard" else "gqa")  # no padded past
        for rows, prompt, new in ((2, 10, 4), (2, 30, 6), (1, 17, 4), (2, 10, 12)):
            ids = np.random.default_rng(prompt).integers(0, 97, (rows, prompt))
            want = reference_greedy(model, ids, new)
            np.testing.assert_array_equal(s.generate(ids, new), want, err_msg=f"{rows} x {prompt} + {new}")
    assert s.close().committed == 0


def test_the_first_chunk_crosses_the_largest_threshold_below_the_prompt():
    assert prompt_pieces(30, 4, (16,)) == [(0, 18), (18, 4), (22, 4), (26, 4)]
    assert prompt_pieces(30, 4, (40,)) == prompt_pieces(30, 4) == [(0, 2)] + [(s, 4) for s in range(2, 30, 4)]
    assert prompt_pieces(17, 1, (16,)) == [(0, 17)]
    assert prompt_chunk(30, 4, None) == 0 and prompt_chunk(30, 4, (16,)) == 4  # unread: in one step
    # every later chunk sees a mask on the prompt's side: the cache's room, or the threshold
    assert fed_length(10, 40, (16,)) == 16 and fed_length(17, 40, (16,)) == 40 and fed_length(10, 12, (16,)) == 12
    assert fed_length(10, 40, ()) == 40 and fed_length(10, 40, None) == 10


@pytest.fixture(scope="module")
def builder_phi3(tmp_path_factory):
    """onnxruntime-genai's builder's fp32 and int4 exports (for the CPU EP) of a small
    Phi-3.5-mini-shaped model whose LongRoPE switches past 32 positions; skipped where the
    builder cannot run."""
    from builder_models import build, builder_missing, phi3_longrope_folder
    missing = builder_missing()
    if missing:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("phi3")
    hf = phi3_longrope_folder(str(root / "hf"))
    return {p: build(hf, str(root / p), precision=p, ep="cpu") for p in ("fp32", "int4")}


@pytest.mark.parametrize("precision", ["fp32", "int4"])
@pytest.mark.parametrize("weights", ["resident", "streamed"])
def test_the_builders_phi3_5_in_chunks_gives_plain_orts_tokens(builder_phi3, precision, weights):
    import onnx
    folder = builder_phi3[precision]
    model = onnx.load(os.path.join(folder, "model.onnx"))
    # Streamed, ORT's CPU kernels read int4 weights without prepacking them (test_int4.py).
    prepack = weights == "resident" or precision == "fp32"
    kw = {} if weights == "resident" else dict(offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3)
    with OffloadSession(folder, providers=CPU, host_granularity=64 << 10, prefill_chunk=8, **kw) as s:
        assert s.decoder_spec.length_thresholds == (32,)
        # a prompt past the original context, one below it, one that crosses it decoding
        for rows, prompt, new in ((1, 45, 6), (2, 20, 6), (2, 28, 12)):
            ids = np.random.default_rng(prompt).integers(3, 2048, (rows, prompt))
            want = reference_greedy(model, ids, new, head_size=64, prepack=prepack)
            np.testing.assert_array_equal(s.generate(ids, new), want, err_msg=f"{rows} x {prompt} + {new}")
    assert s.close().committed == 0
