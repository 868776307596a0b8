"""``onnx-offload bench compare --devices 0,1``: decode at one total weights budget on
one device, then split across several, in one run.

Rows, each in a process of its own (see ``bench_decode``), for the model and anchor of
``bench compare`` (the TinyLlama shape in the builder layout on CUDA, a small one on the
CPU) and, on CUDA, for the Llama-3-8B shape of ``bench cards``:
- one device: an OffloadSession on the first device, its weights budget the fraction f
  of the weights;
- every device: OffloadSession(..., devices=[...]), each device a budget of f / n of the
  weights, the model split by ``devices.split_stages``.

Each device streams its stage's weights over its own link, each device's pinned H2D rate
measured in the row's own process right after its decode. Two bounds:
- the pipeline's, ``max(anchor ms/token, the sum over devices of its streamed bytes per
  step / its H2D)``: the stages of one sequence run one after the other, and a device's
  ring prefetches one weight ahead, so the links take turns;
- the links', ``max(anchor, the largest over devices of the same)``: what the devices
  would reach streaming at once (stages that overlap, which this package does not do).
One device's are both ``(1 - f) x weights / H2D``. On the CPU each device is a host
backend of its own, and all of them copy over the one memory bus.
"""
from __future__ import annotations

import os
import time
from typing import Dict, List, Sequence

import numpy as np

from ..config import MiB
from ..stats import fmt_bytes, table
from .bench import pinned_h2d
from .bench_compare import _kv_bytes
from .bench_decode import WARMUP, build_decoder, in_process_of_its_own, setup


def devices_row(path: str, shape: dict, ids: np.ndarray, new: int, kind: str, devices: List[int], weights: int,
                fraction: float, scratch: int) -> Dict:
    """Decode on `devices` at a total weights budget of `fraction`, shared evenly."""
    from ..session import OffloadSession
    n = len(devices)
    g = 2 * MiB if kind == "cuda" else 64 << 10
    kv = -(-_kv_bytes(shape, ids.shape[0], ids.shape[1] + new) // g) * g + g
    share = int(weights * fraction / n)
    kw = dict(offload=True, vmm=True, engine="graph" if kind == "cuda" else "segments", cache_dir="off")
    each = dict(vram_limit=share + kv + scratch, weight_bytes=share, kv_bytes=kv, scratch_bytes=scratch)
    kw.update({k: [v] * n for k, v in each.items()} if n > 1 else each)
    if kind != "cuda":
        kw["host_granularity"] = g
    provider = "CUDAExecutionProvider" if kind == "cuda" else "CPUExecutionProvider"
    t0 = time.perf_counter()
    s = OffloadSession(path, providers=[provider], devices=list(devices), **kw)
    load_s = time.perf_counter() - t0
    stages = s.stages if n > 1 else [s]
    try:
        tokens, stamps = [], []
        for tok in s.generate_iter(ids, new):
            stamps.append(time.perf_counter())
            tokens.append(tok)
            if len(tokens) == WARMUP + 1:
                h0 = [st.stats().counters.htod_bytes for st in stages]
            if len(tokens) == new - 1:
                h1 = [st.stats().counters.htod_bytes for st in stages]
        steps = np.diff(stamps) * 1e3
        measured = new - 2 - WARMUP
        streamed = [(b - a) / measured for a, b in zip(h0, h1)]
        h2d = [pinned_h2d(kind, 256 * MiB, d) for d in devices]
        return dict(devices=list(devices), engines=[st.engine for st in stages], load_s=load_s,
                    ms_per_token=float(np.median(steps[WARMUP:])), streamed_per_step=streamed,
                    h2d_gbps=[r / 1e9 for r in h2d], stage_weights=[st.stats().weight_bytes for st in stages],
                    moved_per_step=getattr(s, "moved_bytes", 0) / max(1, len(tokens)),
                    tokens=np.stack(tokens, 1))
    finally:
        s.close()


def _models(kind: str, out_dir: str, prompt: int, new: int):
    """(name, model path, shape, weight bytes, prompt ids, anchor row) of each model: the
    TinyLlama shape of bench compare, and on CUDA the Llama-3-8B shape of bench cards."""
    path, shape, weights, _, ids, a = setup(kind, out_dir, prompt, new)
    yield "TinyLlama shape" if kind == "cuda" else "small decoder", path, shape, weights, ids, a
    if kind != "cuda":
        return
    from .bench_cards import SHAPE_8B
    path = build_decoder(SHAPE_8B, os.path.join(out_dir, "cards_model"))
    ids = np.random.default_rng(0).integers(0, SHAPE_8B["vocab"], (1, prompt))
    a = in_process_of_its_own("bench_decode", "anchor", path=path, shape=SHAPE_8B, ids=ids.tolist(), new=new,
                              kind=kind)
    print(f"  Llama-3-8B shape anchor: {a['ms_per_token']:.2f} ms/token", flush=True)
    yield "Llama-3-8B shape", path, SHAPE_8B, os.path.getsize(path + ".data"), ids, a


def bench_devices(kind: str, out_dir: str, devices: Sequence[int], prompt: int = 128, new: int = 64,
                  fraction: float = 0.25) -> Dict:
    scratch = 512 * MiB if kind == "cuda" else 4 * MiB
    models, failures = [], []
    for name, path, shape, weights, ids, a in _models(kind, out_dir, prompt, new):
        rows = []
        for group in ([devices[0]], list(devices)):
            try:
                r = in_process_of_its_own("bench_devices", "devices_row", path=path, shape=shape, ids=ids.tolist(),
                                          new=new, kind=kind, devices=group, weights=weights, fraction=fraction,
                                          scratch=scratch)
            except RuntimeError as e:
                last = [ln for ln in str(e).splitlines() if ln.strip()][-1]
                failures.append(f"{name}, devices {group}: {last.strip()[:600]}")
                print(f"  {name}, devices {group}: FAILED: {last.strip()[:600]}", flush=True)
                continue
            tokens = r.pop("tokens")
            per = [s / (h * 1e9) * 1e3 for s, h in zip(r["streamed_per_step"], r["h2d_gbps"])]
            r.update(bound_ms=max(a["ms_per_token"], sum(per)), links_bound_ms=max(a["ms_per_token"], max(per)),
                     tokens_equal=bool(np.array_equal(tokens, a["tokens"])))
            r["vs_bound"] = r["ms_per_token"] / r["bound_ms"]
            rows.append(r)
            print(f"  {name}, devices {group}: {r['ms_per_token']:.2f} ms/token (bound {r['bound_ms']:.2f})",
                  flush=True)
        a.pop("tokens")
        models.append(dict(name=name, weights=weights, anchor=a, rows=rows))
    return dict(kind=kind, fraction=fraction, prompt=prompt, new=new, models=models, failures=failures)


def print_devices(res: Dict) -> str:
    rows: List = []
    for model in res["models"]:
        a = model["anchor"]
        one = next((r["ms_per_token"] for r in model["rows"] if len(r["devices"]) == 1), None)
        rows.append((model["name"], fmt_bytes(model["weights"]), "plain ORT, all resident (anchor)",
                     f"{a['ms_per_token']:.2f}", "-", "-", "-", "-", "-", "-", "-", "-"))
        for r in model["rows"]:
            rows.append((model["name"], "", f"devices {','.join(map(str, r['devices']))} ({'/'.join(r['engines'])})",
                         f"{r['ms_per_token']:.2f}", " + ".join(fmt_bytes(w) for w in r["stage_weights"]),
                         " + ".join(fmt_bytes(s) for s in r["streamed_per_step"]),
                         " / ".join(f"{h:.1f}" for h in r["h2d_gbps"]), f"{r['bound_ms']:.2f}",
                         f"{r['vs_bound']:.2f}x", f"{r['links_bound_ms']:.2f}",
                         f"{r['ms_per_token'] / one:.2f}x" if one else "-", "yes" if r["tokens_equal"] else "NO"))
    text = (f"devices on {res['kind']}: a total weights budget of {int(res['fraction'] * 100)}% shared evenly by "
            f"the devices of a row; prompt {res['prompt']}, {res['new']} new tokens, batch 1; pipeline bound = "
            f"max(anchor, sum over devices of streamed bytes per step / its H2D); links bound = the same with the "
            f"largest term instead of the sum (devices streaming at once); each device's H2D measured in the row's "
            f"process after its decode\n"
            + table(rows, ("model", "weights", "row", "ms/token", "weights per device", "streamed per step",
                           "H2D GB/s", "pipeline bound ms", "vs bound", "links bound ms", "vs one device",
                           "= anchor tokens")))
    for f in res.get("failures", ()):
        text += f"\nFAILED {f}"
    return text


if __name__ == "__main__":
    from .bench_decode import _main
    import sys
    _main(sys.argv[1], sys.argv[2], module=sys.modules[__name__])
