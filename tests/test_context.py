"""The longest sequence a decoder runs, read from its graph's position tables and from
config.json beside it: a generation past it is refused before anything runs."""
import json
import time

import numpy as np
import pytest

from onnx_offload import OffloadSession
from onnx_offload.models.decoder import decoder_lm, save_decoder

CPU = ["CPUExecutionProvider"]


def test_a_position_table_bounds_the_generation_before_it_runs(tmp_path):
    """A standard-layout export without genai_config.json, whose rotary tables hold 64
    positions: 70 positions would fail in ORT's Gather after the prompt ran."""
    path = save_decoder(decoder_lm("standard", max_length=64), str(tmp_path / "llm"))
    ids = np.random.default_rng(0).integers(0, 97, (1, 60))
    with OffloadSession(path, providers=CPU, vram_limit="64MiB") as s:
        assert s.decoder_spec.max_length == 64
        with pytest.raises(ValueError, match="need 70 positions; the model holds 64"):
            s.generate(ids, 11)
        assert s.generate(ids, 5).shape == (1, 65)  # 64 positions fed: the last token is never fed back


@pytest.mark.parametrize("key", ["max_position_embeddings", "n_positions"])
def test_config_json_s_context_bounds_the_generation(tmp_path, key):
    path = save_decoder(decoder_lm("gqa", max_length=256), str(tmp_path / "llm"))
    (tmp_path / "llm" / "config.json").write_text(json.dumps({key: 32}))
    ids = np.random.default_rng(0).integers(0, 97, (1, 30))
    with OffloadSession(path, providers=CPU, vram_limit="64MiB") as s:
        assert s.decoder_spec.max_length == 32
        t = time.perf_counter()
        with pytest.raises(ValueError, match="need 39 positions; the model holds 32"):
            s.generate(ids, 10)
        assert time.perf_counter() - t < 1
        assert s.generate(ids, 3).shape == (1, 33)


def test_the_advice_for_a_known_context_holds_a_short_prompt_s_growing_cache():
    """A too-small budget's advice is tried with a sequence of the model's context (512
    here): on the bucketed layout a short prompt's cache grows as it decodes, and its last
    growth holds the 256-position bucket and the 512-position one at once, more than a
    prompt of 512 tokens allocates. Followed, the advice runs both."""
    from onnx_offload import BudgetExceeded
    from onnx_offload.generation.advice import advised
    model = decoder_lm("standard", layers=4, hidden=128, intermediate=384, vocab=512, max_length=512)
    kw = dict(offload=True, vmm=True, prefill_chunk=128, providers=CPU, host_granularity=4096)
    with pytest.raises(BudgetExceeded) as e:
        OffloadSession(model.SerializeToString(), vram_limit=300000, **kw)
    advice = advised(e.value)
    ids = np.random.default_rng(0).integers(0, 512, (1, 300))
    with OffloadSession(model.SerializeToString(), **advice, **kw) as s:
        assert s.generate(ids, 4).shape == (1, 304)
        assert s.generate(ids[:, :8], 300).shape == (1, 308)
