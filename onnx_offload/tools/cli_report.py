"""What `demo` and `generate` say they measured, after their figures: the budget and what
it saved (on the CPU: that the host backend plays the GPU and saves no RAM), the step
against its bound, and the next thing to try.

A step that streams weights cannot be faster than its bound: the larger of the step with
every weight resident (where it was measured) and the bytes it copies over the link at
the link's bandwidth, measured here with a copy of the same kind (pinned host memory to
the device; on the CPU, the host backend's copy).
"""
from __future__ import annotations

import resource
from typing import List, Optional

from ..config import fmt_bytes
from ..errors import OffloadError

# A step within this factor of its bound runs at the bound: what is left is the link's
# (or the computation's) own time, which only fewer bytes a step shortens.
AT_BOUND = 1.5
ON_CPU = ("next: on the CPU the host backend plays a GPU's streams with threads and waits, which cost more than its "
          "copies; plain onnxruntime runs a model that fits in RAM faster. Streaming pays on a GPU whose memory the "
          "weights exceed: pip install 'onnx-offload[gpu]' there")


def generation_lines(device_kind: str, device_id: int, stats, decode_ms: Optional[float]) -> List[str]:
    """generate's report of a session on one device, from its `stats` (an OffloadStats):
    the budget and what it saved, and a decode step (`decode_ms`; None where no token came
    after the first) against its bound."""
    kind = "cuda" if device_kind == "cuda" else "host"
    lines = budget_lines(kind, stats)
    if decode_ms is None:
        return lines + ([ON_CPU] if kind != "cuda" else [])
    if not streamed_bytes(stats.last_step):
        return lines + bound_lines(kind, stats, decode_ms, 0.0, what="a decode step")
    try:
        bandwidth = link_bandwidth(kind, device_id)
    except (OffloadError, MemoryError) as e:  # the device had no room for the measurement's buffer
        return lines + [f"a decode step: {decode_ms:.2f} ms; its bound is not known: the link's bandwidth could not "
                        f"be measured ({e})"]
    return lines + bound_lines(kind, stats, decode_ms, bandwidth, what="a decode step")


def link_bandwidth(kind: str, device: int = 0) -> float:
    """The link's bandwidth in bytes/s: pinned host memory to `device` (CUDA), or the host
    backend's copy (the CPU), measured on a buffer large enough to reach it."""
    from .bench import pinned_h2d
    return pinned_h2d(kind, 64 << 20, device)


def streamed_bytes(step) -> int:
    """The weight bytes a step moved over the link: copied in, or read in place."""
    return step.htod_bytes + step.expert_read_bytes


def budget_lines(kind: str, stats) -> List[str]:
    """The budget, what the weights took of it, and what that saved; on the CPU, that the
    host backend plays the GPU in host memory and saves no RAM."""
    zones = stats.ledger.zones
    weights = zones["weights"].committed.peak + zones["transient"].committed.peak  # resident, and streamed through
    lines = [f"budget: {fmt_bytes(stats.ledger.budget)}; {fmt_bytes(stats.peak_committed)} committed at its peak, "
             f"of which the weights (resident, and streamed through; in whole granules) took at most "
             f"{fmt_bytes(weights)}, for the model's {fmt_bytes(stats.weight_bytes)} of weights"]
    if kind == "cuda":
        lines.append(f"saved: {fmt_bytes(max(stats.weight_bytes - weights, 0))} of GPU memory that plain ORT's "
                     f"weights would take")
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # KiB on Linux
        lines.append(f"saved: no RAM: on the CPU the host backend plays the GPU in host memory (to run and test "
                     f"the package without one), and every weight stays in RAM as well; this process's peak RSS: "
                     f"{fmt_bytes(rss)}")
    return lines


def bound_lines(kind: str, stats, step_ms: float, bandwidth: float, resident_ms: Optional[float] = None,
                what: str = "a step") -> List[str]:
    """The step against its bound, and the next thing to try."""
    moved = streamed_bytes(stats.last_step)
    on_cpu = ON_CPU
    if not moved:
        return [f"{what}: {step_ms:.2f} ms; no weight streamed (every weight stayed within the budget)",
                on_cpu if kind != "cuda" else "next: a smaller --vram-limit leaves more of the GPU free, until "
                                              "weights stream and the step slows toward the link's bound"]
    link_ms = moved / bandwidth * 1e3
    bound_ms = max(link_ms, resident_ms or 0.0)
    parts = [f"{fmt_bytes(moved)} over the link at {bandwidth / 1e9:.1f} GB/s (measured) take {link_ms:.2f} ms"]
    if resident_ms is not None:
        parts.append(f"with every weight resident it took {resident_ms:.2f} ms")
    lines = [f"{what}: {step_ms:.2f} ms against its bound of {bound_ms:.2f} ms ({step_ms / bound_ms:.1f}x): "
             + "; ".join(parts)]
    if kind != "cuda":
        lines.append(on_cpu)
    elif step_ms <= AT_BOUND * bound_ms:
        lines.append("next: the step runs at its bound; a larger --vram-limit keeps more weights resident and "
                     "streams fewer bytes a step")
    else:
        lines.append("next: the step runs above its bound; a larger --vram-limit streams fewer bytes a step, and "
                     "the session's stats() show where the rest goes (page-ins, host waits, graphs "
                     f"{'on' if stats.graph_steps else 'off'})")
    return lines
