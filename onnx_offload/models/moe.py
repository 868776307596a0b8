"""Decoder-only mixture-of-experts LLMs with random weights, in the layout onnxruntime-genai's
model builder writes for MoE models (gpt-oss, Qwen3-MoE, Phi-3.5-MoE).

Each layer is the attention of ``decoder_lm("gqa")`` (GroupQueryAttention, the residual
through SkipSimplifiedLayerNormalization), then a router MatMul (hidden -> experts logits)
and one ``com.microsoft.MoE`` node in place of the dense MLP. The MoE node holds every
expert of the layer in stacked initializers, in the layout of ORT's MoE schema:

- ``layers.{i}.moe.fc1``: [experts, 2 * intermediate, hidden], gate and up rows interleaved
  (``swiglu_fusion=1``: row 2j is gate j, row 2j + 1 is up j), with ``fc1_bias``
  [experts, 2 * intermediate] when biased;
- ``layers.{i}.moe.fc2``: [experts, hidden, intermediate], with ``fc2_bias`` [experts, hidden].

The node takes the router's logits (one row per token: [batch * sequence, experts]), applies
softmax, keeps the top k and renormalizes them (``normalize_routing_weights=1``), which is
gpt-oss's top-k-then-softmax and Qwen3-MoE's ``norm_topk_prob``. The experts' activation is
SwiGLU, ``G * sigmoid(alpha * G) * (L + beta)`` with G clamped above and L on both sides at
``swiglu_limit``: gpt-oss's (alpha 1.702, beta 1, limit 7), or SiLU(gate) * up with alpha 1,
beta 0 and no limit (Qwen3-MoE). Interleaved fused SwiGLU is the only gated form ORT's CPU
kernel runs (it refuses ``swiglu_fusion`` 0 and 2, and a separate fc3).

Not modelled: gpt-oss's attention sinks and alternating sliding windows, Qwen3's q/k norms,
shared experts. Expert weights are most of the model's bytes, as in the real models
(``expert_share``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .decoder import MS, _assemble, _draw, _gqa_graph, _Graph, _lin, _rope_tables, _weight_spec

# Tiny shapes of the two families (head size 16, the least GroupQueryAttention takes on the CPU);
# experts and top_k keep the routed fraction small as theirs is (gpt-oss-20b: 32 experts, top 4,
# expert width = hidden; Qwen3-30B-A3B: 128, top 8, expert width < hidden).
GPT_OSS = dict(hidden=64, heads=4, kv_heads=1, experts=8, top_k=2, expert_intermediate=64, eps=1e-5,
               rope_theta=150000.0, swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0, biases=True)
QWEN3_MOE = dict(hidden=64, heads=4, kv_heads=2, experts=16, top_k=4, expert_intermediate=32, eps=1e-6,
                 rope_theta=1000000.0, swiglu_alpha=1.0, swiglu_beta=0.0, swiglu_limit=None, biases=False)
PRESETS = {"gpt-oss": GPT_OSS, "qwen3-moe": QWEN3_MOE}


def _moe_spec(hidden, experts, intermediate, biases):
    """The per-layer weight spec of the router and the stacked experts, in draw order."""
    def spec(p):
        s = {p + "moe.router": _lin(hidden, experts)}
        if biases:
            s[p + "moe.router_bias"] = ((experts,), 0.1)
        s[p + "moe.fc1"] = ((experts, 2 * intermediate, hidden), hidden ** -0.5)
        if biases:
            s[p + "moe.fc1_bias"] = ((experts, 2 * intermediate), 0.1)
        s[p + "moe.fc2"] = ((experts, hidden, intermediate), intermediate ** -0.5)
        if biases:
            s[p + "moe.fc2_bias"] = ((experts, hidden), 0.1)
        return s
    return spec


def moe_lm(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, experts: int = 8, top_k: int = 2,
           expert_intermediate: int = 64, vocab: int = 97, max_length: int = 128, dtype=np.float32, seed: int = 0,
           eps: float = 1e-5, rope_theta: float = 10000.0, swiglu_alpha: float = 1.0, swiglu_beta: float = 0.0,
           swiglu_limit: Optional[float] = None, biases: bool = False, quant: Optional[str] = None,
           window_cache: Optional[int] = None) -> onnx.ModelProto:
    """A decoder whose MLPs are mixtures of `experts` SwiGLU experts, `top_k` of them per
    token, in onnxruntime-genai's layout (inputs, outputs and KV cache as decoder_lm("gqa")).
    `biases`: the router and the experts have biases (gpt-oss). `quant="int4"`: the experts
    as the builder's int4 models hold them, a ``com.microsoft.QMoE`` node (see quantize_experts).
    `window_cache`: the even layers keep a window-sized cache, as decoder_lm's. See gpt_oss(),
    qwen3_moe()."""
    if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise ValueError("hidden must split into heads of even size, and heads into kv_heads groups")
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k must be in 1..experts ({experts}), not {top_k}")
    dtype = np.dtype(dtype)
    elem, hd = helper.np_dtype_to_tensor_dtype(dtype), hidden // heads
    mixture_spec = _moe_spec(hidden, experts, expert_intermediate, biases)
    spec = _weight_spec(layers, hidden, heads, kv_heads, vocab, mixture_spec)
    weights = _draw(np.random.default_rng(seed), spec, dtype, seed)
    weights.update(_rope_tables("gqa", hd, max_length, rope_theta, dtype))
    if quant not in (None, "int4"):
        raise ValueError(f"quant must be None or 'int4', not {quant!r}")
    if quant:
        for i in range(layers):
            for fc in ("fc1", "fc2"):
                name = f"layers.{i}.moe.{fc}"
                weights[name], weights[name + "_scales"] = quantize_experts(weights[name])

    attrs = dict(k=top_k, activation_type="swiglu", swiglu_fusion=1, activation_alpha=float(swiglu_alpha),
                 activation_beta=float(swiglu_beta), normalize_routing_weights=1)
    if swiglu_limit is not None:
        attrs["swiglu_limit"] = float(swiglu_limit)

    def mixture(g, h, p):
        logits = g("MatMul", [h, p + "moe.router"])
        if biases:
            logits = g("Add", [logits, p + "moe.router_bias"])
        rows = g("Reshape", [logits, "moe_router_rows"])  # router_probs is one row per token
        bias = (lambda n: p + n) if biases else (lambda n: "")
        if quant:
            return g("QMoE", [h, rows, p + "moe.fc1", p + "moe.fc1_scales", bias("moe.fc1_bias"), p + "moe.fc2",
                              p + "moe.fc2_scales", bias("moe.fc2_bias")], domain=MS, expert_weight_bits=4, **attrs)
        return g("MoE", [h, rows, p + "moe.fc1", bias("moe.fc1_bias"), p + "moe.fc2", bias("moe.fc2_bias")],
                 domain=MS, **attrs)

    g = _Graph()
    g.const("moe_router_rows", [-1, experts])
    _gqa_graph(g, layers, heads, kv_heads, eps, mixture, window_cache)
    return _assemble(g, weights, "gqa", "moe_lm", layers, kv_heads, hd, vocab, elem)


def quantize_experts(w: np.ndarray) -> tuple:
    """Stacked expert weights [experts, out, in] as QMoE's 4-bit layout: (uint8 [experts, out,
    in / 2], two values a byte, the even column in the low nibble; a scale per output row,
    [experts, out], in the weights' dtype). A value is (q - 8) * scale, q in 0..15."""
    scale = np.abs(w.astype(np.float32)).max(axis=2) / 7.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w.astype(np.float32) / scale[..., None]), -8, 7).astype(np.int16) + 8
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed, scale.astype(w.dtype)


def gpt_oss(**kw) -> onnx.ModelProto:
    """A tiny gpt-oss-shaped MoE (8 experts, top 2; biases; SwiGLU alpha 1.702, beta 1, limit 7)."""
    return moe_lm(**{**GPT_OSS, **kw})


def qwen3_moe(**kw) -> onnx.ModelProto:
    """A tiny Qwen3-MoE-shaped MoE (16 experts, top 4; no biases; SiLU(gate) * up)."""
    return moe_lm(**{**QWEN3_MOE, **kw})


def expert_share(model: onnx.ModelProto) -> float:
    """The experts' share of the bytes of the model's initializers (the fc1/fc2 stacks and
    their biases)."""
    total = experts = 0
    for t in model.graph.initializer:
        n = len(t.raw_data) if t.HasField("raw_data") else numpy_helper.to_array(t).nbytes
        total += n
        experts += n if ".moe.fc" in t.name else 0  # the stacks, their biases and scales
    return experts / total
