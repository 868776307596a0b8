"""Experts read in place, the hot ones from device pages.

A stack of experts that the streaming engine reads in place has a stable address of its
own: a reservation whose granules map the stack's host handles (the host store's paged
region, ``HostStore.pages``), so that the MoE kernel reads a token's picked experts over
the link. An expert made resident gets device pages in place of its host pages, a copy
of them, behind the same address: the captured graph reads it from the device from the
next step on, and nothing is captured again. A granule that two experts share (an
expert's rows need not fill whole granules) is on the device while either is resident.

Which experts are resident: those the router picked most often (``place``), as many as
the weights zone has room for beside the weights the plan keeps. Every step's picks are
counted (``count``, from the router's values, which the engine reads back after the
step): a hit where the expert is resident, a miss and its bytes read over the link where
not. Every REBALANCE_STEPS steps (``rebalance``), a missed expert picked more often than a
resident one takes its place; the counts are halved then, so that the set follows a change
of topic. Those are the only steps that map, unmap, create or release; each runs after the
step before it has ended (the engine's host wait), so no reader is left on a page it unmaps.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..loading import routed_experts
from .host_store import map_granules, unmap_granules

REBALANCE_STEPS = 16
ZONE = "weights"


@dataclasses.dataclass(frozen=True)
class InPlaceNode:
    """A MoE node whose stacks are read in place."""

    router: str  # the value its experts are picked by: [tokens, experts]
    k: int
    experts: int
    stacks: tuple  # its stacks read in place (paged in the host store)


class ExpertPages:
    def __init__(self, device, store, nodes: Sequence[InPlaceNode]):
        self._dev = device
        self._backend = device.backend
        self._pages = store.pages
        self.g = device.granularity
        self.nodes = list(nodes)
        self.address: Dict[str, int] = {}  # each stack's stable address
        self._size: Dict[str, int] = {}
        self._on_device: Dict[Tuple[str, int], int] = {}  # (stack, granule) -> device handle
        self._users: "collections.Counter[Tuple[str, int]]" = collections.Counter()
        self.resident: set = set()  # (node index, expert)
        self.counts: Dict[Tuple[int, int], int] = {(i, e): 0 for i, n in enumerate(self.nodes)
                                                   for e in range(n.experts)}
        self.committed = 0
        self._steps = 0
        # Recorded after the copies into device pages: a page is unmapped only once they
        # have ended (a copy the host backend's stream runs later would write an unmapped
        # page, and on CUDA the copy engine would).
        self._copied = None
        self._pending = False
        try:
            for n in self.nodes:
                for stack in n.stacks:
                    self._map_stack(stack)
        except BaseException:
            self.close()
            raise

    def _map_stack(self, stack: str) -> None:
        b = self._backend
        self.address[stack] = map_granules(b, self._pages.granules(stack), self.g, b.set_access)
        self._size[stack] = self._pages.sizes[stack]

    # ------------------------------------------------------------------ residency
    def _granules(self, key: Tuple[int, int]) -> List[Tuple[str, int]]:
        """The (stack, granule) pairs expert key's rows span."""
        node, e = self.nodes[key[0]], key[1]
        out = []
        for stack in node.stacks:
            rows = self._size[stack] // node.experts
            lo, hi = e * rows, (e + 1) * rows
            out.extend((stack, i) for i in range(lo // self.g, -(-hi // self.g)))
        return out

    def cost(self, key: Tuple[int, int]) -> int:
        """The device bytes making expert key resident would commit now."""
        return sum(self.g for p in self._granules(key) if p not in self._on_device)

    def expert_bytes(self, node: int) -> int:
        """The bytes of one expert of a node, over its stacks read in place."""
        n = self.nodes[node]
        return sum(self._size[s] // n.experts for s in n.stacks)

    def _to_device(self, stack: str, i: int) -> None:
        """Granule i of `stack` on a device page of its own, charged to the zone, holding a
        copy of its host page (queued on the compute stream, before the next step)."""
        b, g, ledger = self._backend, self.g, self._dev.ledger
        va = self.address[stack] + i * g
        self._dev.charge_outside(ZONE, g)
        try:
            h = b.create(g)
        except BaseException:
            ledger.refund(ZONE, g, True)
            raise
        try:
            b.unmap(va, g)
            try:
                b.map(va, g, h)
                try:
                    b.set_access(va, g)
                except BaseException:
                    b.unmap(va, g)
                    raise
            except BaseException:
                self._remap_host(stack, i)
                raise
        except BaseException:
            b.release(h)
            ledger.refund(ZONE, g, True)
            raise
        self._on_device[(stack, i)] = h
        self.committed += g
        stream = self._dev.compute_stream
        b.copy_h2d(va, self._pages.address(stack) + i * g, g, stream)
        if self._copied is None:
            self._copied = b.create_event()
        self._copied.record(stream)
        self._pending = True

    def _copies_ended(self) -> None:
        """Waits for the copies into device pages queued since the last wait, if any."""
        if self._copied is not None and self._pending:
            self._copied.synchronize()
        self._pending = False

    def _remap_host(self, stack: str, i: int) -> None:
        """Granule i of `stack` maps its host handle again (its address holds no mapping)."""
        b, g = self._backend, self.g
        va = self.address[stack] + i * g
        b.map(va, g, self._pages.granules(stack)[i])
        b.set_access(va, g)

    def _to_host(self, stack: str, i: int) -> None:
        b, g = self._backend, self.g
        self._copies_ended()
        h = self._on_device.pop((stack, i))
        b.unmap(self.address[stack] + i * g, g)
        self._remap_host(stack, i)
        b.release(h)
        self._dev.ledger.refund(ZONE, g, True)
        self.committed -= g

    def promote(self, key: Tuple[int, int]) -> bool:
        """Makes expert key resident; False, with nothing changed, where the zone has no room."""
        if key in self.resident:
            return True
        if not self._dev.ledger.can_charge(ZONE, self.cost(key)):
            return False
        made = []
        try:
            for p in self._granules(key):
                if p not in self._on_device:
                    self._to_device(*p)
                    made.append(p)
        except BaseException:
            for p in made:
                self._to_host(*p)
            raise
        for p in self._granules(key):
            self._users[p] += 1
        self.resident.add(key)
        return True

    def demote(self, key: Tuple[int, int]) -> None:
        if key not in self.resident:
            return
        self.resident.discard(key)
        for p in self._granules(key):
            self._users[p] -= 1
            if not self._users[p]:
                del self._users[p]
                if p in self._on_device:
                    self._to_host(*p)

    def _by_heat(self) -> List[Tuple[int, int]]:
        """Every expert, the most picked first; ties spread over the layers alike."""
        return sorted(self.counts, key=lambda k: (-self.counts[k], k[1], k[0]))

    def place(self) -> None:
        """As many experts resident as the zone holds, the most picked first."""
        for key in self._by_heat():
            self.promote(key)

    # ------------------------------------------------------------------ counting
    def count(self, routers: Dict[str, np.ndarray]) -> Tuple[int, int, int]:
        """A step's picks, from each node's router values: (hits, misses, bytes of the
        missed experts read over the link)."""
        hits = misses = read = 0
        for i, n in enumerate(self.nodes):
            logits = routers.get(n.router)
            if logits is None or not logits.size:
                continue
            picked = routed_experts(logits, n.k, n.experts)
            for e in picked:
                self.counts[(i, e)] += 1
                if (i, e) in self.resident:
                    hits += 1
                else:
                    misses += 1
                    read += self.expert_bytes(i)
        self._steps += 1
        return hits, misses, read

    def due(self) -> bool:
        return self._steps >= REBALANCE_STEPS

    def rebalance(self) -> int:
        """Swaps each missed expert picked more often than a resident one in for the
        coldest resident; returns the experts moved in. The counts are halved after."""
        self._steps = 0
        moved = 0
        hot = [k for k in self._by_heat() if k not in self.resident]
        for key in hot:
            cold = min(self.resident, key=lambda k: (self.counts[k], k), default=None)
            if cold is None or self.counts[key] <= self.counts[cold]:
                if not self.promote(key):  # room may have been left
                    break
                moved += 1
                continue
            self.demote(cold)
            if self.promote(key):
                moved += 1
            else:
                self.promote(cold)
                break
        for k in self.counts:
            self.counts[k] //= 2
        return moved

    def close(self) -> None:
        """Every mapping and reservation released, every device page back to the ledger."""
        b, g = self._backend, self.g
        self._copies_ended()
        for stack, va in list(self.address.items()):
            unmap_granules(b, va, -(-self._size[stack] // g), g)
            del self.address[stack]
        for h in self._on_device.values():
            b.release(h)
            self._dev.ledger.refund(ZONE, g, True)
            self.committed -= g
        self._on_device.clear()
        self.resident.clear()
        self._users.clear()
