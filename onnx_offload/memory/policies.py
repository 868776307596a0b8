"""Residency policies: which weights stay in the weights zone, and which give way.

Every policy name the package accepts is in ``config.POLICIES``, which the configuration
and the command line read; ``POLICIES`` here maps each to its class, and the import
fails if the two lists differ.

A policy sees what it needs, not the residency manager: the weights in pack order,
their sizes, the segments that read them, a cost model of committed bytes and the
weights allowance (``PolicyInputs``). It keeps its own recency state, fed by the
manager through ``on_hit``, ``on_admit`` and ``on_evict``.

- ``stable``: a first-fit resident subset, fixed up front; zero evictions.
- ``planned``: knows the cyclic order of the segments and picks the resident set with
  the most resident bytes per step (a knapsack over segment packs, then first-fit for
  the rest), and streams the remainder; zero evictions.
- ``lru`` and ``mru``: admit every miss and evict the least / most recently used.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from ..config import POLICIES as NAMES


@dataclasses.dataclass(frozen=True)
class PolicyInputs:
    order: Sequence[str]  # every weight, packs in segment order
    sizes: Dict[str, int]  # content bytes of each weight
    segments: Sequence[Sequence[str]]  # the weights each segment reads, in run order
    packs: Sequence[Sequence[str]]  # the weights laid out with each segment
    new_cost: Callable[[], "object"]  # a fresh cost model: .extra(name), .add(name), .total
    allowance: int  # committed bytes the weights zone may hold
    granularity: int


class Policy:
    """Admit every miss; evict the least recently used. Reclaim the most recent first."""

    name = "lru"

    def __init__(self):
        self._recent: "collections.OrderedDict[str, None]" = collections.OrderedDict()

    def prepare(self, inputs: PolicyInputs) -> None:
        pass

    def reset_counts(self) -> None:
        """Forgets what the accesses so far say of the weights' heat (those of construction)."""

    def admit(self, name: str) -> bool:
        return True

    # Recency: the names resident in the weights zone, least recently used first.
    def on_hit(self, name: str) -> None:
        if name in self._recent:
            self._recent.move_to_end(name)

    def on_admit(self, name: str) -> None:
        self._recent[name] = None

    def on_evict(self, name: str) -> None:
        self._recent.pop(name, None)

    def victim(self, exclude: set, incoming: Optional[str] = None) -> Optional[str]:
        """The next weight to evict from the weights zone to make room for the miss `incoming`."""
        return next((n for n in self._recent if n not in exclude), None)

    def reclaim_victim(self, exclude: set) -> Optional[str]:
        """What to give up when another zone borrows budget."""
        return next((n for n in reversed(self._recent) if n not in exclude), None)


class LRUPolicy(Policy):
    name = "lru"


class MRUPolicy(Policy):
    name = "mru"

    def victim(self, exclude, incoming=None):
        return next((n for n in reversed(self._recent) if n not in exclude), None)


class StablePolicy(Policy):
    """First fit, in first-use order, into the weights allowance. Never evicts."""

    name = "stable"

    def __init__(self):
        super().__init__()
        self.resident_set: set = set()

    def prepare(self, inputs):
        self.resident_set = first_fit(inputs.order, inputs.new_cost(), inputs.allowance)

    def admit(self, name):
        return name in self.resident_set

    def victim(self, exclude, incoming=None):
        return None


class PlannedPolicy(StablePolicy):
    """The resident set with the most bytes per step; the rest streams."""

    name = "planned"

    def prepare(self, inputs):
        uses = collections.Counter(n for seg in inputs.segments for n in seg)
        value = {n: inputs.sizes[n] * uses[n] for n in inputs.order}
        knap = plan_by_packs(inputs, value)
        fit = first_fit(inputs.order, inputs.new_cost(), inputs.allowance)
        score = lambda s: sum(value[n] for n in s)  # noqa: E731
        self.resident_set = knap if score(knap) >= score(fit) else fit


def first_fit(order: Sequence[str], cost, allowance: int) -> set:
    chosen = set()
    for n in order:
        if cost.total + cost.extra(n) <= allowance:
            cost.add(n)
            chosen.add(n)
    return chosen


def plan_by_packs(inputs: PolicyInputs, value: Dict[str, int]) -> set:
    """0/1 knapsack over segment packs, in granules (a pack's cost counts the granules it
    may share with a neighbour, so the sum is an upper bound), then first-fit of the
    remaining weights, at their true incremental cost, into what is left."""
    g = inputs.granularity
    packs = [p for p in inputs.packs if p]
    costs = []
    for p in packs:
        c = inputs.new_cost()
        for n in p:
            c.add(n)
        costs.append(-(-c.total // g))
    cap = inputs.allowance // g
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
    cost = inputs.new_cost()
    for n in inputs.order:
        if n in chosen:
            cost.add(n)
    for n in inputs.order:
        if n not in chosen and cost.total + cost.extra(n) <= inputs.allowance:
            cost.add(n)
            chosen.add(n)
    return chosen


POLICIES: Dict[str, type] = {"planned": PlannedPolicy, "stable": StablePolicy, "lru": LRUPolicy, "mru": MRUPolicy}
if tuple(POLICIES) != NAMES:
    raise ImportError(f"the policies implemented ({', '.join(POLICIES)}) are not config.POLICIES ({', '.join(NAMES)})")


def make_policy(name: str) -> Policy:
    return POLICIES[name]()
