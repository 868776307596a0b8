"""``onnx-offload bench compare``: decode under weight budgets of 25, 50 and 75%, for
every way of running the same architecture, in one run.

Rows, each in a process of its own (see ``bench_decode``):
- plain ORT, every weight resident, the KV cache on the device, one CUDA graph per
  decode step: the anchor of the bound;
- OffloadSession with the streaming engine (one ORT session, page-ins in its graph);
- the non-VMM baseline: segments whose weights are paged into fresh ``cuMemAlloc``
  memory at every page-in, uncaptured;
- HF accelerate's CPU offload (``device_map`` from ``max_memory``) of a
  ``transformers`` Llama of the same shape with random weights, decoding with its KV
  cache, when torch, transformers and accelerate import (else skipped, saying why);
- two OffloadSessions at once at 25%, each with its own budget and a thread of its own:
  each step's bound is then twice its page-in bytes over the one link.

The model is the TinyLlama shape in onnxruntime-genai's builder layout (fp16) on
CUDA, a small one on the CPU. The bound is max(anchor ms/token, (1 - f) x weight bytes
/ H2D), with the pinned H2D rate measured in each row's own process right after its
decode (the link's rate drifts by several percent over minutes). Peak device bytes are everything the process
took on the device after its CUDA context existed: the device's free memory, sampled
after loading and after every token, against its value before the session was made.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Dict, List

import numpy as np

from ..config import GiB, MiB
from ..stats import fmt_bytes, table
from .bench import pinned_h2d
from .bench_decode import WARMUP, in_process_of_its_own, setup

STEADY = ("creates", "releases", "maps", "unmaps", "set_access", "plain_allocs", "plain_frees")


def _kv_bytes(shape: dict, batch: int, length: int) -> int:
    hd = shape["hidden"] // shape["heads"]
    return 2 * shape["layers"] * batch * shape["kv_heads"] * length * hd * np.dtype(shape["dtype"]).itemsize


class _PeakDevice:
    """The most device memory the process took since it was made: the device's free
    memory, sampled, against its value at the start (nothing on the CPU)."""

    def __init__(self, kind: str):
        import threading
        from .. import _core
        self.backend = _core.make_cuda_backend(0) if kind == "cuda" else None
        self.free0 = self.low = self.backend.mem_info()[0] if self.backend else 0
        self._lock = threading.Lock()  # threads sample at once

    def sample(self) -> None:
        if self.backend:
            free = self.backend.mem_info()[0]
            with self._lock:
                self.low = min(self.low, free)

    @property
    def peak(self) -> int:
        return self.free0 - self.low


def _session(path: str, shape: dict, ids: np.ndarray, new: int, kind: str, cache: str, weights: int,
             fraction: float, engine: str, scratch: int):
    """An OffloadSession at a weights budget of `fraction`, made as the rows make it."""
    from ..session import OffloadSession
    provider = "CUDAExecutionProvider" if kind == "cuda" else "CPUExecutionProvider"
    # The weights budget is f of the weights; the KV cache and ORT's scratch are reserved
    # on top of it (the streaming engine's resident weights cannot lend to the cache).
    # The cache's buffers are carved from whole granules: one more covers their padding.
    g = 2 * MiB if kind == "cuda" else 64 << 10
    kv = -(-_kv_bytes(shape, ids.shape[0], ids.shape[1] + new) // g) * g + g
    kw = dict(offload=True, vram_limit=int(weights * fraction) + kv + scratch, kv_bytes=kv, scratch_bytes=scratch,
              cache_dir=cache)
    if engine == "graph":
        kw.update(vmm=True, engine="graph" if kind == "cuda" else "segments")
    else:
        kw.update(vmm=False, cuda_graph=False)
    if kind != "cuda":
        kw["host_granularity"] = 64 << 10
    return OffloadSession(path, providers=[provider], **kw)


def offload_row(path: str, shape: dict, ids: np.ndarray, new: int, kind: str, cache: str, weights: int,
                fraction: float, engine: str, scratch: int) -> Dict:
    """OffloadSession at a weights budget of `fraction`: engine "graph" (the streaming
    engine) or "baseline" (segments paged into fresh device memory, no graphs)."""
    device = _PeakDevice(kind)
    sample = device.sample
    t0 = time.perf_counter()
    s = _session(path, shape, ids, new, kind, cache, weights, fraction, engine, scratch)
    load_s = time.perf_counter() - t0
    try:
        sample()
        tokens, stamps = [], []
        d0 = c0 = None
        t0 = time.perf_counter()
        for tok in s.generate_iter(ids, new):
            stamps.append(time.perf_counter())
            tokens.append(tok)
            sample()
            if len(tokens) == WARMUP + 1:
                st = s.stats()
                d0, c0, g0 = st.driver.as_dict(), st.counters, st.graph_steps
            if len(tokens) == new - 1:  # before the last: the cache is given back with it
                st = s.stats()
                d1, c1, g1 = st.driver.as_dict(), st.counters, st.graph_steps
        steps = np.diff(stamps) * 1e3
        measured = new - 2 - WARMUP
        # The link's rate drifts by several percent over minutes on a shared host: a row's
        # bound holds the rate its own copies saw, measured right after its decode.
        h2d = pinned_h2d(kind, 256 * MiB)
        access = c1.access_bytes - c0.access_bytes
        st = s.stats()
        snap = st.ledger.zones
        return dict(engine=engine, ran=s.engine, fraction=fraction, segments=len(s.segments), load_s=load_s,
                    ms_per_token=float(np.median(steps[WARMUP:])), prompt_ms=(stamps[0] - t0) * 1e3,
                    byte_hit_rate=(c1.hit_bytes - c0.hit_bytes) / access if access else 1.0,
                    htod_per_step=(c1.htod_bytes - c0.htod_bytes) / measured,
                    driver_per_step={k: (d1[k] - d0[k]) / measured for k in STEADY},
                    host_waits_per_step=(d1["host_waits"] - d0["host_waits"]) / measured,
                    graph_steps=(g1 - g0) / measured, peak_device=device.peak,
                    ort_bytes=st.outside_bytes, peak_committed=st.peak_committed,
                    weights_budget=snap["weights"].allowance + snap["transient"].reserve, h2d_gbps=h2d / 1e9,
                    tokens=np.stack(tokens, 1))
    finally:
        s.close()


def tenants_row(path: str, shape: dict, ids: np.ndarray, new: int, kind: str, cache: str, weights: int,
                fraction: float, scratch: int) -> Dict:
    """Two sessions at once, each with its own budget of `fraction` of the weights, each
    decoding in a thread of its own from the same start: they share the device and its
    link. A step of either is timed only while the other decodes too."""
    import threading
    device = _PeakDevice(kind)
    sessions = []
    try:
        for _ in range(2):
            sessions.append(_session(path, shape, ids, new, kind, cache, weights, fraction, "graph", scratch))
            device.sample()
        stamps: List[List[float]] = [[], []]
        tokens: List[list] = [[], []]
        errors: List[BaseException] = []
        start = threading.Barrier(2)

        def work(i: int) -> None:
            try:
                start.wait()
                stamps[i].append(time.perf_counter())
                for tok in sessions[i].generate_iter(ids, new):
                    stamps[i].append(time.perf_counter())
                    tokens[i].append(tok)
                    device.sample()
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        both = (max(st[0] for st in stamps), min(st[-1] for st in stamps))  # when both decoded
        medians = []
        for st in stamps:
            # The decode steps (the first stamp starts the prompt) past the warm-up, whole
            # inside the time both decoded.
            steps = [(b - a) * 1e3 for a, b in zip(st[1 + WARMUP:], st[2 + WARMUP:]) if a >= both[0] and b <= both[1]]
            medians.append(float(np.median(steps)) if steps else float("nan"))
        h2d = pinned_h2d(kind, 256 * MiB)
        runs = [np.stack(t, 1) for t in tokens]
        return dict(engine="two sessions", ran=[s.engine for s in sessions], fraction=fraction,
                    ms_per_token=medians, peak_device=device.peak, h2d_gbps=h2d / 1e9,
                    same_tokens=bool(np.array_equal(runs[0], runs[1])), tokens=runs[0])
    finally:
        for s in sessions:
            s.close()


def accelerate_row(shape: dict, ids: np.ndarray, new: int, weights: int, fraction: float) -> Dict:
    """HF accelerate's CPU offload of a random-weight transformers Llama of the same shape."""
    import torch
    from accelerate import dispatch_model, infer_auto_device_map
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], max_position_embeddings=shape["max_length"],
                      torch_dtype=torch.float16)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float16)  # random weights made in fp16 directly
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.eval()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    device_map = infer_auto_device_map(model, max_memory={0: int(weights * fraction), "cpu": 512 * GiB},
                                       no_split_module_classes=["LlamaDecoderLayer"], dtype=torch.float16)
    model = dispatch_model(model, device_map=device_map, main_device=0)
    on_gpu = sum(1 for v in device_map.values() if v == 0)
    low = torch.cuda.mem_get_info()[0]
    x = torch.tensor(ids, device="cuda")
    times = []
    with torch.no_grad():
        out = model(x, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new - 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
            low = min(low, torch.cuda.mem_get_info()[0])
    return dict(engine="accelerate", fraction=fraction, ms_per_token=statistics.median(times[WARMUP:]),
                peak_device=free0 - low, modules_on_gpu=on_gpu, modules=len(device_map),
                tokens=np.zeros((1, 1), np.int64))


def accelerate_missing() -> str:
    """Why the accelerate rows cannot run here ("" when they can)."""
    import importlib.util
    for name in ("torch", "transformers", "accelerate"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not importable"
    import torch
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ""


def bench_compare(kind: str, out_dir: str, prompt: int = 128, new: int = 64, fractions=(0.25, 0.5, 0.75),
                  accelerate_new: int = 16, tenants_fraction: float = 0.25, int4: bool = False) -> Dict:
    """`int4`: the same shape with its MatMuls int4 (MatMulNBits), the streaming engine's
    rows only, against plain ORT's run of the int4 model."""
    path, shape, weights, bw, ids, a = setup(kind, out_dir, prompt, new, int4)
    scratch = 512 * MiB if kind == "cuda" else 4 * MiB
    cache = os.path.join(out_dir, "cache")
    rows: List[Dict] = []
    failures: List[str] = []
    why_not = "int4: the streaming engine's rows only" if int4 else \
        accelerate_missing() if kind == "cuda" else "the accelerate rows need CUDA"
    for frac in fractions:
        engines = ("graph",) if int4 else ("graph", "baseline") + (("accelerate",) if not why_not else ())
        for engine in engines:
            try:
                if engine == "accelerate":
                    r = in_process_of_its_own("bench_compare", "accelerate_row", shape=shape, ids=ids.tolist(),
                                              new=accelerate_new, weights=weights, fraction=frac)
                else:
                    # The baseline's segment sessions each take ORT's memory: room for all of them.
                    room = scratch if engine == "graph" else 4 * scratch
                    r = in_process_of_its_own("bench_compare", "offload_row", path=path, shape=shape,
                                              ids=ids.tolist(), new=new, kind=kind, cache=cache, weights=weights,
                                              fraction=frac, engine=engine, scratch=room)
            except RuntimeError as e:  # a row that fails is reported, and the others still run
                last = [ln for ln in str(e).splitlines() if ln.strip()][-1]
                failures.append(f"{int(frac * 100)}% {engine}: {last.strip()[:600]}")
                print(f"  {int(frac * 100)}% {engine}: FAILED: {last.strip()[:600]}", flush=True)
                continue
            tokens = r.pop("tokens")
            bound = max(a["ms_per_token"], (1 - frac) * weights / (r.get("h2d_gbps", bw / 1e9) * 1e9) * 1e3)
            r.update(bound_ms=bound, vs_bound=r["ms_per_token"] / bound,
                     tokens_equal=bool(np.array_equal(tokens, a["tokens"])) if engine != "accelerate" else None,
                     kv_bytes=_kv_bytes(shape, 1, prompt + new))
            if "htod_per_step" in r:
                # The bytes the row copied, where (1 - f) x weights counts every byte the
                # budget leaves out: a table read in place (see the streaming engine) is
                # not copied, and the ring's granules are.
                copy = max(a["ms_per_token"], r["htod_per_step"] / (r["h2d_gbps"] * 1e9) * 1e3)
                r.update(copy_bound_ms=copy, vs_copy_bound=r["ms_per_token"] / copy)
            rows.append(r)
            print(f"  {int(frac * 100)}% {engine}: {r['ms_per_token']:.2f} ms/token (bound {bound:.2f})", flush=True)
    # Two tenants: both stream (1 - f) of the weights every step over the one link.
    tenants = None
    try:
        if not int4:
            tenants = in_process_of_its_own("bench_compare", "tenants_row", path=path, shape=shape,
                                            ids=ids.tolist(), new=new, kind=kind, cache=cache, weights=weights,
                                            fraction=tenants_fraction, scratch=scratch)
    except RuntimeError as e:
        last = [ln for ln in str(e).splitlines() if ln.strip()][-1]
        failures.append(f"two sessions at {int(tenants_fraction * 100)}%: {last.strip()[:600]}")
        print(f"  two sessions: FAILED: {last.strip()[:600]}", flush=True)
    if tenants is not None:
        tokens = tenants.pop("tokens")
        tenants.update(bound_ms=max(a["ms_per_token"], 2 * (1 - tenants_fraction) * weights / (tenants["h2d_gbps"] * 1e9) * 1e3),
                       tokens_equal=bool(np.array_equal(tokens, a["tokens"])) and tenants["same_tokens"],
                       kv_bytes=_kv_bytes(shape, 1, prompt + new))
        print(f"  two sessions at {int(tenants_fraction * 100)}%: "
              + " and ".join(f"{m:.2f}" for m in tenants["ms_per_token"])
              + f" ms/token (bound {tenants['bound_ms']:.2f})", flush=True)
    for r in rows:
        acc = [x for x in rows if x["engine"] == "accelerate" and x["fraction"] == r["fraction"]]
        r["vs_accelerate"] = acc[0]["ms_per_token"] / r["ms_per_token"] if acc else None
    a.pop("tokens")
    return dict(kind=kind, weights=weights, h2d_gbps=bw / 1e9, prompt=prompt, new=new, anchor=a, rows=rows,
                shape=shape, int4=int4, accelerate=why_not or "ran", accelerate_new=accelerate_new, failures=failures,
                tenants=tenants)


NAMES = {"graph": "OffloadSession (streaming engine)", "baseline": "non-VMM baseline (segments, cuMemAlloc)",
         "accelerate": "HF accelerate CPU offload"}


def print_compare(res: Dict) -> str:
    a = res["anchor"]
    rows: List = [("100%", "plain ORT, all resident (anchor)", f"{a['ms_per_token']:.2f}",
                   f"{1e3 / a['ms_per_token']:.1f}", "-", "-", "-", "-", "-", "-", "-", "-", "-")]
    for r in res["rows"]:
        driver = r.get("driver_per_step")
        name = NAMES[r["engine"]] if r.get("ran", "graph") == "graph" or r["engine"] != "graph" else \
            "OffloadSession (segments: no graphs here)"
        rows.append((f"{int(r['fraction'] * 100)}%", name, f"{r['ms_per_token']:.2f}",
                     f"{1e3 / r['ms_per_token']:.1f}", f"{r['h2d_gbps']:.1f}" if "h2d_gbps" in r else "-",
                     f"{r['bound_ms']:.2f}", f"{r['vs_bound']:.2f}x",
                     fmt_bytes(r["peak_device"]),
                     f"{r['vs_accelerate']:.1f}x" if r.get("vs_accelerate") else "-",
                     f"{r['byte_hit_rate']:.1%}" if "byte_hit_rate" in r else "-",
                     f"{sum(driver.values()):.1f}" if driver else "-",
                     f"{r['host_waits_per_step']:.1f}" if "host_waits_per_step" in r else "-",
                     "-" if r["tokens_equal"] is None else ("yes" if r["tokens_equal"] else "NO")))
    text = (f"compare on {res['kind']}: {fmt_bytes(res['weights'])} of weights (TinyLlama shape, builder layout"
            f"{', int4 MatMulNBits' if res.get('int4') else ''}), "
            f"prompt {res['prompt']}, {res['new']} new tokens ({res['accelerate_new']} for accelerate), batch 1; "
            f"pinned H2D {res['h2d_gbps']:.1f} GB/s at the start; bound = max(anchor ms/token, (1 - f) x weights / "
            f"H2D), with the H2D that each row measured in its own process right after its decode (the start's "
            f"for accelerate); "
            f"peak device = all the process took after its CUDA context; host waits = the package's stream and "
            f"event synchronizes (ORT's copy of the logits to the host is not counted)\n"
            + table(rows, ("weight budget", "engine", "ms/token", "tokens/s", "H2D GB/s", "bound ms", "vs bound", "peak device",
                           "vs accelerate", "byte hit", "driver calls/step", "host waits/step",
                           "= anchor tokens")))
    for f in res.get("failures", ()):
        text += f"\nFAILED {f}"
    if res["accelerate"] != "ran":
        text += f"\naccelerate rows skipped: {res['accelerate']}"
    for r in res["rows"]:
        if r.get("ran") == "graph":
            if "copy_bound_ms" in r:
                text += (f"\n{int(r['fraction'] * 100)}% streaming engine: copied {fmt_bytes(r['htod_per_step'])} a step; "
                         f"copy bound max(anchor, copied / H2D) {r['copy_bound_ms']:.2f} ms: {r['vs_copy_bound']:.2f}x")
            text += (f"\n{int(r['fraction'] * 100)}% streaming engine: weights budget {fmt_bytes(r['weights_budget'])}, "
                     f"KV {fmt_bytes(r['kv_bytes'])}, peak device {fmt_bytes(r['peak_device'])} "
                     f"(budget + KV + {fmt_bytes(r['peak_device'] - r['weights_budget'] - r['kv_bytes'])}), "
                     f"ORT's own memory {fmt_bytes(r['ort_bytes'])}, graph steps per step {r['graph_steps']:.2f}")
    t = res.get("tenants")
    if t:
        f = int(t["fraction"] * 100)
        text += (f"\ntwo sessions at once ({'/'.join(t['ran'])}), each with a weights budget of {f}%, each decoding "
                 f"in a thread: " + " and ".join(f"{m:.2f}" for m in t["ms_per_token"])
                 + f" ms/token; shared-link bound {t['bound_ms']:.2f} ms (2 x (1 - {t['fraction']:g}) x weights / "
                 f"H2D {t['h2d_gbps']:.1f} GB/s): " + " and ".join(f"{m / t['bound_ms']:.2f}x" for m in t["ms_per_token"])
                 + f"; peak device {fmt_bytes(t['peak_device'])} (KV {fmt_bytes(t['kv_bytes'])} each); tokens = anchor: "
                 + ("yes" if t["tokens_equal"] else "NO"))
    return text


if __name__ == "__main__":
    from .bench_decode import _main
    import sys
    _main(sys.argv[1], sys.argv[2], module=sys.modules[__name__])
