"""Host compute in the streaming engine's decode steps: the split, made once when the
engine starts (docs/host_compute.md).

At start, with weights that stream and MatMuls the host can compute among them:
1. the two rates are measured on this process's own memory: the host GEMV over the
   candidate weights where they lie in the pinned store, while H2D copies from that store
   run back to back on the copy stream (``measure_rates``), for a step of 1, 4 and 8 rows
   (HOST_ROWS);
2. the split planner (``memory.plan_host_split``) chooses the MatMuls the host computes
   for a step of one token, so that the link and the host finish together;
3. the model is rewritten for them (``loading.rewrite_for_host``), and the engine makes a
   second ORT session on that rewrite for the steps the split helps. Every other step (a
   prompt, or a batch the host would slow) runs the whole model and streams every weight,
   as with host compute off.

``auto`` takes the split only where it predicts a step at least MIN_GAIN faster than
streaming everything; a thread count takes it wherever the host computes anything.
"""
from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx

from .. import _core
from ..errors import HostComputeRefused
from ..loading import HostMatMul, host_candidates, rewrite_for_host
from ..memory import NODE_SECONDS, PREFILL_TOKENS, HostSplit, StepWeight, host_rate, plan_host_split

HOST_ROWS = (1, 4, 8)  # the step sizes (rows of X) whose host rates are measured
MEASURE_BYTES = 512 << 20  # candidate weights a kind's GEMV reads per pass: beyond the host's caches
MEASURE_PASSES = 3  # passes per row count; the median counts
COPY_BYTES = 64 << 20  # one H2D copy of the rate measurement
MIN_GAIN = 0.05  # "auto": the split must predict a step at least this much faster
# The resident part's GPU time is estimated from its bytes at this read rate (an H100
# PCIe's HBM reads about 2 TB/s). It matters only where few bytes stream, where the split
# gains little either way.
DEVICE_READ_RATE = 2.0e12


@dataclasses.dataclass
class HostPlan:
    """The split in force: the MatMuls the host computes, the rewritten model, and the
    rates and predictions it rests on."""

    split: HostSplit
    hosts: List[HostMatMul]  # in graph order
    model: onnx.ModelProto  # the rewrite: the host MatMuls cut out
    link_rate: float  # bytes/s, H2D from the pinned store while the host GEMV runs
    host_rates: Dict[str, Dict[int, float]]  # kind -> {rows: bytes/s while the link runs}
    threads: Optional[int]  # host threads a job uses (None: every physical core)
    gpu_seconds: float  # the resident part's estimated GPU time a step
    weights: List[StepWeight]  # the step's non-resident weights, in read order
    measure_seconds: float  # what measuring the rates took

    @property
    def host_weights(self) -> Tuple[str, ...]:
        return self.split.host_weights

    def predicted(self, rows: int) -> Tuple[float, float]:
        """(seconds of a step of `rows` rows with this split, seconds streaming every weight),
        as the planner counts them: max(streamed / link + the host MatMuls read after the
        last streamed weight, resident GPU time + every host MatMul)."""
        streamed = sum(w.nbytes for w in self.weights)
        whole = max(streamed / self.link_rate, self.gpu_seconds)
        on_host = set(self.split.host)
        last = max((i for i, w in enumerate(self.weights) if w.matmul not in on_host), default=-1)
        tail = {w.matmul for w in self.weights[last + 1:]}
        per: Dict[str, list] = {}
        for w in self.weights:
            if w.matmul in on_host:
                per.setdefault(w.matmul, [0, w.kind])[0] += w.nbytes
        host_s = tail_s = 0.0
        for name, (nbytes, kind) in per.items():
            rate = host_rate(self.host_rates, kind, rows)
            if rate <= 0:
                return float("inf"), whole
            seconds = nbytes / rate + NODE_SECONDS
            host_s += seconds
            tail_s += seconds if name in tail else 0.0
        return max(self.split.streamed_bytes / self.link_rate + tail_s, self.gpu_seconds + host_s), whole

    def helps(self, rows: int) -> bool:
        """Whether a step of `rows` rows runs faster with the host's part than streaming all."""
        if rows < 1 or rows > PREFILL_TOKENS:
            return False
        split, whole = self.predicted(rows)
        return split < whole

    def report(self, steps: int) -> dict:
        """What stats() says of host compute."""
        one, whole = self.predicted(1)
        return dict(on=True, matmuls=list(self.split.host), weights=list(self.split.host_weights),
                    host_bytes_per_step=self.split.host_bytes, streamed_bytes_per_step=self.split.streamed_bytes,
                    link_rate=self.link_rate, host_rates={k: dict(v) for k, v in self.host_rates.items()},
                    threads=self.threads, predicted_ms=one * 1e3, streaming_only_ms=whole * 1e3, steps=steps,
                    measure_ms=self.measure_seconds * 1e3)


def _by_matmul(found: Mapping[str, Tuple[str, str]]) -> Dict[str, List[str]]:
    """{MatMul: its weights (B, then an int4 MatMul's scales and zero points)}."""
    out: Dict[str, List[str]] = {}
    for name, (label, _) in found.items():
        out.setdefault(label, []).append(name)
    return out


def _x_dtype(kind: str, weights: Sequence) -> Optional[np.dtype]:
    """The dtype of a candidate MatMul's X and Y (float16 or float32), or None where the host
    kernels do not take it (bfloat16)."""
    dtype = np.dtype(weights[1].dtype if kind == "int4" else weights[0].dtype)
    return dtype if dtype.name in ("float16", "float32") else None


def weight_views(store, kind: str, weights: Sequence) -> dict:
    """The arrays of one candidate MatMul's weights (WeightInfo: B, then an int4 MatMul's
    scales and zero points) where they lie in the pinned store, with its k and n."""
    if kind == "int4":
        b = weights[0]
        n, blocks, half = (int(d) for d in b.shape)
        scales = store.view(weights[1].name).view(weights[1].dtype)
        zp = store.view(weights[2].name) if len(weights) > 2 else None
        return dict(kind=kind, b=store.view(b.name).reshape(n, blocks, half), scales=scales, zp=zp,
                    k=blocks * half * 2, n=n, block=half * 2, bytes=sum(w.nbytes for w in weights),
                    x_dtype=_x_dtype(kind, weights))
    w = weights[0]
    k, n = (int(d) for d in w.shape)
    view = store.view(w.name).view(w.dtype).reshape(k, n)
    return dict(kind=kind, w=view, k=k, n=n, bytes=w.nbytes, x_dtype=_x_dtype(kind, weights))


def gemv(v: dict, x: np.ndarray, threads: Optional[int]) -> np.ndarray:
    """x [M, K] @ the weight of `v` (as weight_views gives it), on the host's cores."""
    if v["kind"] == "int4":
        return _core.host_matmul_nbits(x, v["b"], v["scales"], v["zp"], k=v["k"], n=v["n"], block_size=v["block"],
                                       threads=threads)
    return _core.host_matmul(x, v["w"], threads=threads)


class _Copies:
    """H2D copies of one source back to back on the copy stream, on a thread of their own,
    until stopped; the bytes and seconds of the copies that ended."""

    def __init__(self, device, dst: int, src: int, nbytes: int):
        self.device, self.dst, self.src, self.nbytes = device, dst, src, nbytes
        self.bytes, self.seconds = 0, 0.0
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        stream, backend = self.device.copy_stream, self.device.backend
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                backend.copy_h2d(self.dst, self.src, self.nbytes, stream)
                stream.synchronize()
                self.seconds += time.perf_counter() - t0
                self.bytes += self.nbytes
        except BaseException as e:  # noqa: BLE001 - raised again by stop(), in the caller's thread
            self.error = e

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None and exc[0] is None:
            raise self.error


def measure_rates(device, store, by_kind: Mapping[str, Sequence[dict]], copy: Tuple[int, int, int],
                  threads: Optional[int], rows: Sequence[int] = HOST_ROWS) -> Tuple[float, Dict[str, Dict[int, float]]]:
    """(H2D bytes/s, {kind: {rows: host GEMV bytes/s}}), both measured at once: the GEMV
    over each kind's weights (`by_kind`, as weight_views gives them) while copies of
    `copy` = (device address, pinned source, bytes) run back to back."""
    rng = np.random.default_rng(0)
    rates: Dict[str, Dict[int, float]] = {}
    with _Copies(device, *copy) as copies:
        for kind, views in by_kind.items():
            total = sum(v["bytes"] for v in views)
            rates[kind] = {}
            for m in rows:
                xs = {(v["k"], v["x_dtype"]): rng.standard_normal((m, v["k"])).astype(v["x_dtype"]) for v in views}
                for v in views[:1]:
                    gemv(v, xs[v["k"], v["x_dtype"]], threads)  # the pool's threads start
                passes = []
                for _ in range(MEASURE_PASSES):
                    t0 = time.perf_counter()
                    for v in views:
                        gemv(v, xs[v["k"], v["x_dtype"]], threads)
                    passes.append(time.perf_counter() - t0)
                rates[kind][m] = total / statistics.median(passes)
    if not copies.bytes or copies.seconds <= 0:
        raise RuntimeError("no H2D copy ended while the host rates were measured")
    return copies.bytes / copies.seconds, rates


def plan_host_compute(mode, device, store, model: onnx.ModelProto, plan, info: Mapping, ring_address: Mapping[str, int],
                      ) -> Tuple[Optional[HostPlan], str]:
    """The split for the streaming engine's decode steps, or (None, why not)."""
    if mode == "off":
        return None, "host compute is off"
    if not device.is_cuda:
        return None, ("host compute is off: it runs inside a captured step graph, and the host backend captures "
                      "no graphs")
    streamed = plan.streamed
    if not streamed:
        return None, "host compute is off: every weight the step reads is resident"
    # The link measured on the largest streamed weight: copies of a few KiB would measure
    # their overhead, not the link.
    first = max(streamed, key=lambda n: info[n].nbytes)
    resident = sum(info[n].nbytes for n in plan.resident)
    return choose_split(mode, device, store, model, streamed, resident / DEVICE_READ_RATE, info,
                        ring_address[first])


def host_threads(mode) -> Tuple[Optional[int], str]:
    """(The host threads a job of `mode` uses: None under "auto", every physical core; else
    the count asked for, at most the CPUs this process may use, which the host kernels
    refuse to exceed; what was taken off, as a note's words, or "")."""
    if mode == "auto":
        return None, ""
    asked, cpus = int(mode), int(_core.host_cpu()["logical_cpus"])
    if asked <= cpus:
        return asked, ""
    return cpus, f" on {cpus} threads ({asked} asked for; this process may use {cpus} CPUs)"


def choose_split(mode, device, store, model: onnx.ModelProto, streamed: Sequence[str], gpu: float, info: Mapping,
                 copy_dst: int) -> Tuple[Optional[HostPlan], str]:
    """The split of a step that streams `streamed` (in read order) beside `gpu` seconds of
    the resident part's compute, its rates measured with copies of the largest streamed
    weight into `copy_dst` (COPY_BYTES, or the weight where smaller), or (None, why not)."""
    candidates, streaming = host_candidates(model), set(streamed)
    groups = _by_matmul(candidates)
    # A MatMul is a candidate where every weight it reads streams (an int4 MatMul's scales may
    # be too small to be a weight: they stay in the model, and so does the MatMul), and where
    # the host kernels take its X and Y: float16 or float32, an int4 MatMul's its scales' type.
    found = {n: c for n, c in candidates.items() if all(m in streaming for m in groups[c[0]])
             and _x_dtype(c[1], [info[m] for m in groups[c[0]]])}
    if not found:
        return None, "host compute is off: no streamed weight is read by a MatMul the host can compute"
    threads, fewer = host_threads(mode)
    by_kind: Dict[str, List[dict]] = {}
    for label, names in _by_matmul(found).items():
        kind = found[names[0]][1]
        if sum(v["bytes"] for v in by_kind.get(kind, ())) >= MEASURE_BYTES:
            continue
        by_kind.setdefault(kind, []).append(weight_views(store, kind, [info[n] for n in names]))
    first = max(streamed, key=lambda n: info[n].nbytes)
    copy = (copy_dst, store.ptr(first), min(COPY_BYTES, info[first].nbytes))
    t0 = time.perf_counter()
    link, rates = measure_rates(device, store, by_kind, copy, threads)
    measured = time.perf_counter() - t0
    weights = [StepWeight(n, info[n].nbytes, *(reversed(found[n]) if n in found else ())) for n in streamed]
    split = plan_host_split(weights, link, rates, gpu, 1)
    said = (f"H2D {link / 1e9:.1f} GB/s while the host GEMV ran at "
            + ", ".join(f"{k} {r[1] / 1e9:.1f} GB/s" for k, r in rates.items()) + " (one row)")
    if not split.host:
        return None, f"host compute is off: the split gives the host nothing ({said})"
    chosen = HostPlan(split, [], model, link, rates, threads, gpu, weights, measured)
    one, whole = chosen.predicted(1)
    if mode == "auto" and one > whole * (1 - MIN_GAIN):
        return None, (f"host compute is off: the split predicts {one * 1e3:.2f} ms a step against "
                      f"{whole * 1e3:.2f} ms streaming every weight ({said})")
    try:
        chosen.model, chosen.hosts = rewrite_for_host(model, split.host_weights)
    except HostComputeRefused as e:
        return None, f"host compute is off: {e}"
    return chosen, (f"host compute: the host's cores multiply {len(split.host)} MatMul(s) of a decode step{fewer} "
                    f"({split.host_bytes / 1e9:.2f} GB) while {split.streamed_bytes / 1e9:.2f} GB stream; predicted "
                    f"{one * 1e3:.2f} ms a step against {whole * 1e3:.2f} ms streaming every weight ({said})")
