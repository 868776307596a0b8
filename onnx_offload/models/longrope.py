"""A decoder whose rotary tables depend on the sequence's total length, as onnxruntime-genai's
builder writes Phi-3 and Phi-3.5 (LongRoPE, the ``su`` scaling of their config.json).

The builder keeps two pairs of tables: ``cos_cache_small``/``sin_cache_small`` of
``original`` positions with the short factors, and ``cos_cache_large``/``sin_cache_large`` of
``max_length`` positions with the long factors and their magnitude scale. An ``If`` picks
one pair from "the attention mask's length > original", each branch a pair of ``Constant``
nodes; GroupQueryAttention reads the chosen pair. One step over a whole prompt longer than
``original`` therefore rotates every position with the long factors, where a first step of
``original`` tokens or fewer rotates them with the short ones.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .decoder import decoder_lm


def _tables(layout: str, hd: int, rows: int, theta: float, factors: np.ndarray, scale: float, dtype) -> tuple:
    inv_freq = 1.0 / (factors * theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    freqs = np.outer(np.arange(rows, dtype=np.float64), inv_freq)  # [rows, hd/2]
    if layout == "standard":  # [rows, hd] for rotate_half
        freqs = np.concatenate([freqs, freqs], axis=-1)
    return (np.cos(freqs) * scale).astype(dtype), (np.sin(freqs) * scale).astype(dtype)


def _branch(name: str, table: str, cos: np.ndarray, sin: np.ndarray) -> onnx.GraphProto:
    elem = helper.np_dtype_to_tensor_dtype(cos.dtype)
    nodes = [helper.make_node("Constant", [], [f"{k}_{table}_{name}"], name=f"/{name}/{k}_{table}/Constant",
                              value=numpy_helper.from_array(t, f"{k}_{table}_{name}_value"))
             for k, t in (("cos", cos), ("sin", sin))]
    outputs = [helper.make_tensor_value_info(f"{k}_{table}_{name}", elem, list(cos.shape)) for k in ("cos", "sin")]
    return helper.make_graph(nodes, f"{name}_rotemb_caches_graph", [], outputs)


def longrope_lm(layout: str = "gqa", original: int = 16, max_length: int = 64, rope_theta: float = 10000.0,
                hidden: int = 64, heads: int = 4, dtype=np.float32, **kw) -> onnx.ModelProto:
    """decoder_lm(layout) with LongRoPE tables: short factors up to `original` positions,
    long ones (and their magnitude scale) past it, picked by an If on the attention mask's
    length, as the builder writes them ("gqa"); "standard" picks the tables that
    position_ids index the same way. Other arguments as decoder_lm's."""
    if not 0 < original < max_length:
        raise ValueError("original must be positive and shorter than max_length")
    model = decoder_lm(layout, max_length=max_length, rope_theta=rope_theta, hidden=hidden, heads=heads,
                       dtype=dtype, **kw)
    table = "cache" if layout == "gqa" else "table"
    hd = hidden // heads
    rng = np.random.default_rng(7)
    short = 1.0 + 0.2 * rng.random(hd // 2)
    long = np.linspace(1.0, 8.0, hd // 2)
    scale = math.sqrt(1 + math.log(max_length / original) / math.log(original))
    graph = model.graph
    for i in reversed(range(len(graph.initializer))):  # decoder_lm's one pair of tables goes
        if graph.initializer[i].name in (f"cos_{table}", f"sin_{table}"):
            del graph.initializer[i]
    graph.initializer.append(numpy_helper.from_array(np.array(original, np.int64), "original_context_length"))
    graph.initializer.append(numpy_helper.from_array(np.array(1, np.int64), "mask_length_axis"))
    nodes = [
        helper.make_node("Shape", ["attention_mask"], ["/rotemb/Shape"], name="/rotemb/Shape"),
        helper.make_node("Gather", ["/rotemb/Shape", "mask_length_axis"], ["/rotemb/Gather"], name="/rotemb/Gather",
                         axis=0),
        helper.make_node("Greater", ["/rotemb/Gather", "original_context_length"], ["/rotemb/Greater"],
                         name="/rotemb/Greater"),
        helper.make_node("If", ["/rotemb/Greater"], [f"cos_{table}", f"sin_{table}"], name="/rotemb/If",
                         then_branch=_branch("large", table,
                                             *_tables(layout, hd, max_length, rope_theta, long, scale, dtype)),
                         else_branch=_branch("small", table,
                                             *_tables(layout, hd, original, rope_theta, short, 1.0, dtype))),
    ]
    for n in reversed(nodes):
        graph.node.insert(0, n)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    width = hd // 2 if layout == "gqa" else hd
    graph.value_info.extend(helper.make_tensor_value_info(f"{k}_{table}", elem, ["max_sequence_length", width])
                            for k in ("cos", "sin"))
    model.graph.name = f"longrope_lm_{layout}"
    return model
