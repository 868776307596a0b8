"""``bench host``'s peer on the same cores: llama.cpp's decode with every weight in host
memory (``llama-bench -dev none -ngl 0``), the path llama.cpp takes for the layers it
leaves on the host of a card smaller than the model.

A decoder of ``SHAPE`` (0.92 GiB fp16, or its MatMuls int4: 0.35 GiB) is written once as
ONNX and as a GGUF (F16, or Q4_0 of the very blocks: ``llama_cpp.write_gguf``). Each
thread count of bench host's ladder decodes ``NEW`` tokens at depth 0; the rate is the
weight bytes a token reads (every tensor but ``token_embd``, whose one row a token is a
gather) over the time a token takes. That time also holds the norms, the rotary and the
attention over a few positions, so the rate is a floor on llama.cpp's GEMV rate, to set
beside the host kernels' rate at one row of x and the same threads.
"""
from __future__ import annotations

import os
import subprocess
from typing import Dict, List

SHAPE = dict(layers=8, hidden=2048, heads=16, kv_heads=4, intermediate=5632, vocab=32000, max_length=4096,
             dtype="float16")
NEW = 16


def gguf_for(kind: str, out_dir: str, shape: dict = SHAPE) -> str:
    """The GGUF of `shape`'s decoder (fp16 or int4), written once under `out_dir`."""
    from . import llama_cpp
    from .bench_decode import build_decoder
    shape = dict(shape, quant="int4") if kind == "int4" else shape
    folder = os.path.join(out_dir, f"host_peer_{kind}")
    path = build_decoder(shape, folder)
    gguf_path = os.path.join(folder, "model-q4_0.gguf" if kind == "int4" else "model-f16.gguf")
    if not os.path.exists(gguf_path):
        llama_cpp.write_gguf(path, shape, gguf_path + ".part")
        os.replace(gguf_path + ".part", gguf_path)
    return gguf_path


def bytes_a_token(gguf_path: str) -> int:
    """The weight bytes a decode step reads: every tensor of the file but token_embd."""
    from gguf import GGUFReader
    return sum(int(t.n_bytes) for t in GGUFReader(gguf_path).tensors if t.name != "token_embd.weight")


def bench_llama_host(llama_bench: str, out_dir: str, thread_counts: List[int], kinds=("fp16", "int4"),
                     runs: int = 3, shape: dict = SHAPE) -> List[Dict]:
    """llama.cpp's decode on the host alone, a row for each kind and thread count (a row
    with `error` where llama-bench failed)."""
    from . import llama_cpp
    rows = []
    for kind in kinds:
        gguf_path = gguf_for(kind, out_dir, shape)
        read = bytes_a_token(gguf_path)
        for threads in thread_counts:
            args = [llama_bench, "-m", gguf_path, "-dev", "none", "-ngl", "0", "-p", "0", "-n", str(NEW),
                    "-t", str(threads), "-r", str(runs), "-o", "json"]
            row = dict(kind=kind, threads=threads, bytes=read)
            try:
                proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
                if proc.returncode != 0:
                    raise ValueError(proc.stderr[-300:])
                tg = llama_cpp.parse_gen(proc.stdout, NEW)
            except (ValueError, subprocess.TimeoutExpired) as e:
                rows.append(dict(row, error=str(e)[-300:]))
                continue
            ms = 1e3 / tg["avg_ts"]
            rows.append(dict(row, ms_per_token=ms, gbps=read / ms / 1e6))
    return rows


def print_llama_host(rows: List[Dict], ours: List[Dict]) -> str:
    """llama.cpp's rows beside the host kernels' own at one row of x (`ours`: bench
    host's rows) with as many threads."""
    from ..config import fmt_bytes
    from ..stats import table
    mine = {(r["kind"], r["threads"]): r["gbps"] for r in ours if r["m"] == 1}
    body = []
    for r in rows:
        our = mine.get((r["kind"], r["threads"]))
        failed = "error" in r
        body.append(("fp16" if r["kind"] == "fp16" else "int4 (Q4_0)", r["threads"], fmt_bytes(r["bytes"]),
                     "FAILED: " + r["error"][:60] if failed else f"{r['ms_per_token']:.2f}",
                     "-" if failed else f"{r['gbps']:.1f}", "-" if our is None else f"{our:.1f}",
                     "-" if failed or our is None else f"{our / r['gbps']:.2f}x"))
    head = ("llama.cpp on the same cores (llama-bench -dev none -ngl 0, decode at depth 0): the weight bytes a "
            "token reads over its time, a floor on its GEMV rate; ours: the host kernels at M = 1")
    return head + "\n" + table(body, ("weights", "threads", "read a token", "ms/token", "GB/s", "ours GB/s",
                                      "ours vs llama.cpp"))
