"""The offload counters of a session: accesses, hits and page-ins of its weights, and
of the experts that stream by route."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Counters:
    """Offload counters. `page_ins + hits == accesses` always holds."""

    steps: int = 0
    accesses: int = 0
    hits: int = 0
    page_ins: int = 0
    access_bytes: int = 0
    hit_bytes: int = 0
    bypassed: int = 0
    bypassed_bytes: int = 0
    evictions: int = 0
    htod_bytes: int = 0
    htod_ms: float = 0.0
    # Of the accesses, those of one expert's rows of a stack streamed by route (routed
    # experts only: an expert the router did not pick is not accessed).
    expert_accesses: int = 0
    expert_hits: int = 0
    expert_htod_bytes: int = 0
    # Experts read in place (experts="in_place"): a step's picks, counted as above (a hit
    # is an expert on device pages), and the bytes of the missed ones, read over the link.
    expert_read_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def byte_hit_rate(self) -> float:
        return self.hit_bytes / self.access_bytes if self.access_bytes else 0.0

    @property
    def expert_misses(self) -> int:
        """Routed experts paged in (to stay, or streamed through the transient zone), or
        read over the link in place."""
        return self.expert_accesses - self.expert_hits

    @property
    def expert_hit_rate(self) -> float:
        return self.expert_hits / self.expert_accesses if self.expert_accesses else 0.0

    @property
    def htod_bytes_per_step(self) -> float:
        return self.htod_bytes / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["hit_rate"] = self.hit_rate
        d["byte_hit_rate"] = self.byte_hit_rate
        d["expert_misses"] = self.expert_misses
        d["expert_hit_rate"] = self.expert_hit_rate
        d["htod_bytes_per_step"] = self.htod_bytes_per_step
        return d

    def minus(self, other: "Counters") -> "Counters":
        return Counters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)})

    def __add__(self, other: "Counters") -> "Counters":
        """These counts and `other`'s, added up in a new object. The session's running
        counters are replaced by the sum in one store, so that a `stats()` read on
        another thread sees a step whole or not at all."""
        return Counters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})

    def plus(self, **more) -> "Counters":
        return dataclasses.replace(self, **{k: getattr(self, k) + v for k, v in more.items()})
