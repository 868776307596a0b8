"""ORT's own device memory, measured and charged to the scratch zone.

ORT commits device memory outside the arena: its own arena (capped through
``gpu_mem_limit``), initializers it copies, and cuBLAS/cuDNN workspaces. The meter
reads the device's free memory before and after ORT may have taken some, subtracts
what the arena itself committed meanwhile, and charges the difference, in whole
granules, to the scratch zone as outside bytes. Nothing is measured on the host
backend, where ORT's memory is ordinary process memory.
"""
from __future__ import annotations

from typing import Optional, Tuple

from .errors import BudgetExceeded
from .step_memory import StepMemoryShort


class OrtMemoryMeter:
    def __init__(self, device):
        self._device = device
        self.charged = 0  # outside bytes charged so far
        self.at_creation = 0  # of those, what ORT took while creating sessions

    def mark(self) -> Optional[Tuple[int, int]]:
        """The device's free bytes and the arena's physical bytes now (None: not measured)."""
        if not self._device.is_cuda:
            return None
        free, _ = self._device.backend.mem_info()
        snap = self._device.ledger.snapshot()
        return free, snap.committed + snap.pooled

    def charge_since(self, mark, creating: bool = False) -> int:
        """Charges what appeared outside the arena since `mark`; returns the bytes charged.
        StepMemoryShort (a BudgetExceeded) when the scratch zone cannot take them: ORT
        holds them, and the budget plan must make room or the session must let it go."""
        if mark is None:
            return 0
        free0, ours0 = mark
        free1, _ = self._device.backend.mem_info()
        snap = self._device.ledger.snapshot()
        grown = (free0 - free1) - (snap.committed + snap.pooled - ours0)
        g = self._device.granularity
        grown = (grown // g) * g
        if grown <= 0:
            return 0
        try:
            self._device.ledger.charge("scratch", grown, outside=True)
        except BudgetExceeded as e:
            raise StepMemoryShort(f"ORT took {grown} bytes of device memory for its own use (its arena, "
                                  f"workspaces), which the scratch zone has no room for: {e}", grown) from None
        self.charged += grown
        if creating:
            self.at_creation += grown
        return grown

    def refund(self, mark=None) -> None:
        """Gives the charge back (the sessions that held the memory are gone). With `mark`,
        taken before they went, only what the device got back beyond the arena's own bytes:
        what ORT leaves in the process once its sessions are gone (the kernels it loaded,
        library handles and their workspaces) stays taken, and so stays charged."""
        back = self.charged
        if mark is not None and back:
            free0, ours0 = mark
            free1, _ = self._device.backend.mem_info()
            snap = self._device.ledger.snapshot()
            returned = (free1 - free0) - (ours0 - (snap.committed + snap.pooled))
            g = self._device.granularity
            back = min(back, max(0, -(-returned // g) * g))
        if back:
            self._device.ledger.refund("scratch", back, outside=True)
            self.charged -= back
            self.at_creation = min(self.at_creation, self.charged)
