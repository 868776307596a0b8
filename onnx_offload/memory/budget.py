"""How one device budget is split: every zone's allowance and reserve, whether the
weights stream, the segment target and the cap on ORT's own memory.

``plan_budget`` is the one place that decides it, as a pure function of the
configuration, the device's memory, the weights' committed cost and the segment plan.
``Device`` and the session only apply the ``BudgetPlan`` it returns.

The split:
- The budget is ``config.vram_limit``, by default the device's free memory less the
  backend's margin (``config.BUDGET_MARGIN``).
- ``kv`` reserves ``config.kv_bytes``; ``scratch`` reserves ``config.scratch_bytes``.
  Where the configuration leaves them (0 and None), scratch reserves 256 MiB or an eighth
  of what the KV reserve leaves, whichever is less (the share), and KV none; but where the
  `defaults` the session gives for its model (a decoder's first generation:
  ``generation.needs``) take less than the share together, they are the reserves, so
  that more is left to the weights. Both in whole granules. What is left after both
  reserves is usable by the weights.
- When every weight fits the weights allowance (``config.weight_bytes``, default the
  whole budget) and the usable budget, all stay resident in one segment.
- Otherwise, with offload on, the graph is split into segments of at most
  ``segment_target`` committed bytes of weights (``config.segment_bytes``, default a
  quarter of the allowance). The transient zone reserves the largest segment's committed
  cost, so the misses of any segment can stream; the weights zone keeps the rest of the
  usable budget for resident weights. A segment's cost is that of the granules its
  weights lie in (``segment_costs``, from the slots' layout: a weight read by several
  segments lies with the first, and later readers pay for its granules too).
- ORT's own memory (its arena, capped through ``gpu_mem_limit``, and its workspaces)
  is measured and charged to ``scratch``; its cap is what the other zones leave.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..config import MiB, OffloadConfig
from ..errors import BudgetExceeded

ZONES = ("weights", "kv", "scratch", "transient")


@dataclasses.dataclass(frozen=True)
class ZonePlan:
    allowance: int
    reserve: int


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    budget: int
    zones: Dict[str, ZonePlan]
    streaming: bool  # the weights exceed their allowance and stream, segment by segment (one or more)
    segment_target: int  # committed weight bytes per segment; 0 when not streaming
    segments: List[Sequence[str]]  # the weights of each segment, as the segmenter planned them
    ort_memory_cap: int  # ORT's arena limit (gpu_mem_limit)
    note: str = ""  # why the budget differs from what was asked, if it does


def device_budget(config: OffloadConfig, free: int, total: int, margin: int = 0) -> Tuple[int, str]:
    """The budget in bytes, and a note when the request exceeds the memory free. "auto"
    leaves `margin` bytes of the free memory (config.BUDGET_MARGIN)."""
    requested = config.resolve_budget(free, total, margin)
    if requested <= free:
        return requested, ""
    return free, f"the requested budget of {requested} bytes exceeds the {free} bytes free; using {free}"


def base_zones(config: OffloadConfig, budget: int, granularity: int,
               defaults: Optional[Dict[str, int]] = None) -> Dict[str, ZonePlan]:
    """The zones before the weights are known: allowances and the KV and scratch reserves.
    `defaults` ({"kv": bytes, "scratch": bytes}) are the reserves where the configuration
    gives none."""
    def granules(n: int) -> int:
        return -(-n // granularity) * granularity
    kv_reserve = min(config.kv_bytes, budget)
    share = min(256 * MiB, (budget - kv_reserve) // 8)  # the scratch reserve where nothing sizes it
    if config.scratch_bytes is not None:
        scratch_reserve = config.scratch_bytes
    elif defaults and granules(defaults["scratch"]) + (0 if config.kv_bytes else granules(defaults["kv"])) <= share:
        # The model's own reserves where they take less than the share: more is left to
        # the weights, never less.
        scratch_reserve = defaults["scratch"]
        kv_reserve = kv_reserve or min(granules(defaults["kv"]), budget)
    else:
        scratch_reserve = share
    if scratch_reserve:  # at least one granule when there is any: less backs no buffer
        scratch_reserve = min(-(-scratch_reserve // granularity) * granularity, budget - kv_reserve)
    return {
        "weights": ZonePlan(min(config.weight_bytes or budget, budget), 0),
        "kv": ZonePlan(budget, kv_reserve),
        "scratch": ZonePlan(budget, scratch_reserve),
        "transient": ZonePlan(budget, 0),
    }


def plan_budget(config: OffloadConfig, *, free: int, total: int, granularity: int,
                weight_costs: Dict[str, int], cost: Callable[[Sequence[str]], int],
                plan_segments: Callable[[int], List[Sequence[str]]],
                segment_costs: Optional[Callable[[List[Sequence[str]]], List[int]]] = None, margin: int = 0,
                reserves: Optional[Dict[str, int]] = None) -> BudgetPlan:
    """Splits the device budget for one model.

    `weight_costs` is each weight's committed cost on its own; `cost(names)` the
    committed cost of a set of weights packed together; `plan_segments(target)` the
    weights of each segment when segments hold at most `target` committed bytes (a
    single node over the target gets a segment of its own); `segment_costs(segments)`
    what paging in each segment whole commits, as the slots will lie (by default its
    packed cost plus one granule, for a pack that starts inside one). A budget that
    cannot run the model raises ``BudgetExceeded`` saying why. `margin`: what an "auto"
    budget leaves of the free memory; `reserves`: the default reserves (base_zones).
    """
    budget, note = device_budget(config, free, total, margin)
    zones = base_zones(config, budget, granularity, reserves)
    usable = budget - zones["scratch"].reserve - zones["kv"].reserve
    allowance = zones["weights"].allowance
    names = list(weight_costs)
    if names:
        largest = max(names, key=lambda n: weight_costs[n])
        if weight_costs[largest] > usable:
            raise BudgetExceeded(
                f"the budget of {budget} bytes ({usable} after the scratch and KV reserves) cannot hold "
                f"the largest weight {largest!r} ({weight_costs[largest]} committed bytes)")
    total_cost = cost(names)
    if total_cost <= min(allowance, usable):
        return BudgetPlan(budget, zones, False, 0, [names],
                          _ort_cap(budget, zones, total_cost, granularity), note)
    if not config.offload:
        raise BudgetExceeded(
            f"the weights need {total_cost} committed bytes but the weights zone allows "
            f"{min(allowance, usable)}: set ONNX_GENAI_WEIGHT_OFFLOAD=1 (offload=True) to stream them, "
            f"or raise the budget")
    target = config.segment_bytes or max(weight_costs[largest], min(allowance, usable) // 4)
    segments = plan_segments(target)
    if segment_costs is None:
        pad = granularity if config.vmm else 0
        streamed = max(cost(s) for s in segments) + pad
    else:
        streamed = max(segment_costs(segments))
    if streamed > usable:
        raise BudgetExceeded(f"a segment needs {streamed} committed bytes, more than the usable budget {usable}")
    zones["transient"] = ZonePlan(budget, streamed)
    zones["weights"] = ZonePlan(max(0, min(allowance, usable - streamed)), 0)
    resident = zones["weights"].allowance
    return BudgetPlan(budget, zones, True, target, segments,
                      _ort_cap(budget, zones, resident, granularity), note)


def smallest_budget(config: OffloadConfig, *, free: int, total: int, granularity: int,
                    weight_costs: Dict[str, int], cost: Callable[[Sequence[str]], int],
                    plan_segments: Callable[[int], List[Sequence[str]]],
                    segment_costs: Optional[Callable[[List[Sequence[str]]], List[int]]] = None, margin: int = 0,
                    reserves: Optional[Dict[str, int]] = None) -> int:
    """The smallest device budget, in whole granules, for which ``plan_budget`` plans this
    model under this configuration (its offload flag, reserves and allowance), or 0 when
    not even the device's total memory would do. A binary search over plan_budget itself,
    so it always agrees with what a session would accept."""
    def works(budget: int) -> bool:
        trial = dataclasses.replace(config, vram_limit=budget)
        try:
            plan_budget(trial, free=max(free, budget), total=total, granularity=granularity,
                        weight_costs=weight_costs, cost=cost, plan_segments=plan_segments,
                        segment_costs=segment_costs, margin=margin, reserves=reserves)
            return True
        except BudgetExceeded:
            return False

    lo, hi = 1, -(-total // granularity)  # in granules: lo fails or is the answer, hi is the limit
    if not works(hi * granularity):
        return 0
    while lo < hi:
        mid = (lo + hi) // 2
        if works(mid * granularity):
            hi = mid
        else:
            lo = mid + 1
    return hi * granularity


def _ort_cap(budget: int, zones: Dict[str, ZonePlan], weights: int, granularity: int) -> int:
    """What ORT's arena may take: the budget less the weights and the other reserves."""
    others = zones["kv"].reserve + zones["transient"].reserve
    return max(granularity, budget - weights - others)


def describe_zones(ledger) -> str:
    """Every zone of a budget owner in one line, for errors that name them."""
    snap = ledger.snapshot()
    parts = [f"{name} {z.committed.current} committed (allowance {z.allowance}, reserve {z.reserve}, "
             f"lent {z.lent})" for name, z in snap.zones.items()]
    return f"budget {snap.budget}: " + "; ".join(parts)
