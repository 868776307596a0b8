"""``onnx-offload bench int4``: an int4 decoder (MatMulNBits, as onnxruntime-genai's
builder writes it; accuracy_level 4) with every weight resident, against plain ORT with
its defaults over the same model, in the same run, each in a process of its own.
ms/token is the median over the decode steps after the first three; the tokens are
compared."""
from __future__ import annotations

import os
import time
from typing import Dict

import numpy as np

from ..stats import table
from .bench_decode import WARMUP, in_process_of_its_own


def _shape(kind: str) -> dict:
    return dict(layers=8, hidden=1024, heads=16, kv_heads=4, intermediate=3072, vocab=8000, max_length=512,
                dtype="float16" if kind == "cuda" else "float32")


def build_model(kind: str, out_dir: str) -> str:
    from ..models import decoder_lm, genai_config, int4, save_decoder
    shape = _shape(kind)
    folder = os.path.join(out_dir, f"int4_model_{kind}")
    path = os.path.join(folder, "model.onnx")
    if not os.path.exists(path):
        model = int4(decoder_lm("gqa", dtype=np.dtype(shape["dtype"]),
                                **{k: v for k, v in shape.items() if k != "dtype"}))
        save_decoder(model, folder, config=genai_config(shape["layers"], shape["hidden"], shape["heads"],
                                                        shape["kv_heads"], shape["vocab"], shape["max_length"],
                                                        eos_token_id=-1))
    return path


def resident_row(path: str, ids: np.ndarray, new: int, kind: str) -> Dict:
    from ..session import OffloadSession
    provider = "CUDAExecutionProvider" if kind == "cuda" else "CPUExecutionProvider"
    with OffloadSession(path, providers=[provider], cache_dir="off") as s:
        s.generate(ids, 4)
        stamps, tokens = [], []
        for t in s.generate_iter(ids, new):
            stamps.append(time.perf_counter())
            tokens.append(t)
        return dict(ms_per_token=float(np.median(np.diff(stamps)[WARMUP:] * 1e3)), segments=len(s.segments),
                    tokens=np.stack(tokens, 1))


def bench_int4(kind: str, out_dir: str, prompt: int = 32, new: int = 64) -> Dict:
    os.makedirs(out_dir, exist_ok=True)
    path = build_model(kind, out_dir)
    shape = _shape(kind)
    ids = np.random.default_rng(0).integers(0, shape["vocab"], (1, prompt))
    a = in_process_of_its_own("bench_decode", "anchor", path=path, shape=shape, ids=ids.tolist(), new=new, kind=kind)
    r = in_process_of_its_own("bench_int4", "resident_row", path=path, ids=ids.tolist(), new=new, kind=kind)
    return dict(kind=kind, weights=os.path.getsize(path + ".data"), anchor_ms=a["ms_per_token"],
                ms_per_token=r["ms_per_token"], ratio=r["ms_per_token"] / a["ms_per_token"],
                tokens_equal=bool(np.array_equal(r["tokens"], a["tokens"])), shape=shape)


def print_int4(res: Dict) -> str:
    return (f"bench int4 ({res['kind']}): a {res['shape']['layers']}-layer int4 decoder, "
            f"{res['weights'] / 2**20:.0f} MiB of weights, every weight resident\n"
            + table([("plain ORT, its defaults", f"{res['anchor_ms']:.3f}", "-", "-"),
                     ("OffloadSession", f"{res['ms_per_token']:.3f}", f"{res['ratio']:.2f}x",
                      "yes" if res["tokens_equal"] else "NO")],
                    ("", "ms/token", "vs plain ORT", "tokens = plain ORT")))


if __name__ == "__main__":
    import sys
    from .bench_decode import _main
    _main(sys.argv[1], sys.argv[2], sys.modules[__name__])
