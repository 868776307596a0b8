"""Walking an ONNX graph: every tensor it holds, its subgraphs, the values a node reads,
and the external-data record (location, offset, length) of a tensor.

The files, the optimization pass and the weights table all walk the graph the same way,
subgraphs of If/Loop/Scan included, so the walk is here once.
"""
from __future__ import annotations

import onnx


def all_tensors(graph: onnx.GraphProto):
    """Every tensor a graph holds: initializers, sparse ones, constant attributes, and
    those of its subgraphs."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield attr.sparse_tensor.values
                yield attr.sparse_tensor.indices
            for g in subgraphs(attr):
                yield from all_tensors(g)


def subgraphs(attr) -> list:
    """The graphs an attribute holds (an If's branches, a Loop's or a Scan's body)."""
    return ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)


def nested_graphs(graph):
    """Every subgraph of `graph`, at any depth."""
    for node in graph.node:
        for attr in node.attribute:
            for g in subgraphs(attr):
                yield g
                yield from nested_graphs(g)


def node_inputs(node) -> list[str]:
    """Every value a node reads, including outer-scope names used by its subgraphs."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        for g in subgraphs(attr):
            local = {t.name for t in g.initializer} | {i.name for i in g.input}
            for sub in g.node:
                local.update(sub.output)
            for sub in g.node:
                names.extend(n for n in node_inputs(sub) if n not in local)
    return names


def read_as_tables(model: onnx.ModelProto, names) -> list[str]:
    """The weights of `names` that only Gathers of the main graph read, each as the table
    (input 0) they take rows from (axis 0): an embedding. A step reads a row of such a table per
    token, never the whole table."""
    gathers, reads = {}, {}
    for node in model.graph.node:
        for n in node_inputs(node):
            if n in names:
                reads[n] = reads.get(n, 0) + 1
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and axis == 0 and node.input \
                and node.input[0] in names:
            gathers[node.input[0]] = gathers.get(node.input[0], 0) + 1
    outputs = {o.name for o in model.graph.output}
    return [n for n, k in gathers.items() if reads[n] == k and n not in outputs]


def external_info(t: onnx.TensorProto) -> dict:
    """A tensor's external-data record: location, offset, length (as strings)."""
    return {e.key: e.value for e in t.external_data}


def set_external(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Points `t` at `length` bytes at `offset` of the data file `location`."""
    del t.external_data[:]
    t.external_data.add(key="location", value=location)
    t.external_data.add(key="offset", value=str(offset))
    t.external_data.add(key="length", value=str(length))


def external_locations(model: onnx.ModelProto) -> set:
    """The location of every external tensor of `model`, each once."""
    return {external_info(t).get("location", "") for t in all_tensors(model.graph)
            if t.data_location == onnx.TensorProto.EXTERNAL}
