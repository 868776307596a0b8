"""Benchmarks: ``onnx-offload bench arena|session|offload``.

Every figure is stated against its bound, measured in the same run: page-in copies
against pinned H2D bandwidth, driver time against copy time, offloaded step time
against max(all-resident step, streamed bytes / H2D bandwidth). Timings are medians
after warm-up, taken with events or after a synchronize.
"""
from __future__ import annotations

import math
import mmap
import os
import statistics
import time
from typing import Dict, List

import numpy as np

from .. import _core
from ..config import GiB, MiB
from ..stats import fmt_bytes, table

HANDLE_CLASSES_2MIB = "2 MiB handles"
HANDLE_CLASSES_SIZED = "size classes"


def _backend(kind: str, device: int = 0):
    return _core.make_cuda_backend(device) if kind == "cuda" else _core.make_host_backend(2 * MiB)


class PinnedBuffer:
    """Page-locked host memory for copy benchmarks."""

    def __init__(self, backend, nbytes: int):
        self.backend = backend
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.array[::4096] = 1  # touch every page
        self.ptr = self.array.ctypes.data
        backend.host_register(self.ptr, nbytes)

    def close(self):
        self.backend.host_unregister(self.ptr)
        self.array = None
        self.map.close()


def timed_copy_ms(backend, stream, dst: int, src: int, nbytes: int) -> float:
    start, end = backend.create_event(), backend.create_event()
    start.record(stream)
    backend.copy_h2d(dst, src, nbytes, stream)
    end.record(stream)
    end.synchronize()
    return end.elapsed_ms(start)


def h2d_bandwidth(backend, stream, pinned: PinnedBuffer, nbytes: int, reps: int = 5) -> float:
    """Pinned host-to-device bandwidth in bytes/s (median of `reps` after a warm-up)."""
    dst = backend.plain_alloc(nbytes)
    try:
        timed_copy_ms(backend, stream, dst, pinned.ptr, nbytes)
        ms = [timed_copy_ms(backend, stream, dst, pinned.ptr, nbytes) for _ in range(reps)]
    finally:
        backend.plain_free(dst, nbytes)
    return nbytes / (statistics.median(ms) / 1e3)


def pinned_h2d(kind: str, nbytes: int, device: int = 0) -> float:
    """Pinned H2D bytes/s to `device` on a backend of its own, from a pinned buffer of `nbytes`."""
    backend = _backend(kind, device)
    pinned = PinnedBuffer(backend, nbytes)
    try:
        return h2d_bandwidth(backend, backend.create_stream(), pinned, nbytes)
    finally:
        pinned.close()


def _delta(after: _core.DriverCounters, before: _core.DriverCounters, *keys) -> int:
    return sum(getattr(after, k) - getattr(before, k) for k in keys)


def bench_arena(kind: str, sizes_mib=(2, 8, 32, 128, 512), reps: int = 7) -> Dict:
    backend = _backend(kind)
    g = backend.granularity
    stream = backend.create_stream()
    biggest = max(sizes_mib) * MiB
    pinned = PinnedBuffer(backend, max(biggest, GiB if kind == "cuda" else 256 * MiB))
    bw = h2d_bandwidth(backend, stream, pinned, min(pinned.array.nbytes, GiB))
    rows = []
    for label, classes in ((HANDLE_CLASSES_2MIB, [g]), (HANDLE_CLASSES_SIZED, [])):
        ledger = _core.BudgetOwner(4 * biggest)
        arena = _core.Arena(backend, ledger, zone_va_bytes=8 * biggest, handle_classes=classes)
        for size_mib in sizes_mib:
            n = size_mib * MiB
            va = arena.carve("weights", n, g)
            samples = []
            for rep in range(reps + 2):
                c0 = backend.counters()
                arena.commit("weights", [(va, n)], n)
                c1 = backend.counters()
                copy_ms = timed_copy_ms(backend, stream, va, pinned.ptr, n)
                c2 = backend.counters()
                arena.decommit("weights", [(va, n)], n)
                c3 = backend.counters()
                if rep >= 2:  # the first page-ins fill the handle pool
                    samples.append(dict(
                        map_us=_delta(c1, c0, "map_ns") / 1e3, access_us=_delta(c1, c0, "set_access_ns") / 1e3,
                        unmap_us=_delta(c3, c2, "unmap_ns") / 1e3,
                        create_release=_delta(c1, c0, "creates") + _delta(c3, c2, "releases"),
                        handles=_delta(c1, c0, "maps"), copy_us=copy_ms * 1e3))
            arena.release(va)
            med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            driver = med["map_us"] + med["access_us"] + med["unmap_us"]
            rows.append(dict(handles=label, size_mib=size_mib, handles_per_page_in=int(med["handles"]),
                             map_us=med["map_us"], access_us=med["access_us"], unmap_us=med["unmap_us"],
                             driver_us=driver, copy_us=med["copy_us"], bound_us=n / bw * 1e6,
                             driver_pct_of_copy=100 * driver / med["copy_us"],
                             steady_creates_releases=sum(s["create_release"] for s in samples)))
        arena.close()
    pinned.close()
    return dict(kind=kind, h2d_gbps=bw / 1e9, page_in=rows, overhead=granule_overhead(g))


def llama7b_layer() -> List[int]:
    """Tensor sizes (fp16 bytes) of one 7B decoder layer: attention, MLP, norms."""
    h, f = 4096, 11008
    return [h * h * 2] * 4 + [h * f * 2] * 3 + [h * 2] * 2


def granule_overhead(g: int, layers: int = 32) -> List[Dict]:
    """Committed bytes of packed slots against one granule-rounded reservation per slot."""
    sizes = llama7b_layer() * layers + [32000 * 4096 * 2] * 2 + [4096 * 2]
    content = sum(sizes)
    spans = _core.SpanAllocator(1 << 44)
    gm = _core.GranuleMap(g)
    ranges = [(spans.carve(n, _core.DEFAULT_ALIGNMENT), n) for n in sizes]
    packed = gm.incremental_commit_bytes(ranges)
    per_slot = sum(-(-n // g) * g for n in sizes)
    return [dict(layout=name, content=content, committed=c, overhead_pct=100 * (c - content) / content)
            for name, c in (("packed slots", packed), ("reservation per slot", per_slot))]


def print_arena(res: Dict) -> str:
    rows = [(r["handles"], r["size_mib"], r["handles_per_page_in"], f"{r['map_us']:.0f}", f"{r['access_us']:.0f}",
             f"{r['unmap_us']:.0f}", f"{r['driver_us']:.0f}", f"{r['copy_us']:.0f}", f"{r['bound_us']:.0f}",
             f"{r['driver_pct_of_copy']:.1f}%", r["steady_creates_releases"]) for r in res["page_in"]]
    text = (f"arena page-in on {res['kind']}: pinned H2D {res['h2d_gbps']:.1f} GB/s measured in this run\n"
            + table(rows, ("handles", "MiB", "handles/page-in", "map us", "access us", "unmap us", "driver us",
                           "copy us", "H2D bound us", "driver/copy", "creates+releases"))
            + "\n\ngranule overhead, 7B decoder tensors (32 layers, embeddings):\n"
            + table([(o["layout"], fmt_bytes(o["content"]), fmt_bytes(o["committed"]), f"{o['overhead_pct']:.3f}%")
                     for o in res["overhead"]], ("layout", "content", "committed", "overhead")))
    return text


# ---------------------------------------------------------------------- sessions
def _providers(kind: str, capture: bool):
    if kind != "cuda":
        return ["CPUExecutionProvider"]
    opts = {"enable_cuda_graph": "1"} if capture else {}
    return [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]


def _bound_io(sess, x: np.ndarray, kind: str):
    import onnxruntime as ort
    dev = "cuda" if kind == "cuda" else "cpu"
    xin = ort.OrtValue.ortvalue_from_numpy(x, dev, 0)
    out = ort.OrtValue.ortvalue_from_shape_and_type(list(x.shape), x.dtype, dev, 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", xin)
    io.bind_ortvalue_output("y", out)
    return io, (xin, out)


def step_times(run, warmup: int, steps: int) -> List[float]:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def bench_session(kind: str, out_dir: str, steps: int = 100) -> Dict:
    import onnxruntime as ort

    from ..models import decoder_like
    from ..session import OffloadSession
    os.makedirs(out_dir, exist_ok=True)
    if kind == "cuda":
        path = decoder_like(os.path.join(out_dir, "session_model.onnx"), layers=4, hidden=4096, ffn=11008)
        x = (np.random.default_rng(0).standard_normal((1, 4096)) * 0.1).astype(np.float16)
    else:
        path = decoder_like(os.path.join(out_dir, "session_model.onnx"), layers=2, hidden=512, ffn=1024,
                            dtype=np.float32)
        x = np.random.default_rng(0).standard_normal((1, 512)).astype(np.float32)
    weights = os.path.getsize(path + ".data")
    rows = []
    for capture in ((False, True) if kind == "cuda" else (False,)):
        plain = ort.InferenceSession(path, providers=_providers(kind, capture))
        ours = OffloadSession(path, providers=["CUDAExecutionProvider" if kind == "cuda" else "CPUExecutionProvider"],
                              offload=True, vmm=True, vram_limit=2 * weights + GiB, cuda_graph=capture,
                              cache_dir=os.path.join(out_dir, "cache"))
        io_p, keep_p = _bound_io(plain, x, kind)
        io_o, keep_o = _bound_io(ours, x, kind)
        t_plain, t_ours = [], []
        for _ in range(5):  # interleaved rounds, so drift hits both sides alike
            t_plain += step_times(lambda: plain.run_with_iobinding(io_p), 5, steps // 5)
            t_ours += step_times(lambda: ours.run_with_iobinding(io_o), 5, steps // 5)
        same = np.array_equal(keep_p[1].numpy(), keep_o[1].numpy())
        mp, mo = statistics.median(t_plain), statistics.median(t_ours)
        rows.append(dict(capture=capture, capture_reason=ours.graph_capture.reason, weights=weights,
                         plain_ms=mp, offload_ms=mo, overhead_pct=100 * (mo - mp) / mp, outputs_equal=bool(same)))
        ours.close()
    return dict(kind=kind, rows=rows)


def print_session(res: Dict) -> str:
    rows = [("on" if r["capture"] else "off", fmt_bytes(r["weights"]), f"{r['plain_ms']:.3f}", f"{r['offload_ms']:.3f}",
             f"{r['overhead_pct']:+.2f}%", "yes" if r["outputs_equal"] else "NO") for r in res["rows"]]
    return (f"OffloadSession (budget >= weights, offload on) against plain ORT on {res['kind']}, median step:\n"
            + table(rows, ("cuda graph", "weights", "plain ORT ms", "OffloadSession ms", "overhead", "bitwise equal")))


# ---------------------------------------------------------------------- offload
def bench_offload(kind: str, out_dir: str, weight_gb: float = 8.0, steps: int = 3,
                  fractions=(0.25, 0.5, 0.75), policies=("planned", "stable", "lru", "mru")) -> Dict:
    from ..models import decoder_like
    from ..session import OffloadSession
    os.makedirs(out_dir, exist_ok=True)
    if kind == "cuda":
        hidden, ffn, dtype = 4096, 11008, np.float16
    else:
        hidden, ffn, dtype = 256, 704, np.float32
    per_layer = (4 * hidden * hidden + 3 * hidden * ffn) * np.dtype(dtype).itemsize
    layers = max(2, math.ceil(weight_gb * 1e9 / per_layer))
    path = os.path.join(out_dir, "offload_model.onnx")
    if not os.path.exists(path + ".data") or os.path.getsize(path + ".data") != layers * per_layer:
        decoder_like(path, layers=layers, hidden=hidden, ffn=ffn, dtype=dtype)
    weights = layers * per_layer
    x = (np.random.default_rng(0).standard_normal((1, hidden)) * 0.1).astype(dtype)
    provider = "CUDAExecutionProvider" if kind == "cuda" else "CPUExecutionProvider"
    cache = os.path.join(out_dir, "cache")
    backend = _backend(kind)
    pinned = PinnedBuffer(backend, GiB if kind == "cuda" else 128 * MiB)
    bw = h2d_bandwidth(backend, backend.create_stream(), pinned, pinned.array.nbytes)
    pinned.close()
    del backend

    def measure(**kw):
        s = OffloadSession(path, providers=[provider], offload=True, cache_dir=cache, **kw)
        try:
            # Warm-up: the first step sizes the boundary buffers, the second binds them, the
            # third captures each segment's graph; the handle pool settles meanwhile.
            for _ in range(3):
                s.run(None, {"x": x})
            before = s.stats()
            times = step_times(lambda: s.run(None, {"x": x}), 0, steps)
            st = s.stats()
            last = st.last_step
            out = s.run(None, {"x": x})[0]
            per_step = lambda a, b: (a - b) / steps  # noqa: E731
            return s, dict(step_ms=statistics.median(times), htod_bytes=last.htod_bytes,
                           hit_rate=last.hit_rate, byte_hit_rate=last.byte_hit_rate,
                           evictions=last.evictions, page_ins=last.page_ins, segments=st.segments,
                           capture=s.graph_capture.enabled,
                           peak_committed=st.peak_committed, budget=st.ledger.budget,
                           vram_alloc_ms=per_step(st.vram_alloc_ms, before.vram_alloc_ms),
                           vram_free_ms=per_step(st.vram_free_ms, before.vram_free_ms),
                           steady_creates=st.driver.creates - before.driver.creates,
                           steady_releases=st.driver.releases - before.driver.releases), out
        except BaseException:
            s.close()
            raise

    # The budget is the weights' share (resident set plus the transient zone that streams
    # the rest) plus a fixed scratch zone for ORT's own memory and boundary buffers.
    # Each segment is an ORT session with its own arena and cuBLAS workspace (about 70 MB
    # each on the H200, measured and charged to this zone).
    scratch = 3 * GiB if kind == "cuda" else 8 * MiB
    s, resident, want = measure(vmm=True, vram_limit=weights + 2 * scratch, scratch_bytes=scratch)
    s.close()
    print(f"  all resident: {resident['step_ms']:.2f} ms; pinned H2D {bw / 1e9:.1f} GB/s", flush=True)
    rows = []
    timeline = None
    for frac in fractions:
        budget = int(weights * frac)
        # Capture is on where it can be (auto); one arm turns it off to show what it adds.
        arms = ([(p, True, None) for p in policies] + [("planned", True, False)] * (kind == "cuda")
                + [("planned", False, None)])
        for policy, vmm, graph in arms:
            record = policy == "planned" and vmm and graph is None and abs(frac - 0.5) < 1e-9
            s, r, got = measure(vmm=vmm, policy=policy, vram_limit=budget + scratch, scratch_bytes=scratch,
                                record_timeline=record, cuda_graph=graph)
            if record and s.residency.timeline:  # the streaming engine records none
                try:
                    timeline = s.timeline_png(os.path.join(out_dir, "residency_timeline.png"))
                except ImportError as e:
                    print(f"  no residency timeline: {e}", flush=True)
            s.close()
            bound = max(resident["step_ms"], r["htod_bytes"] / bw * 1e3)
            r.update(fraction=frac, weight_budget=budget, policy=policy if vmm else f"{policy} (plain cudaMalloc)",
                     bound_ms=bound,
                     vs_bound=r["step_ms"] / bound, outputs_equal=bool(np.array_equal(got, want)))
            rows.append(r)
            print(f"  {int(frac * 100)}% {r['policy']}: {r['step_ms']:.1f} ms (bound {bound:.1f} ms)", flush=True)
    return dict(kind=kind, weights=weights, scratch=scratch, h2d_gbps=bw / 1e9, resident_ms=resident["step_ms"], rows=rows,
                timeline=timeline)


def print_offload(res: Dict) -> str:
    rows = [(f"{int(r['fraction'] * 100)}% ({fmt_bytes(r['weight_budget'])})", r["policy"], r["segments"],
             "on" if r["capture"] else "off", f"{r['step_ms']:.1f}", f"{r['bound_ms']:.1f}",
             f"{r['vs_bound']:.2f}x", f"{r['hit_rate']:.1%}", f"{r['byte_hit_rate']:.1%}", r["evictions"],
             fmt_bytes(r["htod_bytes"]), f"{r['vram_alloc_ms']:.2f}/{r['vram_free_ms']:.2f}",
             f"{r['steady_creates']}/{r['steady_releases']}",
             "yes" if r["peak_committed"] <= r["budget"] else "NO", "yes" if r["outputs_equal"] else "NO")
            for r in res["rows"]]
    return (f"offload on {res['kind']}: {fmt_bytes(res['weights'])} of weights, all-resident step "
            f"{res['resident_ms']:.2f} ms, pinned H2D {res['h2d_gbps']:.1f} GB/s (this run); "
            f"bound = max(all-resident step, streamed bytes / H2D); each budget is the weights' share "
            f"(resident + transient) plus a {fmt_bytes(res['scratch'])} scratch zone\n"
            + table(rows, ("budget", "policy", "segments", "graphs", "step ms", "bound ms", "vs bound", "hit rate",
                           "byte hit", "evictions/step", "H2D/step", "alloc/free ms/step", "creates/releases",
                           "within budget", "= resident"))
            + (f"\nresidency timeline: {res['timeline']}" if res.get("timeline") else ""))
