"""``onnx-offload bench host``'s dispatch table: what one host MatMul costs when calls come
back to back, as the host nodes of a decode step do (100 - 200 a step on an 8B model), in
microseconds a call, median of many calls, for 1 .. every CPU's threads:
  - `read 64 KiB`: a job that does almost nothing on the pool (`_core._host_read`): the hand-off
    between the caller and the pool's threads, and the Python call;
  - `fp16 1024x1024`: x [1, 1024] @ a 2 MiB fp16 weight;
  - `int4 4096x1024`: the same for a 2 MiB MatMulNBits weight (blocks of 32).
Each job runs with no gap between calls, and with a gap of about 200 us (a sleep: the GPU
work between two host nodes of a step), which only the call's time counts."""
from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional

import numpy as np

from ..stats import table

BLOCK = 32


def _jobs(rng, isa: Optional[str]) -> Dict:
    from .. import _core
    buf = np.zeros(64 << 10, np.uint8)
    w16 = rng.standard_normal((1024, 1024)).astype(np.float16)
    x16 = rng.standard_normal((1, 1024)).astype(np.float16)
    k, n = 4096, 1024
    b = rng.integers(0, 256, (n, k // BLOCK, BLOCK // 2), dtype=np.uint8)
    scales = (rng.standard_normal(n * (k // BLOCK)) * 0.01).astype(np.float16)
    x4 = rng.standard_normal((1, k)).astype(np.float16)
    return {
        "read 64 KiB": lambda t: _core._host_read(buf, threads=t),
        "fp16 1024x1024": lambda t: _core.host_matmul(x16, w16, threads=t, isa=isa),
        "int4 4096x1024": lambda t: _core.host_matmul_nbits(x4, b, scales, None, k=k, n=n, block_size=BLOCK,
                                                             threads=t, isa=isa),
    }


def bench_dispatch(calls: int = 2000, thread_counts: Optional[List[int]] = None, isa: Optional[str] = None,
                   gaps_us=(0, 200)) -> Dict:
    from .. import _core
    cpu = _core.host_cpu()
    counts = thread_counts or list(range(1, cpu["logical_cpus"] + 1))
    rows = []
    for job, fn in _jobs(np.random.default_rng(0), isa).items():
        for gap in gaps_us:
            for threads in counts:
                for _ in range(20):  # warm: the pool's threads, the output's pages, the caches
                    fn(threads)
                times = []
                for _ in range(calls):
                    if gap:
                        time.sleep(gap * 1e-6)
                    t0 = time.perf_counter()
                    fn(threads)
                    times.append(time.perf_counter() - t0)
                rows.append(dict(job=job, gap_us=gap, threads=threads, us=statistics.median(times) * 1e6,
                                 p90_us=statistics.quantiles(times, n=10)[-1] * 1e6))
    return dict(calls=calls, spin_us=cpu.get("spin_us"), rows=rows)


def print_dispatch(res: Dict) -> str:
    spin = "n/a" if res["spin_us"] is None else f"{res['spin_us']} us"
    head = (f"dispatch: back-to-back calls, microseconds a call (median and 90th percentile of {res['calls']}); "
            f"the pool's threads spin {spin} after a job before they sleep")
    body = [(r["job"], r["gap_us"], r["threads"], f"{r['us']:.1f}", f"{r['p90_us']:.1f}") for r in res["rows"]]
    return head + "\n" + table(body, ("job", "gap us", "threads", "us a call", "p90 us"))
