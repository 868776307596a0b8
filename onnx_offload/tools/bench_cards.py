"""``onnx-offload bench cards``: the call a user writes, on cards smaller than the model.

The model is onnxruntime-genai's builder layout (GroupQueryAttention, shared past and
present) at the Llama-3-8B shape (32 layers, hidden 4096, 32 heads, 8 KV heads,
intermediate 14336, vocabulary 128256, fp16: 16.06 GB of weights), made by the package's
generator with random weights. Each row runs in a process of its own beside a second
process that holds all of the device's free memory but the card's, so the session sees
what a user with that card sees. The session is
``OffloadSession(path, providers=["CUDAExecutionProvider"], offload=True, vmm=True)``:
the budget, the reserves and the prompt chunk are left to the package.

Each row generates twice; the second generation is measured (the first captures the
graphs). Columns: ms/token (the median over the decode steps after the first three) and
the time to first token; the weights resident; the decode bound,
``max(resident anchor, streamed bytes per step / H2D)``, and the prefill bound,
``max(resident prefill, bytes streamed during the prompt / H2D)``, with H2D measured in
the same run; the device memory the row's process took at its peak against the card, and the weight
bytes that could have been resident (those that were, and the card's bytes the process
left unused); the tokens against plain ORT's (the anchor: every weight resident, no
second process); the engine that ran.

With llama.cpp's ``llama-bench`` (``--llama-bench PATH``, or on PATH), each batch-1 row
also runs llama.cpp on the same weights (an F16 GGUF, ``llama_cpp.write_gguf``) under
the same card: its own fit and the largest ``-ngl`` that loads, with its ms/token at the
prompt's depth and its prompt time beside ours, and the ratios. ``--int4`` runs the
model with its MatMuls as int4 ``MatMulNBits`` (``models.int4``, as the genai builder's
``-p int4`` writes them) on 4 and 6 GiB cards, and llama.cpp on the same blocks as Q4_0
(on the CPU, a streamed int4 row's tokens can differ from plain ORT's, which prepacks:
docs/int4.md). ``--ort-levers`` measures
the all-resident step (the whole device) with each of ORT's CUDA levers
(``loading.ort_options.CUDA_LEVERS``).

The optimized model is made once, in the anchor's process with the whole device, and
kept in the bench's cache folder, so every row runs the same optimized graph that plain
ORT runs (ORT's CUDA optimization pass loads the weights onto the device, which a card
smaller than the model cannot hold: a session there runs the model as exported).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Dict, List, Optional

import numpy as np

from ..config import GiB, MiB, fmt_bytes
from ..memory import host_rate
from .bench import pinned_h2d
from .bench_cards_table import _line, _llama_cells, print_cards  # noqa: F401 - print_cards: the command's table
from .bench_decode import WARMUP, build_decoder, in_process_of_its_own

SHAPE_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256, max_length=8192,
                dtype="float16")
SHAPE_CPU = dict(layers=4, hidden=256, heads=8, kv_heads=2, intermediate=704, vocab=1000, max_length=8192,
                 dtype="float32")
CARDS_GIB = (8, 12, 16, 24)
CARDS_INT4_GIB = (4, 6)  # the int4 model (4.9 GiB of weights, its embedding fp16) on cards smaller than it
PROMPTS = (512, 4096)
BATCHES = (1, 4)
NEW = 32


def build_model(shape: dict, out_dir: str) -> str:
    """The builder-layout decoder of `shape`, made once in `out_dir` (a folder for each quant)."""
    return build_decoder(shape, os.path.join(out_dir, "cards_model" + ("_int4" if shape.get("quant") else "")))


HOLDER = """
import sys
from onnx_offload import _core
backend = _core.make_cuda_backend(0)
free, _ = backend.mem_info()
card = int(sys.argv[1])
if free > card:
    backend.plain_alloc(free - card)
print(backend.mem_info()[0], flush=True)
sys.stdin.read()  # held until the row's process closes the pipe or ends
"""


class Card:
    """A second process that holds all of the device's free memory but `card` bytes."""

    def __init__(self, card: int):
        # From a neutral folder: the source tree's package (without its built core) must
        # not shadow the installed one.
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(card)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())
        line = self.proc.stdout.readline().strip()
        if not line:
            self.close()
            raise RuntimeError("bench cards: the process holding the device's memory did not start")
        self.free = int(line)  # what the device has free beside it: the card

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        finally:
            self.proc.stdout.close()
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


class _Peak:
    """The device's free memory, sampled every millisecond on a thread, against `start`."""

    def __init__(self, start: int):
        from .. import _core
        self._backend = _core.make_cuda_backend(0)
        self.start = start
        self.low = self._backend.mem_info()[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.sample()

    def sample(self) -> None:
        self.low = min(self.low, self._backend.mem_info()[0])

    def close(self) -> int:
        """Stops sampling (idempotent); the most memory taken since the start."""
        self._stop.set()
        self._thread.join()
        return self.start - self.low


def _generate(s, ids: np.ndarray, new: int) -> Dict:
    """One generation: time to first token, the decode steps' times, the bytes streamed
    during the prompt and per decode step, and the tokens."""
    before = s.stats().counters.htod_bytes
    t0 = time.perf_counter()
    it = s.generate_iter(ids, new)
    tokens = [next(it)]
    first = time.perf_counter()
    prompt_htod = s.stats().counters.htod_bytes - before
    stamps = [first]
    for tok in it:
        stamps.append(time.perf_counter())
        tokens.append(tok)
    return dict(ttft_ms=(first - t0) * 1e3, steps=(np.diff(stamps) * 1e3).tolist(), prompt_htod=prompt_htod,
                tokens=np.stack(tokens, 1))


def row(path: str, card: int, ids: np.ndarray, new: int, kind: str, cache: str, host_compute="off") -> Dict:
    """One card: the user's call beside a process that holds the rest of the device, with
    host compute as given."""
    from ..session import OffloadSession
    holder = Card(card) if kind == "cuda" else None
    peak = _Peak(holder.free) if holder is not None else None
    s = None
    out: Dict = dict(card=card, batch=int(ids.shape[0]), prompt=int(ids.shape[1]), host_compute=host_compute)
    try:
        if kind == "cuda":
            s = OffloadSession(path, providers=["CUDAExecutionProvider"], offload=True, vmm=True, cache_dir=cache,
                               host_compute=host_compute)
        else:  # the host backend: the card is the budget
            s = OffloadSession(path, providers=["CPUExecutionProvider"], offload=True, vmm=True, cache_dir=cache,
                               vram_limit=card, host_granularity=64 << 10, host_compute=host_compute)
        _generate(s, ids, new)  # captures the graphs
        made, replayed = getattr(s._runner, "captures", 0), s.stats().graph_steps
        g = _generate(s, ids, new)
        out["captures_second"] = getattr(s._runner, "captures", 0) - made  # graphs the measured one made
        out["graph_steps"] = s.stats().graph_steps - replayed  # its steps that replayed a graph
        st = s.stats()
        streamed = st.last_step.htod_bytes
        out.update(ms_per_token=float(np.median(g["steps"][WARMUP:])), ttft_ms=g["ttft_ms"],
                   prompt_htod=g["prompt_htod"], step_htod=streamed, resident=st.last_step.hit_bytes,
                   weight_bytes=st.weight_bytes, budget=st.ledger.budget,
                   # one unsplit session, every weight resident, or the engine that streams
                   engine=s.engine if s._runner.streaming else "all resident",
                   zones={k: [z.allowance, z.reserve] for k, z in st.ledger.zones.items()},
                   # What the budget left and how each reserve is sized; the ledger's peak and
                   # ORT's measured bytes, so that the peak less them is what lay outside it.
                   margin=st.margin, reserves=[list(x) for x in st.reserves], ledger_peak=st.ledger.peak_committed,
                   ort_bytes=st.outside_bytes, host=st.host_compute,
                   notes=list(st.notes), tokens=g["tokens"])
    except Exception as e:  # noqa: BLE001 - a row that fails is a row of the table
        out.update(error=f"{type(e).__name__}: {' '.join(str(e).split())[:600]}",
                   where=traceback.format_exc(limit=-8)[-3000:],
                   tokens=np.zeros((ids.shape[0], 0), np.int64))
    finally:
        if s is not None:
            s.close()
        if peak is not None:
            out["peak"] = peak.close()
        if holder is not None:
            out["card_free"] = holder.free
            holder.close()
    return out


def _bounds(r: Dict, a: Dict, bw: float, off: Optional[Dict]) -> None:
    """A row's bounds against plain ORT's loop `a` and the link's `bw` bytes/s. With host
    compute on, the step's non-resident bytes (the off row's streamed bytes, `off`) move
    over the link and through the host's cores at once: the bound is
    max(resident step, non-resident bytes / (H2D + the host rate measured in the session))."""
    r["tokens_equal"] = bool(np.array_equal(r.pop("tokens"), a["tokens"]))
    r["anchor_ms"], r["anchor_prompt_ms"] = a["ms_per_token"], a["prompt_ms"]
    if "error" in r:
        return
    r["bound_ms"] = max(a["ms_per_token"], r["step_htod"] / bw * 1e3)
    r["prefill_bound_ms"] = max(a["prompt_ms"], r["prompt_htod"] / bw * 1e3)
    h = r.get("host") or {}
    if off is not None and "error" not in off and h.get("on") and h.get("steps"):
        # The row came back as JSON: the rates' row counts are strings there.
        rates = {k: {int(m): v for m, v in by.items()} for k, by in h["host_rates"].items()}
        rate = max(host_rate(rates, k, r["batch"]) for k in rates)
        r["bound_ms"] = max(a["ms_per_token"], off["step_htod"] / (bw + rate) * 1e3)
    if r.get("peak") is not None:
        # The weights that could have been resident: those that were, and the card's bytes
        # the process left unused.
        r["could_reside"] = min(r["weight_bytes"], r["resident"] + max(0, r["card_free"] - r["peak"]))


def warm_cache(path: str, kind: str, cache: str, ids=None) -> Dict:
    """Makes the cache entry with the whole device (see the module's note)."""
    from ..session import OffloadSession
    provider = "CUDAExecutionProvider" if kind == "cuda" else "CPUExecutionProvider"
    t = time.perf_counter()
    with OffloadSession(path, providers=[provider], offload=True, vmm=True, cache_dir=cache,
                        **({} if kind == "cuda" else dict(host_granularity=64 << 10))):
        pass
    return dict(seconds=time.perf_counter() - t, tokens=np.zeros((1, 0), np.int64))


def levers_row(path: str, ids, new: int, options: dict, cache: str) -> Dict:
    """The all-resident step (the whole device, the budget left to the package) with these
    CUDA provider options: ms/token of the second generation, and its tokens."""
    from ..session import OffloadSession
    ids = np.asarray(ids)
    with OffloadSession(path, providers=[("CUDAExecutionProvider", dict(options))], offload=True, vmm=True,
                        cache_dir=cache) as s:
        _generate(s, ids, new)
        g = _generate(s, ids, new)
        resident = not s._runner.streaming
    return dict(ms_per_token=float(np.median(g["steps"][WARMUP:])), ttft_ms=g["ttft_ms"], resident=resident,
                tokens=g["tokens"])


def llama_rows(llama_bench: str, gguf_path: str, shape: dict, card: int, prompt: int, new: int) -> Dict:
    """llama.cpp on the card: its own fit, and the largest -ngl that loads (tried from
    above an estimate down, so that the one that runs is the largest), each beside a
    process that holds the rest of the device."""
    from . import llama_cpp

    def under_card(args):
        """llama-bench with `args` beside a process holding the rest of the device: its
        output, or None and why it failed."""
        holder = Card(card)
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return None, "llama-bench ran past 600 s"
        finally:
            holder.close()
        return (proc, "") if proc.returncode == 0 else (None, proc.stderr[-400:])

    def run(ngl):
        proc, why = under_card(llama_cpp.bench_args(llama_bench, gguf_path, prompt, new, ngl))
        return (llama_cpp.parse(proc.stdout, prompt, new), "") if proc else (None, why)

    def buffers(ngl) -> Dict[str, int]:
        """Where llama.cpp put the weights at `ngl`, from a probe's log ({} if it failed)."""
        proc, _ = under_card(llama_cpp.probe_args(llama_bench, gguf_path, ngl))
        return llama_cpp.model_buffers(proc.stderr + proc.stdout) if proc else {}

    out: Dict = {}
    fit, why = run(None)
    out["fit"] = fit if fit is not None else dict(error=why)
    layers = shape["layers"]
    estimate = (card - 2 * GiB) // llama_cpp.layer_bytes(shape)
    ngl = int(min(layers + 1, max(0, estimate + 2)))
    while ngl >= 0:
        best, why = run(ngl)
        if best is not None:
            best["ngl"] = ngl
            best["buffers"] = buffers(ngl)
            out["best"] = best
            break
        ngl -= 1
    else:
        out["best"] = dict(error=why)
    return out


def bench_cards(kind: str, out_dir: str, cards=None, prompts=PROMPTS, batches=BATCHES, new: int = NEW,
                llama_bench=None, ort_levers: bool = False, host_compute: bool = True, int4: bool = False) -> Dict:
    """Every card, prompt and batch: a row with host compute off, and where weights stream
    and `host_compute`, a row with it as the user's call has it ("auto") beside. `int4`: the
    model's MatMuls as MatMulNBits (the genai builder's int4), and llama.cpp's as Q4_0."""
    from . import llama_cpp
    shape = SHAPE_8B if kind == "cuda" else SHAPE_CPU
    shape = dict(shape, quant="int4") if int4 else shape
    llama = llama_cpp.find_llama_bench(llama_bench) if kind == "cuda" else None
    os.makedirs(out_dir, exist_ok=True)
    t = time.perf_counter()
    path = build_model(shape, out_dir)
    print(f"  model ready in {time.perf_counter() - t:.1f} s", flush=True)
    weights = os.path.getsize(path + ".data")
    if cards is None:
        cards = ([c * GiB for c in (CARDS_INT4_GIB if int4 else CARDS_GIB)] if kind == "cuda"
                 else [int(weights * f) for f in (0.3, 0.6, 1.5)])
    bw = pinned_h2d(kind, GiB if kind == "cuda" else 128 * MiB)
    cache = os.path.join(out_dir, "cache")
    w = in_process_of_its_own("bench_cards", "warm_cache", path=path, kind=kind, cache=cache, ids=[[0]])
    print(f"  cache entry made in {w['seconds']:.1f} s; pinned H2D {bw / 1e9:.1f} GB/s", flush=True)
    gguf_path = None
    if llama:
        t = time.perf_counter()
        gguf_path = os.path.join(os.path.dirname(path), "model-q4_0.gguf" if int4 else "model-f16.gguf")
        if not os.path.exists(gguf_path):
            llama_cpp.write_gguf(path, shape, gguf_path + ".part")
            os.replace(gguf_path + ".part", gguf_path)
        print(f"  llama.cpp: {llama}, GGUF ready in {time.perf_counter() - t:.1f} s", flush=True)
    levers: List[Dict] = []
    if ort_levers and kind == "cuda":
        from ..loading import CUDA_LEVERS
        ids = np.random.default_rng(7).integers(0, shape["vocab"], (1, prompts[0]))
        for name, options in {"none": {}, **CUDA_LEVERS}.items():
            try:
                r = in_process_of_its_own("bench_cards", "levers_row", path=path, ids=ids.tolist(), new=new,
                                          options=options, cache=cache)
            except RuntimeError as e:
                r = dict(error=str(e)[-300:], tokens=np.zeros((1, 0), np.int64))
            r.update(lever=name, options=options)
            levers.append(r)
        tokens = [r.pop("tokens") for r in levers]
        for r, t in zip(levers, tokens):  # the same tokens as without a lever
            r["tokens_equal"] = bool(t.size and np.array_equal(t, tokens[0]))
        print("  " + "; ".join(f"{r['lever']}: {r.get('ms_per_token', float('nan')):.2f} ms/token" for r in levers),
              flush=True)
    rows: List[Dict] = []
    for prompt in prompts:
        for batch in batches:
            ids = np.random.default_rng(prompt + batch).integers(0, shape["vocab"], (batch, prompt))
            a = in_process_of_its_own("bench_decode", "anchor", path=path, shape=shape, ids=ids.tolist(), new=new,
                                      kind=kind, warm_prompt=True)
            print(f"  anchor {batch} x {prompt}: {a['ms_per_token']:.2f} ms/token, prompt {a['prompt_ms']:.0f} ms",
                  flush=True)
            for card in cards:
                off = None
                for mode in ("off", "auto"):
                    if mode == "auto" and (not host_compute or kind != "cuda" or off is None or "error" in off
                                           or not off["step_htod"]):
                        break  # every weight resident, the host backend, or the row failed: nothing to compare
                    r = in_process_of_its_own("bench_cards", "row", path=path, card=card, ids=ids.tolist(), new=new,
                                              kind=kind, cache=cache, host_compute=mode)
                    _bounds(r, a, bw, off)
                    off = off or r
                    rows.append(r)
                    print("  " + _line(r), flush=True)
                if llama and batch == 1:  # after ours, on the same card: each of its rows gets llama.cpp's columns
                    lm = llama_rows(llama, gguf_path, shape, card, prompt, new)
                    for r in rows:
                        if r["card"] == card and r["batch"] == 1 and r["prompt"] == prompt:
                            r["llama"] = lm
                    print(f"  {fmt_bytes(card)} card, llama.cpp fit / best / ours vs best (ms/token, first token): "
                          + " / ".join(_llama_cells(dict(off, llama=lm))), flush=True)
    return dict(kind=kind, weights=weights, h2d_gbps=bw / 1e9, new=new, shape=shape, rows=rows, levers=levers,
                llama_bench=llama, int4=int4)


if __name__ == "__main__":
    from .bench_decode import _main
    _main(sys.argv[1], sys.argv[2], sys.modules[__name__])
