"""One device as the session sees it: backend, budget owner, arena, streams, scratch.

The CUDA backend plays the GPU; the host backend plays it on the CPU with the same
granularity, flags, budget and counters, which is how CPU sessions and CI exercise
the whole stack.
"""
from __future__ import annotations

import resource
from typing import Dict

from .. import _core
from ..config import BUDGET_MARGIN, GiB, MiB, OffloadConfig
from ..errors import CudaUnavailable
from .budget import ZONES, BudgetPlan, ZonePlan, base_zones, device_budget


def cuda_available() -> tuple[bool, str]:
    """(True, '') when the CUDA driver and a device are usable, else (False, why not)."""
    why = _core.driver_status()
    return (not why, why)


def make_backend(kind: str, config: OffloadConfig):
    if kind == "cuda":
        ok, why = cuda_available()
        if not ok:
            raise CudaUnavailable(why)
        return _core.make_cuda_backend(config.device_id)
    if kind == "host":
        return _core.make_host_backend(config.host_granularity)
    raise ValueError(f"unknown device kind {kind!r}: expected 'cuda' or 'host'")


def weights_allowance(on_cuda: bool, config: OffloadConfig) -> int:
    """The weight bytes a device keeps resident under `config`, before a model is known:
    the weights zone's allowance within the budget, less the KV and scratch reserves."""
    kind = "cuda" if on_cuda else "host"
    backend = make_backend(kind, config)
    free, total = backend.mem_info()
    budget, _ = device_budget(config, free, total, BUDGET_MARGIN[kind])
    zones = base_zones(config, budget, backend.granularity)
    return max(0, min(zones["weights"].allowance, budget - zones["kv"].reserve - zones["scratch"].reserve))


def default_zone_va(kind: str, total: int) -> int:
    """Address space per zone: twice the device's memory, at least 64 GiB. A host backend's
    reservation counts against the process's address-space limit (``ulimit -v``, which
    containers and batch schedulers set), so there the zones together take at most a
    quarter of what the limit leaves."""
    va = max(64 * GiB, 2 * total)
    if kind == "host":
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            va = min(va, max(64 * MiB, (soft - _mapped_bytes()) // (4 * len(ZONES))))
    return va


def _mapped_bytes() -> int:
    """The address space this process maps now (VmSize), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Device:
    """Owns the ledger and the arena of one device, and the streams that feed it."""

    def __init__(self, kind: str, config: OffloadConfig):
        self.kind = kind
        self.config = config
        self.backend = make_backend(kind, config)
        # The device's free memory as another process leaves it: None reads the backend's;
        # a callable returning bytes plays that process on the host backend (whose free
        # memory is the machine's), so that memory taken after the start can be tested.
        self.free_memory_hook = None
        free, total = self.backend.mem_info()
        self.device_free, self.device_total = free, total
        self.margin = BUDGET_MARGIN[kind]  # what an "auto" budget leaves of the free memory
        self.budget, self.budget_note = device_budget(config, free, total, self.margin)
        self.ledger = _core.BudgetOwner(self.budget)
        self.set_zones(base_zones(config, self.budget, self.backend.granularity))
        zone_va = config.zone_va_bytes or default_zone_va(kind, total)
        self.arena = _core.Arena(self.backend, self.ledger, zone_va_bytes=zone_va,
                                 handle_classes=list(config.handle_classes))
        self.copy_stream = self.backend.create_stream()
        self.compute_stream = self.backend.create_stream()
        self.arena.guard_capture(self.compute_stream)
        self.scratch = _core.ScratchAllocator(self.arena, "scratch")
        self.ledger.set_reclaimer("scratch", lambda n: self.scratch.empty_cache())
        self.closed = False

    def mem_info(self) -> tuple:
        """(free, total) bytes of the device now."""
        free, total = self.backend.mem_info()
        if self.free_memory_hook is not None:
            free = min(free, int(self.free_memory_hook()))
        return free, total

    def charge_outside(self, zone: str, nbytes: int) -> None:
        """Charges to `zone` `nbytes` of device memory that the arena does not hold (ORT's own,
        the streaming ring's or an expert's pages), first giving back the arena's idle
        pooled handles that would take the device past its budget beside them: the pool is
        the arena's cache for reuse, and the ledger counts it as taken. BudgetExceeded, as
        the ledger's charge, where the zones have no room."""
        snap = self.ledger.snapshot()
        over = snap.committed + snap.pooled + nbytes - snap.budget
        if over > 0 and snap.pooled:
            self.arena.trim_pool(over)
        self.ledger.charge(zone, nbytes, outside=True)

    def set_zones(self, zones: Dict[str, ZonePlan]) -> None:
        # Reserves that shrink first: the ledger holds their sum within the budget at
        # every step, and a plan may move bytes from one reserve to another.
        now = self.ledger.snapshot().zones

        def growth(item) -> int:
            name, z = item
            return z.reserve - (now[name].reserve if name in now else 0)
        for name, z in sorted(zones.items(), key=growth):
            self.ledger.set_zone(name, allowance=z.allowance, reserve=z.reserve)

    def apply(self, plan: BudgetPlan) -> None:
        """Sets every zone as the budget plan says."""
        if plan.budget != self.budget:
            raise ValueError(f"a plan for a budget of {plan.budget} bytes applied to a device of {self.budget}")
        self.set_zones(plan.zones)

    @property
    def granularity(self) -> int:
        return self.backend.granularity

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def close(self):
        """Gives back every byte; returns the final ledger snapshot."""
        if self.closed:
            return self.ledger.snapshot()
        self.compute_stream.synchronize()
        self.copy_stream.synchronize()
        for zone in ("weights", "kv", "scratch", "transient"):
            self.ledger.clear_reclaimer(zone)
        self.scratch.empty_cache()
        self.scratch = None
        self.arena.close()
        # Ends the worker threads (host) or CUstreams now, not at GC. The ORT sessions
        # that ran on compute_stream are gone: the session closes its runner first.
        self.arena.unguard_capture(self.compute_stream)
        self.compute_stream.close()
        self.copy_stream.close()
        self.closed = True
        return self.ledger.snapshot()
