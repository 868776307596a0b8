"""Decoder-only LLMs with random weights, in the two ONNX layouts that LLM runtimes load.

- ``gqa``: the layout onnxruntime-genai's model builder writes. Contrib ops
  (SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, GroupQueryAttention with
  the rotary embedding inside); the attention mask is reduced to ``seqlens_k`` and
  ``total_sequence_length``; the KV cache can be one shared buffer of ``max_length`` rows
  bound as both past and present.
- ``standard``: the layout Optimum and torch.onnx write, with standard ONNX ops only. A
  ``position_ids`` input picks the rotary rows, KV heads are repeated with Expand, the mask
  bias is causal-and-padding, and present = Concat(past, new) on the sequence axis.
  With ``position_ids=False`` there is no such input: the rotary rows are the positions
  counted from the past's length, as HF's code takes them when it is given none.

Both layouts draw the same weights in the same order, so with the same arguments they
compute the same function and their greedy tokens can be compared with each other.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .generators import build_model

MS = "com.microsoft"
_ALIGN = 4096  # external-data offsets on page boundaries, so that ORT can map them


def _normal(rng, shape, scale, dtype):
    # float32 draws are faster and half the temporary memory of float64 ones
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(dtype)


# Above this many parameters each weight draws from a stream of its own, on every core
# (an 8B shape's 8e9 draws take minutes on one); below it, one stream in a fixed order.
PARALLEL_DRAWS = 1 << 30


def _lin(n_in, n_out):
    """A linear weight [in, out] and its std, 1/sqrt(in)."""
    return (n_in, n_out), 1.0 / math.sqrt(n_in)


def _dense_mlp(hidden, intermediate):
    """The per-layer weight spec of the SiLU-gated MLP, in draw order."""
    return lambda p: {p + "gate_proj": _lin(hidden, intermediate), p + "up_proj": _lin(hidden, intermediate),
                      p + "down_proj": _lin(intermediate, hidden)}


def _weight_spec(layers, hidden, heads, kv_heads, vocab, mlp):
    """{name: (shape, std)} of every weight, in draw order; `mlp(prefix)` gives a layer's
    MLP entries (drawn after its attention and norms). A std of None marks a norm's gamma."""
    hd = hidden // heads
    gamma = ((hidden,), None)
    spec = {"embed_tokens": ((vocab, hidden), 1.0)}
    for i in range(layers):
        p = f"layers.{i}."
        spec[p + "input_layernorm"] = gamma
        spec[p + "q_proj"] = _lin(hidden, heads * hd)
        spec[p + "k_proj"] = _lin(hidden, kv_heads * hd)
        spec[p + "v_proj"] = _lin(hidden, kv_heads * hd)
        spec[p + "o_proj"] = _lin(heads * hd, hidden)
        spec[p + "post_attention_layernorm"] = gamma
        spec.update(mlp(p))
    spec["norm"] = gamma
    spec["lm_head"] = _lin(hidden, vocab)
    return spec


def _draw(rng, spec, dtype, seed=0):
    """Draws every weight of `spec` in its order. Linear weights have std 1/sqrt(in), so
    activations stay near unit scale (no fp16 overflow); norm gammas are 1 + small noise;
    embeddings have std 1 so that the token keeps weight in the residual."""
    def draw(r, shape, scale):
        if scale is None:  # a norm's gamma
            return (1.0 + 0.05 * r.standard_normal(shape, dtype=np.float32)).astype(dtype)
        return _normal(r, shape, scale, dtype)
    if sum(math.prod(shape) for shape, _ in spec.values()) <= PARALLEL_DRAWS:
        return {name: draw(rng, *v) for name, v in spec.items()}
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # numpy draws without the GIL
        futures = {name: pool.submit(draw, np.random.default_rng([seed, i]), *v)
                   for i, (name, v) in enumerate(spec.items())}
        return {name: f.result() for name, f in futures.items()}


def _given(weights: dict, spec: dict, dtype) -> dict:
    """The given weights in the spec's order and in `dtype`; ValueError for a missing name,
    an unknown one or a shape unlike the spec's."""
    if set(weights) != set(spec):
        raise ValueError(f"weights must name exactly the decoder's weights: missing "
                         f"{sorted(set(spec) - set(weights))}, unknown {sorted(set(weights) - set(spec))}")
    out = {}
    for name, (shape, _) in spec.items():
        if tuple(weights[name].shape) != tuple(shape):
            raise ValueError(f"weight {name} has shape {list(weights[name].shape)}, the decoder's is {list(shape)}")
        out[name] = np.ascontiguousarray(weights.pop(name), dtype=dtype)
    return out


class _Graph:
    """Collects nodes and small constants; names every output it is not given."""

    def __init__(self):
        self.nodes, self.consts, self.count = [], [], 0

    def name(self, hint="t"):
        self.count += 1
        return f"/{hint}_{self.count}"

    def __call__(self, op, inputs, outputs=None, domain="", **attrs):
        outputs = outputs or [self.name(op)]
        self.nodes.append(helper.make_node(op, list(inputs), outputs, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def const(self, name, value, dtype=np.int64):
        self.consts.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name


def _mlp(g, h, p):
    gate = g("MatMul", [h, p + "gate_proj"])
    silu = g("Mul", [gate, g("Sigmoid", [gate])])
    return g("MatMul", [g("Mul", [silu, g("MatMul", [h, p + "up_proj"])]), p + "down_proj"])


def _gqa_graph(g, layers, heads, kv_heads, eps, mlp=_mlp, window_cache=None):
    """The model builder's graph: the residual runs through SkipSimplifiedLayerNormalization.
    `mlp(g, h, prefix)` builds each layer's feed-forward part (a mixture of experts in moe.py).
    `window_cache`: the even layers attend to that many positions and keep a cache of that
    many (sliding_window_cache), as the builder writes gpt-oss's sliding-window layers."""
    g.const("one", 1)
    g.const("axes_1", [1])
    mask_sum = g("ReduceSum", ["attention_mask", "axes_1"], keepdims=0)
    seqlens_k = g("Cast", [g("Sub", [mask_sum, "one"])], to=TensorProto.INT32)
    total = g("Cast", [g("Gather", [g("Shape", ["attention_mask"]), "one"])], to=TensorProto.INT32)
    x, residual = g("Gather", ["embed_tokens", "input_ids"]), None

    def skip_norm(x, residual, gamma):
        normed, total_sum = g.name("norm"), g.name("residual")
        g("SkipSimplifiedLayerNormalization", [x, residual, gamma], [normed, "", "", total_sum], MS, epsilon=eps)
        return normed, total_sum

    for i in range(layers):
        p = f"layers.{i}."
        if residual is None:
            h = g("SimplifiedLayerNormalization", [x, p + "input_layernorm"], axis=-1, epsilon=eps, stash_type=1)
            residual = x
        else:
            h, residual = skip_norm(x, residual, p + "input_layernorm")
        q, k, v = (g("MatMul", [h, p + n]) for n in ("q_proj", "k_proj", "v_proj"))
        attn = g("GroupQueryAttention",
                 [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k, total,
                  "cos_cache", "sin_cache"],
                 [g.name("attn"), f"present.{i}.key", f"present.{i}.value"], MS,
                 num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0,
                 **(dict(local_window_size=window_cache, sliding_window_cache=1) if window_cache and i % 2 == 0
                    else {}))[0]
        h, residual = skip_norm(g("MatMul", [attn, p + "o_proj"]), residual, p + "post_attention_layernorm")
        x = mlp(g, h, p)
    h = g("SkipSimplifiedLayerNormalization", [x, residual, "norm"], domain=MS, epsilon=eps)
    g("MatMul", [h, "lm_head"], ["logits"])


def _standard_graph(g, layers, hidden, heads, kv_heads, eps, dtype, position_ids=True, sliding_window=None):
    """What torch.onnx exports for a Llama: RMSNorm and softmax computed in float32 (as the
    HF code upcasts them), the rest in the model dtype. Without `position_ids`, the
    rotary rows are the positions counted from the past's length, as HF's code does when
    it is given none. With `sliding_window` (as a Mistral's), a query sees only the keys
    less than that many places before it, counted from the past's length as HF's mask is."""
    hd, low = hidden // heads, np.dtype(dtype) != np.float32
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    if not position_ids:  # unused otherwise, and ORT warns of an unused initializer
        g.const("axes_01", [0, 1])
    for n, v in (("i0", 0), ("i1", 1), ("i2", 2), ("axes_1", [1]), ("axes_2", [2]), ("axes_12", [1, 2]),
                 ("axis_3", [3]), ("half", [hd // 2]), ("full", [hd]), ("zero1", [0]),
                 ("expand_rep", [1, 1, heads // kv_heads, 1, 1]), ("shape_q", [0, 0, heads, hd]),
                 ("shape_kv", [0, 0, kv_heads, hd]), ("shape_rep", [0, heads, -1, hd]), ("shape_out", [0, 0, hidden])):
        g.const(n, v)
    g.const("eps", eps, np.float32)
    g.const("two", 2.0, np.float32)
    g.const("scale", 1.0 / math.sqrt(hd), dtype)
    g.const("bias_open", 0, dtype)
    g.const("bias_masked", np.finfo(dtype).min, dtype)  # exp() of it underflows to exactly 0

    def cast(x, to):
        return g("Cast", [x], to=to) if low else x

    def rms(x, gamma):
        xf = cast(x, TensorProto.FLOAT)
        var = g("ReduceMean", [g("Pow", [xf, "two"])], axes=[-1], keepdims=1)
        normed = g("Div", [xf, g("Sqrt", [g("Add", [var, "eps"])])])
        return g("Mul", [cast(normed, elem), gamma])

    # Mask bias [batch, 1, seq, total]: key j is visible to query i (absolute position past + i)
    # iff j <= past + i and attention_mask[b, j] == 1. Positions are not assumed contiguous.
    past = g("Gather", [g("Shape", ["past_key_values.0.key"]), "i2"])
    seq = g("Gather", [g("Shape", ["input_ids"]), "i1"])
    total = g("Gather", [g("Shape", ["attention_mask"]), "i1"])
    qpos = g("Unsqueeze", [g("Range", [past, g("Add", [past, seq]), "i1"]), "axes_1"])
    keys = g("Range", ["i0", total, "i1"])
    causal = g("LessOrEqual", [keys, qpos])
    if sliding_window:
        g.const("window", sliding_window)
        causal = g("And", [causal, g("Greater", [keys, g("Sub", [qpos, "window"])])])
    padding = g("Unsqueeze", [g("Cast", ["attention_mask"], to=TensorProto.BOOL), "axes_12"])
    bias = g("Where", [g("And", [causal, padding]), "bias_open", "bias_masked"])
    if position_ids:
        cos = g("Unsqueeze", [g("Gather", ["cos_table", "position_ids"]), "axes_1"])  # [batch, 1, seq, hd]
        sin = g("Unsqueeze", [g("Gather", ["sin_table", "position_ids"]), "axes_1"])
    else:
        rows = g("Range", [past, g("Add", [past, seq]), "i1"])  # [seq]
        cos = g("Unsqueeze", [g("Gather", ["cos_table", rows]), "axes_01"])  # [1, 1, seq, hd]
        sin = g("Unsqueeze", [g("Gather", ["sin_table", rows]), "axes_01"])

    def split_heads(x, shape):
        return g("Transpose", [g("Reshape", [x, shape])], perm=[0, 2, 1, 3])

    def rotary(x):  # x * cos + rotate_half(x) * sin
        x1 = g("Slice", [x, "zero1", "half", "axis_3"])
        x2 = g("Slice", [x, "half", "full", "axis_3"])
        rot = g("Concat", [g("Neg", [x2]), x1], axis=-1)
        return g("Add", [g("Mul", [x, cos]), g("Mul", [rot, sin])])

    def repeat_kv(x):  # [b, kvh, t, hd] -> [b, heads, t, hd]
        if heads == kv_heads:
            return x
        return g("Reshape", [g("Expand", [g("Unsqueeze", [x, "axes_2"]), "expand_rep"]), "shape_rep"])

    x = g("Gather", ["embed_tokens", "input_ids"])
    for i in range(layers):
        p = f"layers.{i}."
        h = rms(x, p + "input_layernorm")
        q = rotary(split_heads(g("MatMul", [h, p + "q_proj"]), "shape_q"))
        k = rotary(split_heads(g("MatMul", [h, p + "k_proj"]), "shape_kv"))
        v = split_heads(g("MatMul", [h, p + "v_proj"]), "shape_kv")
        k = g("Concat", [f"past_key_values.{i}.key", k], [f"present.{i}.key"], axis=2)
        v = g("Concat", [f"past_key_values.{i}.value", v], [f"present.{i}.value"], axis=2)
        scores = g("Mul", [g("MatMul", [q, g("Transpose", [repeat_kv(k)], perm=[0, 1, 3, 2])]), "scale"])
        scores = cast(g("Add", [scores, bias]), TensorProto.FLOAT)
        probs = cast(g("Softmax", [scores], axis=-1), elem)
        ctx = g("Transpose", [g("MatMul", [probs, repeat_kv(v)])], perm=[0, 2, 1, 3])
        x = g("Add", [x, g("MatMul", [g("Reshape", [ctx, "shape_out"]), p + "o_proj"])])
        x = g("Add", [x, _mlp(g, rms(x, p + "post_attention_layernorm"), p)])
    g("MatMul", [rms(x, "norm"), "lm_head"], ["logits"])


def decoder_lm(layout: str = "gqa", layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               intermediate: int = 128, vocab: int = 97, max_length: int = 128, dtype=np.float32,
               seed: int = 0, eps: float = 1e-5, rope_theta: float = 10000.0,
               position_ids: bool = True, sliding_window: Optional[int] = None,
               window_cache: Optional[int] = None, weights: Optional[dict] = None) -> onnx.ModelProto:
    """A Llama-shaped decoder (RMSNorm, rotary, grouped-query attention, SiLU MLP) with
    random weights, in layout "gqa" (onnxruntime-genai) or "standard" (Optimum/torch.onnx).
    KV cache tensors are [batch, kv_heads, length, hidden // heads]. `position_ids=False`
    (standard only): no position_ids input; positions count from the past's length.
    `sliding_window` (standard only): each query attends to that many keys at most.
    `window_cache` (gqa only): the even layers attend to that many positions and their
    cache holds that many (GroupQueryAttention's sliding_window_cache).
    `weights`: the model's own weights instead of random ones, {name: array} with the names
    and shapes of the random ones (linear weights [in, out]); the dict is emptied."""
    if layout not in ("gqa", "standard"):
        raise ValueError(f"layout must be 'gqa' or 'standard', not {layout!r}")
    if (not position_ids or sliding_window) and layout != "standard":
        raise ValueError("position_ids=False and sliding_window need the standard layout")
    if window_cache and layout != "gqa":
        raise ValueError("window_cache needs the gqa layout")
    if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise ValueError("hidden must split into heads of even size, and heads into kv_heads groups")
    dtype = np.dtype(dtype)
    elem, hd = helper.np_dtype_to_tensor_dtype(dtype), hidden // heads
    spec = _weight_spec(layers, hidden, heads, kv_heads, vocab, _dense_mlp(hidden, intermediate))
    weights = _draw(np.random.default_rng(seed), spec, dtype, seed) if weights is None else _given(weights, spec, dtype)
    weights.update(_rope_tables(layout, hd, max_length, rope_theta, dtype))

    g = _Graph()
    if layout == "gqa":
        _gqa_graph(g, layers, heads, kv_heads, eps, window_cache=window_cache)
    else:
        _standard_graph(g, layers, hidden, heads, kv_heads, eps, dtype, position_ids, sliding_window)
    return _assemble(g, weights, layout, f"decoder_lm_{layout}", layers, kv_heads, hd, vocab, elem, position_ids)


def _rope_tables(layout, hd, max_length, rope_theta, dtype):
    """The rotary cos/sin tables: [max_length, hd/2] for GroupQueryAttention (gqa), or
    [max_length, hd] for rotate_half (standard)."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    freqs = np.outer(np.arange(max_length, dtype=np.float64), inv_freq)  # [max_length, hd/2]
    if layout == "standard":  # tables [max_length, hd] for rotate_half
        freqs = np.concatenate([freqs, freqs], axis=-1)
    table = "cache" if layout == "gqa" else "table"
    return {f"cos_{table}": np.cos(freqs).astype(dtype), f"sin_{table}": np.sin(freqs).astype(dtype)}


def _assemble(g, weights, layout, name, layers, kv_heads, hd, vocab, elem, position_ids=True):
    """The model of graph `g` with the decoder's inputs and outputs; `weights` are moved
    into it (the dict is emptied)."""
    i64, kv = TensorProto.INT64, ["batch_size", kv_heads, "past_sequence_length", hd]
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", i64, ["batch_size", "total_sequence_length"])]
    if layout == "standard" and position_ids:
        inputs.append(helper.make_tensor_value_info("position_ids", i64, ["batch_size", "sequence_length"]))
    outputs = [helper.make_tensor_value_info("logits", elem, ["batch_size", "sequence_length", vocab])]
    for i in range(layers):
        for part in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{part}", elem, kv))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{part}", elem,
                                                         ["batch_size", kv_heads, "total_sequence_length", hd]))
    model = build_model(g.nodes, inputs, outputs, g.consts, name)
    if layout == "gqa":
        model.opset_import.append(helper.make_opsetid(MS, 1))
    # Initializers go straight into the model, one at a time, so that a large model is held
    # once (make_model would copy a graph built with them).
    for name in list(weights):
        model.graph.initializer.append(numpy_helper.from_array(weights.pop(name), name))
    return model


def genai_config(layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, max_length: int,
                 eos_token_id: int = 2, bos_token_id: int = 1, share_buffer: Optional[bool] = None,
                 layout: str = "gqa", filename: str = "model.onnx") -> dict:
    """genai_config.json for a model made by decoder_lm with the same arguments. The shared
    past/present buffer (share_buffer, default: layout == "gqa") needs the gqa layout."""
    share_buffer = layout == "gqa" if share_buffer is None else share_buffer
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask",
              "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    if layout == "standard":
        inputs["position_ids"] = "position_ids"
    return {
        "model": {
            "bos_token_id": bos_token_id, "context_length": max_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename, "head_size": hidden // heads, "hidden_size": hidden,
                "inputs": inputs,
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
            },
            "eos_token_id": eos_token_id, "pad_token_id": eos_token_id, "type": "llama", "vocab_size": vocab,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": max_length, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": share_buffer, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }


def save_decoder(model: onnx.ModelProto, folder: str, config: Optional[dict] = None,
                 external_data: bool = True) -> str:
    """Writes folder/model.onnx, with every initializer of 1 KiB or more in
    folder/model.onnx.data when external_data (needed past protobuf's 2 GiB), and
    folder/genai_config.json when config is given. `model` is left unchanged. Returns the
    model's path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "model.onnx")
    if not external_data:
        onnx.save(model, path)
    else:
        data_name = "model.onnx.data"
        inits, offset = [], 0
        with open(os.path.join(folder, data_name), "wb") as f:
            for t in model.graph.initializer:
                raw = t.raw_data
                if len(raw) < 1024:
                    inits.append(t)
                    continue
                f.write(b"\0" * (-offset % _ALIGN))
                offset += -offset % _ALIGN
                f.write(raw)
                ref = TensorProto(name=t.name, data_type=t.data_type, dims=list(t.dims))
                ref.data_location = TensorProto.EXTERNAL
                for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(len(raw)))):
                    ref.external_data.add(key=k, value=v)
                inits.append(ref)
                offset += len(raw)
        # A model that shares nodes and opsets with `model` but references the data file.
        graph = helper.make_graph(list(model.graph.node), model.graph.name, list(model.graph.input),
                                  list(model.graph.output), initializer=inits)
        light = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                                  producer_name=model.producer_name)
        onnx.save(light, path)
    if config is not None:
        with open(os.path.join(folder, "genai_config.json"), "w") as f:
            json.dump(config, f, indent=4)
    return path
