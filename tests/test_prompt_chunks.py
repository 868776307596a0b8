"""A prompt fed in chunks (prefill_chunk shorter than the prompt) gives the tokens of plain
ORT's loop, which feeds the whole prompt in one step: every row of a batch its own, down
to chunks of one token."""
import numpy as np
import pytest

from onnx_offload import OffloadSession
from onnx_offload.models import gpt_oss, weight_bytes
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
