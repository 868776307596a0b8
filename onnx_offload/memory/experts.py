"""Experts that stream by route: each expert's rows of a stacked initializer get a slot
of their own, and the hottest experts stay resident.

A stack of E experts is carved as E slots one after another (``carve_experts``), so the
stack keeps one stable address, the first slot's, which its ORT session reads as the
whole initializer, while each expert is paged in and out alone. Slots that share a
granule commit it once; an expert that is not resident leaves its rows unmapped, which
a kernel that reads only the routed experts never touches.

Which experts stay (``ExpertPolicy``): the weights every step reads come first, by the
session's policy, since a byte of theirs is read every step and an expert's only when
the router picks it. Experts fill what they leave, hottest first: a routed expert that
misses displaces a resident one only when it has been picked more often (least
frequently used, with the counts halved from time to time so that the set follows a
change of topic). A dense weight the policy keeps displaces experts, coldest first.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Set

from .policies import Policy, PolicyInputs

# The counts are halved after this many routed accesses per expert, on average.
DECAY_ACCESSES = 64


def expert_key(stack: str, e: int) -> str:
    """The slot name of expert e of a stacked initializer."""
    return f"{stack}[expert {e}]"


def carve_experts(kind, arena, stack: str, nbytes: int, experts: int, source: int) -> Optional[Dict[str, object]]:
    """One slot per expert of `stack`, one after another from the stack's aligned start,
    each paged from its rows of the host copy at `source`; None when the arena cannot
    place them back to back (a gap of an earlier slot's alignment took one)."""
    size = nbytes // experts
    slots: Dict[str, object] = {}
    base = 0
    for e in range(experts):
        slot = kind.make(arena, expert_key(stack, e), size, None if e == 0 else 1)
        if e == 0:
            base = slot.va
        elif slot.va != base + e * size:
            return None  # the slots carved so far are released with the dict
        slot.set_source(source + e * size, size)
        slots[expert_key(stack, e)] = slot
    return slots


class ExpertPolicy(Policy):
    """The session's policy for the weights every step reads; least frequently used for
    the experts (see the module's docstring)."""

    def __init__(self, base: Policy, experts: Set[str]):
        super().__init__()
        self.name = base.name
        self.base = base
        self.experts = frozenset(experts)
        self.counts: Dict[str, int] = {n: 0 for n in experts}
        self._accesses = 0

    def prepare(self, inputs: PolicyInputs) -> None:
        dense = [n for n in inputs.order if n not in self.experts]
        keep = set(dense)
        self.base.prepare(dataclasses.replace(
            inputs, order=tuple(dense), sizes={n: inputs.sizes[n] for n in dense},
            segments=[[n for n in s if n in keep] for s in inputs.segments],
            packs=[[n for n in p if n in keep] for p in inputs.packs]))

    def reset_counts(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)
        self._accesses = 0

    def _count(self, name: str) -> None:
        self.counts[name] += 1
        self._accesses += 1
        if self._accesses >= DECAY_ACCESSES * len(self.counts):
            self._accesses = 0
            for n in self.counts:
                self.counts[n] //= 2

    def admit(self, name: str) -> bool:
        if name in self.experts:
            self._count(name)
            return True  # whether it stays is victim()'s: it must find a colder expert
        return self.base.admit(name)

    def on_hit(self, name: str) -> None:
        if name in self.experts:
            self._count(name)
            super().on_hit(name)
        else:
            self.base.on_hit(name)

    def on_admit(self, name: str) -> None:
        (super() if name in self.experts else self.base).on_admit(name)

    def on_evict(self, name: str) -> None:
        (super() if name in self.experts else self.base).on_evict(name)

    def _coldest(self, exclude: set, below: Optional[int] = None) -> Optional[str]:
        # self._recent holds the resident experts, least recently used first: ties go to the older.
        candidates = [n for n in self._recent if n not in exclude and (below is None or self.counts[n] < below)]
        return min(candidates, key=lambda n: self.counts[n], default=None)

    def victim(self, exclude: set, incoming: Optional[str] = None) -> Optional[str]:
        if incoming in self.experts:
            return self._coldest(exclude, self.counts[incoming])
        return self._coldest(exclude) or self.base.victim(exclude, incoming)

    def reclaim_victim(self, exclude: set) -> Optional[str]:
        return self._coldest(exclude) or self.base.reclaim_victim(exclude)
