"""How the streaming engine makes one input-shape signature's graph.

ORT runs uncaptured on the package's compute stream, once to learn the outputs' shapes
and once with every value bound where the graph will find it (it takes its memory and
picks its kernels; what the streamed addresses hold then does not matter); a third
``run_with_iobinding`` is captured into a graph. What ORT took for those runs is charged
to the scratch zone. The captured nodes' parameters are scanned for the streamed
weights' addresses, which gives each weight's readers; the first graph's readers also
place the ring (``ring_by_reads``). The page-in copies (``plan_copies``) are then added
to the graph as H2D copy nodes from the pinned host store, all but the step's leading
copies, which the engine issues itself before the launch.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import onnxruntime as ort

from .._core import round_up
from ..errors import HostComputeRefused, OffloadError
from ..memory import SLACK, StepMemoryShort, is_out_of_memory
from .host_nodes import HostNodes
from .ortvalues import FixedBuffer, nbytes_of, numpy_dtype
from .stream_plan import StreamingUnavailable, leading_copies, plan_copies, ring_by_reads
from .stream_ring import Ring

# Page-in copies in flight at once in a step's graph: each copy waits for the one this
# many places before it (and for its own readers' edges, which every copy carries). One:
# two at once share the link, so the copy the next reader waits for ends later (an int4
# TinyLlama step at 75% on an H100: 4.40 ms with two against 4.10 with one).
COPIES_IN_FLIGHT = 1


class StepGraph:
    """One signature's captured step: the graph and the buffers it reads and writes."""

    def __init__(self, graph, buffers: Dict[str, FixedBuffer], outputs: Dict[str, ort.OrtValue],
                 lead: Tuple[Tuple[int, int, int], ...], host: Optional[HostNodes] = None):
        self.graph = graph
        self.buffers = buffers  # the engine's own: inputs it copies into, outputs the caller did not bind
        self.outputs = outputs  # every output's value, where the graph writes it
        self.lead = lead  # (destination, source, bytes) of the copies issued before the launch
        self.host = host  # the host-computed MatMuls in the graph, if any


class GraphBuilder:
    """Builds the streaming engine's graphs on one of its ORT sessions (`session`, None once
    the engine closes), with the page-ins of the weights streamed through `ring`.

    With `host` (a HostPlan), the session runs the model rewritten for host compute: the
    host MatMuls' weights are not copied (their units are skipped), and each graph gets
    the host MatMuls' copies and host nodes (HostNodes). Such a graph needs the ring
    placed by the whole model's reads first (a graph of the builder without `host`)."""

    def __init__(self, device, session, ring: Ring, store, info, meter, graph_outputs: List[str], device_id: int,
                 host=None):
        self.host = host
        self._skip = set(host.host_weights) if host is not None else set()
        self.device = device
        self.session = session
        self.ring = ring
        self.plan = ring.plan
        self.address = ring.address
        self.store = store
        self.info = info
        self._meter = meter
        self._graph_outputs = graph_outputs
        self._device_id = device_id
        self.captures = 0  # graphs made (a replayed step makes none)
        self._run_options = ort.RunOptions()
        # ORT would wait for its stream at the end of each run; the graph is what runs.
        self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")

    def bind(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue]) -> ort.IOBinding:
        io = self.session.io_binding()
        for k, v in feeds.items():
            io.bind_ortvalue_input(k, v)
        for name in dict.fromkeys(self._graph_outputs):  # an output listed twice is bound once
            if name in outputs:
                io.bind_ortvalue_output(name, outputs[name])
            else:
                io.bind_output(name, "cuda" if self.device.is_cuda else "cpu", self._device_id)
        return io

    def build(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue],
               buffers: Dict[str, FixedBuffer]) -> StepGraph:
        """Warm-up, capture, page-in copies, instantiate: one signature's graph."""
        dev = self.device
        stream = dev.compute_stream
        # The warm-up: ORT takes its memory and picks its kernels. The streamed weights'
        # addresses hold whatever the ring last held; the outputs it writes are
        # overwritten by the graph's own run. What ORT took for it is charged to the
        # scratch zone once the graph is made (StepMemoryShort when it has no room).
        mark = self._meter.mark()
        io = self.bind(feeds, outputs)
        self._ort_run(io)
        bound = dict(outputs)
        made: List[str] = []
        try:
            for name, v in zip(dict.fromkeys(self._graph_outputs), io.get_outputs()):
                if name not in outputs:
                    dtype = numpy_dtype(v.data_type())
                    ptr = dev.scratch.allocate(max(1, nbytes_of(v.shape(), dtype)))
                    buffers[name] = FixedBuffer.on(dev, ptr, v.shape(), dtype)
                    made.append(name)
                    bound[name] = buffers[name].value
            io = self.bind(feeds, bound)
            self._ort_run(io)  # at the addresses the capture uses
            stream.synchronize()
            graph = self._capture(io)
            lead = self._add_page_ins(graph)
            nodes = self._add_host_nodes(graph, feeds, bound) if self.host is not None else None
            graph.instantiate(stream)
            self._meter.charge_since(mark)
            self.captures += 1
        except BaseException:
            for name in made:
                dev.scratch.deallocate(buffers.pop(name).ptr)
            raise
        return StepGraph(graph, buffers, bound, lead, nodes)

    def _add_host_nodes(self, graph, feeds: Dict[str, ort.OrtValue], bound: Dict[str, ort.OrtValue]) -> HostNodes:
        """The host MatMuls' copies and host nodes, in `graph` (HostComputeRefused where
        they cannot be placed)."""
        hosts = self.host.hosts
        for h in hosts:  # the result's buffer was sized from the feeds' named dims: X must agree
            x, y = bound[h.x_output].shape(), feeds[h.y_input].shape()
            if list(x[:-1]) != list(y[:-1]):
                raise HostComputeRefused(f"the host cannot compute {h.node!r}: its input came out {list(x)} in ORT's "
                                         f"run, and its result's buffer is {list(y)}", h.weights)
        nodes = HostNodes(self.device.backend, hosts,
                          {h.x_output: (bound[h.x_output].data_ptr(), bound[h.x_output].shape()) for h in hosts},
                          {h.y_input: feeds[h.y_input].data_ptr() for h in hosts},
                          {w: self.store.ptr(w) for h in hosts for w in h.weights}, self.host.threads)
        nodes.add_to(graph)
        return nodes

    def _ort_run(self, io) -> None:
        """An uncaptured ORT run; ORT's arena or the device running out of memory is a
        StepMemoryShort (of unknown size), not ORT's RuntimeError."""
        try:
            self.session.run_with_iobinding(io, self._run_options)
        except RuntimeError as e:
            if isinstance(e, OffloadError) or not is_out_of_memory(e):
                raise
            raise StepMemoryShort(f"ORT ran out of device memory in the step: "
                                  f"{' '.join(str(e).split())[-300:]}", 0) from None

    def _capture(self, io):
        """One ORT run captured into a graph; StreamingUnavailable when it cannot be."""
        backend, stream = self.device.backend, self.device.compute_stream
        try:
            backend.begin_graph_capture(stream)
        except OffloadError as e:  # no device graphs on this backend
            raise StreamingUnavailable(f"the step cannot be captured: {e}") from e
        failure = graph = None
        try:
            self.session.run_with_iobinding(io, self._run_options)
        except Exception as e:  # noqa: BLE001 - ORT's own types: what it did broke the capture
            failure = e
        finally:
            try:
                graph = backend.end_graph_capture(stream)
            except OffloadError as e:
                failure = failure or e
        if failure is None:
            return graph
        try:
            free = self.device.backend.mem_info()[0]
            if free < SLACK:  # a capture on a full device fails for its memory, not for the model
                raise StepMemoryShort(f"ORT's run could not be captured with {free} bytes of the device free: "
                                      f"{failure}", round_up(SLACK - free, self.device.granularity)) from failure
            raise StreamingUnavailable(f"ORT's run cannot be captured into a graph: {failure}") from failure
        finally:
            # The error's traceback holds this frame: the local would make a cycle that keeps
            # the ORT session (and its arena) alive until the garbage collector runs.
            failure = io = None

    def _describe(self, graph, node: int, name: str) -> str:
        """One captured node, for a message: its kernel and where `name`'s address sits in
        its parameters."""
        lo = self.address[name]
        try:
            where = graph.address_in_params(node, lo, lo + self.info[name].nbytes)
            kernel = graph.kernel_name(node)[:120]
        except OffloadError as e:  # a message must not fail where the error it explains did not
            return f"node {node} (not described: {e})"
        places = ", ".join(f"{'packed parameters' if i < 0 else f'parameter {i}'} ({size} bytes) at +{off}"
                           for i, size, off in where[:3])
        return f"node {node} {kernel}" + (f" [{places}]" if places else "")

    def _ring_by_reads(self, graph, copied: List[int], readers: List[List[int]],
                       first_from: Dict[int, int]) -> List[List[int]]:
        def describe(k: int) -> str:
            name = self.plan.units[k].names[0]
            return "; ".join(self._describe(graph, r, name) for r in sorted({readers[k][0], readers[k][-1]}))

        return ring_by_reads(self.plan.units, self.ring.granules, copied, readers, first_from, describe)

    def _add_page_ins(self, graph) -> Tuple[Tuple[int, int, int], ...]:
        """Adds the page-in copies to the captured graph, all but the lead (returned)."""
        units = [u for u in self.plan.units if not self._skip.intersection(u.names)]
        if not units:
            return ()
        names = [n for u in units for n in u.names]
        ranges = [(self.address[n], self.address[n] + self.info[n].nbytes) for n in names]
        found = dict(zip(names, graph.readers(ranges)))
        if graph.opaque:
            raise StreamingUnavailable(f"{graph.opaque} captured nodes do not show what they read (child graphs or "
                                       f"kernels without readable parameters)")
        unseen = [n for n in names if not found[n]]
        if unseen:
            # A read the scan missed would see whatever the ring last held: refuse.
            raise StreamingUnavailable(
                f"no captured node shows the address of the streamed weight(s) {unseen[:3]}, so their page-ins "
                f"cannot be ordered before their reads (ORT may read them through a copy of its own, or a kernel "
                f"through memory its parameters do not show)")
        readers = [sorted({r for n in u.names for r in found[n]}) for u in units]
        copied = sorted(range(len(units)), key=lambda i: readers[i][0])
        # The earliest reader of any unit copied from i on: everything a copy leads to comes after it.
        first_from: Dict[int, int] = {}
        low = None
        for i in reversed(copied):
            low = readers[i][0] if low is None else min(low, readers[i][0])
            first_from[i] = low
        if not self.ring.placed_by_reads:
            if self._skip:  # the rewrite does not read every unit: the whole model's graph places the ring
                raise StreamingUnavailable("a host-computed step's graph cannot place the ring")
            # ORT's reads, seen for the first time: the ring follows them from now on.
            self.device.copy_stream.synchronize()  # no lead copy may still land in the ring
            self.ring.place(self._ring_by_reads(graph, copied, readers, first_from))
            self.ring.placed_by_reads = True
        copies = plan_copies(units, readers, copied, first_from, self.device.granularity, self.address,
                             {n: self.info[n].nbytes for n in names}, {n: self.store.ptr(n) for n in names}, found)
        lead = leading_copies(copies)
        graph.add_copies(copies[len(lead):], COPIES_IN_FLIGHT)
        return tuple((c[0], c[1], c[2]) for c in lead)
