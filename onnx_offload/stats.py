"""A snapshot of a session's memory and offload counters, printable as a table."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ._core import ArenaStats, DriverCounters, LedgerSnapshot, ScratchStats
from .config import fmt_bytes
from .engines import GraphCaptureDecision, StreamEngine
from .memory import Counters, Device


def table(rows, headers=None) -> str:
    """Rows as text. With headers, a table of figures: the first column left-aligned, the
    others right-aligned. Without, a list of names and values, all left-aligned."""
    from tabulate import tabulate
    rows = [[str(c) for c in r] for r in rows]
    if headers:
        align = ("left",) + ("right",) * (len(headers) - 1)
        return tabulate(rows, headers=list(headers), tablefmt="simple", colalign=align, disable_numparse=True)
    return tabulate(rows, tablefmt="plain", disable_numparse=True)


@dataclasses.dataclass
class OffloadStats:
    backend: str
    policy: str
    vmm: bool
    segments: int
    weights: int
    weight_bytes: int
    capture: str
    ledger: LedgerSnapshot
    arena: ArenaStats
    driver: DriverCounters
    counters: Counters
    last_step: Counters
    scratch: Optional[ScratchStats]
    ort_owned_bytes: int
    outside_bytes: int
    notes: tuple = ()
    graph_steps: int = 0  # steps run under a captured graph (captured once per plan, then replayed)
    margin: int = 0  # what the "auto" budget left of the device's free memory (0: the budget was given)
    reserves: tuple = ()  # (zone, reserve bytes, how it is sized) of each zone that reserves any
    # Host compute (docs/host_compute.md): on, the MatMuls and weights the host computes, the
    # bytes a step each side, both rates and the steps it ran; off, why.
    host_compute: dict = dataclasses.field(default_factory=lambda: dict(on=False, why="", steps=0))

    @property
    def vram_alloc_ms(self) -> float:
        d = self.driver
        return (d.create_ns + d.map_ns + d.set_access_ns + d.plain_alloc_ns) / 1e6

    @property
    def vram_free_ms(self) -> float:
        d = self.driver
        return (d.unmap_ns + d.release_ns + d.plain_free_ns) / 1e6

    @property
    def peak_committed(self) -> int:
        return self.ledger.peak_committed

    @property
    def peak_content(self) -> int:
        return self.ledger.peak_content

    @property
    def granule_overhead(self) -> int:
        return self.ledger.peak_committed - self.ledger.peak_content

    def as_dict(self) -> dict:
        """Plain, JSON-ready data: the core's snapshots become nested dicts."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("ledger", "arena", "driver", "counters", "last_step"):
            d[name] = d[name].as_dict()
        d["scratch"] = self.scratch.as_dict() if self.scratch is not None else None
        d["notes"] = list(self.notes)
        d.update(vram_alloc_ms=self.vram_alloc_ms, vram_free_ms=self.vram_free_ms,
                 peak_committed=self.peak_committed, peak_content=self.peak_content,
                 granule_overhead=self.granule_overhead)
        return d

    def table(self) -> str:
        c = self.counters
        rows = [
            ("backend / policy", f"{self.backend} / {self.policy}{' (vmm)' if self.vmm else ' (plain)'}"),
            ("segments / weights", f"{self.segments} / {self.weights} ({fmt_bytes(self.weight_bytes)})"),
            ("cuda graph", self.capture),
            ("steps", c.steps),
            ("accesses", c.accesses),
            ("page_ins", c.page_ins),
            ("hits", c.hits),
            ("hit rate", f"{c.hit_rate:.2%}"),
            ("byte hit rate", f"{c.byte_hit_rate:.2%}"),
            ("evictions", c.evictions),
            ("bypassed page-ins", f"{c.bypassed} ({fmt_bytes(c.bypassed_bytes)})"),
            ("htod", f"{fmt_bytes(c.htod_bytes)} in {c.htod_ms:.2f} ms ({fmt_bytes(c.htod_bytes_per_step)} a step)"),
        ]
        if c.expert_accesses:
            moved = (f"{fmt_bytes(c.expert_read_bytes)} read in place over the link" if c.expert_read_bytes
                     else f"{fmt_bytes(c.expert_htod_bytes)} paged in")
            rows.append(("routed experts: hits / misses", f"{c.expert_hits} / {c.expert_misses} "
                                                          f"({c.expert_hit_rate:.2%} hit), {moved}"))
        rows += [
            ("vram_alloc / vram_free", f"{self.vram_alloc_ms:.2f} ms / {self.vram_free_ms:.2f} ms"),
            ("driver creates / releases", f"{self.driver.creates} / {self.driver.releases}"),
            ("host waits (synchronizes)", f"{self.driver.host_waits} in {self.driver.host_wait_ns / 1e6:.2f} ms"),
            ("budget", fmt_bytes(self.ledger.budget) + (f" (the device's free memory less a margin of "
                                                          f"{fmt_bytes(self.margin)})" if self.margin else "")),
            ("peak committed", fmt_bytes(self.peak_committed)),
            ("peak content", fmt_bytes(self.peak_content)),
            ("granule overhead", f"{fmt_bytes(self.granule_overhead)} (peak committed less peak content: memory "
                                 f"is committed in whole granules)"),
            ("ORT's own memory at creation", fmt_bytes(self.ort_owned_bytes)),
            ("ORT's own memory (its arena, cuBLAS)", fmt_bytes(self.outside_bytes)),
        ]
        zones = [(z, fmt_bytes(v.committed.current), fmt_bytes(v.committed.peak),
                  fmt_bytes(v.allowance), fmt_bytes(v.reserve))
                 for z, v in self.ledger.zones.items()]
        text = table(rows) + "\n\n" + table(zones, ("zone", "committed", "peak", "allowance", "reserve"))
        if self.reserves:
            text += "\n\n" + "\n".join(f"reserve of {z}: {fmt_bytes(n)}, {how}" for z, n, how in self.reserves)
        h = self.host_compute
        if h.get("on"):
            rates = ", ".join(f"{k} {r.get(1, 0) / 1e9:.1f} GB/s" for k, r in h["host_rates"].items())
            text += (f"\n\nhost compute: {len(h['matmuls'])} MatMul(s), {fmt_bytes(h['host_bytes_per_step'])} a step on "
                     f"the host ({rates} while the link ran), {fmt_bytes(h['streamed_bytes_per_step'])} streamed "
                     f"({h['link_rate'] / 1e9:.1f} GB/s); {h['steps']} step(s) so far")
        if self.notes:
            text += "\n\n" + "\n".join(f"note: {n}" for n in self.notes)
        return text

    __str__ = table


INVARIANTS = ("refcount_underflows", "unmaps_before_reader", "unaccounted_bytes", "uncovered_referenced")


def invariant_violations(arena: ArenaStats) -> dict:
    """The arena's invariant counters that do not read 0, with their values."""
    return {k: getattr(arena, k) for k in INVARIANTS if getattr(arena, k)}


class ReportingMembers:
    """What an OffloadSession reports of itself: its engine, segments, capture decision,
    counters and residency timeline. Mixed into OffloadSession; uses its engine in force
    (_runner, _residency), device, meter and notes."""

    @property
    def graph_capture(self) -> GraphCaptureDecision:
        runner = self._runner
        if runner is None and not self._closed:  # another thread moves the session to another runner
            runner = self._live_runner()
        if runner is None:  # closed while its engine was being replaced, which could not be brought back
            return GraphCaptureDecision(False, "the session closed: its engine could not be made again")
        return runner.capture

    def timeline_png(self, path: str) -> str:
        """Draws the residency timeline (a session made with record_timeline=True) with
        matplotlib, the optional extra [plot]; returns the path."""
        from .timeline import residency_png
        res = self._residency
        budget = self._final_ledger.budget if self._closed else self._device.ledger.snapshot().budget
        title = (f"{self._model_name}: budget {fmt_bytes(budget)}, policy {self.config.policy}, "
                 f"{len(self.segments)} segment(s)")
        return residency_png(path, res.timeline or (), res.zone_timeline or (), budget=budget, title=title)

    @property
    def engine(self) -> str:
        """"graph": the streaming engine runs the model (one ORT session, captured, with
        the page-ins in its graph); "segments": one ORT session per segment (one in all
        when every weight is resident)."""
        return "graph" if isinstance(self._runner, StreamEngine) else "segments"

    @property
    def segments(self) -> list:
        if self._closed and self._segments_at_close is not None:
            return list(self._segments_at_close)
        return [r.seg for r in self._runner.runs] if self._runner else []

    @property
    def device(self) -> Device:
        return self._device

    @property
    def residency(self):
        return self._residency

    def stats(self) -> OffloadStats:
        # A forked child may not even read the counters: a lock of the arena's may have been
        # held by another of the parent's threads at the fork, and is held for good here.
        self._check_process()
        dev, res, runner = self._device, self._residency, self._runner
        ledger = self._final_ledger if self._closed else dev.ledger.snapshot()
        return OffloadStats(
            backend=dev.kind, policy=self.config.policy, vmm=self._stable, segments=len(self.segments),
            weights=len(self._weights), weight_bytes=sum(w.nbytes for w in self._weights),
            capture=f"{'on' if self.graph_capture.enabled else 'off'}: {self.graph_capture.reason}",
            ledger=ledger, arena=dev.arena.stats(), driver=dev.backend.counters(),
            counters=Counters(**vars(res.counters)) if res else Counters(),
            last_step=Counters(**vars(runner.last_step)) if runner else Counters(),  # a copy, as of counters
            scratch=dev.scratch.stats() if dev.scratch is not None else None,
            ort_owned_bytes=self._meter.at_creation if self._meter else 0,
            outside_bytes=self._meter.charged if self._meter else 0, notes=tuple(self._notes),
            graph_steps=runner.graph_steps if runner else 0,
            margin=dev.margin if self.config.vram_limit is None else 0,
            reserves=tuple((z, v.reserve, self._reserve_sizing(z)) for z, v in ledger.zones.items() if v.reserve),
            host_compute=runner.host_report() if runner is not None else dict(on=False, why="", steps=0))

    def _reserve_sizing(self, zone: str) -> str:
        """How the plan in force sized a zone's reserve, in words."""
        cfg, eng = self.config, self._engines
        planned = eng.planned_for if eng is not None else ""
        streaming_engine = eng is not None and eng.needs is not None
        if zone == "kv":
            return "kv_bytes, as given" if cfg.kv_bytes else f"the KV cache of {planned or 'the generation asked'}"
        if zone == "scratch":
            if cfg.scratch_bytes is not None and not streaming_engine:
                return "scratch_bytes, as given"
            if planned:
                return (f"the largest step of {planned}: its buffers and a bound on ORT's memory for its tokens, "
                        f"where ORT's memory is then measured and charged")
            return ("256 MiB or an eighth of the budget, whichever is less, for ORT's memory and the values "
                    "between segments")
        if zone == "transient":
            return ("the ring the streamed weights pass through" if streaming_engine
                    else "the largest segment's streamed weights")
        return "as planned"
