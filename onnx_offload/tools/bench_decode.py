"""``onnx-offload bench decode``: generate() under weight budgets against the best plain
ORT decode loop over the same model, in the same run.

The model is onnxruntime-genai's builder layout (GroupQueryAttention, shared past and
present) at the TinyLlama shape on CUDA (22 layers, hidden 2048, 32 heads, 4 KV heads,
fp16), a small one on the CPU. The anchor keeps every weight resident, the KV cache on
the device, binds everything once with IOBinding and replays one CUDA graph per decode
step. Each OffloadSession row runs the same prompt and greedy decode at a weight budget
of f of the weights; the bound is max(anchor ms/token, (1 - f) * weight bytes / H2D),
with H2D measured in this run. A decode step is also set against the 1-token forward
step (no cache, uncaptured) of the same session. Times are medians over the decode
steps after the first three, each step ending with its logits on the host.

Each measurement runs in a process of its own: in one process the first session's
decode step was measured 8% faster than every later one of the same configuration
(1.52 ms against 1.64 ms on the H200), so a shared process would favour whichever runs
first.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import numpy as np
import onnxruntime as ort

from ..config import GiB, MiB
from ..stats import fmt_bytes, table
from .bench import pinned_h2d

WARMUP = 3


def _shape(kind: str) -> dict:
    if kind == "cuda":
        return dict(layers=22, hidden=2048, heads=32, kv_heads=4, intermediate=5632, vocab=32000, max_length=512,
                    dtype="float16")
    return dict(layers=4, hidden=256, heads=8, kv_heads=2, intermediate=704, vocab=1000, max_length=512,
                dtype="float32")


def build_model(kind: str, out_dir: str, int4: bool = False) -> tuple:
    """The decode benchmarks' model; `int4`: its MatMuls as MatMulNBits (block 32), as
    onnxruntime-genai's builder writes an int4 model."""
    shape = dict(_shape(kind), **({"quant": "int4"} if int4 else {}))
    return build_decoder(shape, os.path.join(out_dir, "decode_model_int4" if int4 else "decode_model")), shape


def build_decoder(shape: dict, folder: str) -> str:
    """The builder-layout decoder of `shape` (random weights, no EOS; its MatMuls int4
    when shape["quant"] is "int4") in `folder`, made once."""
    from ..models import int4
    from ..models.decoder import decoder_lm, genai_config, save_decoder
    marker = os.path.join(folder, "shape.json")
    path = os.path.join(folder, "model.onnx")
    if not (os.path.exists(marker) and json.load(open(marker)) == shape and os.path.exists(path)):
        model = decoder_lm("gqa", dtype=np.dtype(shape["dtype"]),
                           **{k: v for k, v in shape.items() if k not in ("dtype", "quant")})
        if shape.get("quant") == "int4":
            model = int4(model)
        cfg = genai_config(shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"], shape["vocab"],
                           shape["max_length"], eos_token_id=-1)  # no EOS: every row decodes all tokens
        save_decoder(model, folder, config=cfg)
        del model
        with open(marker, "w") as f:
            json.dump(shape, f)
    return path


def setup(kind: str, out_dir: str, prompt: int, new: int, int4: bool = False) -> tuple:
    """The model, its weight bytes, the pinned H2D bandwidth, the prompt and the anchor
    row (plain ORT, in a process of its own): what every decode benchmark starts from."""
    os.makedirs(out_dir, exist_ok=True)
    t = time.perf_counter()
    path, shape = build_model(kind, out_dir, int4)
    print(f"  model ready in {time.perf_counter() - t:.1f} s", flush=True)
    weights = os.path.getsize(path + ".data")
    bw = pinned_h2d(kind, GiB if kind == "cuda" else 128 * MiB)
    ids = np.random.default_rng(0).integers(0, shape["vocab"], (1, prompt))
    a = in_process_of_its_own("bench_decode", "anchor", path=path, shape=shape, ids=ids.tolist(), new=new, kind=kind)
    print(f"  anchor: {a['ms_per_token']:.2f} ms/token; pinned H2D {bw / 1e9:.1f} GB/s", flush=True)
    return path, shape, weights, bw, ids, a


def anchor(path: str, shape: dict, ids: np.ndarray, new: int, kind: str, warm_prompt: bool = False,
           forced: Optional[list] = None, logits_out: Optional[str] = None, prepack: bool = True,
           graphs: bool = True) -> Dict:
    """The best plain-ORT loop: device KV shared between past and present, IOBinding bound
    once, a CUDA graph replayed per decode step (on CUDA). `warm_prompt`: the prompt runs
    once before the timed one (ORT's first run of a shape picks kernels and grows its arena).
    `forced` [batch, new]: the tokens fed after the prompt, in place of the picks (the
    returned tokens stay the picks); `logits_out`: a .npy file for each step's logits
    (float32 [new, batch, vocab]). A layer whose attention keeps a window-sized cache
    (loading.window_caches) gets a buffer of the window's positions. `prepack=False`: ORT's
    kernels read the weights as they are, as in the package's sessions. `graphs=False`: no
    CUDA graph. ORT runs a step twice in the Run that captures its graph, which evicts twice
    from a window-sized cache: a model with one runs each step once only so."""
    import onnx
    from ..loading import window_caches
    dev = "cuda" if kind == "cuda" else "cpu"
    prov = ([("CUDAExecutionProvider", {"enable_cuda_graph": "1" if graphs else "0"})] if kind == "cuda"
            else ["CPUExecutionProvider"])
    so = ort.SessionOptions()
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(path, so, providers=prov)
    windows = dict(window_caches(onnx.load(path, load_external_data=False)))
    dtype = np.dtype(shape["dtype"])
    b, p = ids.shape
    total = p + new
    hd = shape["hidden"] // shape["heads"]
    kv = [ort.OrtValue.ortvalue_from_numpy(np.zeros((b, shape["kv_heads"], windows.get(i // 2, total), hd), dtype),
                                           dev, 0)
          for i in range(2 * shape["layers"])]

    def bind_kv(io):
        for i in range(shape["layers"]):
            for j, name in enumerate(("key", "value")):
                io.bind_ortvalue_input(f"past_key_values.{i}.{name}", kv[2 * i + j])
                io.bind_ortvalue_output(f"present.{i}.{name}", kv[2 * i + j])

    for _ in range(2 if warm_prompt else 1):
        t0 = time.perf_counter()
        io = sess.io_binding()
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("attention_mask", np.ones((b, p), np.int64))
        io.bind_output("logits", dev, 0)
        bind_kv(io)
        ro = ort.RunOptions()
        ro.add_run_config_entry("gpu_graph_id", "-1")
        sess.run_with_iobinding(io, ro)
        last = io.get_outputs()[0].numpy()[:, -1].astype(np.float32)
        tok = last.argmax(-1)
        prompt_ms = (time.perf_counter() - t0) * 1e3
    seen = [last]
    ids_v = ort.OrtValue.ortvalue_from_numpy(np.zeros((b, 1), np.int64), dev, 0)
    mask = np.zeros((b, total), np.int64)
    mask_v = ort.OrtValue.ortvalue_from_numpy(mask, dev, 0)
    logits_v = ort.OrtValue.ortvalue_from_shape_and_type([b, 1, shape["vocab"]], dtype, dev, 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("input_ids", ids_v)
    io.bind_ortvalue_input("attention_mask", mask_v)
    io.bind_ortvalue_output("logits", logits_v)
    bind_kv(io)
    ro = ort.RunOptions()
    ro.add_run_config_entry("gpu_graph_id", "1")
    tokens, times = [tok], []
    for step in range(1, new):
        t = time.perf_counter()
        fed = tok if forced is None else np.asarray(forced)[:, step - 1]
        ids_v.update_inplace(fed.reshape(b, 1).astype(np.int64))
        mask[:, :p + step] = 1
        mask_v.update_inplace(mask)
        sess.run_with_iobinding(io, ro)
        last = logits_v.numpy()[:, -1].astype(np.float32)
        tok = last.argmax(-1)
        times.append((time.perf_counter() - t) * 1e3)
        tokens.append(tok)
        if logits_out:
            seen.append(last)
    if logits_out:
        np.save(logits_out, np.stack(seen))
    return dict(ms_per_token=statistics.median(times[WARMUP:]), prompt_ms=prompt_ms,
                tokens=np.stack(tokens, 1))


def offload_row(path: str, shape: dict, ids: np.ndarray, new: int, kind: str, cache: str, weights: int,
                fraction: float, capture: bool, scratch: int) -> Dict:
    from ..session import OffloadSession
    provider = "CUDAExecutionProvider" if kind == "cuda" else "CPUExecutionProvider"
    b, p = ids.shape
    hd = shape["hidden"] // shape["heads"]
    kv_bytes = 2 * shape["layers"] * b * shape["kv_heads"] * (p + new) * hd * np.dtype(shape["dtype"]).itemsize
    if fraction >= 1:
        # All resident: the budget holds the weights, the KV cache (reserved) and scratch.
        kw = dict(vram_limit=weights + kv_bytes + 2 * scratch, scratch_bytes=scratch, kv_bytes=kv_bytes)
    else:
        # The weights' share plus scratch; the KV cache borrows from the weights zone.
        kw = dict(offload=True, vmm=True, vram_limit=int(weights * fraction) + scratch, scratch_bytes=scratch)
    if kind != "cuda":
        kw["host_granularity"] = 64 << 10  # granules in proportion to the small CPU model
    s = OffloadSession(path, providers=[provider], cache_dir=cache, cuda_graph=capture if kind == "cuda" else None,
                       **kw)
    try:
        fwd = {"input_ids": ids[:, -1:], "attention_mask": np.ones((b, 1), np.int64)}
        empty = np.zeros((b, shape["kv_heads"], 0, hd), np.dtype(shape["dtype"]))
        fwd.update({f"past_key_values.{i}.{n}": empty for i in range(shape["layers"]) for n in ("key", "value")})
        fwd_times = []
        for _ in range(5):
            t = time.perf_counter()
            s.run(["logits"], fwd)
            fwd_times.append((time.perf_counter() - t) * 1e3)
        ledger = s.device.ledger
        lent0 = ledger.snapshot().zones["weights"].lent
        weights0 = ledger.snapshot().zones["weights"].committed.current
        graph0 = s.stats().graph_steps
        tokens, stamps, kv_peak, weights_low = [], [], 0, weights0
        t0 = time.perf_counter()
        c0 = None
        for tok in s.generate_iter(ids, new):
            stamps.append(time.perf_counter())
            tokens.append(tok)
            if c0 is None:
                c0 = s.stats().counters
            snap = ledger.snapshot().zones
            kv_peak = max(kv_peak, snap["kv"].committed.current)
            weights_low = min(weights_low, snap["weights"].committed.current)
        st = s.stats()
        c1 = st.counters
        steps = np.diff(stamps) * 1e3
        access = c1.access_bytes - c0.access_bytes
        return dict(fraction=fraction, capture=s.graph_capture.enabled, segments=len(s.segments),
                    ms_per_token=float(np.median(steps[WARMUP:])), prompt_ms=(stamps[0] - t0) * 1e3,
                    forward_ms=statistics.median(fwd_times[2:]),
                    byte_hit_rate=(c1.hit_bytes - c0.hit_bytes) / access if access else 1.0,
                    peak_committed=st.peak_committed, budget=st.ledger.budget,
                    graph_steps=st.graph_steps - graph0, kv_peak=kv_peak, kv_lent=st.ledger.zones["weights"].lent - lent0,
                    weights_before=weights0, weights_low=weights_low, tokens=np.stack(tokens, 1))
    finally:
        s.close()


def bench_decode(kind: str, out_dir: str, prompt: int = 128, new: int = 128,
                 fractions=(1.0, 0.75, 0.5, 0.25)) -> Dict:
    path, shape, weights, bw, ids, a = setup(kind, out_dir, prompt, new)
    scratch = 2 * GiB if kind == "cuda" else 4 * MiB
    cache = os.path.join(out_dir, "cache")
    rows = []
    for frac in fractions:
        for capture in ((True, False) if kind == "cuda" else (False,)):
            r = in_process_of_its_own("bench_decode", "offload_row", path=path, shape=shape, ids=ids.tolist(), new=new, kind=kind,
                                       cache=cache, weights=weights, fraction=frac, capture=capture, scratch=scratch)
            bound = max(a["ms_per_token"], (1 - frac) * weights / bw * 1e3)
            r.update(bound_ms=bound, vs_bound=r["ms_per_token"] / bound, vs_anchor=r["ms_per_token"] / a["ms_per_token"],
                     vs_forward=r["ms_per_token"] / r["forward_ms"],
                     tokens_equal=bool(np.array_equal(r.pop("tokens"), a["tokens"])))
            rows.append(r)
            print(f"  {int(frac * 100)}% graphs {'on' if r['capture'] else 'off'}: {r['ms_per_token']:.2f} ms/token "
                  f"(bound {bound:.2f}, forward {r['forward_ms']:.2f})", flush=True)
    a.pop("tokens")
    return dict(kind=kind, weights=weights, h2d_gbps=bw / 1e9, prompt=prompt, new=new, anchor=a, rows=rows,
                shape=shape)


def in_process_of_its_own(module: str, fn: str, env: Optional[Dict[str, str]] = None, **kw) -> Dict:
    """Runs `fn(**kw)` of the tools' `module` (bench_decode, bench_int4, ...) in a fresh
    Python, with `env` added to its environment; returns its result."""
    # Run from a neutral folder: the source tree's package (without its built core)
    # must not shadow the installed one.
    proc = subprocess.run([sys.executable, "-m", f"{__package__}.{module}", fn, json.dumps(kw)],
                          capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"bench: {module}.{fn} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["tokens"] = np.array(out["tokens"], np.int64)
    return out


def _main(fn: str, kw: str, module=None) -> None:
    kw = json.loads(kw)
    kw["ids"] = np.array(kw["ids"], np.int64)
    res = (vars(module) if module is not None else globals())[fn](**kw)
    res["tokens"] = res["tokens"].tolist()
    print(json.dumps(res, default=float))


def print_decode(res: Dict) -> str:
    a = res["anchor"]
    rows: List = [("anchor (plain ORT)", "-", "on" if res["kind"] == "cuda" else "off", f"{a['ms_per_token']:.2f}",
                   f"{1e3 / a['ms_per_token']:.1f}", "-", "-", "-", "-", "-", "-", "-", "-")]
    for r in res["rows"]:
        rows.append((f"{int(r['fraction'] * 100)}%", r["segments"], "on" if r["capture"] else "off",
                     f"{r['ms_per_token']:.2f}", f"{1e3 / r['ms_per_token']:.1f}", f"{r['bound_ms']:.2f}",
                     f"{r['vs_bound']:.2f}x", f"{r['forward_ms']:.2f}", f"{r['vs_forward']:.2f}x",
                     f"{r['byte_hit_rate']:.1%}", fmt_bytes(r["peak_committed"]),
                     f"{r['graph_steps']}/{res['new'] - 1}", "yes" if r["tokens_equal"] else "NO"))
    low = min(res["rows"], key=lambda r: r["fraction"])
    return (f"decode on {res['kind']}: {fmt_bytes(res['weights'])} of weights (builder layout, "
            f"{res['shape']['layers']} layers), prompt {res['prompt']}, {res['new']} new tokens, batch 1; "
            f"pinned H2D {res['h2d_gbps']:.1f} GB/s (this run); bound = max(anchor ms/token, "
            f"(1 - f) x weights / H2D)\n"
            + table(rows, ("weight budget", "segments", "graphs", "ms/token", "tokens/s", "bound ms", "vs bound",
                           "1-token fwd ms", "vs fwd", "byte hit", "peak committed", "graph steps",
                           "= anchor tokens"))
            + f"\nKV lending at {int(low['fraction'] * 100)}%: the cache peaked at {fmt_bytes(low['kv_peak'])}; "
              f"the weights zone lent {fmt_bytes(low['kv_lent'])} and went from "
              f"{fmt_bytes(low['weights_before'])} to {fmt_bytes(low['weights_low'])} resident")


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
