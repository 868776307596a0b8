"""int4 weights as onnxruntime-genai's builder writes them: MatMulNBits (4 bits, blocks
along K, a float scale per block, symmetric), from a model's float MatMul weights."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def quantize_block(w: np.ndarray, block_size: int) -> tuple:
    """(B, scales) of MatMulNBits for a [K, N] weight: B [N, K / block, block / 2] uint8,
    two 4-bit values a byte (the first in the low nibble), zero point 8; scales
    [N * K / block] of w's type."""
    k, n = w.shape
    blocks = w.T.reshape(n, k // block_size, block_size).astype(np.float32)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / 7
    scale[scale == 0] = 1
    q = np.clip(np.rint(blocks / scale) + 8, 0, 15).astype(np.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed, scale.reshape(-1).astype(w.dtype)


def int4(model: onnx.ModelProto, block_size: int = 32, accuracy_level: int = 4) -> onnx.ModelProto:
    """A copy of `model` with every MatMul by a 2-D float initializer whose K is a multiple
    of `block_size` as MatMulNBits (accuracy_level 4: int8 compute on the CPU, as the
    builder's int4 models ask for)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # (a round trip through bytes refuses models over 2 GiB)
    model = copy
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers = {}
    for node in g.node:
        for i in node.input:
            readers[i] = readers.get(i, 0) + 1
    nodes = []
    for node in g.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or len(w.dims) != 2 or readers[w.name] != 1 or w.dims[0] % block_size or \
                w.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            nodes.append(node)
            continue
        k, n = w.dims
        packed, scales = quantize_block(numpy_helper.to_array(w), block_size)
        g.initializer.remove(w)
        g.initializer.extend([numpy_helper.from_array(packed, w.name + "_Q4"),
                              numpy_helper.from_array(scales, w.name + "_scales")])
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], w.name + "_Q4", w.name + "_scales"],
                                      list(node.output), name=node.name or w.name + "_MatMulNBits",
                                      domain="com.microsoft", K=k, N=n, bits=4, block_size=block_size,
                                      accuracy_level=accuracy_level))
    del g.node[:]
    g.node.extend(nodes)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model
