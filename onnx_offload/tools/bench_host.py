"""``onnx-offload bench host``: the host kernels (``_core.host_matmul``,
``host_matmul_nbits``) on weights too large for the caches, as GB/s of weight bytes read,
for fp16, bf16 and int4 (MatMulNBits, blocks of 32) weights, batches of 1, 4 and 8 rows
and thread counts doubling from 1 to every physical core (and one fewer, which leaves a
core to the thread that drives the GPU), with the kernels of one ISA (the best the CPU has, or
`isa`). Beside each row:
  - the bound: a plain read of the same bytes by the same pool and thread count;
  - the peer on the same host: onnxruntime's CPU MatMul (fp16) or MatMulNBits (int4) over
    the same weights, with as many intra-op threads: MatMulNBits with accuracy_level 0
    (fp32 compute, as the kernels), and for int4 also with accuracy_level 4 (x quantized
    to int8 per block, as onnxruntime-genai's int4 models ask for). ORT's CPU has no bf16
    MatMul.
Each figure is the median of `runs` warm calls. Then the dispatch table of
bench_host_dispatch: microseconds a call for small jobs back to back."""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Dict, List, Optional

import numpy as np

from ..stats import table

BATCHES = (1, 4, 8)
KINDS = ("fp16", "bf16", "int4")
BLOCK = 32
K = 4096  # the rows of W (a hidden width); N follows from the weight bytes


def thread_ladder(cores: int) -> List[int]:
    """1, 2, 4, ... up to `cores`, with `cores` - 1 and `cores`."""
    out, t = set(), 1
    while t < cores:
        out.add(t)
        t *= 2
    return sorted(out | {max(1, cores - 1), cores})


def _median_s(fn, runs: int) -> float:
    fn()  # warm: the pool's threads, ORT's arena, the pages of the output
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _weights(kind: str, weight_bytes: int, rng) -> Dict:
    import ml_dtypes
    if kind == "int4":
        n = max(1, weight_bytes // (K // 2))
        b = rng.integers(0, 256, (n, K // BLOCK, BLOCK // 2), dtype=np.uint8)
        scales = (rng.standard_normal(n * (K // BLOCK)) * 0.01).astype(np.float16)
        return dict(n=n, b=b, scales=scales, bytes=b.nbytes + scales.nbytes)
    n = max(1, weight_bytes // (2 * K))
    w = np.empty((K, n), np.float16 if kind == "fp16" else ml_dtypes.bfloat16)
    for r0 in range(0, K, 256):  # in slices: no fp32 copy of the whole weight
        w[r0:r0 + 256] = rng.standard_normal((min(256, K - r0), n), dtype=np.float32)
    return dict(n=n, w=w, bytes=w.nbytes)


def _peer_model(kind: str, wt: Dict, accuracy_level: int):
    from onnx import TensorProto, helper, numpy_helper
    n = wt["n"]
    if kind == "int4":
        inits = [numpy_helper.from_array(wt["b"], "B"), numpy_helper.from_array(wt["scales"], "S")]
        node = helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft", K=K, N=n, bits=4,
                                block_size=BLOCK, accuracy_level=accuracy_level)
    else:
        inits = [numpy_helper.from_array(wt["w"], "W")]
        node = helper.make_node("MatMul", ["x", "W"], ["y"])
    graph = helper.make_graph([node], "host_peer", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["m", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["m", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # what onnxruntime 1.31 reads
    return model


def _ort_session(kind: str, wt: Dict, threads: int, folder: str, accuracy_level: int = 0):
    """onnxruntime's CPU kernel over the same weights, or None where it has none (bf16)."""
    if kind == "bf16" or (kind != "int4" and accuracy_level):
        return None
    import onnx
    import onnxruntime as ort
    path = os.path.join(folder, f"peer_{kind}_{accuracy_level}.onnx")
    if not os.path.exists(path):  # one file a kind and level, read by each thread count's session
        onnx.save_model(_peer_model(kind, wt, accuracy_level), path, save_as_external_data=True,
                        location=f"peer_{kind}_{accuracy_level}.data")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def _kernel(kind: str, wt: Dict, x: np.ndarray, threads: int, isa: Optional[str]):
    from .. import _core
    if kind == "int4":
        return lambda: _core.host_matmul_nbits(x, wt["b"], wt["scales"], None, k=K, n=wt["n"], block_size=BLOCK,
                                               threads=threads, isa=isa)
    return lambda: _core.host_matmul(x, wt["w"], threads=threads, isa=isa)


def bench_host(weights_mib: int = 256, runs: int = 3, kinds=KINDS, batches=BATCHES,
               thread_counts: Optional[List[int]] = None, isa: Optional[str] = None,
               dispatch_calls: int = 2000) -> Dict:
    """The rate table (with the kernels of `isa`, default the best this CPU has), then the
    dispatch table (bench_host_dispatch) over `dispatch_calls` calls a row."""
    from .. import _core
    from .bench_host_dispatch import bench_dispatch
    cpu = dict(_core.host_cpu())
    if isa is not None:
        cpu["isa"] = isa
    counts = thread_counts or thread_ladder(cpu["physical_cores"])
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for kind in kinds:
            wt = _weights(kind, weights_mib * 2**20, rng)
            data = wt["b"] if kind == "int4" else wt["w"]
            for threads in counts:
                read_s = _median_s(lambda: _core._host_read(data, threads=threads), runs)
                peers = [_ort_session(kind, wt, threads, folder, level) for level in (0, 4)]
                for m in batches:
                    x = rng.standard_normal((m, K)).astype(np.float16)
                    s = _median_s(_kernel(kind, wt, x, threads, isa), runs)
                    peer_s = [None if p is None else _median_s(lambda: p.run(None, {"x": x}), runs) for p in peers]
                    rows.append(dict(kind=kind, m=m, threads=threads, bytes=wt["bytes"], ms=s * 1e3,
                                     gbps=wt["bytes"] / s / 1e9, read_gbps=data.nbytes / read_s / 1e9,
                                     ort_ms=None if peer_s[0] is None else peer_s[0] * 1e3,
                                     ort_gbps=None if peer_s[0] is None else wt["bytes"] / peer_s[0] / 1e9,
                                     ort_int8_gbps=None if peer_s[1] is None else wt["bytes"] / peer_s[1] / 1e9))
                peers = None
    return dict(cpu=cpu, weights_mib=weights_mib, k=K, block_size=BLOCK, runs=runs, rows=rows,
                dispatch=bench_dispatch(dispatch_calls, isa=isa))


def print_host(res: Dict) -> str:
    cpu = res["cpu"]
    head = (f"bench host: x [M, {res['k']}] @ W, {res['weights_mib']} MiB of weights a kind, on {cpu['isa']} "
            f"({cpu['physical_cores']} physical cores, {cpu['logical_cpus']} CPUs); GB/s of weight bytes read, "
            f"median of {res['runs']} warm runs; bound: a plain read of the same bytes by the same threads")
    body = []
    for r in res["rows"]:
        peer = "n/a" if r["ort_gbps"] is None else f"{r['ort_gbps']:.1f}"
        vs = "-" if r["ort_gbps"] is None else f"{r['gbps'] / r['ort_gbps']:.2f}x"
        int8 = "-" if r["ort_int8_gbps"] is None else f"{r['ort_int8_gbps']:.1f}"
        body.append((r["kind"], r["m"], r["threads"], f"{r['ms']:.2f}", f"{r['gbps']:.1f}", f"{r['read_gbps']:.1f}",
                     f"{r['gbps'] / r['read_gbps']:.0%}", peer, vs, int8))
    from .bench_host_dispatch import print_dispatch
    return (head + "\n" + table(body, ("weights", "M", "threads", "ms", "GB/s", "read bound", "of bound",
                                       "ORT CPU GB/s", "vs ORT", "ORT int8 x (acc. 4)"))
            + "\n\n" + print_dispatch(res["dispatch"]))
