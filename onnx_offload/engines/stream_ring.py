"""The streaming engine's ring: one reservation that gives every streamed unit addresses
of its own, the physical granules that hold the streamed weights, and the mapping of
each unit's granules onto them.

The mapping is made at construction, each unit onto the ring in turn, and made again
once, when the first captured graph shows the order ORT reads the weights in
(``ring_by_reads``). The addresses never change: a captured graph reads and copies to
them for the session's life. The ring's bytes are charged to the transient zone, as
outside the arena.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .stream_plan import StreamPlan


class Ring:
    """The plan's units mapped onto the ring's physical granules; `map` makes it,
    `unmap` gives everything back (also what a failed `map` made)."""

    def __init__(self, device, plan: StreamPlan):
        self.device = device
        self.plan = plan
        self.address: Dict[str, int] = {}  # each streamed weight's address, for the session's life
        self.placed_by_reads = False  # whether the mapping follows ORT's reads yet
        self._handles: List[int] = []
        self._mapped: List[Tuple[int, int]] = []
        self._reservation: Optional[Tuple[int, int]] = None
        self._charged = 0

    @property
    def granules(self) -> int:
        """The ring's physical granules."""
        return len(self._handles)

    def map(self) -> None:
        """Reserves the units' addresses, creates the ring's granules and maps each unit
        onto them in turn."""
        dev, plan = self.device, self.plan
        backend, g = dev.backend, dev.granularity
        if not plan.units:
            return
        # One unmapped granule after each unit: an address one past a weight's end, which
        # kernels take as a bound, falls in no other weight's range.
        total = sum(u.granules + 1 for u in plan.units) * g
        dev.charge_outside("transient", plan.ring_bytes)
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
        self.place(first)

    def place(self, ring_of: List[List[int]]) -> None:
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

    def unmap(self) -> None:
        """Unmaps, releases and frees what `map` made, and refunds the ring's charge."""
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
