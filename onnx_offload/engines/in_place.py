"""The streaming engine's plan with the weights it reads in place: tables only Gathers read
(an embedding, a row a token) and, with experts="in_place", stacks of experts (the picked
experts a token), left in pinned host memory where the device reads them over the link."""
from __future__ import annotations

from typing import List, Sequence, Set

import numpy as np
import onnx

from ..loading import find_routing
from ..memory import InPlaceNode
from .stream_plan import StreamPlan, StreamingUnavailable, plan_stream


def stream_layout(run, allowance: int, granularity: int, cost, policy: str, on_cuda: bool) -> StreamPlan:
    """The streaming engine's plan for a weights budget of `allowance`. Once the weights
    stream, on CUDA, a table that only Gathers read stays in pinned host memory, read in
    place a row a token, and its bytes go to other weights (one under a granule frees none).
    So does a stack of experts read in place (experts="in_place"), whose MoE kernel reads a
    token's picked experts over the link: k/E of its bytes a token where streaming it would
    copy all of them; a stack under a granule too, since streamed it would copy them all. A
    stack comes back to the device where the budget holds it whole and every other weight
    it held before: byte for byte, a streamed weight costs the link more than a stack read
    in place. Nothing is read in place where that would not copy fewer bytes a step."""
    size = {w.name: w.nbytes for w in run.weights}
    stacks = [n for n in dict.fromkeys(run.stacks) if size.get(n)] if on_cuda else []  # an empty one: resident
    tables = {n for n in run.tables if size[n] >= granularity} if on_cuda else set()
    tables.update(stacks)
    try:
        layout = plan_stream(run.weights, allowance, granularity, cost, policy, shared=run.shared)
    except StreamingUnavailable:
        if not tables:
            raise
        layout = None  # a table alone may be over the budget

    def copied(plan: StreamPlan) -> int:
        return sum(size[n] for n in plan.streamed)

    def plan_without(away: Set[str]) -> StreamPlan:
        plan = plan_stream([w for w in run.weights if w.name not in away], allowance, granularity, cost, policy,
                           shared=[n for n in run.shared if n not in away])
        plan.in_host = [w.name for w in run.weights if w.name in away]
        return plan

    if tables and (layout is None or layout.units):
        whole, layout = layout, plan_without(tables)
        at = {w.name: (w.first_use, w.name) for w in run.weights}
        for name in stacks:
            kept = sorted(layout.resident + [name], key=at.__getitem__)
            if cost(kept) > allowance:  # nor can a plan that keeps it and every weight kept without it
                continue
            if not layout.units:  # the others are all resident: it joins them (plan_stream takes O(n^2))
                trial = StreamPlan(kept, [], 0, allowance, [n for n in layout.in_host if n != name])
            else:
                try:
                    trial = plan_without(tables - {name})
                except StreamingUnavailable:
                    continue
            if name in trial.resident and set(trial.streamed) <= set(layout.streamed):
                tables.discard(name)
                layout = trial
        # Without them plan_stream may choose otherwise (the weights it keeps first depend
        # on the sizes it is given, and a larger weight streamed needs a larger ring):
        # where that copies no fewer bytes a step, reading in place saves nothing.
        if whole is not None and copied(layout) >= copied(whole):
            layout = whole
    return layout


def in_place_nodes(model: onnx.ModelProto, weights, in_host: Sequence[str], paged) -> List[InPlaceNode]:
    """The MoE nodes with a stack read in place from the host store's paged region
    (`paged`: HostStore.pages), each with those stacks: their hot experts may take device
    pages behind the stack's address (memory.expert_pages)."""
    routing = find_routing(model, weights)
    away = set(in_host) & set(paged.offsets)
    nodes = []
    for n in routing.nodes if routing is not None else ():
        stacks = tuple(s for s in n.stacks if s in away)
        if stacks:
            nodes.append(InPlaceNode(n.router, n.k, n.experts, stacks))
    return nodes


def with_router_outputs(model: onnx.ModelProto, nodes: Sequence[InPlaceNode], weights) -> onnx.ModelProto:
    """A copy of `model` that also outputs each node's router values, which the engine reads
    back after a step to count the experts picked. Their type is the MoE node's T: its
    experts' (MoE) or their scales' (QMoE), unless the model says it."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    known = {v.name: v for v in list(model.graph.value_info) + list(model.graph.output)}
    dtype = {w.name: w.dtype for w in weights}
    listed = {o.name for o in out.graph.output}
    for n in nodes:
        if n.router in listed:
            continue
        node = next(x for x in model.graph.node if x.op_type in ("MoE", "QMoE") and len(x.input) > 1
                    and x.input[1] == n.router)
        if n.router in known and known[n.router].type.tensor_type.elem_type:
            out.graph.output.append(known[n.router])
        else:
            t = dtype[node.input[3] if node.op_type == "QMoE" else node.input[2]]
            out.graph.output.append(onnx.helper.make_tensor_value_info(
                n.router, onnx.helper.np_dtype_to_tensor_dtype(np.dtype(t)), None))
        listed.add(n.router)
    return out
