"""The graph rewrite that lets the host's cores compute some MatMuls.

A MatMul whose weight the host computes is cut out of ORT's graph: its input X becomes a
graph output (the engine binds it to a buffer of its own and copies it to the host), and its
output Y becomes a graph input (bound to a buffer the host's result is copied into). The
weights it read leave the graph's initializers, so ORT never uploads them.

ORT must still run Y's consumers after X exists, so the rewrite keeps a data dependency on
X that is exact for every value:

    Y = Where(IsNaN(Slice(X, last axis, [0:1])), Y_in, Y_in)

Both branches are Y_in, so whatever X holds, Y is Y_in selected element by element (the
CUDA kernel is a select: NaN payloads and signed zeros pass unchanged; ORT's CPU kernel adds
the two selections, so there a -0 in Y becomes +0 where X's first element is NaN). The condition is
[..., 1] and broadcasts over Y's last axis. Why these ops: in ORT's CUDA EP, Slice takes
every type, IsNaN takes float16, bfloat16 and float (opset 13+; float16 and float from 9),
and Where takes float16 and float (opset 9+) and bfloat16 (opset 16+), so the three run on
the device with no CPU fallback. Arithmetic alternatives (Y_in + 0 * X) are not exact:
0 * inf is NaN, and -0 + 0 is +0. The Where is the kernel that first reads Y_in: the
engine's host-to-device copy of Y goes before it.

MatMuls that read one X (q/k/v, gate/up) share one X output and one condition.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import HostComputeRefused
from .graphs import node_inputs

DENSE_TYPES = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16", TensorProto.FLOAT: "float32"}
MS_DOMAIN = "com.microsoft"


@dataclasses.dataclass(frozen=True)
class HostMatMul:
    """One MatMul the host computes: y[..., n] = sum_k x[..., k] * W[k, n].

    ``kind`` is the weight's element type for a dense MatMul ("float16", "bfloat16",
    "float32"), or "int4" for MatMulNBits (bits 4, ``block_size``). ``weights`` are B, then
    for int4 the scales and, when the node has them, the zero points. ``x_output`` is the
    graph output that carries X, ``y_input`` the graph input the result goes into,
    ``output`` the node's original output (now the Where's). ``y_shape`` is X's shape with
    the last dim N (a str for a symbolic dim, None for an unknown one)."""

    node: str
    weights: Tuple[str, ...]
    kind: str
    k: int
    n: int
    block_size: int
    x_output: str
    y_input: str
    output: str
    y_dtype: np.dtype
    y_shape: Tuple
    weight_bytes: int

    @property
    def zero_points(self) -> Optional[str]:
        return self.weights[2] if self.kind == "int4" and len(self.weights) > 2 else None


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _nbytes(t: TensorProto) -> int:
    count = int(np.prod([int(d) for d in t.dims], dtype=np.int64))
    return count * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


def _target(node, inits: Dict[str, TensorProto]) -> Tuple[Optional[dict], str]:
    """(the node's host description, "") when the host can compute it, else (None, why)."""
    if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
        w = inits.get(node.input[1]) if len(node.input) == 2 else None
        if w is None or len(w.dims) != 2 or w.data_type not in DENSE_TYPES:
            return None, "a MatMul reads it, but not as a 2-D float16, bfloat16 or float32 weight B"
        if node.input[0] in inits:
            return None, "its MatMul's input A is an initializer too"
        return {"weights": (w.name,), "kind": DENSE_TYPES[w.data_type], "k": int(w.dims[0]), "n": int(w.dims[1]),
                "block_size": 0, "y_type": w.data_type}, ""
    if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN:
        ins = list(node.input) + [""] * (6 - len(node.input))
        if int(_attr(node, "bits", 4)) != 4:
            return None, f"its MatMulNBits has bits={_attr(node, 'bits', 4)}; the host computes 4 bits only"
        if ins[4] or ins[5]:
            return None, "its MatMulNBits has a g_idx or bias input, which the host kernel does not take"
        if ins[1] not in inits or ins[2] not in inits or (ins[3] and ins[3] not in inits):
            return None, "its MatMulNBits's B, scales or zero points are not all initializers"
        if ins[3] and inits[ins[3]].data_type != TensorProto.UINT8:
            return None, "its MatMulNBits's zero points are not packed uint8"
        if ins[0] in inits:
            return None, "its MatMulNBits's input A is an initializer too"
        names = tuple(n for n in ins[1:4] if n)
        scales = inits[ins[2]]
        return {"weights": names, "kind": "int4", "k": int(_attr(node, "K", 0)), "n": int(_attr(node, "N", 0)),
                "block_size": int(_attr(node, "block_size", 0)), "y_type": scales.data_type}, ""
    return None, f"a {node.op_type} node ({node.name or node.output[0]!r}) reads it"


def _shapes(model: onnx.ModelProto) -> Dict[str, onnx.TypeProto]:
    """The types shape inference knows, by value name (the weights' data is not read):
    onnxruntime's symbolic inference, which knows its contrib ops (GroupQueryAttention,
    SimplifiedLayerNormalization, ...) and keeps symbolic dims, else onnx's."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    try:
        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
    except Exception:  # a model it cannot follow: onnx's inference, which skips what it does not know
        inferred = None
    if inferred is None:
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:  # without inference, the shapes the model declares
            inferred = model
    g = inferred.graph
    return {v.name: v.type for v in list(g.value_info) + list(g.input) + list(g.output)
            if v.type.tensor_type.HasField("shape")}


def _dims(x_type: Optional[onnx.TypeProto]) -> Optional[list]:
    """A value's dims (int, str for a symbolic one, None for an unknown one), or None where
    its rank is unknown."""
    if x_type is None or not x_type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in x_type.tensor_type.shape.dim]


def _index(g: onnx.GraphProto) -> tuple:
    """(initializers by name, {value: indices of the nodes that read it}, graph outputs)."""
    readers: Dict[str, list] = {}
    for i, node in enumerate(g.node):
        for name in dict.fromkeys(node_inputs(node)):
            readers.setdefault(name, []).append(i)
    return {t.name: t for t in g.initializer}, readers, {o.name for o in g.output}


def _choose(g: onnx.GraphProto, names: Sequence[str], index: tuple) -> Tuple[Dict[int, dict], Dict[str, str]]:
    """({node index: its host description} for the nodes that read `names`, {name: why the
    host cannot take it})."""
    inits, readers, outputs = index
    refused, chosen = {}, {}
    for name in names:
        if name not in inits:
            refused[name] = "it is not an initializer of the main graph"
            continue
        if name in outputs:
            refused[name] = "it is a graph output"
            continue
        if not readers.get(name):
            refused[name] = "no node reads it"
            continue
        for i in readers[name]:
            found, why = _target(g.node[i], inits)
            if found is None:
                refused[name] = why
                break
            chosen[i] = found
    # Every weight a chosen node drops must be read by chosen nodes only.
    for i, found in list(chosen.items()):
        for w in found["weights"]:
            others = [j for j in readers[w] if j not in chosen]
            if others:
                refused.setdefault(w, f"it is read by {g.node[i].name or g.node[i].output[0]!r}, which the host "
                                      f"would compute, and by {g.node[others[0]].name or g.node[others[0]].output[0]!r}")
    return chosen, refused


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _opset_allows(opset: int, found: dict) -> str:
    """Why the model's opset rules the node out, or ""."""
    if opset < 9:
        return f"the model's opset is {opset}; host compute needs opset 9 or later (Where, IsNaN)"
    if opset < 16 and found["y_type"] == TensorProto.BFLOAT16:
        return (f"the model's opset is {opset}; a bfloat16 host MatMul needs opset 16 or later "
                "(ORT's CUDA Where takes bfloat16 from opset 16)")
    return ""


def host_candidates(model: onnx.ModelProto) -> Dict[str, Tuple[str, str]]:
    """{weight name: (the MatMul that reads it, its kind)} for every weight that
    rewrite_for_host takes; the weights of one MatMul name the same MatMul (the split
    planner's StepWeight.matmul and .kind)."""
    g = model.graph
    opset, types, index = _opset(model), None, _index(model.graph)
    found_for: Dict[str, Tuple[str, str]] = {}
    for node in g.node:
        if node.op_type not in ("MatMul", "MatMulNBits") or len(node.input) < 2 or node.input[1] in found_for:
            continue
        chosen, refused = _choose(g, [node.input[1]], index)
        if refused or not chosen or any(_opset_allows(opset, f) for f in chosen.values()):
            continue
        types = _shapes(model) if types is None else types
        first = min(chosen)
        if not all(_dims(types.get(g.node[i].input[0])) for i in chosen):
            continue
        label = g.node[first].name or g.node[first].output[0]
        for f in chosen.values():
            for w in f["weights"]:
                found_for[w] = (label, f["kind"])
    return found_for


def rewrite_for_host(model: onnx.ModelProto, names: Iterable[str]) -> Tuple[onnx.ModelProto, List[HostMatMul]]:
    """A copy of `model` in which the MatMuls that read the weights `names` are computed by
    the host (see the module's docstring), and their descriptions in graph order. Every
    MatMul that reads a named weight is taken, with all the weights it reads (B, scales,
    zero points). A name no MatMul of those kinds reads, or that another node also reads,
    raises HostComputeRefused naming it. External data is neither read nor changed."""
    chosen, refused = _choose(model.graph, list(dict.fromkeys(names)), _index(model.graph))
    if refused:
        raise HostComputeRefused("the host cannot compute these weights: " +
                                 "; ".join(f"{n!r}: {why}" for n, why in refused.items()), refused)
    opset = _opset(model)
    why = next((w for w in (_opset_allows(opset, f) for f in chosen.values()) if w), "")
    if why:
        raise HostComputeRefused(why, [w for f in chosen.values() for w in f["weights"]])
    out = onnx.ModelProto()
    out.CopyFrom(model)
    hosts = _rewrite(out, chosen, _shapes(model) if chosen else {}, opset)
    return out, hosts


class _Names:
    """Fresh value names that collide with none of the graph's."""

    def __init__(self, g: onnx.GraphProto):
        self.used = {t.name for t in g.initializer} | {v.name for v in list(g.input) + list(g.output)}
        for node in g.node:
            self.used.update(node.input)
            self.used.update(node.output)

    def __call__(self, base: str) -> str:
        name, i = base, 1
        while name in self.used:
            name, i = f"{base}_{i}", i + 1
        self.used.add(name)
        return name


def _rewrite(model: onnx.ModelProto, chosen: Dict[int, dict], types: Dict[str, onnx.TypeProto],
             opset: int) -> List[HostMatMul]:
    g = model.graph
    fresh = _Names(g)
    sizes = {t.name: _nbytes(t) for t in g.initializer}
    slice_inputs: Sequence[str] = ()
    if chosen and opset >= 10:
        starts, ends, axes = fresh("host_compute_slice_starts"), fresh("host_compute_slice_ends"), fresh("host_compute_slice_axes")
        g.initializer.extend([helper.make_tensor(starts, TensorProto.INT64, [1], [0]),
                              helper.make_tensor(ends, TensorProto.INT64, [1], [1]),
                              helper.make_tensor(axes, TensorProto.INT64, [1], [-1])])
        slice_inputs = (starts, ends, axes)
    graph_outputs = {o.name for o in g.output}
    conditions: Dict[str, str] = {}  # X -> its IsNaN output
    hosts, nodes = [], []
    for i, node in enumerate(g.node):
        if i not in chosen:
            nodes.append(node)
            continue
        found, x, y = chosen[i], node.input[0], node.output[0]
        label = node.name or y
        x_dims = _dims(types.get(x))
        if not x_dims:
            raise HostComputeRefused(f"the host cannot compute {label!r} (weights {', '.join(found['weights'])}): "
                                     f"shape inference does not give the rank of its input {x!r}", found["weights"])
        if x not in conditions:
            sliced, cond = fresh(f"{x}/host_first"), fresh(f"{x}/host_isnan")
            if slice_inputs:
                nodes.append(helper.make_node("Slice", [x, *slice_inputs], [sliced], name=fresh(f"{label}/host_slice")))
            else:  # opset 9: Slice's ranges are attributes
                nodes.append(helper.make_node("Slice", [x], [sliced], name=fresh(f"{label}/host_slice"),
                                              starts=[0], ends=[1], axes=[-1]))
            nodes.append(helper.make_node("IsNaN", [sliced], [cond], name=fresh(f"{label}/host_isnan")))
            conditions[x] = cond
            if x not in graph_outputs:
                g.output.append(helper.make_tensor_value_info(x, found["y_type"], x_dims))
                graph_outputs.add(x)
        y_input = fresh(f"{y}/host_in")
        y_shape = tuple(x_dims[:-1]) + (found["n"],)
        g.input.append(helper.make_tensor_value_info(y_input, found["y_type"], list(y_shape)))
        nodes.append(helper.make_node("Where", [conditions[x], y_input, y_input], [y], name=fresh(f"{label}/host_where")))
        hosts.append(HostMatMul(node=label, weights=found["weights"], kind=found["kind"], k=found["k"], n=found["n"],
                                block_size=found["block_size"], x_output=x, y_input=y_input, output=y,
                                y_dtype=np.dtype(helper.tensor_dtype_to_np_dtype(found["y_type"])), y_shape=y_shape,
                                weight_bytes=sum(sizes[w] for w in found["weights"])))
    del g.node[:]
    g.node.extend(nodes)
    dropped = {w for h in hosts for w in h.weights}
    keep = [t for t in g.initializer if t.name not in dropped]
    del g.initializer[:]
    g.initializer.extend(keep)
    for field in (g.input, g.value_info):  # an initializer may also be declared (IR < 4 lists them as inputs)
        kept = [v for v in field if v.name not in dropped]
        del field[:]
        field.extend(kept)
    return hosts
