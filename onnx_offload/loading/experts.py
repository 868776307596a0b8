"""The experts of a mixture-of-experts model, and which of them a step's router picks.

ORT's ``com.microsoft`` ``MoE`` and ``QMoE`` nodes hold every expert of a layer in stacked
initializers, expert e at [e] of each (``fc1_experts_weights`` [E, ...], its scales and
biases, ``fc2``, ``fc3``), and read input 1, ``router_probs`` ([tokens, E]), to pick
``k`` experts per token: the top k of its float32 softmax. A token's step reads only the
picked experts' rows of each stack (ORT's CPU kernels, which ``tests/test_moe.py`` checks
with every other expert's pages unreadable).

``find_routing`` finds the stacks that can stream by expert: a stack whose leading
dimension is the node's expert count and whose expert rows are at least ROUTED_MIN_BYTES
(smaller ones, a bias, cost less than the bookkeeping; they stream or stay whole).
``routed_experts`` gives the experts a router's logits pick: a superset, which takes in
every expert whose probability the kernels may round to a tie with the k-th, so that no
expert ORT may read is left out.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import numpy as np
import onnx

from .graphs import node_inputs
from .weights import WeightInfo

MOE_OPS = frozenset({"MoE", "QMoE"})
ROUTED_MIN_BYTES = 4096  # an expert's rows of a stack, at least, to stream by expert
# Probabilities this close (relatively) to a row's k-th count as tied with it: the kernels'
# float32 softmax rounds (exp, the division, fast-math exp on CUDA) within a few ulps, and
# an expert they rank in that the host ranked out would be read unmapped.
TIE_TOLERANCE = 1e-5
UNDERFLOW = 1e-30  # a k-th probability below this: the row's zeros (underflowed) tie


@dataclasses.dataclass(frozen=True)
class MoENode:
    index: int  # in the graph
    router: str  # the value its experts are picked by: [tokens, experts]
    k: int
    experts: int
    stacks: tuple  # the stacked initializers that stream by expert


@dataclasses.dataclass(frozen=True)
class Routing:
    nodes: tuple  # MoENode, in graph order

    @property
    def stacks(self) -> Dict[str, int]:
        """Each routed stack and its expert count."""
        return {s: n.experts for n in self.nodes for s in n.stacks}

    @property
    def cuts(self) -> frozenset:
        """The nodes a segment starts at, so that each one's router is read before its
        experts are paged in."""
        return frozenset(n.index for n in self.nodes)


def _attr(node, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def find_routing(model: onnx.ModelProto, weights: Sequence[WeightInfo]) -> Optional[Routing]:
    """The model's MoE nodes whose experts can stream by expert, or None when none can."""
    info = {w.name: w for w in weights}
    readers: Dict[str, int] = {}
    for node in model.graph.node:
        for i in node_inputs(node):  # a subgraph's reads of outer values count too
            readers[i] = readers.get(i, 0) + 1
    nodes: List[MoENode] = []
    for index, node in enumerate(model.graph.node):
        if node.domain != "com.microsoft" or node.op_type not in MOE_OPS or len(node.input) < 3:
            continue
        if _attr(node, "weights_prepacked", 0) == 1:  # a layout of ORT's own: rows are not experts (-1, 0: not)
            continue
        k = int(_attr(node, "k", 1))
        first = info.get(node.input[2])
        if first is None or not first.shape:
            continue
        experts = int(first.shape[0])
        stacks = []
        for name in dict.fromkeys(node.input[2:]):
            w = info.get(name)
            # Read by this node alone: another reader would read all of its experts.
            if (w is None or not w.shape or int(w.shape[0]) != experts or w.nbytes % experts
                    or readers.get(name) != 1):
                continue
            if w.nbytes // experts >= ROUTED_MIN_BYTES:
                stacks.append(name)
        if stacks and 0 < k < experts and node.input[1]:
            nodes.append(MoENode(index, node.input[1], k, experts, tuple(stacks)))
    return Routing(tuple(nodes)) if nodes else None


def routed_experts(logits: np.ndarray, k: int, experts: int) -> List[int]:
    """The experts that rows of router logits ([..., experts]) pick, top `k` per row, as
    the kernels pick them: by float32 softmax, exp(x - max) / sum, a tie going by index.
    Every expert whose probability is within TIE_TOLERANCE (or a few ulps of the row's
    largest logit, for the rounding of x - max) of the row's k-th is in, and when the k-th
    underflows (a row of very distant logits: the zeros tie) every expert is. A row that
    is not finite picks all, as do logits of another width or type (ORT checks them when
    it runs). ORT's sparse mixer (k = 2) picks the top two too: its threshold changes
    only the weights."""
    x = np.asarray(logits)
    if x.size == 0:
        return []
    if x.dtype.kind != "f" or x.ndim == 0 or x.shape[-1] != experts:  # not rows of this node's experts
        return list(range(experts))
    x = x.reshape(-1, experts).astype(np.float32)
    if not np.isfinite(x).all():
        return list(range(experts))
    top = x.max(axis=1, keepdims=True)
    with np.errstate(under="ignore"):
        p = np.exp(x - top)  # the row's sum divides every value alike
    kth = np.partition(p, experts - k, axis=1)[:, experts - k:experts - k + 1]
    rel = np.maximum(TIE_TOLERANCE, 8 * np.finfo(np.float32).eps * np.abs(top))
    threshold = np.where(kth < UNDERFLOW, -1.0, kth * (1 - rel))
    return np.flatnonzero((p >= threshold).any(axis=0)).tolist()


def read_in_place(model: onnx.ModelProto, weights: Sequence[WeightInfo], mode: str) -> List[str]:
    """The expert stacks the streaming engine leaves in pinned host memory for experts
    "in_place": those that could stream by expert (read by their MoE node alone, experts
    of ROUTED_MIN_BYTES or more). The kernel reads a step's picked experts there, whatever
    its own rule for which rows it reads; a bias or a smaller stack stays with the weights."""
    if mode != "in_place":
        return []
    routing = find_routing(model, weights)
    return list(routing.stacks) if routing is not None else []


def routing_for(model: onnx.ModelProto, weights: Sequence[WeightInfo], mode: str, on_cuda: bool,
                stable: bool) -> tuple:
    """(the routing a session streams its experts by, or None; why a MoE model's experts
    stream whole, or ""), for the configuration's `experts`: "routed" wherever weights
    stream behind stable addresses; "auto" on the CPU execution provider, where the
    kernels are known to read only the routed experts (on CUDA the session takes "auto"
    as "in_place"); "dense" and "in_place" never (the streaming engine reads "in_place"
    stacks where they are, see read_in_place)."""
    if mode == "dense":
        return None, ""
    if mode == "in_place":
        return None, ("" if on_cuda and stable else
                      "the experts stream whole: experts='in_place' needs the streaming engine (CUDA, vmm=True)")
    routing = find_routing(model, weights)
    if not stable:
        return None, ("the experts stream whole: routing them needs stable addresses (vmm=True)"
                      if routing is not None and mode == "routed" else "")
    return routing, ""
