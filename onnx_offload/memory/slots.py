"""The two kinds of weight slot, behind one interface.

- ``VMM``: ``_core.WeightSlot``, a stable address for the weight's whole life, backed
  by physical pages only while resident. Slots of one group share granules, so a
  group's cost is what the arena would newly commit.
- ``PLAIN``: ``PlainSlot``, the baseline: a fresh device allocation per page-in, so the
  address changes and captured graphs cannot use it.

Both kinds offer ``make``, ``page_in``, ``evict``, ``group_cost`` and ``cost_model``;
their slots offer ``pin``, ``unpin``, ``mark_read``, ``state``, ``charged_zone``, ``va``
and ``length``. The residency manager picks a kind once and never asks which.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

from .. import _core
from ..errors import StateError


class PlainSlot:
    """A weight of the plain baseline: allocated on page-in, freed on eviction."""

    def __init__(self, arena, key: str, length: int):
        self.arena, self.key, self.length = arena, key, length
        self.va = 0
        self.state = "evicted"
        self.charged_zone = "weights"
        self._source = 0
        self._readers: list = []
        self._pins = 0

    def set_source(self, ptr: int, nbytes: int) -> None:
        if nbytes < self.length:
            raise ValueError(f"source of {self.key!r} has {nbytes} bytes, the slot {self.length}")
        self._source = ptr

    @property
    def pins(self) -> int:
        """How many pin() calls no unpin() has answered."""
        return self._pins

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

    def mark_read(self, event) -> None:
        if self.state == "evicted":
            raise _state_error(self, "be read")
        self._readers.append(event)

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

    def __init__(self, kind: "SlotKind", slots: Dict[str, object], granularity: int):
        self._kind, self._slots, self._g = kind, slots, granularity
        self._map = _core.GranuleMap(granularity)
        self.total = 0

    def extra(self, name: str) -> int:
        return self._kind.extra_cost(self._map, self._slots[name], self._g)

    def add(self, name: str) -> None:
        s = self._slots[name]
        self.total += self.extra(name)
        self._kind.note_added(self._map, s)


class SlotKind:
    stable_addresses = True
    alignment = _core.DEFAULT_ALIGNMENT  # of each slot's address in the arena

    def make(self, arena, key: str, length: int, alignment: Optional[int] = None):
        return _core.WeightSlot(arena, key, length, alignment or self.alignment, "weights")

    def page_in(self, slots, zone: str, stream):
        return _core.WeightSlot.page_in(slots, zone, stream)

    def evict(self, slots) -> None:
        _core.WeightSlot.evict(slots)

    def group_cost(self, arena, slots) -> int:
        """Committed bytes that paging in `slots` would add now."""
        return arena.incremental_commit_bytes([(s.va, s.length) for s in slots]) if slots else 0

    def cost_model(self, slots: Dict[str, object], granularity: int) -> IncrementalCost:
        return IncrementalCost(self, slots, granularity)

    def packed_cost(self, sizes: Sequence[int], granularity: int) -> int:
        """Committed bytes of weights packed one after another from a granule boundary."""
        end = 0
        for n in sizes:
            end = -(-end // self.alignment) * self.alignment + n
        return -(-end // granularity) * granularity

    # The cost model's two steps: slots that share a granule pay for it once.
    def extra_cost(self, granules, slot, granularity: int) -> int:
        return granules.incremental_commit_bytes([(slot.va, slot.length)])

    def note_added(self, granules, slot) -> None:
        for first, count in granules.uncovered_runs([(slot.va, slot.length)]):
            granules.add_extent(first, count, 0, _core.Zone.WEIGHTS)


class PlainKind(SlotKind):
    stable_addresses = False

    def make(self, arena, key: str, length: int, alignment: Optional[int] = None):
        return PlainSlot(arena, key, length)

    def page_in(self, slots, zone: str, stream):
        return PlainSlot.page_in(slots, zone, stream)

    def evict(self, slots) -> None:
        PlainSlot.evict(slots)

    def group_cost(self, arena, slots) -> int:
        return self.packed_cost([s.length for s in slots], arena.granularity)

    def packed_cost(self, sizes: Sequence[int], granularity: int) -> int:
        return sum(_core.plain_charge(n, granularity) for n in sizes)

    def extra_cost(self, granules, slot, granularity: int) -> int:
        return _core.plain_charge(slot.length, granularity)

    def note_added(self, granules, slot) -> None:
        pass


VMM = SlotKind()
PLAIN = PlainKind()


def slot_kind(stable_addresses: bool) -> SlotKind:
    return VMM if stable_addresses else PLAIN
