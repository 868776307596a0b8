"""``onnx-offload bench host`` on a machine with a GPU: the host kernels' rate while the
host-to-device link runs, the figure host compute's split rests on (docs/host_compute.md).

Three rows a weight kind (fp16 and int4, one row of x, every physical core and one core
fewer, which leaves one to the thread that drives the copies):
  - pinned H2D copies alone (256 MiB each, back to back, on a stream of their own);
  - the host GEMV alone over `weights_mib` of weights (larger than the host's caches);
  - both at once: the GEMV's rate, and the rate of the copies that ran wholly inside the
    GEMV's calls.
Each GEMV figure is the median of `runs` warm calls."""
from __future__ import annotations

import statistics
import threading
import time
from typing import Dict, List, Optional

import numpy as np

from ..config import MiB
from ..stats import table

COPY = 256 * MiB


class _Copier:
    """H2D copies of COPY bytes back to back on a thread of its own, each with its wall
    window and its device time, until stopped. A copy that fails ends the thread; start()
    or stop() raises its error in the caller's thread."""

    def __init__(self, backend):
        from .bench import PinnedBuffer
        self.backend = backend
        self.stream = backend.create_stream()
        self.pinned = PinnedBuffer(backend, COPY)
        self.dst = backend.plain_alloc(COPY)
        self.done: List[tuple] = []  # (wall start, wall end, device ms)
        self._error: Optional[BaseException] = None  # what ended the thread
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        from .bench import timed_copy_ms
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                ms = timed_copy_ms(self.backend, self.stream, self.dst, self.pinned.ptr, COPY)
                self.done.append((t0, time.perf_counter(), ms))
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            self._error = e

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def start(self) -> None:
        self.done.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        while not self.done:  # the first copy pays for the stream's start
            if not self._thread.is_alive():
                self._thread.join()
                self._raise_error()
                raise RuntimeError("the H2D copies' thread ended before its first copy")
            time.sleep(0.001)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_error()

    def rate_within(self, t0: float, t1: float) -> Optional[float]:
        """Bytes/s of the copies that ran wholly inside [t0, t1] (None: none did)."""
        inside = [ms for a, b, ms in self.done if a >= t0 and b <= t1]
        return COPY * len(inside) / (sum(inside) / 1e3) if inside else None

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self.backend.plain_free(self.dst, COPY)
            self.pinned.close()
            self.stream.close()


def bench_link(weights_mib: int = 2048, runs: int = 7, kinds=("fp16", "int4"),
               thread_counts: Optional[List[int]] = None) -> Dict:
    from .. import _core
    from .bench_host import _kernel, _weights
    cpu = dict(_core.host_cpu())
    counts = thread_counts or sorted({cpu["physical_cores"], max(1, cpu["physical_cores"] - 1)})
    copier = _Copier(_core.make_cuda_backend(0))
    rows = []
    try:
        copier.start()
        time.sleep(0.5)
        copier.stop()
        h2d_alone = COPY / (statistics.median(ms for _, _, ms in copier.done) / 1e3)
        rng = np.random.default_rng(0)
        for kind in kinds:
            wt = _weights(kind, weights_mib * MiB, rng)
            x = rng.standard_normal((1, 4096)).astype(np.float16)
            for threads in counts:
                fn = _kernel(kind, wt, x, threads, None)
                fn()
                alone = statistics.median(_timed(fn) for _ in range(runs))
                copier.start()
                t0 = time.perf_counter()
                both = statistics.median(_timed(fn) for _ in range(runs))
                t1 = time.perf_counter()
                copier.stop()
                rows.append(dict(kind=kind, threads=threads, bytes=wt["bytes"], gemv_alone_gbps=wt["bytes"] / alone / 1e9,
                                 gemv_with_link_gbps=wt["bytes"] / both / 1e9,
                                 h2d_with_gemv_gbps=(copier.rate_within(t0, t1) or float("nan")) / 1e9))
            wt = None
    finally:
        copier.close()
    return dict(cpu=cpu, weights_mib=weights_mib, runs=runs, h2d_alone_gbps=h2d_alone / 1e9, rows=rows)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def print_link(res: Dict) -> str:
    head = (f"while the link runs: x [1, 4096] @ W, {res['weights_mib']} MiB of weights a kind, {res['cpu']['isa']}; "
            f"pinned H2D alone {res['h2d_alone_gbps']:.1f} GB/s ({COPY // MiB} MiB copies back to back)")
    body = [(r["kind"], r["threads"], f"{r['gemv_alone_gbps']:.1f}", f"{r['gemv_with_link_gbps']:.1f}",
             f"{r['h2d_with_gemv_gbps']:.1f}", f"{r['gemv_with_link_gbps'] + r['h2d_with_gemv_gbps']:.1f}")
            for r in res["rows"]]
    return head + "\n" + table(body, ("weights", "threads", "GEMV alone GB/s", "GEMV with H2D GB/s",
                                      "H2D with GEMV GB/s", "together GB/s"))
