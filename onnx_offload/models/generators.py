"""Generators for the test and benchmark models. Nothing large is committed: every
model is built on demand, and big ones stream their weights straight into an external
data file so that they are never held in memory whole.

- ``mlp_stack``: MatMul + Add + Relu layers (chains).
- ``residual_mlp``: layers with skip connections, two outputs, and one weight read by
  two distant layers.
- ``transformer_block``: LayerNorm, multi-head attention, GELU feed-forward, residuals.
- ``decoder_like``: a decode-step stack of LLM-shaped layers (QKV, output projection,
  gated MLP), for models of many gigabytes.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 9


def build_model(nodes, inputs, outputs, initializers, name):
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                             producer_name="onnx-offload-models")


def _tensor(rng, name, shape, dtype=np.float32, scale=None):
    scale = scale if scale is not None else 1.0 / math.sqrt(shape[0])
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(dtype), name)


def mlp_stack(layers: int = 4, hidden: int = 256, batch: Optional[int] = 8, seed: int = 0,
              dtype=np.float32) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [_tensor(rng, f"w{i}", (hidden, hidden), dtype), _tensor(rng, f"b{i}", (hidden,), dtype, 0.1)]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"]),
                  helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"add{i}"])]
        if i + 1 < layers:
            nodes.append(helper.make_node("Relu", [f"add{i}"], [f"h{i}"]))
            x = f"h{i}"
    nodes.append(helper.make_node("Identity", [f"add{layers - 1}"], ["y"]))
    return build_model(nodes, [helper.make_tensor_value_info("x", elem, [batch, hidden])],
                  [helper.make_tensor_value_info("y", elem, [batch, hidden])], inits, "mlp_stack")


def residual_mlp(layers: int = 6, hidden: int = 128, batch: int = 4, seed: int = 1) -> onnx.ModelProto:
    """x -> layers with skips; weight 'shared' is read by the first and the last layer;
    outputs 'y' (the end) and 'mid' (a middle activation)."""
    rng = np.random.default_rng(seed)
    f = TensorProto.FLOAT
    inits = [_tensor(rng, "shared", (hidden, hidden))]
    nodes, x = [], "x"
    for i in range(layers):
        w = "shared" if i in (0, layers - 1) else f"w{i}"
        if w != "shared":
            inits.append(_tensor(rng, w, (hidden, hidden)))
        nodes += [helper.make_node("MatMul", [x, w], [f"m{i}"]),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}"]),
                  helper.make_node("Add", [x, f"t{i}"], [f"r{i}"])]
        x = f"r{i}"
    mid = f"r{layers // 2}"
    nodes += [helper.make_node("Identity", [x], ["y"]), helper.make_node("Identity", [mid], ["mid"])]
    return build_model(nodes, [helper.make_tensor_value_info("x", f, [batch, hidden])],
                  [helper.make_tensor_value_info("y", f, [batch, hidden]),
                   helper.make_tensor_value_info("mid", f, [batch, hidden])], inits, "residual_mlp")


def transformer_block(hidden: int = 256, heads: int = 4, seq: int = 16, batch: int = 2, ffn: int = 1024,
                      blocks: int = 1, seed: int = 2) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    f = TensorProto.FLOAT
    hd = hidden // heads
    inits = [numpy_helper.from_array(np.array([batch, seq, heads, hd], np.int64), "shape_heads"),
             numpy_helper.from_array(np.array([batch, seq, hidden], np.int64), "shape_merge"),
             numpy_helper.from_array(np.array(1.0 / math.sqrt(hd), np.float32), "scale"),
             numpy_helper.from_array(np.array(1.0 / math.sqrt(2.0), np.float32), "inv_sqrt2"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    nodes, x = [], "x"
    for b in range(blocks):
        p = f"b{b}_"
        inits += [numpy_helper.from_array(np.ones(hidden, np.float32), p + "ln1_g"),
                  numpy_helper.from_array(np.zeros(hidden, np.float32), p + "ln1_b"),
                  numpy_helper.from_array(np.ones(hidden, np.float32), p + "ln2_g"),
                  numpy_helper.from_array(np.zeros(hidden, np.float32), p + "ln2_b")]
        for w in ("wq", "wk", "wv", "wo"):
            inits.append(_tensor(rng, p + w, (hidden, hidden)))
        inits += [_tensor(rng, p + "w1", (hidden, ffn)), _tensor(rng, p + "b1", (ffn,), scale=0.02),
                  _tensor(rng, p + "w2", (ffn, hidden))]
        nodes.append(helper.make_node("LayerNormalization", [x, p + "ln1_g", p + "ln1_b"], [p + "ln1"], axis=-1))
        for w in ("q", "k", "v"):
            nodes += [helper.make_node("MatMul", [p + "ln1", p + "w" + w], [p + w]),
                      helper.make_node("Reshape", [p + w, "shape_heads"], [p + w + "_r"]),
                      helper.make_node("Transpose", [p + w + "_r"], [p + w + "_t"],
                                       perm=[0, 2, 3, 1] if w == "k" else [0, 2, 1, 3])]
        nodes += [helper.make_node("MatMul", [p + "q_t", p + "k_t"], [p + "qk"]),
                  helper.make_node("Mul", [p + "qk", "scale"], [p + "qk_s"]),
                  helper.make_node("Softmax", [p + "qk_s"], [p + "attn"], axis=-1),
                  helper.make_node("MatMul", [p + "attn", p + "v_t"], [p + "ctx"]),
                  helper.make_node("Transpose", [p + "ctx"], [p + "ctx_t"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", [p + "ctx_t", "shape_merge"], [p + "ctx_m"]),
                  helper.make_node("MatMul", [p + "ctx_m", p + "wo"], [p + "o"]),
                  helper.make_node("Add", [x, p + "o"], [p + "res1"]),
                  helper.make_node("LayerNormalization", [p + "res1", p + "ln2_g", p + "ln2_b"], [p + "ln2"], axis=-1),
                  helper.make_node("MatMul", [p + "ln2", p + "w1"], [p + "f1"]),
                  helper.make_node("Add", [p + "f1", p + "b1"], [p + "f1b"]),
                  # GELU, exact: 0.5 * x * (1 + erf(x / sqrt(2)))
                  helper.make_node("Mul", [p + "f1b", "inv_sqrt2"], [p + "g0"]),
                  helper.make_node("Erf", [p + "g0"], [p + "g1"]),
                  helper.make_node("Add", [p + "g1", "one"], [p + "g2"]),
                  helper.make_node("Mul", [p + "f1b", p + "g2"], [p + "g3"]),
                  helper.make_node("Mul", [p + "g3", "half"], [p + "gelu"]),
                  helper.make_node("MatMul", [p + "gelu", p + "w2"], [p + "f2"]),
                  helper.make_node("Add", [p + "res1", p + "f2"], [p + "out"])]
        x = p + "out"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    return build_model(nodes, [helper.make_tensor_value_info("x", f, [batch, seq, hidden])],
                  [helper.make_tensor_value_info("y", f, [batch, seq, hidden])], inits, "transformer_block")


def decoder_like(path: str, layers: int = 20, hidden: int = 4096, ffn: int = 11008, batch: int = 1,
                 dtype=np.float16, seed: int = 3) -> str:
    """Writes a decode-step stack to `path` (+ `path`.data) and returns the path.

    Per layer: LayerNorm, Q/K/V projections summed, output projection, residual,
    LayerNorm, gated MLP (SiLU(x W_g) * x W_u) W_d, residual. At the defaults each
    layer holds about 404 MB of fp16 weights: 20 layers make about 8 GB.
    """
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(dt)
    block = (rng.standard_normal(1 << 22) * 0.02).astype(dt)  # tiled into every weight
    data_name = os.path.basename(path) + ".data"
    inits, nodes, x, offset = [], [], "x", 0

    def external(f, name, shape):
        nonlocal offset
        n = int(np.prod(shape))
        start = (offset * 7919) % block.size
        arr = np.resize(np.roll(block, -start), n).astype(dt).reshape(shape)
        f.write(arr.tobytes())
        t = TensorProto(name=name, data_type=elem, dims=list(shape))
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(arr.nbytes))):
            t.external_data.add(key=k, value=v)
        offset += arr.nbytes
        return t

    with open(path + ".data", "wb") as f:
        for i in range(layers):
            p = f"l{i}_"
            for nm, shape in ((p + "wq", (hidden, hidden)), (p + "wk", (hidden, hidden)), (p + "wv", (hidden, hidden)),
                              (p + "wo", (hidden, hidden)), (p + "wg", (hidden, ffn)), (p + "wu", (hidden, ffn)),
                              (p + "wd", (ffn, hidden))):
                inits.append(external(f, nm, shape))
            inits += [numpy_helper.from_array(np.ones(hidden, dt), p + "g1"),
                      numpy_helper.from_array(np.zeros(hidden, dt), p + "b1"),
                      numpy_helper.from_array(np.ones(hidden, dt), p + "g2"),
                      numpy_helper.from_array(np.zeros(hidden, dt), p + "b2")]
            nodes += [helper.make_node("LayerNormalization", [x, p + "g1", p + "b1"], [p + "n1"], axis=-1),
                      helper.make_node("MatMul", [p + "n1", p + "wq"], [p + "q"]),
                      helper.make_node("MatMul", [p + "n1", p + "wk"], [p + "k"]),
                      helper.make_node("MatMul", [p + "n1", p + "wv"], [p + "v"]),
                      helper.make_node("Add", [p + "q", p + "k"], [p + "qk"]),
                      helper.make_node("Add", [p + "qk", p + "v"], [p + "qkv"]),
                      helper.make_node("MatMul", [p + "qkv", p + "wo"], [p + "o"]),
                      helper.make_node("Add", [x, p + "o"], [p + "r1"]),
                      helper.make_node("LayerNormalization", [p + "r1", p + "g2", p + "b2"], [p + "n2"], axis=-1),
                      helper.make_node("MatMul", [p + "n2", p + "wg"], [p + "gate"]),
                      helper.make_node("Sigmoid", [p + "gate"], [p + "sg"]),
                      helper.make_node("Mul", [p + "gate", p + "sg"], [p + "silu"]),
                      helper.make_node("MatMul", [p + "n2", p + "wu"], [p + "up"]),
                      helper.make_node("Mul", [p + "silu", p + "up"], [p + "act"]),
                      helper.make_node("MatMul", [p + "act", p + "wd"], [p + "down"]),
                      helper.make_node("Add", [p + "r1", p + "down"], [p + "r2"])]
            x = p + "r2"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    model = build_model(nodes, [helper.make_tensor_value_info("x", elem, [batch, hidden])],
                   [helper.make_tensor_value_info("y", elem, [batch, hidden])], inits, "decoder_like")
    onnx.save(model, path)
    return path


def save(model: onnx.ModelProto, path: str) -> str:
    onnx.save(model, path)
    return path


def weight_bytes(model: onnx.ModelProto, min_bytes: int = 4096) -> int:
    """Bytes of the initializers that onnx-offload treats as weights."""
    total = 0
    for t in model.graph.initializer:
        n = int(np.prod(t.dims, dtype=np.int64)) * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        if n >= min_bytes:
            total += n
    return total
