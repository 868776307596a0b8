"""``onnx-offload bench moe``: a gpt-oss-shaped mixture-of-experts decoder (a router and
one ``com.microsoft.MoE`` node per layer, top 4 of 32 experts, onnxruntime-genai's
layout) decoding at batch 1 under weight budgets of 10, 25 and 50% of its weights.

Rows, each in a process of its own (see ``bench_decode``):
- route-aware streaming (``experts="routed"``): only the experts the router picks page in;
- dense streaming of the same model (``experts="dense"``): every expert, every token;
- the experts read in place (``experts="in_place"``, the streaming engine): the stacks the
  budget cannot hold stay in host memory, where ORT's MoE kernel reads the picked experts
  over the link, but for the most picked experts, which hold device pages behind the same
  address as far as the budget goes;
- plain ORT with every weight resident: the anchor.

Columns: ms/token (the median of the decode steps after the first three); the bytes
streamed per token (the residency's page-ins over those steps) and, for the stacks read
in place, the bytes of the picked experts not on device pages (read over the link,
counted from the routers' values each step); the dense bound
``(1 - f) * W / H2D``; the routed bound ``max(anchor, (non-resident dense weights +
k/E x non-resident experts) / H2D)``, with the resident sets the session held at the end
(whole stacks, and the experts read in place that hold device pages);
the ratio to each; the experts' hit rate over the decode steps; whether the tokens are
the anchor's, and if not, the first token at which they part, beside plain ORT run again
(a model with near ties between its logits may part from itself). Past the first parting
the tokens say nothing more, so each row, and plain ORT again, also runs fed the anchor's
tokens: the steps whose pick is the anchor's, and the largest difference of a logit from
the anchor's (with the largest anchor margin, top logit over the next, at a step whose
pick differs: a pick that differs where the margin is within that difference is a near
tie, not a wrong expert). H2D is the pinned bandwidth measured in the same run. Every
process runs with ORT_FORCE_DETERMINISTIC_MOE=1 (see SAME_TACTICS).
"""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional

import numpy as np

from ..config import GiB, MiB
from ..stats import fmt_bytes, table
from .bench import pinned_h2d
from .bench_decode import WARMUP, in_process_of_its_own

FRACTIONS = (0.10, 0.25, 0.50)
STACKS = (".moe.fc1", ".moe.fc2")  # the experts' stacked weights, as models/moe.py names them
# ORT's CUDA MoE picks a GEMM tactic by timing in each session, so two sessions of one model
# may round otherwise; with this, every row's process takes the same one and the tokens
# compare.
SAME_TACTICS = {"ORT_FORCE_DETERMINISTIC_MOE": "1"}


WIDTHS = ("gpt-oss-20b", "narrow")


def _shape(kind: str, widths: str = "gpt-oss-20b") -> dict:
    """gpt-oss-20b's proportions (32 experts, top 4, expert width = hidden). On CUDA,
    "gpt-oss-20b": its layer widths (hidden and expert width 2880, heads of 64) in 4 layers,
    6.5 GB of fp16 weights, each expert 50 MB; "narrow": hidden 1024 in 12 layers, 2.3 GiB,
    each expert 6 MiB. The width matters on CUDA: ORT's MoE kernel reads the picked experts
    in host memory faster the larger they are. On the CPU, 79 MiB of fp32."""
    if widths not in WIDTHS:
        raise ValueError(f"widths must be one of {', '.join(WIDTHS)}, not {widths!r}")
    base = dict(heads=16, kv_heads=4, experts=32, top_k=4, vocab=8000, max_length=512, swiglu_alpha=1.702,
                swiglu_beta=1.0, swiglu_limit=7.0, biases=True, eps=1e-5, rope_theta=150000.0)
    if kind != "cuda":
        return dict(base, layers=4, hidden=256, heads=8, kv_heads=2, expert_intermediate=192, vocab=2000,
                    dtype="float32")
    if widths == "narrow":
        return dict(base, layers=12, hidden=1024, expert_intermediate=1024, dtype="float16")
    return dict(base, layers=4, hidden=2880, heads=45, kv_heads=9, expert_intermediate=2880, dtype="float16")


def build_model(kind: str, out_dir: str, widths: str = "gpt-oss-20b") -> tuple:
    """The benchmark's model in out_dir, made once; (its path, its shape)."""
    from ..models import genai_config, moe_lm, save_decoder
    shape = _shape(kind, widths)
    folder = os.path.join(out_dir, f"moe_model_{kind}" + (f"_{widths}" if kind == "cuda" else ""))
    marker, path = os.path.join(folder, "shape.json"), os.path.join(folder, "model.onnx")
    if not (os.path.exists(marker) and json.load(open(marker)) == shape and os.path.exists(path)):
        model = moe_lm(dtype=np.dtype(shape["dtype"]), **{k: v for k, v in shape.items() if k != "dtype"})
        cfg = genai_config(shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"], shape["vocab"],
                           shape["max_length"], eos_token_id=-1)  # no EOS: every token is decoded
        save_decoder(model, folder, config=cfg)
        with open(marker, "w") as f:
            json.dump(shape, f)
    return path, shape


def forced_logits(session, ids: np.ndarray, forced: np.ndarray) -> np.ndarray:
    """Each step's last-position logits (float32 [steps, batch, vocab]) of a greedy
    generation fed the tokens `forced` [batch, steps] rather than its own picks."""
    b, p = ids.shape
    n = forced.shape[1]
    gen = session._new_generation(session.decoder_spec, b, p, p + n - 1)
    try:
        # Copies: on the CPU a step's logits are a view of a buffer the next step writes.
        seen = [np.array(gen.prompt(ids), np.float32)]
        for step in range(n - 1):
            seen.append(np.array(gen.decode(forced[:, step], p + step + 1)[0], np.float32))
    except BaseException:
        gen.close()
        raise
    session._park(gen)  # kept for the next generation of this shape, as generate() keeps it
    return np.stack(seen)


def agreement(got: np.ndarray, want: np.ndarray) -> Dict:
    """Logits [steps, batch, vocab] of a run fed the anchor's tokens against the anchor's:
    the steps whose picks are the anchor's, the largest difference of a logit, and the
    largest anchor margin (top logit over the next) at a step whose pick differs."""
    same = (got.argmax(-1) == want.argmax(-1)).all(axis=1)
    top2 = np.sort(want, axis=-1)[..., -2:]
    margin = (top2[..., 1] - top2[..., 0]).max(axis=1)
    return dict(forced_agree=int(same.sum()), forced_steps=int(same.size),
                max_logit_diff=float(np.abs(got - want).max()),
                parted_margin=float(margin[~same].max()) if (~same).any() else None)


def streamed_row(path: str, ids: np.ndarray, new: int, kind: str, fraction: float, weights: int,
                 experts: str, forced: Optional[list] = None, anchor_logits: Optional[str] = None) -> Dict:
    """generate() at a weights allowance of `fraction` of the weights, the experts streamed
    as `experts` says; the counters over the decode steps after the warm-up. With `forced`
    (the anchor's tokens) and `anchor_logits` (its logits' .npy): the agreement of the
    logits of a generation fed those tokens."""
    from ..session import OffloadSession
    provider = "CUDAExecutionProvider" if kind == "cuda" else "CPUExecutionProvider"
    kw = dict(offload=True, vmm=True, weight_bytes=int(weights * fraction), experts=experts, cache_dir="off")
    if kind == "cuda":
        kw["engine"] = "segments" if experts == "routed" else "auto"
    else:
        kw["host_granularity"] = 64 << 10  # granules in proportion to the small CPU model
    with OffloadSession(path, providers=[provider], **kw) as s:
        s.generate(ids, 4)  # ORT's first runs of each shape
        stamps, tokens, c0 = [], [], None
        for step, tok in enumerate(s.generate_iter(ids, new)):
            stamps.append(time.perf_counter())
            tokens.append(tok)
            if step == WARMUP:
                c0 = s.stats().counters
        c1 = s.stats().counters
        d = c1.minus(c0)
        agreed = agreement(forced_logits(s, ids, np.asarray(forced)), np.load(anchor_logits)) if forced else {}
        # The experts' stacks by name (the generator's); resident: what the weights zone holds
        # at the end (the streaming engine's residency holds only its resident weights).
        res = s._engines.residency
        resident = {n for n, slot in res.slots.items() if slot.state != "evicted" and slot.charged_zone == "weights"}

        def is_expert(name):
            return res.stack_of.get(name, name).endswith(STACKS)
        expert_bytes = sum(w.nbytes for w in s._weights if w.name.endswith(STACKS))
        expert_resident = sum(res.slots[n].length for n in resident if is_expert(n))
        dense_resident = sum(res.slots[n].length for n in resident if not is_expert(n))
        in_host = getattr(getattr(s._engines.runner, "plan", None), "in_host", None) or []
        in_place = sum(w.nbytes for w in s._weights if w.name in in_host and w.name.endswith(STACKS))
        # Experts read in place that hold device pages at the end (memory.expert_pages).
        pages = getattr(s._engines.runner, "experts", None)
        expert_resident += sum(pages.expert_bytes(i) for i, _ in pages.resident) if pages is not None else 0
        return dict(experts=experts, fraction=fraction, segments=len(s.segments), engine=s.engine,
                    in_place_bytes=in_place,
                    ms_per_token=float(np.median(np.diff(stamps)[WARMUP:] * 1e3)),
                    bytes_per_token=d.htod_bytes / max(1, d.steps),
                    read_per_token=d.expert_read_bytes / max(1, d.steps),
                    expert_hit_rate=d.expert_hit_rate, expert_accesses=d.expert_accesses,
                    expert_bytes=expert_bytes, expert_resident=expert_resident,
                    dense_resident=dense_resident, tokens=np.stack(tokens, 1), **agreed)


def bench_moe(kind: str, out_dir: str, prompt: int = 16, new: int = 48, widths: str = "gpt-oss-20b") -> Dict:
    os.makedirs(out_dir, exist_ok=True)
    t = time.perf_counter()
    path, shape = build_model(kind, out_dir, widths)
    print(f"  model ready in {time.perf_counter() - t:.1f} s", flush=True)
    weights = os.path.getsize(path + ".data")
    bw = pinned_h2d(kind, GiB if kind == "cuda" else 128 * MiB)
    ids = np.random.default_rng(0).integers(0, shape["vocab"], (1, prompt))
    logits = os.path.join(out_dir, "moe_anchor_logits.npy")
    anchor = in_process_of_its_own("bench_decode", "anchor", path=path, shape=shape, ids=ids.tolist(), new=new,
                                   kind=kind, env=SAME_TACTICS, logits_out=logits)
    forced = anchor["tokens"].tolist()
    # Plain ORT once more, in a process of its own: how far its tokens hold from run to run,
    # the yardstick for the rows' (a model with near ties may not hold its own); then fed
    # the anchor's tokens, how far its logits hold.
    again = in_process_of_its_own("bench_decode", "anchor", path=path, shape=shape, ids=ids.tolist(), new=new,
                                  kind=kind, env=SAME_TACTICS)
    repeat = parted_at(again["tokens"], anchor["tokens"])
    again_logits = os.path.join(out_dir, "moe_again_logits.npy")
    in_process_of_its_own("bench_decode", "anchor", path=path, shape=shape, ids=ids.tolist(), new=new, kind=kind,
                          env=SAME_TACTICS, forced=forced, logits_out=again_logits)
    again_agreed = agreement(np.load(again_logits), np.load(logits))
    print(f"  anchor: {anchor['ms_per_token']:.2f} ms/token; pinned H2D {bw / 1e9:.1f} GB/s; plain ORT again: "
          f"{_parted(repeat)}; fed the anchor's tokens: {_agreed(again_agreed)}", flush=True)
    share = shape["top_k"] / shape["experts"]
    rows: List[Dict] = []
    for f in FRACTIONS:
        for experts in ("in_place", "dense", "routed"):
            r = in_process_of_its_own("bench_moe", "streamed_row", path=path, ids=ids.tolist(), new=new, kind=kind,
                                      fraction=f, weights=weights, experts=experts, env=SAME_TACTICS,
                                      forced=forced, anchor_logits=logits)
            dense_streamed = weights - r["expert_bytes"] - r["dense_resident"]
            routed_bytes = dense_streamed + share * (r["expert_bytes"] - r["expert_resident"])
            r["read_in_place_per_token"] = r["read_per_token"]  # the missed experts' bytes, counted a step
            r.update(dense_bound_ms=(1 - f) * weights / bw * 1e3,
                     routed_bound_ms=max(anchor["ms_per_token"], routed_bytes / bw * 1e3),
                     tokens_equal=bool(np.array_equal(r["tokens"], anchor["tokens"])),
                     parted_at=parted_at(r["tokens"], anchor["tokens"]))
            r["vs_dense_bound"] = r["ms_per_token"] / r["dense_bound_ms"]
            r["vs_routed_bound"] = r["ms_per_token"] / r["routed_bound_ms"]
            del r["tokens"]
            rows.append(r)
            print(f"  {experts} at {f:.0%} ({r['engine']}): {r['ms_per_token']:.2f} ms/token, "
                  f"{fmt_bytes(r['bytes_per_token'])} a token (+ {fmt_bytes(r['read_in_place_per_token'])} read in "
                  f"place), {r['vs_dense_bound']:.2f}x the dense bound, {r['vs_routed_bound']:.2f}x the routed bound "
                  f"({r['routed_bound_ms']:.2f} ms), tokens against the anchor's: {_parted(r['parted_at'])}; fed "
                  f"the anchor's tokens: {_agreed(r)}", flush=True)
    dense = {r["fraction"]: r["ms_per_token"] for r in rows if r["experts"] == "dense"}
    for r in rows:
        if r["experts"] != "dense":  # how much faster than the dense streaming of its budget
            r["vs_dense"] = dense[r["fraction"]] / r["ms_per_token"]
    return dict(kind=kind, shape=shape, weights=weights, h2d_gbps=bw / 1e9, anchor_ms=anchor["ms_per_token"],
                anchor_again_parted_at=repeat, anchor_again=again_agreed, rows=rows)


def parted_at(tokens, anchor) -> Optional[int]:
    """The first new token (from 0) at which rows of `tokens` part from the anchor's; None
    where they are equal."""
    a, b = np.asarray(tokens), np.asarray(anchor)
    if a.shape != b.shape:
        return 0
    differ = (a != b).any(axis=0)
    return int(np.argmax(differ)) if differ.any() else None


def _parted(at: Optional[int]) -> str:
    return "equal" if at is None else f"part at token {at + 1}"


def _agreed(r: Dict) -> str:
    """A row's agreement with the anchor fed its tokens: picks, and the logits' difference."""
    if "forced_agree" not in r:
        return "-"
    ties = f", margin <= {r['parted_margin']:.3g} where not" if r.get("parted_margin") is not None else ""
    return f"{r['forced_agree']}/{r['forced_steps']} picks, |dlogit| <= {r['max_logit_diff']:.3g}{ties}"


def print_moe(res: Dict) -> str:
    s = res["shape"]
    head = (f"bench moe ({res['kind']}): a gpt-oss-shaped decoder, {s['layers']} layers, hidden {s['hidden']}, "
            f"{s['experts']} experts of width {s['expert_intermediate']}, "
            f"top {s['top_k']}, {fmt_bytes(res['weights'])} of weights; batch 1; pinned H2D "
            f"{res['h2d_gbps']:.1f} GB/s (this run); ORT_FORCE_DETERMINISTIC_MOE=1; anchor (plain ORT, all resident) "
            f"{res['anchor_ms']:.2f} ms/token\n")
    rows = [("plain ORT, all resident", "-", f"{res['anchor_ms']:.2f}", "-", "-", "-", "-", "-", "-", "-", "-", "-",
             "-"),
            ("plain ORT again", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
             _parted(res.get("anchor_again_parted_at")), _agreed(res.get("anchor_again", {})))]
    for r in res["rows"]:
        rows.append((f"{r['experts']} ({r['engine']})", f"{r['fraction']:.0%}", f"{r['ms_per_token']:.2f}",
                     fmt_bytes(r["bytes_per_token"]), fmt_bytes(r.get("read_in_place_per_token", 0)),
                     f"{r['dense_bound_ms']:.2f}", f"{r['routed_bound_ms']:.2f}",
                     f"{r['vs_dense_bound']:.2f}x", f"{r['vs_routed_bound']:.2f}x",
                     f"{r['expert_hit_rate']:.1%}" if r.get("expert_accesses", r["experts"] == "routed") else "-",
                     f"{r['vs_dense']:.2f}x" if "vs_dense" in r else "-",
                     _parted(r.get("parted_at")) if "parted_at" in r else ("yes" if r["tokens_equal"] else "NO"),
                     _agreed(r)))
    return head + table(rows, ("row", "budget", "ms/token", "streamed/token", "read in place/token", "dense bound",
                               "routed bound", "vs dense bound", "vs routed bound", "expert hits", "vs dense",
                               "tokens = anchor", "fed the anchor's tokens"))


if __name__ == "__main__":
    import sys
    from .bench_decode import _main
    _main(sys.argv[1], sys.argv[2], sys.modules[__name__])
