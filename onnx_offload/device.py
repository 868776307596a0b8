"""One device as the session sees it: backend, budget owner, arena, streams, scratch.

The CUDA backend plays the GPU; the host backend plays it on the CPU with the same
granularity, flags, budget and counters, which is how CPU sessions and CI exercise
the whole stack.
"""
from __future__ import annotations

from . import _core
from .config import GiB, MiB, OffloadConfig
from .errors import CudaUnavailable


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


class Device:
    """Owns the ledger and the arena of one device, and the streams that feed it."""

    def __init__(self, kind: str, config: OffloadConfig):
        self.kind = kind
        self.config = config
        self.backend = make_backend(kind, config)
        free, total = self.backend.mem_info()
        self.device_free, self.device_total = free, total
        requested = config.resolve_budget(free, total)
        # A budget beyond what the device has free cannot be honoured.
        self.budget = min(requested, free)
        self.budget_note = "" if requested <= free else (
            f"the requested budget of {requested} bytes exceeds the {free} bytes free; using {free}")
        self.ledger = _core.BudgetOwner(self.budget)
        weights = min(config.weight_bytes or self.budget, self.budget)
        kv_reserve = min(config.kv_bytes, self.budget)
        if config.scratch_bytes is None:
            scratch_reserve = min(256 * MiB, (self.budget - kv_reserve) // 8)
        else:
            scratch_reserve = config.scratch_bytes
        # At least one granule when there is any: less cannot back a single buffer.
        if scratch_reserve:
            g = self.backend.granularity
            scratch_reserve = min(-(-scratch_reserve // g) * g, self.budget - kv_reserve)
        self.ledger.set_zone("weights", allowance=weights, reserve=0, priority=0)
        self.ledger.set_zone("kv", allowance=self.budget, reserve=kv_reserve, priority=2)
        self.ledger.set_zone("scratch", allowance=self.budget, reserve=scratch_reserve, priority=1)
        self.ledger.set_zone("transient", allowance=self.budget, reserve=0, priority=3)
        zone_va = config.zone_va_bytes or max(64 * GiB, 2 * total)
        self.arena = _core.Arena(self.backend, self.ledger, zone_va_bytes=zone_va,
                                 handle_classes=list(config.handle_classes))
        self.copy_stream = self.backend.create_stream()
        self.compute_stream = self.backend.create_stream()
        self.arena.guard_capture(self.compute_stream)
        self.scratch = _core.ScratchAllocator(self.arena, "scratch")
        self.ledger.set_reclaimer("scratch", lambda n: self.scratch.empty_cache())
        self.closed = False

    @property
    def granularity(self) -> int:
        return self.backend.granularity

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def set_transient_reserve(self, reserve: int) -> None:
        self.ledger.set_zone("transient", allowance=self.budget, reserve=reserve, priority=3)

    def set_weights_allowance(self, allowance: int) -> None:
        self.ledger.set_zone("weights", allowance=allowance, reserve=0, priority=0)

    def close(self) -> dict:
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
        self.closed = True
        return self.ledger.snapshot()
