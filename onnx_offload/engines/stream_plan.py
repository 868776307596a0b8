"""The streaming engine's plan: which weights stay resident, the units the others stream
in, the ring behind them, and the page-in copies of a step (pure functions, no device).

Layout (``plan_stream``). The weights that stay resident live in the arena's weights
zone, pinned for the session's life. Each of the others is a unit that streams: it has
stable addresses of its own, from a granule boundary, inside one reservation. Behind
those addresses lies the ring, a small set of physical granules that holds the largest
streamed weight and RING_SLACK spare granule(s). A unit's granules are mapped onto ring
granules once: in turn at construction, then, when the first captured graph shows the
order ORT reads the weights in, each unit onto the ring granules whose readers finish
earliest (``ring_by_reads``). Every streamed weight keeps one address for the session's
life, and many units share each ring granule.

Copies (``plan_copies``). A weight's granules are copied in runs by the unit that held
their ring granules earlier in the step, with these edges:
- each copy after the one before it, so one copy at a time runs at the link's rate;
- each run after every reader of the unit that held its ring granules;
- each reader of a weight after every run of that weight.
The part of a copy that lands in the spare granules thus runs while the weight before
it is still read. The step's leading copies (``leading_copies``) wait for no reader.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._core import DEFAULT_ALIGNMENT as ALIGNMENT, round_up
from ..errors import OffloadError
from ..loading import WeightInfo
from .graph_capture import GraphCaptureDecision

# The ring's floor, as a share of the weights budget: 0. Decode is bound by the link (on
# the H200 a 23 MB weight copies in 0.4 ms, its reader takes microseconds); a ring of
# several weights was no faster than one with a spare granule (below), and costs bytes.
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
GIANT = 4  # a weight over this many times the median size is resident first under `planned`


class StreamingUnavailable(OffloadError):
    """The streaming engine cannot run this model or these shapes; says why."""


def choose_engine(config, on_cuda: bool, streaming: bool, stable: bool, capture: GraphCaptureDecision,
                  growing_steps: bool = False, notes: Optional[List[str]] = None, routed: bool = False) -> str:
    """"graph" (the streaming engine) or "segments", for the configuration's `engine`.
    `growing_steps`: a decoder whose decode steps change shape every step; `routed`: its
    experts stream by route. Why streamed weights on the CUDA EP run in segments instead
    is appended to `notes`."""
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
    elif routed:
        why = "its experts stream by route (experts='routed'): the router's picks are read between segments"
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
    in_host: List[str] = dataclasses.field(default_factory=list)  # read in place over the link: tables

    @property
    def streamed(self) -> List[str]:
        return [n for u in self.units for n in u.names]


def plan_stream(weights: Sequence[WeightInfo], allowance: int, granularity: int,
                cost: Callable[[Sequence[str]], int], policy: str, shared: Sequence[str] = ()) -> StreamPlan:
    """Which weights stay resident, and the units and ring of the others, for a weights
    budget of `allowance` committed bytes (the resident weights' packed `cost` plus the ring).

    The weights one node reads first, side by side in first-use order (an int4
    MatMulNBits's packed weight, its scales and zero points), stay resident or stream
    together, as one item laid out as in the host store: the kernel waits for all of
    them, so streaming part of them saves it nothing, and they copy as one."""
    order = sorted(weights, key=lambda w: (w.first_use, w.name))
    groups: List[List[WeightInfo]] = []
    for w in order:
        # An empty weight has no address range to show its reader: it stays alone (and resident).
        if groups and w.nbytes and groups[-1][-1].nbytes and groups[-1][-1].first_use == w.first_use:
            groups[-1].append(w)
        else:
            groups.append([w])
    members: Dict[str, List[Tuple[str, int]]] = {}  # item -> (weight, offset in the item)
    items = []
    for g in groups:
        at, placed = 0, []
        for w in g:
            at = round_up(at, ALIGNMENT)
            placed.append((w.name, at))
            at += w.nbytes
        members[g[0].name] = placed
        items.append(dataclasses.replace(g[0], nbytes=at))
    shared = set(shared)
    plan = _plan_items(items, allowance, granularity, lambda names: cost([m for n in names for m, _ in members[n]]),
                       policy, [g[0].name for g in groups if any(w.name in shared for w in g)])
    for u in plan.units:
        u.names, u.offsets = [m for n in u.names for m, _ in members[n]], \
            [off + at for n, off in zip(u.names, u.offsets) for _, at in members[n]]
    plan.resident = [m for n in plan.resident for m, _ in members[n]]
    return plan


def _plan_items(weights: Sequence[WeightInfo], allowance: int, granularity: int,
                cost: Callable[[Sequence[str]], int], policy: str, shared: Sequence[str] = ()) -> StreamPlan:
    """plan_stream over `weights`, each of which may stand for a group of weights.

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
    # One item per unit, from a granule boundary: ORT may read weights in another
    # order than the model lists them, and a unit never shares a granule with another.
    units = [Unit([w.name], [0], w.nbytes, round_up(w.nbytes, granularity) // granularity) for w in streamed]
    keep = set(resident)
    return StreamPlan([w.name for w in order if w.name in keep], units, ring, allowance)


FILL_CELLS = 1 << 16  # the fill's resolution: the room left, in at most this many steps
FILL_MASKS = 64 << 20  # the most bits the fill keeps to tell which sizes it took
# What one more streamed weight costs a step beyond its bytes, in bytes the link moves
# meanwhile: a copy node's own overhead, about 10 us on the H200 (the fill's rate).
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
    whose last readers finish earliest, its first granule the earliest, so that its copy
    waits as little as it can and the part that runs while the weight before is read is
    whole granules, not the partly filled last one (an int4 weight with its scales fills
    3 granules and a tenth of a fourth). StreamingUnavailable when a unit would need
    granules whose weight is still to be read; `describe(k)` says where k is read."""
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
        ring_of[i] = picked  # the unit's first, whole granules where the copy waits least
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
        # A unit laid out as its weights lie in the host store copies each run in one
        # copy, whatever weights the run spans.
        base = source[u.names[0]]
        whole = len(u.names) > 1 and all(source[n] - base == off for n, off in zip(u.names, u.offsets))
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
            if whole:
                a, b = lo * g, min(hi * g, u.nbytes)
                spanned = [n for n, off in zip(u.names, u.offsets) if off < b and off + nbytes[n] > a]
                out.append((address[u.names[0]] + a, base + a, b - a, after,
                            sorted({r for n in spanned for r in reads[n]})))
                continue
            for n, off in zip(u.names, u.offsets):
                a, b = max(off, lo * g), min(off + nbytes[n], hi * g)
                if a < b:
                    out.append((address[n] + a - off, source[n] + a - off, b - a, after, list(reads[n])))
        for gr in u.ring:
            holder[gr] = i
    return out
