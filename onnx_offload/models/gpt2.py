"""A GPT-2-shaped decoder with random weights, laid out as torch.onnx and Optimum export
transformers' GPT2LMHeadModel (standard ONNX ops; inputs input_ids, attention_mask,
position_ids and past_key_values.N.key/value; outputs logits and present.N.key/value).

What sets it apart from ``decoder.decoder_lm("standard")``: learned position embeddings,
LayerNorm with biases, one fused QKV projection split three ways, a tanh GELU, biases on
every projection, and the attention mask built once under ``/transformer`` the way
transformers builds it: a causal block and the padding mask, each expanded to
``[batch, 1, seq, total]``, their batch and length read from the shape of the token
embeddings. That shape comes from a weight (the embedding Gather), so the mask is no
value a segment can compute again from the graph's inputs: it crosses every cut, and its
size changes between the prompt and each decode step.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class _Graph:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.count = [], [], 0

    def const(self, name, value, dtype=np.int64):
        self.inits.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def weight(self, name, shape, scale):
        self.inits.append(numpy_helper.from_array((self.rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def __call__(self, op, inputs, scope="/transformer", outputs=None, **attrs):
        """A node named as torch.onnx names it (scope/Op_N), its outputs scope/Op_N_output_k."""
        self.count += 1
        name = f"{scope}/{op}_{self.count}"
        outputs = outputs or [f"{name}_output_0"]
        self.nodes.append(helper.make_node(op, list(inputs), outputs, name=name, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs


def _mask(g: _Graph, embeds: str) -> str:
    """transformers' 4-d mask [batch, 1, seq, past + seq]: 0 where a query sees a key,
    the float minimum elsewhere (a key after the query, or padding)."""
    low = np.finfo(np.float32).min
    shape = g("Shape", [embeds])
    batch, seq = (g("Unsqueeze", [g("Gather", [shape, i]), "axes_0"]) for i in ("i0", "i1"))
    past = g("Unsqueeze", [g("Gather", [g("Shape", ["past_key_values.0.key"]), "i2"]), "axes_0"])
    total = g("Add", [seq, past])
    full = g("ConstantOfShape", [g("Concat", [seq, seq], axis=0)],
             value=numpy_helper.from_array(np.array([low], np.float32)))
    cols = g("Range", ["i0", g("Squeeze", [seq, "axes_0"]), "i1"])
    rows = g("Reshape", [g("Add", [cols, "i1"]), g("Concat", [seq, "one_1"], axis=0)])
    causal = g("Where", [g("Less", [cols, rows]), "zero_f", full])
    before = g("ConstantOfShape", [g("Concat", [seq, past], axis=0)],
               value=numpy_helper.from_array(np.array([0.0], np.float32)))
    causal = g("Concat", [before, causal], axis=-1)
    shape4 = g("Concat", [batch, "one_1", seq, total], axis=0)
    causal = g("Expand", [g("Unsqueeze", [causal, "axes_01"]), shape4])
    padding = g("Cast", [g("Expand", [g("Unsqueeze", ["attention_mask", "axes_12"]), shape4])], to=TensorProto.FLOAT)
    inverted = g("Sub", ["one_f", padding])
    padding = g("Where", [g("Cast", [inverted], to=TensorProto.BOOL), "low_f", inverted])
    return g("Where", [g("Cast", [padding], to=TensorProto.BOOL), "low_f", causal])


def gpt2_lm(layers: int = 4, hidden: int = 64, heads: int = 4, vocab: int = 97, positions: int = 128,
            seed: int = 0) -> onnx.ModelProto:
    """A GPT-2-shaped decoder (see the module's docstring); KV cache tensors are
    [batch, heads, length, hidden // heads]."""
    if hidden % heads:
        raise ValueError("hidden must split into heads")
    hd = hidden // heads
    g = _Graph(seed)
    for name, value in (("i0", 0), ("i1", 1), ("i2", 2), ("axes_0", [0]), ("axes_01", [0, 1]), ("axes_12", [1, 2]),
                        ("one_1", [1]), ("split_qkv", [hidden] * 3), ("shape_heads", [0, 0, heads, hd]),
                        ("shape_out", [0, 0, hidden])):
        g.const(name, value)
    for name, value in (("one_f", 1.0), ("zero_f", 0.0), ("low_f", np.finfo(np.float32).min),
                        ("scale", 1.0 / math.sqrt(hd)), ("half", 0.5), ("cube", 3.0), ("gelu_c", 0.044715),
                        ("gelu_s", math.sqrt(2.0 / math.pi))):
        g.const(name, value, np.float32)
    embeds = g("Gather", [g.weight("transformer.wte.weight", (vocab, hidden), 1.0), "input_ids"])
    mask = _mask(g, embeds)
    x = g("Add", [embeds, g("Gather", [g.weight("transformer.wpe.weight", (positions, hidden), 0.1), "position_ids"])])

    def norm(x, p, s):
        gamma, beta = g.weight(p + ".weight", (hidden,), 0.05), g.weight(p + ".bias", (hidden,), 0.05)
        return g("LayerNormalization", [x, gamma, beta], s, axis=-1, epsilon=1e-5)

    def linear(x, p, n_in, n_out, s):
        w = g.weight(p + ".weight", (n_in, n_out), 1.0 / math.sqrt(n_in))
        return g("Add", [g("MatMul", [x, w], s), g.weight(p + ".bias", (n_out,), 0.02)], s)

    for i in range(layers):
        s, p = f"/transformer/h.{i}", f"transformer.h.{i}"
        qkv = linear(norm(x, p + ".ln_1", s), p + ".attn.c_attn", hidden, 3 * hidden, s)
        q, k, v = (g("Transpose", [g("Reshape", [t, "shape_heads"], s)], s, perm=[0, 2, 1, 3])
                   for t in g("Split", [qkv, "split_qkv"], s, outputs=[f"{s}/attn/{n}" for n in "qkv"], axis=2))
        k = g("Concat", [f"past_key_values.{i}.key", k], s, outputs=[f"present.{i}.key"], axis=2)
        v = g("Concat", [f"past_key_values.{i}.value", v], s, outputs=[f"present.{i}.value"], axis=2)
        scores = g("Mul", [g("MatMul", [q, g("Transpose", [k], s, perm=[0, 1, 3, 2])], s), "scale"], s)
        probs = g("Softmax", [g("Add", [scores, mask], s)], s, axis=-1)
        ctx = g("Reshape", [g("Transpose", [g("MatMul", [probs, v], s)], s, perm=[0, 2, 1, 3]), "shape_out"], s)
        x = g("Add", [x, linear(ctx, p + ".attn.c_proj", hidden, hidden, s)], s)
        f = linear(norm(x, p + ".ln_2", s), p + ".mlp.c_fc", hidden, 4 * hidden, s)
        # gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        inner = g("Mul", [g("Add", [f, g("Mul", [g("Pow", [f, "cube"], s), "gelu_c"], s)], s), "gelu_s"], s)
        f = g("Mul", [g("Mul", [f, "half"], s), g("Add", [g("Tanh", [inner], s), "one_f"], s)], s)
        x = g("Add", [x, linear(f, p + ".mlp.c_proj", 4 * hidden, hidden, s)], s)
    h = norm(x, "transformer.ln_f", "/transformer/ln_f")
    g("MatMul", [h, g.weight("lm_head.weight", (hidden, vocab), 1.0 / math.sqrt(hidden))], "/lm_head",
      outputs=["logits"])
    i64, f32 = TensorProto.INT64, TensorProto.FLOAT
    total = "past_sequence_length + sequence_length"
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", i64, ["batch_size", total]),
              helper.make_tensor_value_info("position_ids", i64, ["batch_size", "sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch_size", "sequence_length", vocab])]
    for i in range(layers):
        for part in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{part}", f32,
                                                        ["batch_size", heads, "past_sequence_length", hd]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{part}", f32, ["batch_size", heads, total, hd]))
    graph = helper.make_graph(g.nodes, "main_graph", inputs, outputs, initializer=g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8,
                             producer_name="pytorch")
