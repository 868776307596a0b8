"""The budget plan of a session: its inputs from the model's weights, and the error that
names what would run when no plan fits.

``plan_inputs`` gives ``plan_budget`` the device's memory and the weights' committed
cost, as the slots would lay them out (packed at byte granularity behind stable
addresses, or one allocation each without them), and the segments of every target the
plan tries. ``plan_or_explain`` plans, or raises ``BudgetExceeded`` with the smallest
budget that runs the model with this configuration, or the keyword that limits it.
"""
from __future__ import annotations

from typing import Dict

from ..config import ENV_VRAM_LIMIT, fmt_bytes
from ..errors import BudgetExceeded
from ..loading import plan_segments, segment_weights
from .budget import BudgetPlan, plan_budget, smallest_budget
from .residency import segment_costs
from .slots import slot_kind


def plan_inputs(model, weights, stable: bool, device, cuts=frozenset(), reserves=None) -> tuple:
    """(the keyword arguments of plan_budget, the node groups planned for each segment
    target): the second names what the split of a streaming plan cuts. Each node of
    `cuts` starts a segment; `reserves` are the default reserves ({"kv", "scratch"}
    bytes) where the configuration gives none."""
    names = {w.name for w in weights}
    sizes = {w.name: w.nbytes for w in weights}
    first_use = {w.name: w.first_use for w in weights}
    kind = slot_kind(stable)
    g = device.granularity
    groups_by_target: Dict[int, list] = {}

    def cost(ns):
        return kind.packed_cost([sizes[n] for n in ns], g)

    def segments_for(target):
        groups = plan_segments(model, cost, names.__contains__, target, cuts)
        groups_by_target[target] = groups
        return [segment_weights(model, grp, names.__contains__) for grp in groups]

    def costs_of(segments):
        return segment_costs(segments, sizes, first_use, kind, g)

    inputs = dict(free=device.device_free, total=device.device_total, granularity=g,
                  weight_costs={n: cost([n]) for n in names}, cost=cost, plan_segments=segments_for,
                  segment_costs=costs_of, margin=device.margin, reserves=reserves)
    return inputs, groups_by_target


def plan_or_explain(config, inputs: dict) -> BudgetPlan:
    """plan_budget, or BudgetExceeded naming the smallest budget that runs the model with
    this configuration (or, when no budget of the device does, what limits). Default
    reserves (`inputs["reserves"]`, a decoder's first generation) that leave the weights
    no plan are dropped, from `inputs` too: the session starts, and a generation that
    finds no room plans again or names the budget that holds it."""
    if inputs.get("reserves"):
        try:
            return plan_budget(config, **inputs)
        except BudgetExceeded:
            inputs["reserves"] = None
    try:
        return plan_budget(config, **inputs)
    except BudgetExceeded as e:
        least = smallest_budget(config, **inputs)
        why = str(e).rstrip(".") + "."
        if not least:
            raise BudgetExceeded(f"{why} Not even the device's {fmt_bytes(inputs['total'])} would run this model "
                                 f"with this configuration.{_what_limits(config, inputs)}") from None
        more = "" if config.offload else ", or turn offload on to stream the weights"
        error = BudgetExceeded(f"{why} The smallest budget that runs it with this configuration is "
                               f"{fmt_bytes(least)} ({least} bytes): pass vram_limit={least} (or set "
                               f"{ENV_VRAM_LIMIT}){more}.")
        error.smallest_budget, error.reason = least, why
        raise error from None


def _what_limits(config, inputs: dict) -> str:
    """For a configuration that no budget of this device runs: the keyword to change."""
    total = inputs["total"]
    largest = max(inputs["weight_costs"].values(), default=0)
    reserves = {k: getattr(config, k) for k in ("kv_bytes", "scratch_bytes") if getattr(config, k)}
    if reserves and sum(reserves.values()) + largest > total:
        given = " and ".join(f"{k}={v}" for k, v in reserves.items())
        return (f" The reserves ({given}) leave no room for the largest weight ({largest} committed bytes) on "
                f"the device's {total} bytes: lower {' or '.join(reserves)} below {max(0, total - largest)} "
                f"in all.")
    if config.weight_bytes:
        return (f" The weights zone's allowance (weight_bytes={config.weight_bytes}) is what limits: raise it"
                f"{'' if config.offload else ' or turn offload on'}.")
    return ""
