"""The residency manager: which weights are resident, which stream, and when.

Every weight has a slot keyed by its initializer name. A segment runs only once all
of its weights are resident (the residency guarantee): `acquire` pages in the misses
and pins the whole segment; `release` records the run's event as the last reader,
unpins, and evicts the weights that were only passing through.

A miss goes to the weights zone when the policy admits it and the allowance has room
(after evicting the policy's victims). Otherwise it becomes a bypass page in the
transient zone, inside the same ledger, and is evicted right after its segment.

Policies:
- ``stable``: a first-fit resident subset, fixed up front; zero evictions.
- ``planned``: knows the cyclic order of the segments and picks the resident set with
  the most resident bytes per step (a knapsack over segment packs, then first-fit for
  the rest), and streams the remainder; zero evictions.
- ``lru`` and ``mru``: admit every miss and evict the least / most recently used.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import _core
from .errors import StateError
from .model import WeightInfo


@dataclasses.dataclass
class Counters:
    """Offload counters. `page_ins + hits == accesses` always holds."""

    steps: int = 0
    accesses: int = 0
    hits: int = 0
    page_ins: int = 0
    access_bytes: int = 0
    hit_bytes: int = 0
    bypassed: int = 0
    bypassed_bytes: int = 0
    evictions: int = 0
    htod_bytes: int = 0
    htod_ms: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def byte_hit_rate(self) -> float:
        return self.hit_bytes / self.access_bytes if self.access_bytes else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["hit_rate"] = self.hit_rate
        d["byte_hit_rate"] = self.byte_hit_rate
        return d

    def minus(self, other: "Counters") -> "Counters":
        return Counters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)})


class PlainSlot:
    """A weight in the plain baseline: a fresh allocation on every page-in, so its
    address changes, and captured graphs cannot use it."""

    def __init__(self, arena, key: str, length: int):
        self.arena, self.key, self.length = arena, key, length
        self.va = 0
        self.state = "evicted"
        self.charged_zone = "weights"
        self._source = 0
        self._readers: list = []
        self._pins = 0

    def set_source(self, ptr: int, nbytes: int) -> None:
        self._source = ptr

    def pin(self) -> None:
        if self.state == "evicted":
            raise _state_error(self, "be pinned")
        self._pins += 1
        self.state = "pinned"

    def unpin(self) -> None:
        if self.state != "pinned":
            raise _state_error(self, "be unpinned")
        self._pins -= 1
        if self._pins == 0:
            self.state = "resident"

    @staticmethod
    def page_in(slots: Sequence["PlainSlot"], zone: str, stream):
        arena = slots[0].arena
        done = []
        try:
            for s in slots:
                if s.state != "evicted":
                    raise _state_error(s, "be paged in")
                s.va = arena.plain_alloc(zone, s.length)
                done.append(s)
                arena.backend.copy_h2d(s.va, s._source, s.length, stream)
        except BaseException:
            stream.synchronize()
            for s in done:
                arena.plain_free(s.va)
                s.va = 0
            raise
        ev = arena.backend.create_event()
        ev.record(stream)
        for s in slots:
            s.state, s.charged_zone, s._readers = "resident", zone, [ev]
        return ev

    @staticmethod
    def evict(slots: Sequence["PlainSlot"]) -> None:
        for s in slots:
            if s.state != "resident":
                raise _state_error(s, "be evicted")
        for s in slots:
            for ev in s._readers:  # never free what a reader may still use
                ev.synchronize()
            s.arena.plain_free(s.va)
            s.va, s.state, s._readers = 0, "evicted", []


def _state_error(slot, op: str) -> StateError:
    return StateError(f"slot '{slot.key}' at {slot.va:#x} cannot {op} while {slot.state}")


class IncrementalCost:
    """Committed bytes of a growing set of weights, as the arena would charge them."""

    def __init__(self, slots: Dict[str, object], granularity: int, vmm: bool):
        self._slots, self._g, self._vmm = slots, granularity, vmm
        self._map = _core.GranuleMap(granularity) if vmm else None
        self.total = 0

    def extra(self, name: str) -> int:
        s = self._slots[name]
        if not self._vmm:
            return _core.plain_charge(s.length, self._g)
        return self._map.incremental_commit_bytes([(s.va, s.length)])

    def add(self, name: str) -> None:
        s = self._slots[name]
        self.total += self.extra(name)
        if self._vmm:
            for first, count in self._map.uncovered_runs([(s.va, s.length)]):
                self._map.add_extent(first, count, 0, _core.Zone.WEIGHTS)


class Policy:
    name = "policy"

    def prepare(self, mgr: "ResidencyManager") -> None:
        pass

    def admit(self, name: str) -> bool:
        return True

    def victim(self, resident: "collections.OrderedDict[str, None]", exclude: set) -> Optional[str]:
        """The next weight to evict from the weights zone, least recently used first."""
        return next((n for n in resident if n not in exclude), None)

    def reclaim_victim(self, resident, exclude: set) -> Optional[str]:
        """What to give up when another zone borrows budget."""
        return next((n for n in reversed(resident) if n not in exclude), None)


class LRUPolicy(Policy):
    name = "lru"


class MRUPolicy(Policy):
    name = "mru"

    def victim(self, resident, exclude):
        return next((n for n in reversed(resident) if n not in exclude), None)


class StablePolicy(Policy):
    """First fit, in first-use order, into the weights allowance. Never evicts."""

    name = "stable"

    def __init__(self):
        self.resident_set: set = set()

    def prepare(self, mgr):
        self.resident_set = first_fit(mgr.order, mgr.cost_model(), mgr.allowance)

    def admit(self, name):
        return name in self.resident_set

    def victim(self, resident, exclude):
        return None


class PlannedPolicy(StablePolicy):
    """The resident set with the most bytes per step; the rest streams."""

    name = "planned"

    def prepare(self, mgr):
        uses = collections.Counter(n for seg in mgr.segments for n in seg)
        value = {n: mgr.slots[n].length * uses[n] for n in mgr.order}
        knap = plan_by_packs(mgr, value)
        fit = first_fit(mgr.order, mgr.cost_model(), mgr.allowance)
        score = lambda s: sum(value[n] for n in s)  # noqa: E731
        self.resident_set = knap if score(knap) >= score(fit) else fit


def first_fit(order: Sequence[str], cost: IncrementalCost, allowance: int) -> set:
    chosen = set()
    for n in order:
        if cost.total + cost.extra(n) <= allowance:
            cost.add(n)
            chosen.add(n)
    return chosen


def plan_by_packs(mgr: "ResidencyManager", value: Dict[str, int]) -> set:
    """0/1 knapsack over segment packs, in granules (a pack's cost counts the granules it
    may share with a neighbour, so the sum is an upper bound), then first-fit of the
    remaining weights, at their true incremental cost, into what is left."""
    g = mgr.granularity
    packs = [p for p in mgr.packs if p]
    costs = []
    for p in packs:
        c = mgr.cost_model()
        for n in p:
            c.add(n)
        costs.append(-(-c.total // g))
    cap = mgr.allowance // g
    best = np.zeros(cap + 1, dtype=np.float64)
    take = np.zeros((len(packs), cap + 1), dtype=bool)
    for i, (p, w) in enumerate(zip(packs, costs)):
        if w > cap:
            continue
        v = float(sum(value[n] for n in p))
        cand = np.full(cap + 1, -1.0)
        cand[w:] = best[:cap + 1 - w] + v
        better = cand > best
        take[i] = better
        best = np.where(better, cand, best)
    chosen, c = set(), int(np.argmax(best))
    for i in range(len(packs) - 1, -1, -1):
        if take[i, c]:
            chosen.update(packs[i])
            c -= costs[i]
    cost = mgr.cost_model()
    for n in mgr.order:
        if n in chosen:
            cost.add(n)
    for n in mgr.order:
        if n not in chosen and cost.total + cost.extra(n) <= mgr.allowance:
            cost.add(n)
            chosen.add(n)
    return chosen


POLICY_CLASSES = {"stable": StablePolicy, "planned": PlannedPolicy, "lru": LRUPolicy, "mru": MRUPolicy}


class ResidencyManager:
    """Slots, the policy and the counters for one device and one model's weights."""

    def __init__(self, device, store, weights: Sequence[WeightInfo], segments: Sequence[Sequence[str]],
                 policy: str, vmm: bool, record_timeline: bool = False):
        self.device = device
        self.store = store
        self.vmm = vmm
        self.granularity = device.granularity
        self.segments = [list(s) for s in segments]
        self.info = {w.name: w for w in weights}
        # Pack order: each weight lives in the pack of the first segment that reads it.
        # Packs follow each other at byte granularity: the granule on a boundary between
        # two segments is refcounted, committed once and freed when neither holds it.
        owner: Dict[str, int] = {}
        for k, seg in enumerate(self.segments):
            for n in seg:
                owner.setdefault(n, k)
        self.packs: List[List[str]] = [[] for _ in self.segments]
        for n in sorted(owner, key=lambda n: (owner[n], self.info[n].first_use, n)):
            self.packs[owner[n]].append(n)
        self.order = [n for p in self.packs for n in p]
        self.slots: Dict[str, object] = {}
        for pack in self.packs:
            for n in pack:
                nbytes = self.info[n].nbytes
                if vmm:
                    slot = _core.WeightSlot(device.arena, n, nbytes, 256, "weights")
                else:
                    slot = PlainSlot(device.arena, n, nbytes)
                slot.set_source(store.ptr(n), nbytes)
                self.slots[n] = slot
        self.resident: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        self.counters = Counters()
        self.timeline: Optional[List[bytes]] = [] if record_timeline else None
        self.policy = POLICY_CLASSES[policy]()
        self.policy.prepare(self)
        self._pending: Dict[int, tuple] = {}
        device.ledger.set_reclaimer("weights", self._reclaim)

    # ------------------------------------------------------------------ sizing
    @property
    def allowance(self) -> int:
        return self.device.ledger.snapshot()["zones"]["weights"]["allowance"]

    def cost_model(self) -> IncrementalCost:
        return IncrementalCost(self.slots, self.granularity, self.vmm)

    def _group_cost(self, names: Sequence[str]) -> int:
        if not names:
            return 0
        if self.vmm:
            return self.device.arena.incremental_commit_bytes([(self.slots[n].va, self.slots[n].length) for n in names])
        return sum(_core.plain_charge(self.slots[n].length, self.granularity) for n in names)

    def _page_in(self, names: Sequence[str], zone: str):
        slots = [self.slots[n] for n in names]
        cls = _core.WeightSlot if self.vmm else PlainSlot
        return cls.page_in(slots, zone, self.device.copy_stream)

    def _evict(self, names: Sequence[str]) -> None:
        cls = _core.WeightSlot if self.vmm else PlainSlot
        cls.evict([self.slots[n] for n in names])

    # ------------------------------------------------------------------ the guarantee
    def acquire(self, k: int):
        """Makes every weight of segment k resident and pinned. Returns the event after
        which the copies are done (None when everything hit)."""
        names = self.segments[k]
        c = self.counters
        pinned: List[str] = []
        bypass: List[str] = []
        try:
            misses = []
            for n in names:
                if self.slots[n].state == "evicted":
                    misses.append(n)
                else:
                    self.slots[n].pin()
                    pinned.append(n)
                    if n in self.resident:
                        self.resident.move_to_end(n)
            current = set(names)
            admitted: List[str] = []
            ledger = self.device.ledger
            for n in misses:
                if not self.policy.admit(n):
                    bypass.append(n)
                    continue
                # Recomputed after each eviction: a victim may have shared a granule with the group.
                while (need := self._group_cost(admitted + [n])) > ledger.headroom("weights"):
                    victim = self.policy.victim(self.resident, current)
                    if victim is None:
                        break
                    self._evict([victim])
                    del self.resident[victim]
                    c.evictions += 1
                if ledger.headroom("weights") >= need:
                    admitted.append(n)
                else:
                    bypass.append(n)
            start = self.device.backend.create_event()
            start.record(self.device.copy_stream)
            ready = None
            if admitted:
                ready = self._page_in(admitted, "weights")
                for n in admitted:
                    self.slots[n].pin()
                    pinned.append(n)
                    self.resident[n] = None
            if bypass:
                need = self._group_cost(bypass)
                if not ledger.can_charge("transient", need):
                    ledger.make_room("transient", need)
                # The same copy stream as the admitted page-in: this later event covers both.
                ready = self._page_in(bypass, "transient")
                for n in bypass:
                    self.slots[n].pin()
                    pinned.append(n)
        except BaseException:
            for n in pinned:
                self.slots[n].unpin()
            streamed = [n for n in bypass if self.slots[n].state != "evicted"]
            if streamed:
                self._evict(streamed)
            raise
        paged = admitted + bypass
        c.accesses += len(names)
        c.hits += len(names) - len(paged)
        c.page_ins += len(paged)
        c.bypassed += len(bypass)
        nbytes = {n: self.slots[n].length for n in names}
        c.access_bytes += sum(nbytes.values())
        c.hit_bytes += sum(nbytes[n] for n in names if n not in paged)
        c.bypassed_bytes += sum(nbytes[n] for n in bypass)
        c.htod_bytes += sum(nbytes[n] for n in paged)
        self._pending[k] = (start, ready, bypass)
        if self.timeline is not None:
            self.timeline.append(self._snapshot_states())
        return ready

    def release(self, k: int, reader_event=None) -> None:
        """Segment k has been submitted; `reader_event` marks the end of its reads."""
        names = self.segments[k]
        start, ready, bypass = self._pending.pop(k)
        if reader_event is not None:
            if self.vmm:
                self.device.arena.note_reader([(self.slots[n].va, self.slots[n].length) for n in names], reader_event)
            else:
                for n in names:
                    self.slots[n]._readers.append(reader_event)
        for n in names:
            self.slots[n].unpin()
        if bypass:
            self._evict(bypass)  # waits for the reader inside
        if ready is not None:
            ready.synchronize()
            self.counters.htod_ms += ready.elapsed_ms(start)

    def end_step(self) -> None:
        self.counters.steps += 1

    def _reclaim(self, nbytes: int) -> int:
        """Lends weights-zone budget to a higher-priority zone."""
        ledger = self.device.ledger
        before = ledger.snapshot()["zones"]["weights"]["committed"]["current"]
        freed = 0
        pinned = {n for n, s in self.slots.items() if s.state == "pinned"}
        while freed < nbytes:
            victim = self.policy.reclaim_victim(self.resident, pinned)
            if victim is None:
                break
            self._evict([victim])
            del self.resident[victim]
            self.counters.evictions += 1
            freed = before - ledger.snapshot()["zones"]["weights"]["committed"]["current"]
        return freed

    def _snapshot_states(self) -> bytes:
        code = {"evicted": 0, "resident": 1, "paging_in": 1, "pinned": 1}
        return bytes(2 if self.slots[n].state != "evicted" and self.slots[n].charged_zone == "transient"
                     else code[self.slots[n].state] for n in self.order)

    def make_all_resident(self) -> None:
        """Pages in every weight to the weights zone in one transaction (budget permitting)."""
        names = [n for n in self.order if self.slots[n].state == "evicted"]
        if names:
            self._page_in(names, "weights").synchronize()
            for n in names:
                self.resident[n] = None

    def close(self) -> None:
        self.device.ledger.clear_reclaimer("weights")
        by_zone: Dict[str, List[str]] = collections.defaultdict(list)
        for n, s in self.slots.items():
            if s.state == "pinned":
                s.unpin()
            if s.state != "evicted":
                by_zone[s.charged_zone].append(n)
        for names in by_zone.values():
            self._evict(names)
        self.resident.clear()
        self.slots.clear()
