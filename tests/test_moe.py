"""Mixture-of-experts decoders (models/moe.py) on the CPU host backend: they run in plain ORT,
generate() gives plain ORT's greedy tokens all resident and streamed, and each layer's stacked
experts are one weight of the session."""
import numpy as np
import onnxruntime as ort
import pytest

from onnx_offload import OffloadSession
from onnx_offload.models import expert_share, gpt_oss, qwen3_moe, weight_bytes

from conftest import reference_greedy

CPU = ["CPUExecutionProvider"]
PRESETS = {"gpt-oss": gpt_oss, "qwen3-moe": qwen3_moe}
_MODELS = {}


def model_of(preset):
    if preset not in _MODELS:
        _MODELS[preset] = PRESETS[preset](max_length=64)
    return _MODELS[preset]


def session(model, **kw):
    kw.setdefault("host_granularity", 4096)
    kw.setdefault("vram_limit", "64MiB")
    return OffloadSession(model.SerializeToString(), providers=CPU, **kw)


def prompt(batch=2, length=6):
    return np.random.default_rng(0).integers(0, 97, (batch, length))


@pytest.mark.parametrize("preset", PRESETS)
def test_the_model_runs_in_plain_ort_with_experts_most_of_its_bytes(preset):
    model = model_of(preset)
    moe = [n for n in model.graph.node if n.op_type == "MoE"]
    assert len(moe) == 2 and all(n.domain == "com.microsoft" for n in moe)
    assert expert_share(model) > 0.8  # as in gpt-oss and Qwen3-MoE, the experts are most of the weights
    s = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    assert {o.name for o in s.get_outputs()} >= {"logits", "present.0.key", "present.1.value"}
    tokens = reference_greedy(model, prompt(), 8)
    assert tokens.shape == (2, 14)


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_equal_plain_ort_all_resident(preset):
    model = model_of(preset)
    want = reference_greedy(model, prompt(), 12)
    with session(model) as s:
        assert len(s.segments) == 1
        np.testing.assert_array_equal(s.generate(prompt(), 12), want)


# Streamed: the weights zone's allowance (weight_bytes) or the whole budget (vram_limit, which
# also holds the KV cache and the step's scratch) below the weights' bytes.
@pytest.mark.parametrize("limit", ["weight_bytes", "vram_limit"])
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_equal_plain_ort_streamed(preset, limit):
    model = model_of(preset)
    want = reference_greedy(model, prompt(), 12)
    total = weight_bytes(model)
    budget = {"weight_bytes": total // 2, "vram_limit": total * 6 // 10}[limit]
    with session(model, offload=True, vmm=True, **{limit: budget}) as s:
        assert len(s.segments) > 1
        np.testing.assert_array_equal(s.generate(prompt(), 12), want)
        assert s.stats().counters.page_ins > 0


@pytest.mark.parametrize("preset", PRESETS)
def test_each_stack_of_experts_is_one_weight_of_the_session(preset):
    model = model_of(preset)
    with session(model) as s:
        min_bytes = s.config.min_weight_bytes
        big = {t.name: int(np.prod(t.dims)) * 4 for t in model.graph.initializer
               if int(np.prod(t.dims)) * 4 >= min_bytes}  # float32
        held = {w for seg in s.segments for w in seg.weights}
        stats = s.stats()
    # Today the session streams whole initializers: every initializer of min_weight_bytes or
    # more is one weight in one slot, so a layer's fc1 (and fc2) stack of all its experts
    # pages in whole whenever the MoE node runs, whichever experts the router picked.
    # Route-aware streaming would keep one slot per stack but page its experts in as slices
    # ([e] of [experts, ...]), counted per expert: only the routed misses move.
    assert stats.weights == len(big) and stats.weight_bytes == sum(big.values())
    assert held == set(big)
    stacks = {n for n in big if ".moe.fc" in n and not n.endswith("_bias")}
    assert len(stacks) == 4  # fc1 and fc2 of each of the 2 layers
