"""Splits a graph, in topological order, into contiguous segments whose weights fit a
target, and computes the boundary tensors between them.

Each segment becomes a model of its own: its nodes, the small initializers they read,
the weights they read (as declarations; the data arrives through slots), the boundary
values it consumes as inputs, and the values later segments or the caller need as
outputs. Running the segments in order gives the outputs of the unsplit model.

Values that a few cheap shape and mask ops compute from the graph inputs alone (a
decoder's ``seqlens_k`` and ``total_sequence_length`` from its attention mask, a
position range) are recomputed inside each segment that reads them instead of crossing
a boundary. ORT keeps such values on the CPU; passed between sessions they would go
through device memory and back inside a step, which a captured graph cannot hold.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import AbstractSet, Callable, Dict, List, Optional, Sequence

import onnx
from onnx import helper

from ..errors import UnsupportedModel
from .graphs import node_inputs

# Ops cheap enough to run again in every segment that needs their result, when all
# their inputs come from the graph inputs or small constants.
RECOMPUTED_OPS = frozenset({
    "Shape", "Size", "Gather", "Cast", "ReduceSum", "Sub", "Add", "Mul", "Div", "Neg", "Unsqueeze", "Squeeze",
    "Concat", "Slice", "Constant", "ConstantOfShape", "Range", "Equal", "Less", "LessOrEqual", "Greater",
    "GreaterOrEqual", "Where", "Not", "And", "Or", "CumSum", "Identity", "Min", "Max", "Reshape", "Expand", "Trilu"})


def recomputed_values(model: onnx.ModelProto, is_weight: Callable[[str], bool]) -> AbstractSet[str]:
    """The values each segment that reads them computes again (see _recomputable): they
    never cross a boundary."""
    return set(_recomputable(model.graph, is_weight, {t.name: t for t in model.graph.initializer}))


def _recomputable(graph, is_weight: Callable[[str], bool], initializers) -> Dict[str, int]:
    """value -> index of the node that makes it, for values that RECOMPUTED_OPS compute
    from graph inputs and non-weight constants alone."""
    graph_inputs = {v.name for v in graph.input}
    out: Dict[str, int] = {}
    for i, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in RECOMPUTED_OPS:
            continue
        if all(not n or n in out or (n in graph_inputs and not is_weight(n))
               or (n in initializers and not is_weight(n)) for n in node.input):
            for o in node.output:
                if o:
                    out[o] = i
    return out


@dataclasses.dataclass
class Segment:
    index: int
    node_indices: List[int]
    weights: List[str]  # weights its nodes read, in first-use order
    inputs: List[str]   # values it consumes from the caller or earlier segments
    outputs: List[str]  # values it produces for later segments or the caller
    model: onnx.ModelProto = None


def plan_segments(model: onnx.ModelProto, weight_cost: Callable[[Sequence[str]], int],
                  is_weight: Callable[[str], bool], target: int, cuts: AbstractSet[int] = frozenset(),
                  hard: AbstractSet[int] = frozenset()) -> List[List[int]]:
    """Groups consecutive nodes so that each group's weights cost at most `target`, and
    so that each node of `cuts` starts a group where the group before it reads a weight,
    and each node of `hard` starts one wherever it is not the first node.

    `weight_cost(names)` is the committed cost of a set of weights. A node whose own
    weights exceed the target gets a segment to itself. Nodes before the first weight
    join the first segment that reads one: alone, they could be only cheap values that
    the next segment computes again (a Cast of an input), leaving a segment with no
    outputs, which ORT refuses to run.
    """
    groups: List[List[int]] = []
    current: List[int] = []
    current_weights: List[str] = []
    seen = set()
    for i, node in enumerate(model.graph.node):
        mine = [n for n in dict.fromkeys(node_inputs(node)) if is_weight(n)]
        new = [n for n in mine if n not in seen]
        if (current and i in hard) or (current_weights and ((new and weight_cost(current_weights + new) > target)
                                                            or i in cuts)):
            groups.append(current)
            current, current_weights, seen = [], [], set()
            new = mine
        current.append(i)
        current_weights.extend(new)
        seen.update(new)
    if current:
        groups.append(current)
    return groups


def segment_weights(model: onnx.ModelProto, group: Sequence[int], is_weight: Callable[[str], bool]) -> List[str]:
    """The weights a group of nodes reads, in first-use order."""
    read = dict.fromkeys(n for i in group for n in node_inputs(model.graph.node[i]))
    return [n for n in read if is_weight(n)]


def _symbolic_shape_infer():
    """ORT's onnxruntime/tools/symbolic_shape_infer.py (numpy, onnx, sympy and packaging are
    all it imports), loaded from its file: importing it as onnxruntime.tools.symbolic_shape_infer
    runs onnxruntime/tools/__init__.py, which imports torch wherever torch is installed (seconds,
    and gigabytes of address space, for nothing the package uses)."""
    name = "onnxruntime.tools.symbolic_shape_infer"
    if name in sys.modules:
        return sys.modules[name]
    own = "onnx_offload._symbolic_shape_infer"
    if own not in sys.modules:
        import importlib.util
        import onnxruntime
        path = os.path.join(os.path.dirname(onnxruntime.__file__), "tools", "symbolic_shape_infer.py")
        if not os.path.isfile(path):
            raise ImportError(f"onnxruntime's symbolic shape inference is missing ({path}): reinstall onnxruntime")
        spec = importlib.util.spec_from_file_location(own, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[own] = module
    return sys.modules[own]


def _symbolic(model: onnx.ModelProto) -> Optional[onnx.ModelProto]:
    """ORT's symbolic shape inference as SymbolicShapeInference.infer_shapes runs it, but
    None where that would save a debug copy of the model into the working folder and
    raise (some shapes left unknown), or decline (opset below 7)."""
    ssi = _symbolic_shape_infer()
    SymbolicShapeInference, get_opset = ssi.SymbolicShapeInference, ssi.get_opset
    opset = get_opset(model)
    if not opset or opset < 7:
        return None
    infer = SymbolicShapeInference(2**31 - 1, True, True, 0)  # int_max, auto_merge, guess_output_rank, verbose
    infer._preprocess(model)
    complete = False
    while infer.run_:
        complete = infer._infer_impl()
    infer._update_output_from_vi()
    return infer.out_mp_ if complete else None


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with value_info filled: ORT's symbolic shape inference, which knows its
    contrib ops (GroupQueryAttention, MatMulNBits, MatMulInteger16, ...), else ONNX's."""
    try:
        inferred = _symbolic(model)
        if inferred is not None:
            return inferred
    except ImportError:  # sympy, which it needs, is a dependency: a missing one is an install error
        raise
    except Exception:  # noqa: BLE001 - it gives up on some graphs: ONNX's inference then
        pass
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - inference is best effort; value_types' fallback covers it
        return model


_OTHER_TYPES = ("sequence_type", "map_type", "optional_type", "sparse_tensor_type")


def value_types(model: onnx.ModelProto) -> Dict[str, onnx.TypeProto]:
    """Types of every value: shape inference (_inferred), then, for values it leaves
    untyped, the element type of the node's first typed input."""
    inferred = _inferred(model)
    types: Dict[str, onnx.TypeProto] = {}
    for vi in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        kind = vi.type.WhichOneof("value")
        if (kind == "tensor_type" and vi.type.tensor_type.elem_type) or kind in _OTHER_TYPES:
            types.setdefault(vi.name, vi.type)
    for t in model.graph.initializer:
        types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    for node in model.graph.node:
        for out in node.output:
            if out and out not in types:
                src = next((types[n] for n in node.input if n in types), None)
                if src is not None and src.HasField("tensor_type"):
                    types[out] = helper.make_tensor_type_proto(src.tensor_type.elem_type, None)
    return types


def elem_name(elem_type: int) -> str:
    """An element type as ORT spells it inside tensor(...): float, int64, bfloat16, ..."""
    return onnx.helper.tensor_dtype_to_string(elem_type).split(".")[-1].lower()


def onnx_type_string(t: onnx.TypeProto) -> str:
    """A value's type as ORT's NodeArg.type spells it: tensor(float), seq(tensor(int64)),
    map(string,tensor(float)), optional(...), sparse_tensor(float)."""
    kind = t.WhichOneof("value")
    if kind == "tensor_type":
        return f"tensor({elem_name(t.tensor_type.elem_type)})"
    if kind == "sequence_type":
        return f"seq({onnx_type_string(t.sequence_type.elem_type)})"
    if kind == "map_type":
        return f"map({elem_name(t.map_type.key_type)},{onnx_type_string(t.map_type.value_type)})"
    if kind == "optional_type":
        return f"optional({onnx_type_string(t.optional_type.elem_type)})"
    if kind == "sparse_tensor_type":
        return f"sparse_tensor({elem_name(t.sparse_tensor_type.elem_type)})"
    return "unknown"


def dims(tensor_type) -> List:
    """A tensor type's shape as ONNX Runtime reports it: sizes, symbolic names, or None."""
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim]


def _value_info(name: str, types: Dict[str, onnx.TypeProto], shaped: bool,
                declared: Dict[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    """A segment's input or output. `shaped`: with the shape the model declares (a graph
    input or output as `declared` holds it, a weight); a value passed between segments
    keeps the rank inference gives it but no sizes, since inference may get a size wrong
    (a merged dimension), and ORT refuses a value whose size differs from one its graph
    input declares. Inference rewrites the graph's own inputs too where it merges a
    dimension (an input of unknown sizes broadcast against the heads of attention scores
    becomes one of that many heads), so theirs are taken as the model declares them."""
    if shaped and name in declared:
        return helper.make_value_info(name, declared[name])
    if name not in types:
        raise ValueError(f"no type is known for boundary value {name!r}")
    t = types[name]
    if not t.HasField("tensor_type"):  # a sequence, map or optional: its type as inferred
        return helper.make_value_info(name, t)
    shape = dims(t.tensor_type) if t.tensor_type.HasField("shape") else None
    if shape is not None and not shaped:
        shape = [None] * len(shape)
    return helper.make_tensor_value_info(name, t.tensor_type.elem_type, shape)


def _bindable(t: onnx.TypeProto) -> bool:
    """Whether a value of type `t` can live in a fixed buffer: a tensor of numbers."""
    return t.HasField("tensor_type") and t.tensor_type.elem_type not in (onnx.TensorProto.STRING,
                                                                         onnx.TensorProto.UNDEFINED)


def check_bindable(model: onnx.ModelProto, groups: List[List[int]], consumers: Dict[str, set],
                   types: Dict[str, onnx.TypeProto], where: str, instead: str) -> None:
    """UnsupportedModel unless every value that enters the segments (`groups` of the
    model's nodes; `consumers`: the groups that read each value), passes between them or
    leaves them is a tensor of numbers: such values are bound through IOBinding and
    kept in fixed buffers, which hold no sequence, map, optional or string."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    graph_outputs = {o.name for o in graph.output}
    for vi in graph.input:
        if vi.name not in initializers and not _bindable(vi.type):
            raise UnsupportedModel(f"the input {vi.name!r} ({onnx_type_string(vi.type)}) would enter a segment of "
                                   f"{where}, and only tensors of numbers can: {instead}")
    for gi, group in enumerate(groups):
        for o in (o for i in group for o in graph.node[i].output if o):
            t = types.get(o)
            if t is not None and not _bindable(t) and (o in graph_outputs or any(c > gi for c in consumers.get(o, ()))):
                raise UnsupportedModel(f"the value {o!r} ({onnx_type_string(t)}) would cross from one segment of the "
                                       f"model to the next or leave {where}, and only tensors of numbers can: {instead}")


def split(model: onnx.ModelProto, groups: List[List[int]], is_weight: Callable[[str], bool],
          instead: str = "run it unsplit (a weights budget that holds every weight, or offload=False)"
          ) -> List[Segment]:
    """Builds one model per group. `model` holds weights as declarations only. `instead`:
    what the refusal of a value no boundary can hold advises."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    graph_outputs = [o.name for o in graph.output]
    cheap = _recomputable(graph, is_weight, initializers)
    members = []  # per group: the indices of its nodes, recomputed ones first
    for group in groups:
        own = set(group)
        extra: set = set()

        def pull(value):
            i = cheap[value]
            if i in own or i in extra:
                return
            extra.add(i)
            for n in graph.node[i].input:
                if n in cheap:
                    pull(n)

        for i in group:
            for n in node_inputs(graph.node[i]):
                if n in cheap:
                    pull(n)
        members.append(sorted(extra) + list(group))
    consumers: Dict[str, set] = {}
    for gi, member in enumerate(members):
        produced = {o for i in member for o in graph.node[i].output if o}
        for i in member:
            for name in node_inputs(graph.node[i]):
                if name not in produced:
                    consumers.setdefault(name, set()).add(gi)
    types = value_types(model)
    fed = {vi.name for vi in graph.input}
    declared = {vi.name: vi.type for vi in list(graph.input) + list(graph.output) if vi.type.WhichOneof("value")}
    segments = []
    if len(groups) > 1:
        check_bindable(model, groups, consumers, types, "a split model", instead)
    for gi, (group, member) in enumerate(zip(groups, members)):
        nodes = [graph.node[i] for i in member]
        read = list(dict.fromkeys(n for node in nodes for n in node_inputs(node)))
        produced = {o for node in nodes for o in node.output if o}
        inputs = [n for n in read if n not in produced and n not in initializers and not is_weight(n)]
        weights = segment_weights(model, group, is_weight)
        constants = [initializers[n] for n in read if n in initializers and not is_weight(n)]
        # Weights arrive as initializers (stable slots) or, in the plain baseline, as inputs.
        weight_inputs = [n for n in weights if n not in initializers]
        outputs = [o for i in group for o in graph.node[i].output
                   if o and (o in graph_outputs or any(c > gi for c in consumers.get(o, ())))]
        sub = helper.make_graph(
            nodes, f"{graph.name or 'graph'}_segment{gi}",
            [_value_info(n, types, n in fed or is_weight(n), declared) for n in inputs + weight_inputs],
            [_value_info(n, types, n in graph_outputs, declared) for n in outputs],
            initializer=constants + [initializers[n] for n in weights if n in initializers])
        m = helper.make_model(sub, opset_imports=list(model.opset_import), ir_version=model.ir_version)
        m.producer_name = "onnx-offload"
        segments.append(Segment(gi, list(group), weights, inputs, outputs, m))
    return segments
