"""What a session does when a generation's KV cache finds no room, and the advice when
nothing it can do makes room.

Weights resident for the session's life (all of them, or the streaming engine's
resident set) cannot give way. With offload on, the budget is planned again:
- where the streaming engine can run, it is planned again for the cache and the step
  buffers the generation holds and asks for;
- elsewhere the weights stream in segments, which give way as the cache grows.
Otherwise the advice names the smallest budget that holds the weights and this cache.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Optional

from .._core import round_up
from ..config import ENV_VRAM_LIMIT, fmt_bytes
from ..errors import BudgetExceeded, OffloadWarning
from ..memory import StepMemoryShort, base_zones, plan_budget, smallest_budget
from .stream_plan import StreamingUnavailable
from .streaming import StreamEngine


def kv_short(engines, nbytes: int, kv_peak: int, io_peak: int, boundary: int,
             device_full: bool = False, at_chunk: Optional[Callable[[int], tuple]] = None) -> Optional[str]:
    """A generation's KV cache, which holds at most `kv_peak` bytes (with `io_peak` bytes
    of step buffers in scratch, and about `boundary` bytes per segment boundary once the
    weights stream), found no room for `nbytes` more. None says the budget was planned
    again and to try again; a text is the advice for the error. `device_full`: the
    budget had room and the device did not, so the engine's plan sets aside more for the
    steps (as for a step that ran out), which keeps fewer weights resident. The caller
    holds the session's lock. `at_chunk(prefill_chunk)`: the generation's (kv_peak,
    io_peak) with its prompt fed that many tokens a step, for the advice to offer a
    smaller prefill_chunk where the prompt's chunk drives the budget."""
    cfg, dev = engines.config, engines.device
    g = dev.granularity
    zones = dev.ledger.snapshot().zones
    # Needs over the whole budget (this buffer beside what its zone holds, the whole cache,
    # or the step buffers): no plan of it holds them, so nothing is planned again, nor a
    # kept generation given back, to find that out; the advice names the budget that does.
    over = max(zones["kv"].committed.current + nbytes, kv_peak,
               zones["scratch"].committed.current + io_peak) > dev.budget
    if not over and engines.release_kept():
        return None  # the kept generation's bytes were the ones missing, perhaps
    in_force = engines.plan
    # The cache's peak as planned, or, where the cache already holds more than that with
    # this buffer (its buffers, placed in the gaps older ones left, commit granules the
    # plan does not count), what it holds: so that the cache planned for holds it.
    kv = round_up(max(kv_peak, zones["kv"].committed.current + nbytes), g)
    if engines.graph_possible and cfg.offload:
        # On CUDA the streaming engine takes the weights: planned (again) for this cache
        # and for the step buffers held and asked for, or the advice of why it cannot be.
        have = engines.needs or (0, 0)
        need = (max(have[0], kv), max(have[1], round_up(zones["scratch"].committed.current + io_peak, g)))
        if device_full and need == have and have != (0, 0):
            need = (have[0], have[1] + max(have[1], g))
        if need == have:
            return (f"the plan in force already sets aside {fmt_bytes(have[0])} for the KV cache and "
                    f"{fmt_bytes(have[1])} for the steps")
        if not over and sum(need) <= dev.budget:  # else the advice below, the engine kept
            try:
                engines.replan_engine(*need, f"a KV cache of up to {fmt_bytes(kv_peak)}")
                return None
            except StreamingUnavailable:
                pass  # the weights stream in segments instead, below
            except BudgetExceeded as e:
                return str(e)
    # Segments pass values between them through scratch, which the resident runner
    # never needed and whose sizes are known only once the segments run: the scratch
    # reserve the configuration gives is doubled, plus `boundary` bytes per segment.
    # (The configuration's, not the reserve in force, which an earlier plan may have
    # raised: a plan depends on the cache it is for, not on the ones before it.)
    plan_inputs = engines.run_inputs.plan_inputs
    configured = base_zones(cfg, in_force.budget, g, plan_inputs.get("reserves"))["scratch"].reserve

    def trial_for(segments: int, kv: int = kv, io: int = io_peak, **more):
        base = 2 * max(configured, round_up(zones["scratch"].committed.current + io, g))
        scratch = base + round_up(boundary * segments, g)
        return dataclasses.replace(cfg, kv_bytes=max(cfg.kv_bytes, kv), scratch_bytes=scratch, **more)

    trial = trial_for(len(in_force.segments))
    pinned = isinstance(engines.runner, StreamEngine) or not in_force.streaming
    # Segments planned with less set aside for the cache than this generation needs (a
    # shorter one came first): planned again, as a session new to this length would be.
    short = in_force.streaming and kv > in_force.zones["kv"].reserve
    if (pinned or short) and cfg.offload and cfg.engine != "graph" and not over:
        kept = configured
        now = round_up(zones["kv"].committed.current + nbytes, g)

        def planned(trial):
            try:
                return plan_budget(trial, **plan_inputs)
            except BudgetExceeded:
                return None

        plan = planned(trial)
        if plan is not None and plan.streaming:
            plan = planned(trial_for(len(plan.segments)))
        for fallback in (dict(kv_bytes=max(cfg.kv_bytes, kv), scratch_bytes=kept),
                         dict(kv_bytes=max(cfg.kv_bytes, now), scratch_bytes=kept)):
            if plan is None or not plan.streaming:
                plan = planned(dataclasses.replace(cfg, **fallback))
        if plan is not None and plan.streaming:
            engines.run_in_segments(plan)
            if pinned:
                why = (f"the KV cache needs up to {fmt_bytes(kv_peak)} and the weights, resident for the "
                       f"session's life, left no room: the weights now stream in {len(plan.segments)} segments. "
                       f"Pass kv_bytes={trial.kv_bytes} to plan for the cache from the start, or raise the budget "
                       f"to keep the weights resident")
            else:
                why = (f"the KV cache needs up to {fmt_bytes(kv_peak)}, more than the "
                       f"{fmt_bytes(in_force.zones['kv'].reserve)} set aside for it: the weights now stream in "
                       f"{len(plan.segments)} segments. Pass kv_bytes={trial.kv_bytes} to plan for the cache from "
                       f"the start")
            engines.notes.append(why)
            warnings.warn(why, OffloadWarning, stacklevel=4)
            return None
    least, trial = _smallest(lambda segments: trial_for(segments), len(in_force.segments), plan_inputs)
    if not least:
        return f"not even the device's {fmt_bytes(dev.device_total)} holds the weights and this cache"
    what = f"the smallest budget that holds the weights and this cache (up to {fmt_bytes(kv_peak)}) is {fmt_bytes(least)}"
    said = _keywords(least, trial)
    if trial.scratch_bytes <= trial.kv_bytes:
        return f"{what}, the KV reserve the most of it (kv_bytes, the cache of this batch and length): pass {said}"
    lower = _smaller_chunk(cfg, at_chunk, io_peak, least, dev.budget,
                           lambda c, peaks: _smallest(lambda n: trial_for(n, round_up(peaks[0], g), peaks[1],
                                                                          prefill_chunk=c),
                                                      len(in_force.segments), plan_inputs))
    if lower is None:
        return (f"{what}, the scratch reserve the most of it (scratch_bytes, a step's memory: the largest step's "
                f"buffers and what ORT takes beside them): pass {said}")
    chunk, low, at = lower
    where = "which this budget holds" if low <= dev.budget else "the smallest budget of any prompt chunk"
    return (f"{what} ({said}), the scratch reserve the most of it: a prompt chunk's step of {cfg.prefill_chunk} "
            f"tokens, whose buffers and logits the steps hold. A smaller prompt chunk lowers it: with "
            f"prefill_chunk={chunk}, {fmt_bytes(low)} ({where}): pass prefill_chunk={chunk}, {_keywords(low, at)}")


def _keywords(budget: int, trial) -> str:
    """The budget keywords of advice: the budget and its reserves (a KV reserve of 0, for
    a device whose stage holds no layer's cache, is the default and goes unsaid)."""
    kv = f"kv_bytes={trial.kv_bytes}, " if trial.kv_bytes else ""
    return f"vram_limit={budget}, {kv}scratch_bytes={trial.scratch_bytes}"


def _smallest(trial_for: Callable[[int], object], segments: int, plan_inputs: dict) -> tuple:
    """(the smallest budget, the configuration tried) for `trial_for(segments)`, whose
    scratch depends on the number of segments, which depends on the budget: the search
    runs again while it grows. (0, ...) where no budget of the device holds it."""
    for _ in range(3):
        trial = trial_for(segments)
        least = smallest_budget(trial, **plan_inputs)
        if not least:
            break
        at = plan_budget(dataclasses.replace(trial, vram_limit=least),
                         **dict(plan_inputs, free=max(plan_inputs["free"], least)))
        if len(at.segments) <= segments:
            break
        segments = len(at.segments)
    return least, trial


def _smaller_chunk(cfg, at_chunk, io_peak: int, least: int, budget: int, smallest) -> Optional[tuple]:
    """(prefill_chunk, its smallest budget, its configuration) of a prompt chunk smaller
    than the configuration's that lowers the smallest budget `least`: the largest such
    chunk whose budget `budget` holds, else the largest within 1/16 of the lowest any
    chunk down to 16 tokens gives. None where the prompt's chunk does not drive the
    scratch (a prompt within one step, or a decode step's buffers)."""
    if at_chunk is None:
        return None
    found = []
    chunk = cfg.prefill_chunk // 2
    while chunk >= 16:
        peaks = at_chunk(chunk)
        if peaks[1] >= io_peak:
            break  # the prompt runs in one step at this chunk, or the chunk was not what drove it
        low, at = smallest(chunk, peaks)
        if low and low < least:
            found.append((chunk, low, at))
        chunk //= 2
    if not found:
        return None
    fits = [f for f in found if f[1] <= budget]
    if fits:
        return fits[0]
    lowest = min(f[1] for f in found)
    return next(f for f in found if f[1] <= lowest + lowest // 16)


def engine_short(engines, kv: int, scratch: int, why) -> BudgetExceeded:
    """The error for a budget too small for the streaming engine with these reserves,
    with the smallest budget that runs it."""
    dev, g, run = engines.device, engines.device.granularity, engines.run_inputs
    shared = set(run.shared)
    largest = max((w.nbytes for w in run.weights if w.name not in shared), default=0)
    ring = round_up(largest, g) + 2 * g
    least = kv + scratch + ring + (engines.cost(run.shared) if run.shared else 0)
    what = (f"the streaming engine needs {fmt_bytes(kv)} for the KV cache, {fmt_bytes(scratch)} for a step's "
            f"memory (ORT's and the step's buffers) and a ring of about {fmt_bytes(ring)} for the streamed "
            f"weights, and the budget is {fmt_bytes(dev.budget)} ({why})")
    if least <= dev.device_total * 0.9 and least > dev.budget:
        return BudgetExceeded(f"{what}: pass vram_limit={least} (or set {ENV_VRAM_LIMIT}={least}), or lower the "
                              f"batch or the length")
    return BudgetExceeded(f"{what}: lower the batch, the length or prefill_chunk (the prompt's tokens per "
                          f"step, now {engines.config.prefill_chunk})")


def segments_with_room(engines) -> None:
    """engines.make_segment_runner(), planned again with more scratch while ORT takes more
    device memory when it creates its sessions (its handles and workspaces) than the plan
    set aside: the new plan keeps fewer weights resident to make the room. Where no plan
    of the budget holds it, the StepMemoryShort stands (a BudgetExceeded). The caller
    holds the session's lock."""
    for attempt in range(3):
        needed = 0
        try:
            return engines.make_segment_runner()
        except StepMemoryShort as e:
            if attempt == 2 or not engines.config.offload or not e.needed:
                raise
            # A copy of the error, without its traceback or context: their frames hold the
            # failed runner and its ORT sessions, which must go before the next ones are made.
            needed, error = e.needed, StepMemoryShort(str(e), e.needed)
        # Outside the handler: the failed runner's ORT sessions go with its frames.
        engines.drop()
        engines.meter.refund()
        g = engines.device.granularity
        # The KV reserve of the plan in force stays (the first generation's, where the
        # model sized it): a configuration that names the scratch reserve takes none
        # from the model's defaults.
        zones = engines.plan.zones
        trial = dataclasses.replace(engines.config, scratch_bytes=round_up(zones["scratch"].reserve + needed, g),
                                    kv_bytes=engines.config.kv_bytes or zones["kv"].reserve)
        try:
            plan = plan_budget(trial, **engines.run_inputs.plan_inputs)
        except BudgetExceeded:
            raise error from None
        engines.plan = plan
        engines.device.apply(plan)
        engines.notes.append(f"ORT took {fmt_bytes(needed)} of device memory for its sessions beyond the step "
                             f"memory planned: the budget was planned again with {fmt_bytes(trial.scratch_bytes)} "
                             f"for the steps")
