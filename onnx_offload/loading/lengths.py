"""Where a decoder's graph computes by the sequence's total length: the attention mask's
length, compared with a constant, choosing a branch (an ``If``) or values (a ``Where``).

onnxruntime-genai's builder writes Phi-3 and Phi-3.5 so: their LongRoPE rotary tables come
from an ``If`` on "the mask's length > original context". Plain ORT's loop feeds the mask at
the sequence's length each step, so one step over a whole prompt takes the branch of the
prompt's length and each decode step that of its own. A prompt in chunks, and the builder
layout's mask as long as its cache, would see other lengths; ``length_thresholds`` gives
the lengths at which such a graph changes, so that generate() feeds each step a length on
the same side of all of them.
"""
from __future__ import annotations

from typing import Dict, Optional, Set

import numpy as np
import onnx
from onnx import numpy_helper

_PASS = {"Cast", "Squeeze", "Unsqueeze", "Reshape", "Identity", "Flatten"}
# op: (the branch changes between t and t + 1 for `length op c`, t as a function of c)
_COMPARE = {"Greater": lambda c: [c], "GreaterOrEqual": lambda c: [c - 1], "Less": lambda c: [c - 1],
            "LessOrEqual": lambda c: [c], "Equal": lambda c: [c - 1, c]}
_MIRROR = {"Greater": "Less", "Less": "Greater", "GreaterOrEqual": "LessOrEqual", "LessOrEqual": "GreaterOrEqual",
           "Equal": "Equal"}
_SOURCES = ("attention_mask", "input_ids", "position_ids")


class _Graph:
    def __init__(self, graph: onnx.GraphProto):
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consts: Dict[str, np.ndarray] = {}
        for t in graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL and int(np.prod(t.dims)) <= 1:
                self.consts[t.name] = numpy_helper.to_array(t)
        for n in graph.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                value = numpy_helper.to_array(n.attribute[0].t)
                if value.size <= 1:
                    self.consts[n.output[0]] = value

    def scalar(self, name: str) -> Optional[int]:
        value = self.consts.get(name)
        if value is None or value.size != 1 or value.dtype.kind not in "iu":
            return None
        return int(value.reshape(()))

    def mask_length(self, name: str, depth: int = 0) -> Optional[int]:
        """k where `name` holds the attention mask's length plus k, else None."""
        node = self.producer.get(name)
        if node is None or depth > 16:
            return None
        if node.op_type in _PASS:
            return self.mask_length(node.input[0], depth + 1)
        if node.op_type in ("Add", "Sub") and len(node.input) == 2:
            for i, j in ((0, 1), (1, 0)):
                k, c = self.mask_length(node.input[i], depth + 1), self.scalar(node.input[j])
                if k is not None and c is not None and not (node.op_type == "Sub" and i == 1):
                    return k + c if node.op_type == "Add" else k - c
            return None
        if node.op_type == "Gather" and self._mask_shape(node.input[0]) == 0:
            return 0 if self.scalar(node.input[1]) in (1, -1) else None
        if node.op_type == "Shape" and node.input[0] == "attention_mask":
            attrs = {a.name: a.i for a in node.attribute}
            return 0 if attrs.get("start") in (1, -1) and attrs.get("end", 2) == 2 else None
        return None

    def _mask_shape(self, name: str) -> Optional[int]:
        node = self.producer.get(name)
        if node is not None and node.op_type == "Shape" and node.input[0] == "attention_mask":
            attrs = {a.name: a.i for a in node.attribute}
            return 0 if attrs.get("start", 0) == 0 and "end" not in attrs else None
        return None

    def thresholds(self, cond: str) -> Optional[list]:
        """The lengths at which the boolean `cond` changes, where it compares the mask's
        length with a constant; None where it is no such comparison."""
        node = self.producer.get(cond)
        if node is None:
            return None
        if node.op_type == "Not":
            return self.thresholds(node.input[0])
        if node.op_type not in _COMPARE or len(node.input) != 2:
            return None
        for i, op in ((0, node.op_type), (1, _MIRROR[node.op_type])):
            k, c = self.mask_length(node.input[i]), self.scalar(node.input[1 - i])
            if k is not None and c is not None:
                return [t - k for t in _COMPARE[op](c)]
        return None


def _derived(graph: onnx.GraphProto) -> Set[str]:
    """The values of the main graph computed from the shapes of the inputs whose length a
    chunked prompt changes (and of the past, which the builder layout feeds at its room)."""
    sources = set(_SOURCES) | {i.name for i in graph.input if i.name.startswith("past_key_values.")}
    derived: Set[str] = set()
    for n in graph.node:
        if (n.op_type == "Shape" and n.input[0] in sources) or any(i in derived for i in n.input):
            derived.update(o for o in n.output if o)
    return derived


def length_thresholds(model: onnx.ModelProto) -> Optional[tuple]:
    """The sorted lengths t at which the graph's If and Where nodes change their choice
    between a total length of t and t + 1: () for a graph that chooses nothing by the
    length; None for one whose If chooses by the lengths in a way not read here (a prompt
    of such a graph runs in one step)."""
    g = _Graph(model.graph)
    derived = None
    found = set()
    for n in model.graph.node:
        if n.op_type not in ("If", "Where") or not n.input:
            continue
        ts = g.thresholds(n.input[0])
        if ts is not None:
            found.update(t for t in ts if t >= 1)
            continue
        if n.op_type == "If":
            derived = _derived(model.graph) if derived is None else derived
            if n.input[0] in derived:
                return None
    return tuple(sorted(found))
