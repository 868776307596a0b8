"""The streaming engine: one ORT session for the whole model, its run captured into a
CUDA graph that the package owns, and the page-ins of the streamed weights added to
that graph as copies.

Layout (``plan_stream``, a pure function). The weights that stay resident live in
the arena's weights zone, pinned for the session's life. Each of the others is a
unit that streams: it has stable addresses of its own, from a granule boundary,
inside one reservation. Behind those addresses lies the ring, a small set of
physical granules that holds the largest streamed weight and RING_SLACK spare
granule(s). A unit's granules are
mapped onto ring granules once: in turn at construction, then, when the first
captured graph shows the order ORT reads the weights in, each unit onto the ring
granules whose readers finish earliest.
Every streamed weight keeps one address for the session's life, and many units
share each ring granule.

A step (``StreamEngine``). For each input-shape signature ORT runs uncaptured on the
package's compute stream, once to learn the outputs' shapes and once with every value
bound where the graph will find it (it takes its memory and picks its kernels; what
the streamed addresses hold then does not matter); a third ``run_with_iobinding`` is
captured into a graph. What ORT took for those runs is charged to the scratch zone. The captured nodes' parameters are scanned for the units'
addresses, which gives each weight's readers. H2D copy nodes are then added, from the
pinned host store to the weights' addresses (``plan_copies``): a weight's granules are
copied in runs by the unit that held their ring granules earlier in the step, with
these edges:
- each copy after the one before it, so one copy at a time runs at the link's rate;
- each run after every reader of the unit that held its ring granules;
- each reader of a weight after every run of that weight.
The part of a copy that lands in the spare granules thus runs while the weight before
it is still read. The step's leading copies, which wait for no reader, are not in the
graph: they are issued on the copy stream as soon as the step before ends, while the
host reads its outputs, and the launch waits for them on an event. A replay is one
graph launch: the copies run on the copy engine while the kernels run, a kernel waits
only for its own weights, and nothing in a step maps, unmaps, sets access, creates or
releases; the host waits once, at the end, for the outputs.
"""
from __future__ import annotations

import collections
import dataclasses
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import onnxruntime as ort

from .._core import DEFAULT_ALIGNMENT as ALIGNMENT, round_up
from ..errors import OffloadError, StateError
from ..loading import WeightInfo, save_model
from ..loading import Segment
from ..memory import SLACK
from ..memory import Counters
from ..memory import StepMemoryShort, is_out_of_memory
from .graph_capture import GraphCaptureDecision
from .ortvalues import FixedBuffer, as_ortvalue, copy_into, nbytes_of, numpy_dtype, ortvalue_at, signature

# The ring's floor, as a share of the weights budget. Decode is bound by the link (on
# the H200 a 23 MB weight copies in 0.4 ms and its reader takes microseconds), so a
# ring that holds several weights measured no faster than one with a few spare
# granules (below) and only took bytes from the resident weights: the floor is 0.
RING_FRACTION = 0.0
# Granules the ring holds beyond the largest streamed weight. A weight's copy that
# reuses the granules of the weight before it must wait for that weight's reader (the
# copy, a dependency hop, the kernel, another hop); the part of the copy that lands in
# the spare granule does not, and runs meanwhile, so the copy engine does not idle
# between two weights. On the H200 (a 2.05 GiB TinyLlama-shape decoder, 2 MiB granules),
# no spare granule gave slower steps; one and two gave the same step within 1% at
# budgets of 25, 50 and 75%, and each costs the resident weights one granule: at 25%
# a second one would keep the resident bytes under 0.95 of the weights budget.
RING_SLACK = 1
# Input-shape signatures kept captured: a generation of 4 rows whose prompt runs in
# chunks holds 2 per row (the first step and the chunks') and its decode step's.
GRAPH_SIGNATURES = 16
GIANT = 4  # a weight over this many times the median size is resident first under `planned`


class StreamingUnavailable(OffloadError):
    """The streaming engine cannot run this model or these shapes; says why."""


def choose_engine(config, on_cuda: bool, streaming: bool, stable: bool, capture: GraphCaptureDecision,
                  growing_steps: bool = False, notes: Optional[List[str]] = None) -> str:
    """"graph" (the streaming engine) or "segments", for the configuration's `engine`.
    `growing_steps`: a decoder whose decode steps change shape every step. Why streamed
    weights on the CUDA EP run in segments instead is appended to `notes`."""
    if config.engine == "segments" or not streaming:
        return "segments"
    why = None
    if not on_cuda:
        why = "it replays CUDA graphs, and the CPU execution provider runs segments"
    elif not stable:
        why = "it needs stable addresses (vmm=True)"
    elif not capture.enabled:
        why = f"graph capture is off ({capture.reason})"
    elif config.policy not in ("planned", "stable"):
        why = f"policy {config.policy!r} changes the resident set from step to step; a replayed graph cannot"
    elif growing_steps:
        why = ("this decoder's past is fed at its exact length, so each decode step has new shapes, and the "
               "engine would capture a graph for every one")
    if why is None:
        return "graph"
    if config.engine == "graph":
        raise StreamingUnavailable(f"engine='graph' cannot run this session: {why}")
    if on_cuda and notes is not None:
        notes.append(f"the weights run in segments: {why}")
    return "segments"


def _bit_reversed(i: int) -> float:
    """i's place in the van der Corput sequence (0, 1/2, 1/4, 3/4, ...): any prefix of
    0, 1, 2, ... taken in this order is spread evenly, and so is the rest."""
    x, f = 0.0, 0.5
    while i:
        if i & 1:
            x += f
        i >>= 1
        f /= 2
    return x


@dataclasses.dataclass
class Unit:
    names: List[str]
    offsets: List[int]  # each weight's offset in the unit's addresses
    nbytes: int  # content bytes, from the unit's start to its last weight's end
    granules: int
    va: int = 0
    ring: List[int] = dataclasses.field(default_factory=list)  # the ring granule behind each of its granules


@dataclasses.dataclass
class StreamPlan:
    resident: List[str]  # in first-use order
    units: List[Unit]  # in first-use order
    ring_bytes: int
    allowance: int  # the weights budget: resident bytes + the ring

    @property
    def streamed(self) -> List[str]:
        return [n for u in self.units for n in u.names]


def plan_stream(weights: Sequence[WeightInfo], allowance: int, granularity: int,
                cost: Callable[[Sequence[str]], int], policy: str, shared: Sequence[str] = ()) -> StreamPlan:
    """Which weights stay resident, and the units and ring of the others, for a weights
    budget of `allowance` committed bytes (the resident weights' packed `cost` plus the ring).

    The ring holds the largest streamed weight (and at least RING_FRACTION of the
    budget). The resident set: first the `shared` weights, read by more than one node
    (a rotary table read by every layer would hold its ring granules for the whole
    step); then `planned` takes the weights far above the median size (embeddings, the
    LM head: the ring then only has to hold a typical one), then the smallest, so that
    the streamed weights are few and large, and spread over the step; `stable` takes
    the model's first weights. Either way the set is fixed for the session's life,
    since a replayed graph copies the same weights every step.
    """
    order = sorted(weights, key=lambda w: (w.first_use, w.name))
    floor = round_up(int(allowance * RING_FRACTION), granularity)

    def ring_for(largest: int) -> int:
        return max(round_up(largest, granularity) + RING_SLACK * granularity, floor) if largest else 0

    if policy == "planned":
        # The few weights far above the typical size first (one streamed would size the
        # ring), then the smallest: the weights that stream are then the large ones, which
        # copy at the link's rate with the fewest copies. Among weights of one size (a
        # layer's MLP matrices, in every layer), residents are taken in bit-reversed read
        # order, so that those left to stream are spread over the step and their copies
        # overlap compute from its start to its end; left to the last layers, the copies
        # would wait for compute to reach them.
        typical = sorted(w.nbytes for w in order)[len(order) // 2] if order else 0
        giants = sorted((w for w in order if w.nbytes > GIANT * typical), key=lambda w: (-w.nbytes, w.first_use))
        spread: Dict[str, float] = {}
        by_size: Dict[int, List[WeightInfo]] = collections.defaultdict(list)
        for w in order:
            by_size[w.nbytes].append(w)
        for same in by_size.values():
            for i, w in enumerate(same):
                spread[w.name] = _bit_reversed(i)
        rest = sorted((w for w in order if w.nbytes <= GIANT * typical),
                      key=lambda w: (w.nbytes, spread[w.name], w.first_use))
        candidates = giants + rest
    elif policy == "stable":
        candidates = list(order)
    else:
        raise StreamingUnavailable(f"the streaming engine fixes the resident set; policy {policy!r} changes it "
                                   f"every step")
    # Weights several nodes read stay resident, and so do empty ones: they cost no bytes,
    # and a unit of no granules has nothing to put in the ring.
    must = set(shared) | {w.name for w in weights if w.nbytes == 0}
    resident: List[str] = [w.name for w in order if w.name in must]
    left = collections.Counter(w.nbytes for w in weights if w.name not in must)
    if set(shared) and cost(resident) + ring_for(max(left, default=0)) > allowance:
        raise StreamingUnavailable(f"the weights budget of {allowance} bytes cannot hold the {len(set(shared))} "
                                   f"weights read by several nodes ({cost(resident)} bytes) and a ring")
    for w in candidates:
        if w.name in must:
            continue
        left[w.nbytes] -= 1
        largest_left = max((s for s, c in left.items() if c > 0), default=0)
        trial = resident + [w.name]
        if cost(trial) + ring_for(largest_left) <= allowance:
            resident = trial
        else:
            left[w.nbytes] += 1
    if policy == "planned":
        resident = _fill(order, resident, must, allowance, granularity, cost, ring_for, candidates)
    streamed = [w for w in order if w.name not in set(resident)]
    largest = max((w.nbytes for w in streamed), default=0)
    ring = ring_for(largest)
    if streamed and ring > allowance:
        raise StreamingUnavailable(f"the weights budget of {allowance} bytes cannot hold a ring for the largest "
                                   f"streamed weight ({largest} bytes)")
    # One weight per unit, from a granule boundary: ORT may read weights in another
    # order than the model lists them, and a unit never shares a granule with another.
    units = [Unit([w.name], [0], w.nbytes, round_up(w.nbytes, granularity) // granularity) for w in streamed]
    keep = set(resident)
    return StreamPlan([w.name for w in order if w.name in keep], units, ring, allowance)


FILL_CELLS = 1 << 16  # the fill's resolution: the room left, in at most this many steps
FILL_MASKS = 64 << 20  # the most bits the fill keeps to tell which sizes it took
# What one more streamed weight costs a step beyond its bytes, in bytes the link moves
# in that time: a copy node's own overhead, about 10 us on the H200. The fill trades
# bytes against copies at this rate.
COPY_COST = 512 << 10


def _fill(order: Sequence[WeightInfo], resident: List[str], must, allowance: int, granularity: int,
          cost: Callable[[Sequence[str]], int], ring_for: Callable[[int], int],
          candidates: Sequence[WeightInfo]) -> List[str]:
    """The resident set that fills the weights budget best, for the ring `resident`
    leaves. The greedy pass stops at the first weight that does not fit, which can leave
    most of a large weight's bytes unused (at 25% of a TinyLlama, 6 of 8 MiB). A bounded
    knapsack over the weights' sizes (how many of each size stay resident) fills the
    room to within a granule; each resident weight is worth its bytes plus COPY_COST, so
    the fill takes more copies only for more bytes than they cost. Within a size,
    residents are taken in `candidates` order, so the streamed ones stay spread over the
    step. Returns `resident` unless the fill is worth more and fits."""
    keep = set(resident)
    bytes_of = {w.name: w.nbytes for w in order}
    streamed = [w for w in order if w.name not in keep]
    if not streamed:
        return resident
    largest = max(w.nbytes for w in streamed)
    # The weights above the ring's size stay as they are; those up to it are chosen again.
    fixed = [n for n in resident if n in must or bytes_of[n] > largest]
    free = [w for w in candidates if w.name not in must and w.nbytes <= largest]
    # A pack costs each weight's bytes from an aligned start, rounded up to a granule:
    # the room is what is left of the whole granules the budget holds beside the ring.
    room = (allowance - ring_for(largest)) // granularity * granularity - sum(
        round_up(bytes_of[n], ALIGNMENT) for n in fixed)
    if room <= 0 or not free:
        return resident
    by_size: Dict[int, List[WeightInfo]] = collections.defaultdict(list)
    for w in free:
        by_size[w.nbytes].append(w)
    # Binary splitting: c weights of one size become items of 1, 2, 4, ... weights.
    items: List[Tuple[int, int]] = []  # (size, how many)
    for size, ws in by_size.items():
        c, k = len(ws), 1
        while c > 0:
            take = min(k, c)
            items.append((size, take))
            c -= take
            k *= 2
    cells = max(1, min(FILL_CELLS, FILL_MASKS // len(items)))
    q = max(1, -(-room // cells))
    cap = room // q
    worth = np.full(cap + 1, -1, dtype=np.int64)  # the most a fill of each size is worth; -1: none
    worth[0] = 0
    took = []  # per item, packed: where it raised the worth
    steps_of = []
    for size, take in items:
        steps = -(-round_up(size, ALIGNMENT) * take // q)  # rounded up: what fits in steps fits in bytes
        steps_of.append(steps)
        raised = np.zeros(cap + 1, dtype=bool)
        if steps <= cap:
            before = worth[:cap + 1 - steps]
            gain = np.where(before >= 0, before + take * (size + COPY_COST), -1)
            raised[steps:] = gain > worth[steps:]
            worth[steps:] = np.maximum(worth[steps:], gain)
        took.append(np.packbits(raised))
    at = int(np.argmax(worth))
    count: Dict[int, int] = collections.Counter()
    for (size, take), steps, bits in zip(reversed(items), reversed(steps_of), reversed(took)):
        if bits[at >> 3] & (0x80 >> (at & 7)):  # this item raised the best fill's worth: it is in it
            count[size] += take
            at -= steps
    chosen_set = set(fixed)
    for size, ws in by_size.items():
        chosen_set.update(w.name for w in ws[:count[size]])
    chosen = [w.name for w in order if w.name in chosen_set]
    left = max((w.nbytes for w in order if w.name not in chosen_set), default=0)

    def value(names):
        return sum(bytes_of[n] + COPY_COST for n in names)

    if cost(chosen) + ring_for(left) <= allowance and value(chosen) > value(resident):
        return chosen
    return resident


def ring_by_reads(units: Sequence[Unit], ring: int, copied: Sequence[int], readers: Sequence[Sequence[int]],
                  first_from: Dict[int, int], describe: Callable[[int], str] = str) -> List[List[int]]:
    """Ring granules for each unit, in read order (`copied`): a unit takes the granules
    whose last readers finish earliest, so its copy waits as little as it can.
    StreamingUnavailable when a unit would need granules whose weight is still to be
    read; `describe(k)` says where unit k is read, for the message."""
    done = {gr: -1 for gr in range(ring)}  # ring granule -> the last reader of what it holds
    held: Dict[int, Optional[int]] = {gr: None for gr in range(ring)}
    ring_of = [list(u.ring) for u in units]
    for i in copied:
        picked = sorted(range(ring), key=lambda gr: (done[gr], gr))[:units[i].granules]
        if len(picked) < units[i].granules or done[picked[-1]] >= first_from[i]:
            k = held[picked[-1]] if len(picked) == units[i].granules else None
            whose = (f"the ring granules of {units[k].names[0]!r} (read by nodes {list(readers[k])}: {describe(k)})"
                     if k is not None else f"{units[i].granules} granules of {ring}")
            raise StreamingUnavailable(
                f"the ring of {ring} granules is too small for the order this graph reads its weights in: "
                f"{units[i].names[0]!r} (first read by node {readers[i][0]}) needs {whose}")
        ring_of[i] = sorted(picked)
        for gr in picked:
            done[gr], held[gr] = readers[i][-1], i
    return ring_of


def leading_copies(copies: Sequence[tuple]) -> Sequence[tuple]:
    """The copies at the head of a step's plan that wait for no reader: they land in
    ring granules nothing of the step read before, so they can run before the step
    starts, while the host works on the previous step's outputs."""
    k = 0
    while k < len(copies) and not copies[k][3]:
        k += 1
    return copies[:k]


def plan_copies(units: Sequence[Unit], readers: Sequence[Sequence[int]], copied: Sequence[int],
                first_from: Dict[int, int], granularity: int, address: Dict[str, int],
                nbytes: Dict[str, int], source: Dict[str, int],
                reads: Dict[str, Sequence[int]]) -> List[Tuple[int, int, int, List[int], List[int]]]:
    """The page-in copies of one step, in the order the copy engine runs them:
    (destination, source, bytes, after, before). Units are copied in the order of their
    first reader. Each unit's granules are copied in runs by the unit that held their
    ring granules earlier in the step: first those nobody held, then those whose holder's
    last reader finishes earliest. A run waits for every reader of its holder (`after`),
    and every reader of a weight waits for each of its runs (`before`). So the part of a
    copy that lands in spare ring granules runs while the previous weight is still read.
    StreamingUnavailable when a run would overwrite a weight still to be read."""
    holder: Dict[int, int] = {}  # ring granule -> the unit that last held it in this step
    out = []
    g = granularity
    for i in copied:
        u = units[i]
        runs: List[Tuple[Optional[int], int, int]] = []  # (holder, first granule, end granule)
        for k, gr in enumerate(u.ring):
            h = holder.get(gr)
            if runs and runs[-1][0] == h and runs[-1][2] == k:
                runs[-1] = (h, runs[-1][1], k + 1)
            else:
                runs.append((h, k, k + 1))
        runs.sort(key=lambda r: (-1 if r[0] is None else readers[r[0]][-1], r[1]))
        for h, lo, hi in runs:
            after = [] if h is None else list(readers[h])
            if after and after[-1] >= first_from[i]:
                raise StreamingUnavailable(
                    f"the ring is too small for the order this graph reads its weights in: unit {i} "
                    f"({u.names[0]!r}...) would overwrite weights read after it")
            for n, off in zip(u.names, u.offsets):
                a, b = max(off, lo * g), min(off + nbytes[n], hi * g)
                if a < b:
                    out.append((address[n] + a - off, source[n] + a - off, b - a, after, list(reads[n])))
                    after = []
        for gr in u.ring:
            holder[gr] = i
    return out


class _Graph:
    """One signature's captured step: the graph and the buffers it reads and writes."""

    def __init__(self, graph, buffers: Dict[str, FixedBuffer], outputs: Dict[str, ort.OrtValue],
                 lead: Tuple[Tuple[int, int, int], ...]):
        self.graph = graph
        self.buffers = buffers  # the engine's own: inputs it copies into, outputs the caller did not bind
        self.outputs = outputs  # every output's value, where the graph writes it
        self.lead = lead  # (destination, source, bytes) of the copies issued before the launch


class StreamEngine:
    """Runs a model whose weights do not fit as one captured ORT session, streaming
    through the ring. Offers the runner's interface to the session."""

    streaming = True
    plain = False  # the model runs captured, with the page-ins in its graph

    def __init__(self, device, residency, store, weights: Sequence[WeightInfo], plan: StreamPlan, factory, meter,
                 model, workdir: str, inputs: Sequence[str], graph_outputs: List[str], capture_reason: str,
                 device_id: int):
        self.device = device
        self.residency = residency
        self.store = store
        self.plan = plan
        self._meter = meter
        self._graph_outputs = list(graph_outputs)
        self._device_id = device_id
        self.info = {w.name: w for w in weights}
        self.capture = GraphCaptureDecision(True, f"{capture_reason}; the streaming engine captures one ORT run per "
                                                  f"input-shape signature and adds the page-ins to that graph")
        self.notes: List[str] = []
        self.steps = 0
        self.graph_steps = 0
        self.captures = 0  # graphs made (a replayed step makes none)
        self.last_step = Counters()
        self._graphs: "collections.OrderedDict[tuple, _Graph]" = collections.OrderedDict()
        self._oneshot: Optional[_Graph] = None
        self._handles: List[int] = []
        self._placed_by_reads = False
        self._mapped: List[Tuple[int, int]] = []
        self._reservation: Optional[Tuple[int, int]] = None
        self._charged = 0
        self._initializer_values: List[ort.OrtValue] = []
        self.session = None
        self.runs = []
        self.address: Dict[str, int] = {}
        self._per_step: Optional[Counters] = None
        self._lead: Optional[tuple] = None  # the lead copies issued for the next step, if any
        self._lead_done = self._compute_done = None  # events: after the lead copies, after queued compute
        try:
            self._map_ring()
            so = factory.session_options()
            for w in weights:
                va = residency.slots[w.name].va if w.name in residency.slots else self.address[w.name]
                value = ortvalue_at(va, w.shape, w.dtype, device.is_cuda, device_id)
                so.add_initializer(w.name, value)
                self._initializer_values.append(value)
            path = save_model(model, os.path.join(workdir, "model.onnx"))
            mark = meter.mark()
            self.session = factory.create(path, so, False)[0]
            meter.charge_since(mark, creating=True)
        except BaseException:
            self.session = None
            self._initializer_values = []
            self._unmap_ring()  # the session never sees a half-built engine: give the ring back here
            raise
        segment = Segment(0, list(range(len(model.graph.node))), [w.name for w in weights], list(inputs),
                          list(graph_outputs), model)
        self.runs = [_Run(segment, self.session)]
        self._run_options = ort.RunOptions()
        # ORT would wait for its stream at the end of each run; the graph is what runs.
        self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")

    # ------------------------------------------------------------------ the ring
    def _map_ring(self) -> None:
        dev, plan = self.device, self.plan
        backend, g = dev.backend, dev.granularity
        if not plan.units:
            return
        # One unmapped granule after each unit: an address one past a weight's end, which
        # kernels take as a bound, falls in no other weight's range.
        total = sum(u.granules + 1 for u in plan.units) * g
        dev.ledger.charge("transient", plan.ring_bytes, outside=True)
        self._charged = plan.ring_bytes
        base = backend.reserve(total)
        self._reservation = (base, total)
        for _ in range(plan.ring_bytes // g):
            self._handles.append(backend.create(g))
        va = base
        for u in plan.units:
            u.va = va
            for n, off in zip(u.names, u.offsets):
                self.address[n] = va + off
            va += (u.granules + 1) * g
        # Until ORT's reads are seen, the units take the ring in turn.
        ring, cursor, first = len(self._handles), 0, []
        for u in plan.units:
            first.append([(cursor + k) % ring for k in range(u.granules)])
            cursor = (cursor + u.granules) % ring
        self._place(first)

    def _place(self, ring_of: List[List[int]]) -> None:
        """Maps granule k of unit i onto ring granule ring_of[i][k]."""
        backend, g = self.device.backend, self.device.granularity
        for va, n in self._mapped:
            backend.unmap(va, n)
        self._mapped = []
        for u, ring in zip(self.plan.units, ring_of):
            u.ring = list(ring)
            for k, r in enumerate(ring):
                backend.map(u.va + k * g, g, self._handles[r])
                self._mapped.append((u.va + k * g, g))
            backend.set_access(u.va, u.granules * g)

    def _unmap_ring(self) -> None:
        backend = self.device.backend
        try:
            for va, n in self._mapped:
                backend.unmap(va, n)
            self._mapped = []
            for h in self._handles:
                backend.release(h)
            self._handles = []
            if self._reservation is not None:
                backend.free_reservation(*self._reservation)
                self._reservation = None
        finally:
            if self._charged:
                self.device.ledger.refund("transient", self._charged, outside=True)
                self._charged = 0

    # ------------------------------------------------------------------ building a step's graph
    def _bind(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue]) -> ort.IOBinding:
        io = self.session.io_binding()
        for k, v in feeds.items():
            io.bind_ortvalue_input(k, v)
        for name in dict.fromkeys(self._graph_outputs):  # an output listed twice is bound once
            if name in outputs:
                io.bind_ortvalue_output(name, outputs[name])
            else:
                io.bind_output(name, "cuda" if self.device.is_cuda else "cpu", self._device_id)
        return io

    def _build(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue],
               buffers: Dict[str, FixedBuffer]) -> _Graph:
        """Warm-up, capture, page-in copies, instantiate: one signature's graph."""
        dev = self.device
        stream = dev.compute_stream
        # The warm-up: ORT takes its memory and picks its kernels. The streamed weights'
        # addresses hold whatever the ring last held; the outputs it writes are
        # overwritten by the graph's own run. What ORT took for it is charged to the
        # scratch zone once the graph is made (StepMemoryShort when it has no room).
        mark = self._meter.mark()
        io = self._bind(feeds, outputs)
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
            io = self._bind(feeds, bound)
            self._ort_run(io)  # at the addresses the capture uses
            stream.synchronize()
            graph = self._capture(io)
            lead = self._add_page_ins(graph)
            graph.instantiate(stream)
            self._meter.charge_since(mark)
            self.captures += 1
        except BaseException:
            for name in made:
                dev.scratch.deallocate(buffers.pop(name).ptr)
            raise
        return _Graph(graph, buffers, bound, lead)

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

        return ring_by_reads(self.plan.units, len(self._handles), copied, readers, first_from, describe)

    def _add_page_ins(self, graph) -> Tuple[Tuple[int, int, int], ...]:
        """Adds the page-in copies to the captured graph, all but the lead (returned)."""
        units = self.plan.units
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
        if not self._placed_by_reads:
            # ORT's reads, seen for the first time: the ring follows them from now on.
            self.device.copy_stream.synchronize()  # no lead copy may still land in the ring
            self._place(self._ring_by_reads(graph, copied, readers, first_from))
            self._placed_by_reads = True
        copies = plan_copies(units, readers, copied, first_from, self.device.granularity, self.address,
                             {n: self.info[n].nbytes for n in names}, {n: self.store.ptr(n) for n in names}, found)
        lead = leading_copies(copies)
        graph.add_copies(copies[len(lead):])
        return tuple((c[0], c[1], c[2]) for c in lead)

    # ------------------------------------------------------------------ running
    def _issue_lead(self, lead) -> None:
        """The lead copies of a step, on the copy stream after everything the compute
        stream has queued; the next launch waits for them (`_lead_done`)."""
        dev = self.device
        self._lead = None
        if self._lead_done is None:
            self._lead_done, self._compute_done = dev.backend.create_event(), dev.backend.create_event()
        self._compute_done.record(dev.compute_stream)
        self._compute_done.wait_on(dev.copy_stream)
        for dst, src, n in lead:
            dev.backend.copy_h2d(dst, src, n, dev.copy_stream)
        self._lead_done.record(dev.copy_stream)
        self._lead = lead

    def _launch(self, g: _Graph) -> None:
        stream = self.device.compute_stream
        if self._lead != g.lead:  # the copies issued after the last step were another graph's
            self._issue_lead(g.lead)
        if self._lead_done is not None:
            self._lead_done.wait_on(stream)
        self._lead = None  # the graph may overwrite them from here on
        g.graph.launch(stream)
        # As after ORT's own run, the outputs are complete on return: the caller reads
        # them from the host (the step's one host wait) or from any stream.
        stream.synchronize()
        self.steps += 1
        self.graph_steps += 1
        self._count_step()
        # The next step's lead copies run while the caller works on this one's outputs:
        # nothing reads the granules they land in before the next launch, which waits
        # for them.
        self._issue_lead(g.lead)

    def _count_step(self) -> None:
        """Counts a replayed step: every resident weight hits, every streamed one is copied."""
        if self._per_step is None:
            resident, streamed = list(self.residency.slots), self.plan.streamed
            resident_bytes = sum(self.info[n].nbytes for n in resident)
            streamed_bytes = sum(self.info[n].nbytes for n in streamed)
            self._per_step = Counters(steps=1, accesses=len(resident) + len(streamed), hits=len(resident),
                                      page_ins=len(streamed), access_bytes=resident_bytes + streamed_bytes,
                                      hit_bytes=resident_bytes, bypassed=len(streamed), bypassed_bytes=streamed_bytes,
                                      htod_bytes=streamed_bytes)
        c, step = self.residency.counters, self._per_step
        for f in dataclasses.fields(Counters):
            setattr(c, f.name, getattr(c, f.name) + getattr(step, f.name))
        self.last_step = step

    def _keep(self, sig, g: _Graph) -> None:
        self._graphs[sig] = g
        while len(self._graphs) > GRAPH_SIGNATURES:
            self._free(self._graphs.popitem(last=False)[1])

    def _free(self, g: Optional[_Graph]) -> None:
        if g is None:
            return
        self.device.compute_stream.synchronize()  # nothing may still replay onto the buffers
        g.graph = None
        for buf in g.buffers.values():
            self.device.scratch.deallocate(buf.ptr)
        g.buffers.clear()

    def run_bound(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue], *,
                  fixed: bool, key: Optional[tuple] = None) -> Tuple[Dict[str, ort.OrtValue], bool]:
        """One step with the caller's values bound where they are (see SegmentRunner.run_bound).
        Every step runs as a graph: `fixed` keeps it for the steps to come."""
        sig = ("bound", key if key is not None
               else signature(feeds, addresses=True) + signature(outputs, "->", addresses=True))
        g = self._graphs.get(sig) if fixed else None
        if g is None:
            self._free(self._oneshot)
            self._oneshot = None
            g = self._build(feeds, outputs, {})
            if fixed:
                self._keep(sig, g)
            else:
                self._oneshot = g
        else:
            self._graphs.move_to_end(sig)
        self._launch(g)
        values = dict(feeds)
        values.update(g.outputs)
        return values, True

    def run_segments(self, input_feed, run_options=None) -> Dict[str, ort.OrtValue]:
        """One step on the caller's values (host or device); returns every output's value."""
        feeds = {k: as_ortvalue(v) for k, v in input_feed.items()}
        sig = ("run",) + signature(feeds)
        g = self._graphs.get(sig)
        if g is None:
            buffers: Dict[str, FixedBuffer] = {}
            try:
                for k, v in feeds.items():
                    dtype = numpy_dtype(v.data_type())
                    ptr = self.device.scratch.allocate(max(1, nbytes_of(v.shape(), dtype)))
                    buffers[k] = FixedBuffer.on(self.device, ptr, v.shape(), dtype)
                for k, v in feeds.items():
                    copy_into(self.device, buffers[k], v)
                g = self._build({k: buffers[k].value for k in feeds}, {}, buffers)
            except BaseException:
                for buf in buffers.values():
                    self.device.scratch.deallocate(buf.ptr)
                raise
            self._keep(sig, g)
        else:
            self._graphs.move_to_end(sig)
            for k, v in feeds.items():
                copy_into(self.device, g.buffers[k], v)
        self._launch(g)
        values = dict(feeds)
        values.update(g.outputs)
        return values

    def run(self, output_names, input_feed, run_options):
        values = self.run_segments(input_feed, run_options)
        return [values[n].numpy() for n in (output_names or self._graph_outputs)]

    @property
    def single(self) -> ort.InferenceSession:
        if self.session is None:  # closed, as another thread may find it while the session closes
            raise StateError("the session is closed")
        return self.session

    @property
    def plan_count(self) -> int:
        return len(self._graphs)

    def drop_plans(self, keys) -> None:
        for key in keys:
            g = self._graphs.pop(("bound", key), None)
            self._free(g)
        if self._oneshot is not None:
            self._free(self._oneshot)
            self._oneshot = None

    def close(self) -> None:
        """The graphs, then the ORT session (it may free scratch), then the ring."""
        try:
            for stream in (self.device.compute_stream, self.device.copy_stream):
                if not stream.closed:
                    stream.synchronize()
            self._lead = None
            for g in list(self._graphs.values()) + [self._oneshot]:
                self._free(g)
            self._graphs.clear()
            self._oneshot = None
            self.runs = []
            self.session = None
            self._initializer_values = []
        finally:
            self._unmap_ring()


class _Run:
    def __init__(self, seg: Segment, session):
        self.seg = seg
        self.session = session
        self.captured = True
