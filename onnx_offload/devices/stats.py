"""What a StagedSession reports: each device's OffloadStats, and their totals."""
from __future__ import annotations

import dataclasses
from typing import List

from ..memory import Counters
from ..stats import OffloadStats, table


@dataclasses.dataclass
class StagedStats:
    devices: List[int]  # the device of each stage
    stages: List[OffloadStats]  # each stage's, from its own device's ledger and counters
    moved_bytes: int  # boundary values moved from one device to another

    @property
    def committed(self) -> int:
        return sum(s.ledger.committed for s in self.stages)

    @property
    def peak_committed(self) -> int:
        """The sum of each device's peak (each device's budget bounds its own)."""
        return sum(s.peak_committed for s in self.stages)

    @property
    def weight_bytes(self) -> int:
        return sum(s.weight_bytes for s in self.stages)

    @property
    def counters(self) -> Counters:
        """The stages' offload counters added up (a step counts once per stage)."""
        total = Counters()
        for s in self.stages:
            for f in dataclasses.fields(Counters):
                setattr(total, f.name, getattr(total, f.name) + getattr(s.counters, f.name))
        return total

    def as_dict(self) -> dict:
        return {"devices": list(self.devices), "stages": [s.as_dict() for s in self.stages],
                "moved_bytes": self.moved_bytes, "committed": self.committed,
                "peak_committed": self.peak_committed, "weight_bytes": self.weight_bytes,
                "counters": self.counters.as_dict()}

    def table(self) -> str:
        rows = [[str(d), s.backend, str(s.weights), str(s.weight_bytes), str(s.ledger.budget),
                 str(s.peak_committed), str(s.counters.htod_bytes)] for d, s in zip(self.devices, self.stages)]
        rows.append(["total", "", str(sum(s.weights for s in self.stages)), str(self.weight_bytes),
                     str(sum(s.ledger.budget for s in self.stages)), str(self.peak_committed),
                     str(self.counters.htod_bytes)])
        return table(rows, ["device", "backend", "weights", "weight bytes", "budget", "peak committed", "htod bytes"])

    __str__ = table
