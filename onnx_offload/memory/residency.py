"""The residency manager: which weights are resident, which stream, and when.

Every weight has a slot keyed by its initializer name. A segment runs only once all
of its weights are resident (the residency guarantee): `acquire` pages in the misses
and pins the whole segment; `release` records the run's event as the last reader,
unpins, and evicts the weights that were only passing through.

A miss goes to the weights zone when the policy admits it and the allowance has room
(after evicting the policy's victims). Otherwise it becomes a bypass page in the
transient zone, inside the same ledger, and is evicted right after its segment.

Which misses are admitted and which weights give way is the policy's choice
(``policies.py``); how a slot is backed is the slot kind's (``slots.py``).
"""
from __future__ import annotations

import collections
from typing import Dict, List, Optional, Sequence

from .._core import round_up
from ..loading import WeightInfo
from .counters import Counters
from .experts import ExpertPolicy, carve_experts
from .policies import PolicyInputs, make_policy
from .slots import slot_kind


def packs(segments: Sequence[Sequence[str]], first_use: Dict[str, int]) -> List[List[str]]:
    """The weights of each segment's pack: a weight lies with the first segment that
    reads it, in first-use order. The slots are carved in this order, one pack after
    another."""
    owner: Dict[str, int] = {}
    for k, seg in enumerate(segments):
        for n in seg:
            owner.setdefault(n, k)
    out: List[List[str]] = [[] for _ in segments]
    for n in sorted(owner, key=lambda n: (owner[n], first_use[n], n)):
        out[owner[n]].append(n)
    return out


def segment_costs(segments: Sequence[Sequence[str]], sizes: Dict[str, int], first_use: Dict[str, int],
                  kind, granularity: int) -> List[int]:
    """What paging in each segment whole commits, with the slots laid out as the
    residency manager carves them (packs one after another, from a granule boundary).
    A weight read by several segments lies in the first one's pack, so each later
    reader pays for the granules it lies in as well."""
    if not kind.stable_addresses:
        return [kind.packed_cost([sizes[n] for n in seg], granularity) for seg in segments]
    granules: Dict[str, range] = {}  # the granules each weight lies in
    end = 0
    for pack in packs(segments, first_use):
        for n in pack:
            start = round_up(end, kind.alignment)
            end = start + sizes[n]
            granules[n] = range(start // granularity, (end - 1) // granularity + 1 if sizes[n] else 0)
    return [len({g for n in seg for g in granules[n]}) * granularity for seg in segments]


class ResidencyManager:
    """Slots, the policy and the counters for one device and one model's weights."""

    def __init__(self, device, store, weights: Sequence[WeightInfo], segments: Sequence[Sequence[str]],
                 policy: str, vmm: bool, record_timeline: bool = False, experts: Optional[Dict[str, int]] = None):
        """`experts`: stacked initializers that stream by expert, with their expert
        counts (see ``experts.py``); each expert is a slot of its own, and the segments,
        packs and policy see the experts' slots in the stack's place."""
        self.device = device
        self.store = store
        self.kind = slot_kind(vmm)
        self.granularity = device.granularity
        self.info = {w.name: w for w in weights}
        # Pack order: each weight lives in the pack of the first segment that reads it.
        # Packs follow each other at byte granularity: the granule on a boundary between
        # two segments is refcounted, committed once and freed when neither holds it.
        stack_packs = packs([list(s) for s in segments], {n: w.first_use for n, w in self.info.items()})
        self.slots: Dict[str, object] = {}
        self.parts: Dict[str, List[str]] = {}  # a stack that streams by expert -> its experts' slots
        for n in (n for p in stack_packs for n in p):
            nbytes = self.info[n].nbytes
            carved = (carve_experts(self.kind, device.arena, n, nbytes, experts[n], store.ptr(n))
                      if experts and n in experts and self.kind.stable_addresses else None)
            if carved is not None:
                self.slots.update(carved)
                self.parts[n] = list(carved)
                continue
            slot = self.kind.make(device.arena, n, nbytes)
            slot.set_source(store.ptr(n), nbytes)
            self.slots[n] = slot
        self.stack_of = {e: n for n, parts in self.parts.items() for e in parts}

        def expand(names):
            return [p for n in names for p in self.parts.get(n, (n,))]

        self.segments = [expand(s) for s in segments]
        self.packs = [expand(p) for p in stack_packs]
        self.order = [n for p in self.packs for n in p]
        self.counters = Counters()
        self.timeline: Optional[List[bytes]] = [] if record_timeline else None
        # With the timeline: every zone's committed bytes at each of its columns.
        self.zone_timeline: Optional[List[Dict[str, int]]] = [] if record_timeline else None
        self.policy = make_policy(policy)
        if self.stack_of:
            self.policy = ExpertPolicy(self.policy, set(self.stack_of))
        self.policy.prepare(PolicyInputs(
            order=tuple(self.order), sizes={n: s.length for n, s in self.slots.items()}, segments=self.segments,
            packs=self.packs, new_cost=self.cost_model, allowance=self.allowance, granularity=self.granularity))
        # The segments acquired and not yet released: k -> [start event, ready event, bypass names].
        self._pending: Dict[int, list] = {}
        # Set while a change of slots and policy is under way, and left set by one that an
        # exception cut short: settle() then makes the bookkeeping agree with the slots.
        self._torn = False
        self._pinned_for_life = False
        self._resident_step: Optional[Counters] = None  # a step of all weights resident, counted once
        device.ledger.set_reclaimer("weights", self._reclaim)

    def address(self, name: str) -> int:
        """A weight's stable address; a stack streamed by expert starts at its first expert's."""
        return self.slots[self.parts[name][0] if name in self.parts else name].va

    # ------------------------------------------------------------------ sizing
    @property
    def allowance(self) -> int:
        return self.device.ledger.snapshot().zones["weights"].allowance

    def cost_model(self):
        return self.kind.cost_model(self.slots, self.granularity)

    def _group_cost(self, names: Sequence[str]) -> int:
        return self.kind.group_cost(self.device.arena, [self.slots[n] for n in names])

    def _page_in(self, names: Sequence[str], zone: str):
        """One commit for the weights, one per expert: a physical handle is given back only
        whole, so an expert sharing one with its neighbours would keep their pages. The
        copies share a stream: the last event covers them all."""
        ready = None
        for group in [[n for n in names if n not in self.stack_of]] + [[n] for n in names if n in self.stack_of]:
            if group:
                ready = self.kind.page_in([self.slots[n] for n in group], zone, self.device.copy_stream)
        return ready

    def _evict(self, names: Sequence[str]) -> None:
        self.kind.evict([self.slots[n] for n in names])

    def _evict_resident(self, name: str) -> None:
        """Evicts a weight held in the weights zone and tells the policy. A name the policy
        still holds but whose slot is not there (an eviction cut short before the policy
        heard of it) is only forgotten."""
        slot = self.slots[name]
        if slot.state == "evicted" or slot.charged_zone != "weights":
            self.policy.on_evict(name)
            return
        self._evict([name])
        self.policy.on_evict(name)
        self.counters.evictions += 1

    # ------------------------------------------------------------------ the guarantee
    def acquire(self, k: int, routed: Optional[Dict[str, Sequence[int]]] = None):
        """Makes every weight of segment k resident and pinned. Returns the event after
        which the copies are done (None when everything hit). `routed`: for a stack that
        streams by expert, the experts the step reads; its others are left as they are.

        The segment is pending from the first line: an exception anywhere after it (a
        KeyboardInterrupt that a signal's handler raises between any two lines, even
        between a pin() and the line after it) leaves release() or settle() what to undo."""
        names = self.segments[k]
        if routed:
            picked = {self.parts[stack][e] for stack, experts in routed.items() for e in experts}
            names = [n for n in names if self.stack_of.get(n) not in routed or n in picked]
        torn, self._torn = self._torn, True
        bypass: List[str] = []
        admitted: List[str] = []
        pending = self._pending[k] = [None, None, bypass, names]
        try:
            misses = []
            for n in names:
                if self.slots[n].state == "evicted":
                    misses.append(n)
                else:
                    self.slots[n].pin()
                    self.policy.on_hit(n)
            current = set(names)
            ledger = self.device.ledger
            for n in misses:
                if not self.policy.admit(n):
                    bypass.append(n)
                    continue
                # Recomputed after each eviction: a victim may have shared a granule with the group.
                while (need := self._group_cost(admitted + [n])) > ledger.headroom("weights"):
                    victim = self.policy.victim(current, n)
                    if victim is None:
                        break
                    self._evict_resident(victim)
                if ledger.headroom("weights") >= need:
                    admitted.append(n)
                else:
                    bypass.append(n)
            start = pending[0] = self.device.backend.create_event()
            start.record(self.device.copy_stream)
            ready = None
            if admitted:
                ready = pending[1] = self._page_in(admitted, "weights")
                for n in admitted:
                    self.slots[n].pin()
                    self.policy.on_admit(n)
            if bypass:
                need = self._group_cost(bypass)
                if not ledger.can_charge("transient", need):
                    ledger.make_room("transient", need)
                # The same copy stream as the admitted page-in: this later event covers both.
                ready = pending[1] = self._page_in(bypass, "transient")
                for n in bypass:
                    self.slots[n].pin()
        except BaseException:
            self.release(k, None)  # unpins what it pinned, evicts what it streamed
            raise
        paged = set(admitted + bypass)
        nbytes = {n: self.slots[n].length for n in names}
        experts = [n for n in names if n in self.stack_of]
        # One store: the counters never show half a segment.
        self.counters = self.counters.plus(
            accesses=len(names), hits=len(names) - len(paged), page_ins=len(paged), bypassed=len(bypass),
            access_bytes=sum(nbytes.values()), hit_bytes=sum(nbytes[n] for n in names if n not in paged),
            bypassed_bytes=sum(nbytes[n] for n in bypass), htod_bytes=sum(nbytes[n] for n in paged),
            expert_accesses=len(experts), expert_hits=sum(n not in paged for n in experts),
            expert_htod_bytes=sum(nbytes[n] for n in experts if n in paged))
        if self.timeline is not None:
            self._record()
        self._torn = torn
        return ready

    def release(self, k: int, reader_event=None) -> None:
        """Segment k has been submitted; `reader_event` marks the end of its reads. The
        segment stays pending until the release is whole: one cut short by an exception
        (an interrupt lands between any two lines) is finished by settle(). A segment
        names each weight once, and no other pins its weights while it is pending, so
        every pinned weight of it is unpinned once."""
        start, ready, bypass, names = self._pending[k]
        for n in names:
            slot = self.slots[n]
            if reader_event is not None and slot.state != "evicted":
                slot.mark_read(reader_event)
            if slot.state == "pinned":
                slot.unpin()
        streamed = [n for n in bypass if self.slots[n].state != "evicted"]
        if streamed:
            self._evict(streamed)  # waits for the reader inside
        del self._pending[k]
        if ready is not None:
            ready.synchronize()
            self.counters.htod_ms += ready.elapsed_ms(start)

    def settle(self) -> None:
        """Makes the residency whole between steps: releases every segment still pending
        (acquired by a step that an exception cut short before it could release it: its
        weights stay pinned, its streamed ones in the transient zone, until this runs)
        and, after a change cut short, makes the pins, the transient zone and the policy
        agree with the slots. The caller holds the session's lock; no step is under way."""
        if not self._pending and not self._torn:
            return
        torn, self._torn = self._torn, True
        # A step cut short may have left reads and copies queued: nothing is unmapped under them.
        self.device.compute_stream.synchronize()
        self.device.copy_stream.synchronize()
        for k in list(self._pending):
            self.release(k, None)
        if torn:
            self._reconcile()
        self._torn = False

    def _reconcile(self) -> None:
        """Between steps no weight that streams is pinned or in the transient zone, and the
        policy knows exactly the weights resident in the weights zone (on_admit keeps the
        place of one it knows; on_evict forgets one it does not know)."""
        if not self._pinned_for_life:
            for s in self.slots.values():
                while s.state == "pinned":
                    s.unpin()
            stray = [n for n, s in self.slots.items() if s.state != "evicted" and s.charged_zone == "transient"]
            if stray:
                self._evict(stray)
        for n, s in self.slots.items():
            if s.state == "evicted" or s.charged_zone != "weights":
                self.policy.on_evict(n)
            else:
                self.policy.on_admit(n)

    def end_step(self) -> None:
        self.counters.steps += 1

    def count_resident_step(self) -> Counters:
        """Counts a step of a session whose weights are all resident: every access hits.
        Returns that step's counters."""
        if self._resident_step is None:
            n, nbytes = len(self.slots), sum(s.length for s in self.slots.values())
            self._resident_step = Counters(steps=1, accesses=n, hits=n, access_bytes=nbytes, hit_bytes=nbytes)
        self.counters = self.counters + self._resident_step  # one store: never half a step
        if self.timeline is not None:
            self._record()
        return self._resident_step

    def reset_counters(self) -> None:
        self.counters = Counters()
        self.policy.reset_counts()

    def _reclaim(self, nbytes: int) -> int:
        """Lends weights-zone budget to a higher-priority zone."""
        torn, self._torn = self._torn, True
        ledger = self.device.ledger
        before = ledger.snapshot().zones["weights"].committed.current
        freed = 0
        pinned = {n for n, s in self.slots.items() if s.state == "pinned"}
        while freed < nbytes:
            victim = self.policy.reclaim_victim(pinned)
            if victim is None:
                break
            self._evict_resident(victim)
            freed = before - ledger.snapshot().zones["weights"].committed.current
        self._torn = torn
        return freed

    def _record(self) -> None:
        self.timeline.append(self._snapshot_states())
        zones = self.device.ledger.snapshot().zones
        self.zone_timeline.append({z: v.committed.current for z, v in zones.items()})

    def _snapshot_states(self) -> bytes:
        code = {"evicted": 0, "resident": 1, "paging_in": 1, "pinned": 1}
        return bytes(2 if self.slots[n].state != "evicted" and self.slots[n].charged_zone == "transient"
                     else code[self.slots[n].state] for n in self.order)

    def make_all_resident(self) -> None:
        """Pages in every weight to the weights zone in one transaction (budget permitting)
        and pins it for the session's life, so captured replays may read any of them."""
        self._pinned_for_life = True
        names = [n for n in self.order if self.slots[n].state == "evicted"]
        if names:
            self._page_in(names, "weights").synchronize()
            for n in names:
                self.policy.on_admit(n)
        for s in self.slots.values():
            s.pin()

    def close(self) -> None:
        self.device.ledger.clear_reclaimer("weights")
        by_zone: Dict[str, List[str]] = collections.defaultdict(list)
        for n, s in self.slots.items():
            while s.state == "pinned":
                s.unpin()
            if s.state != "evicted":
                by_zone[s.charged_zone].append(n)
        for names in by_zone.values():
            self._evict(names)
        for n in self.order:
            self.policy.on_evict(n)
        self.slots.clear()
