"""ORT's own device memory, measured and charged to the scratch zone.

ORT commits device memory outside the arena: its own arena (capped through
``gpu_mem_limit``), initializers it copies, and cuBLAS/cuDNN workspaces. The meter
reads the device's free memory before and after ORT may have taken some, subtracts
what the arena itself committed meanwhile, and charges the difference, in whole
granules, to the scratch zone as outside bytes. Nothing is measured on the host
backend, where ORT's memory is ordinary process memory.

A delta misses what appears between marks: memory the CUDA libraries hold once an ORT
session is gone, kernels loaded lazily, graphs, another process. So each measurement
ends by settling: the part of the budget that the device no longer has (the budget's
room beyond what the arena holds, against the device's free memory less SLACK) is
charged too. Then the ledger never plans for memory the device cannot give, and a
plan made on a small card keeps the device SLACK bytes for what no mark sees. A settling
charge goes back as soon as the device has the memory again (another process gave it
back). Sessions settle before each generation too (``generation.kept``), so memory another
process takes after the start is charged before a step counts on it: the scratch zone takes
it, or the session plans again or says so (StepMemoryShort, a BudgetExceeded).

On the host backend (where ORT's memory, the host store and the device are the same
process memory) nothing is measured or settled, unless the device's free memory is played
(``Device.free_memory_hook``).
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..config import MiB
from ..errors import BudgetExceeded
from .step_memory import StepMemoryShort

# Device memory kept free beyond the budget's room: a capture, a graph's upload and a
# kernel loaded on its first launch take device memory that no ledger call sees.
SLACK = 32 * MiB


class OrtMemoryMeter:
    def __init__(self, device):
        self._device = device
        self.charged = 0  # outside bytes charged so far
        self.at_creation = 0  # of those, what ORT took while creating sessions
        self.settled = 0  # of those, what settle() charged: the budget's room the device could not give

    def mark(self) -> Optional[Tuple[int, int]]:
        """The device's free bytes and the arena's physical bytes now (None: not measured,
        on the host backend unless its free memory is played)."""
        if not self._device.is_cuda and self._device.free_memory_hook is None:
            return None
        free = self.keep_free()
        snap = self._device.ledger.snapshot()
        return free, snap.committed + snap.pooled

    def keep_free(self) -> int:
        """Gives the arena's idle pooled handles back to the device while it has less than
        SLACK free, so that what ORT takes next does not find the device full of memory the
        arena only keeps for reuse; returns the device's free bytes."""
        free, _ = self._device.mem_info()
        if free < SLACK and self._device.ledger.snapshot().pooled:
            self._device.arena.trim_pool(SLACK - free)
            free, _ = self._device.mem_info()
        return free

    def charge_since(self, mark, creating: bool = False) -> int:
        """Charges what appeared outside the arena since `mark`; returns the bytes charged.
        StepMemoryShort (a BudgetExceeded) when the scratch zone cannot take them: ORT
        holds them, and the budget plan must make room or the session must let it go."""
        if mark is None:
            return 0
        free0, ours0 = mark
        free1, _ = self._device.mem_info()
        snap = self._device.ledger.snapshot()
        grown = (free0 - free1) - (snap.committed + snap.pooled - ours0)
        g = self._device.granularity
        grown = (grown // g) * g
        if grown > 0:
            self._charge(grown, creating, f"ORT took {grown} bytes of device memory for its own use (its arena, "
                                          f"workspaces)")
        return max(0, grown) + self.settle(creating)

    def settle(self, creating: bool = False) -> int:
        """Charges the budget's room that the device cannot give (see the module's text);
        returns the bytes charged. StepMemoryShort when the scratch zone cannot take them."""
        if not self._device.is_cuda and self._device.free_memory_hook is None:
            return 0
        free = self.keep_free()
        snap = self._device.ledger.snapshot()
        g = self._device.granularity
        short = -(-((snap.budget - snap.committed - snap.pooled) - max(0, free - SLACK)) // g) * g
        if short < 0 and self.settled:  # the device has the memory again: the settling charge goes back
            back = min(self.settled, (-short // g) * g)
            if back:
                self._device.ledger.refund("scratch", back, outside=True)
                self.charged -= back
                self.settled -= back
                self.at_creation = min(self.at_creation, self.charged)
            return 0
        if short <= 0:
            return 0
        self._charge(short, creating, f"memory outside the budget (the CUDA libraries, kernels and graphs, or "
                                      f"another process) took {short} bytes of the device that the budget counts on")
        self.settled += short
        return short

    def _charge(self, nbytes: int, creating: bool, what: str) -> None:
        try:
            self._device.charge_outside("scratch", nbytes)
        except BudgetExceeded as e:
            raise StepMemoryShort(f"{what}, which the scratch zone has no room for: {e}", nbytes) from None
        self.charged += nbytes
        if creating:
            self.at_creation += nbytes

    def refund(self, mark=None) -> None:
        """Gives the charge back (the sessions that held the memory are gone). With `mark`,
        taken before they went, only what the device got back beyond the arena's own bytes:
        what ORT leaves in the process once its sessions are gone (the kernels it loaded,
        library handles and their workspaces) stays taken, and so stays charged."""
        back = self.charged
        if mark is not None and back:
            free0, ours0 = mark
            free1, _ = self._device.mem_info()
            snap = self._device.ledger.snapshot()
            returned = (free1 - free0) - (ours0 - (snap.committed + snap.pooled))
            g = self._device.granularity
            back = min(back, max(0, -(-returned // g) * g))
        if back:
            self._device.ledger.refund("scratch", back, outside=True)
            self.charged -= back
            self.at_creation = min(self.at_creation, self.charged)
            self.settled = min(self.settled, self.charged)
