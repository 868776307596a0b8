"""Host-computed MatMuls inside a captured step graph.

The graph rewrite (``loading.rewrite_for_host``) cuts each host MatMul out of ORT's graph:
its input X becomes a graph output, bound to a device buffer of the engine's, and its
result a graph input Y_in, bound to another. In the graph captured from ORT's run, each
host MatMul then gets a D2H copy of X into pinned host memory, a host node that runs the
host kernel on it (``host_matmul_job_run``), and an H2D copy of the result into Y_in's
buffer (``DeviceGraph.add_host_matmuls``). MatMuls that read one X share its copy.

Where they go is found by address, as the page-ins' readers are (``DeviceGraph.readers``):

- ``after``: the captured nodes that hold X's buffer and come before the first node that
  holds Y_in's. ORT's CUDA EP runs on one stream, so the captured graph's topological
  order is the order its kernels ran in, and the rewrite's first reader of Y_in (its
  Where) depends on X through Slice and IsNaN: every node that writes X is among these.
  Addresses cannot tell a write from a read, so a node writing X after that Where would
  go unseen; ORT's plan for the rewritten graph has none (X is a graph output, written
  once by its producer into the engine's buffer, which nothing else uses).
- ``before``: every captured node that holds Y_in's buffer.

A MatMul whose X or Y_in no node holds, or whose Y_in is held before any node holds X, is
refused (HostComputeRefused), as is a graph with nodes whose reads cannot be told: a
refusal beats a result read before it is written. The host nodes run one after another,
in the order their results are first read.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from ..errors import HostComputeFailed, HostComputeRefused, StateError
from ..loading import HostMatMul

ROW_ALIGN = 256  # each X and Y row block in the pinned region starts at this alignment
X_DTYPES = ("float16", "float32")  # what the host kernels take for x and y


def node_edges(label: str, x_nodes: Sequence[int], y_nodes: Sequence[int], first_read: Optional[int] = None,
               weights: Sequence[str] = ()) -> Tuple[List[int], List[int]]:
    """(after, before) of one host MatMul, from the captured nodes that hold X's buffer
    (`x_nodes`) and those that hold Y_in's (`y_nodes`), topological indices. `first_read`:
    the earliest node that reads any result computed from this X (MatMuls that share X
    share one copy, which must precede all their results), else Y_in's own first node.
    HostComputeRefused (naming `weights`, the MatMul's) when no node holds X or Y_in, or
    none holding X comes first."""
    if not x_nodes:
        raise HostComputeRefused(f"the host cannot compute {label!r} in the captured graph: no captured node holds "
                                 f"its input's buffer, so nothing orders the copy of X after X is written", weights)
    if not y_nodes:
        raise HostComputeRefused(f"the host cannot compute {label!r} in the captured graph: no captured node holds "
                                 f"its result's buffer, so nothing orders the result's copy before its readers",
                                 weights)
    first = min(y_nodes) if first_read is None else first_read
    after = sorted({i for i in x_nodes if i < first})
    if not after:
        raise HostComputeRefused(f"the host cannot compute {label!r} in the captured graph: node {first} reads a "
                                 f"result before any node holds its input X (first at node {min(x_nodes)})", weights)
    return after, sorted(set(y_nodes))


def place(hosts: Sequence[HostMatMul], x_nodes: Mapping[str, Sequence[int]],
          y_nodes: Mapping[str, Sequence[int]]) -> List[Tuple[int, List[int], List[int]]]:
    """(index into `hosts`, after, before) for each host MatMul, in the order its host
    node runs: by the first node that reads its result. `x_nodes` by X output name,
    `y_nodes` by Y_in input name (as node_edges takes them)."""
    first_read: Dict[str, int] = {}
    for h in hosts:
        if y_nodes.get(h.y_input):
            first = min(y_nodes[h.y_input])
            first_read[h.x_output] = min(first_read.get(h.x_output, first), first)
    placed = []
    for i, h in enumerate(hosts):
        after, before = node_edges(h.node, x_nodes.get(h.x_output, ()), y_nodes.get(h.y_input, ()),
                                   first_read.get(h.x_output), h.weights)
        placed.append((i, after, before))
    placed.sort(key=lambda p: (p[2][0], p[0]))
    return placed


def _aligned(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


class HostNodes:
    """The host-computed MatMuls of one captured graph: their jobs and pinned X and Y rows
    (one ``_core.HostJobs``, which the graph holds once they are added to it).

    `x_buffers`: {X output: (device address, shape)} of the engine's buffers for this
    signature; `y_buffers`: {Y_in input: device address}; `weights`: {weight name: host
    address} (the pinned store's, which must outlive the graph). `threads`: the host
    threads a job uses (None: every physical core). HostComputeRefused when a job cannot
    run (the host kernels' reason)."""

    def __init__(self, backend, hosts: Sequence[HostMatMul], x_buffers: Mapping[str, Tuple[int, Sequence[int]]],
                 y_buffers: Mapping[str, int], weights: Mapping[str, int], threads: Optional[int] = None):
        self.hosts = list(hosts)
        self._x_src, self._y_dst = {}, {}
        self.x_rows: Dict[str, Tuple[int, int]] = {}  # X output -> (offset in the pinned region, bytes)
        self.y_rows: Dict[str, Tuple[int, int]] = {}  # Y_in input -> (offset, bytes)
        rows: Dict[str, int] = {}
        total = 0
        for h in self.hosts:
            dtype = np.dtype(h.y_dtype).name
            if dtype not in X_DTYPES:
                raise HostComputeRefused(f"the host cannot compute {h.node!r}: its input and result are {dtype}; the "
                                         f"host kernels take float16 or float32", h.weights)
            if h.x_output not in x_buffers or h.y_input not in y_buffers:
                raise ValueError(f"no buffer given for {h.node!r}'s input {h.x_output!r} or result {h.y_input!r}")
            address, shape = x_buffers[h.x_output]
            shape = tuple(int(d) for d in shape)
            if not shape or shape[-1] != h.k:
                raise ValueError(f"{h.node!r} takes X of last dim {h.k}; its buffer {h.x_output!r} is {list(shape)}")
            item = np.dtype(h.y_dtype).itemsize
            m = int(np.prod(shape[:-1], dtype=np.int64))
            if h.x_output not in self.x_rows:
                self.x_rows[h.x_output] = (total, m * h.k * item)
                self._x_src[h.x_output] = int(address)
                rows[h.x_output] = m
                total = _aligned(total + m * h.k * item)
            self.y_rows[h.y_input] = (total, m * h.n * item)
            self._y_dst[h.y_input] = int(y_buffers[h.y_input])
            total = _aligned(total + m * h.n * item)
        self.jobs = _core.HostJobs(backend, len(self.hosts), total)
        base = self.jobs.pinned
        self.job_args: List[dict] = []  # what each job was written with (HostJobs.set's arguments)
        for i, h in enumerate(self.hosts):
            args = dict(index=i, kind=h.kind, k=h.k, n=h.n, data=int(weights[h.weights[0]]),
                        scales=int(weights[h.weights[1]]) if h.kind == "int4" else 0,
                        zero_points=int(weights[h.zero_points]) if h.zero_points else 0,
                        block_size=h.block_size, x_dtype=np.dtype(h.y_dtype).name, m=rows[h.x_output],
                        x=base + self.x_rows[h.x_output][0], y=base + self.y_rows[h.y_input][0], threads=threads)
            why = self.jobs.set(**args)
            if why:
                raise HostComputeRefused(f"the host cannot compute {h.node!r}: {why}", h.weights)
            self.job_args.append(args)
        self.placed: List[Tuple[int, List[int], List[int]]] = []  # (host index, after, before), in run order
        self.x_nodes: Dict[str, List[int]] = {}  # the captured nodes that hold each X's buffer (add_to's scan)
        self.y_nodes: Dict[str, List[int]] = {}  # ... and each Y_in's

    def add_to(self, graph) -> None:
        """Finds each MatMul's nodes in `graph` (a DeviceGraph not yet instantiated) and
        adds its copies and host node, once. HostComputeRefused where they cannot be placed
        (see the module's docstring), with nothing added; StateError for a graph that is
        not a device graph, or a second call. A driver failure part way leaves the graph
        unusable (its instantiate raises StateError)."""
        if not isinstance(graph, _core.DeviceGraph):
            raise StateError(f"host-computed MatMuls go into a captured device graph (the CUDA backend's), "
                             f"not a {type(graph).__name__}")
        if self.placed:
            raise StateError("these host MatMuls are in a graph already: their jobs and rows serve one graph")
        xs, ys = list(self.x_rows), list(self.y_rows)
        ranges = [(self._x_src[x], self._x_src[x] + self.x_rows[x][1]) for x in xs]
        ranges += [(self._y_dst[y], self._y_dst[y] + self.y_rows[y][1]) for y in ys]
        found = graph.readers(ranges)
        if graph.opaque:
            raise HostComputeRefused(f"{graph.opaque} captured nodes do not show what they read, so a read of a host "
                                     f"MatMul's result could not be ordered after its copy",
                                     [w for h in self.hosts for w in h.weights])
        self.x_nodes, self.y_nodes = dict(zip(xs, found[:len(xs)])), dict(zip(ys, found[len(xs):]))
        placed = place(self.hosts, self.x_nodes, self.y_nodes)
        graph.add_host_matmuls(self.jobs, self.items(placed))
        self.placed = placed

    def items(self, placed: Sequence[Tuple[int, Sequence[int], Sequence[int]]]) -> list:
        """DeviceGraph.add_host_matmuls's items for `placed` ((host index, after, before)
        in run order, as `place` gives them)."""
        base = self.jobs.pinned
        items = []
        for i, after, before in placed:
            h = self.hosts[i]
            (x_off, x_bytes), (y_off, y_bytes) = self.x_rows[h.x_output], self.y_rows[h.y_input]
            items.append((i, self._x_src[h.x_output], base + x_off, x_bytes, base + y_off, self._y_dst[h.y_input],
                          y_bytes, list(after), list(before)))
        return items

    def check(self) -> None:
        """After a replay has finished: HostComputeFailed naming the first MatMul whose job
        the host refused or did not run (its status as the last run left it)."""
        i = self.jobs.first_failed()
        if i >= 0:
            h, message = self.hosts[i], self.jobs.status(i)[1]
            raise HostComputeFailed(f"the host did not compute {h.node!r} (weights {', '.join(h.weights)}): "
                                    f"{message}", h.node)
