"""bench cards' table: each row's figures against its bounds and beside llama.cpp's."""
from __future__ import annotations

from typing import Dict

from ..config import fmt_bytes
from ..stats import table


def _line(r: Dict) -> str:
    head = f"{fmt_bytes(r['card'])} card, {r['batch']} x {r['prompt']}, host compute {_host_cell(r)}"
    if "error" in r:
        return f"{head}: {r['error']}"
    # Every column the table has, so that a run cut short still says them.
    return (f"{head}: {r['ms_per_token']:.2f} ms/token ({r['ms_per_token'] / r['bound_ms']:.2f}x), first token "
            f"{r['ttft_ms']:.0f} ms ({r['ttft_ms'] / r['prefill_bound_ms']:.2f}x), {r['engine']}, resident "
            f"{fmt_bytes(r['resident'])}, peak {fmt_bytes(r['peak']) if 'peak' in r else '-'} (budget "
            f"{fmt_bytes(r['budget'])}, margin {fmt_bytes(r['margin'])}, ledger peak {fmt_bytes(r['ledger_peak'])}, "
            f"ORT's measured {fmt_bytes(r['ort_bytes'])}), could reside "
            f"{fmt_bytes(r['could_reside']) if 'could_reside' in r else '-'}, tokens "
            f"{'equal' if r['tokens_equal'] else 'DIFFER'}, graphs made in the measured run "
            f"{r.get('captures_second', '-')}, its steps replayed {r.get('graph_steps', '-')}"
            + (", llama.cpp fit / best / ours vs best (ms/token, first token): " + " / ".join(_llama_cells(r))
               if r.get("llama") else ""))


def _host_cell(r: Dict) -> str:
    """Host compute in a row: off, or the bytes a step the host computed at its rate."""
    h = r.get("host") or {}
    if not h.get("on"):
        return "off" if r.get("host_compute", "off") == "off" else f"off ({(h.get('why') or '')[:60]})"
    rates = ", ".join(f"{k} {v.get(1, v.get('1', 0)) / 1e9:.0f}" for k, v in h["host_rates"].items())
    return (f"{fmt_bytes(h['host_bytes_per_step'])} at {rates} GB/s + link {h['link_rate'] / 1e9:.0f} GB/s "
            f"({len(h['matmuls'])} MatMuls)")


def _llama_cells(r: Dict) -> tuple:
    """llama.cpp's columns of a row: its fit's and its best -ngl's ms/token and prompt time,
    and our ms/token and first token against its best."""
    lm = r.get("llama")
    if not lm:
        return ("-",) * 4

    def cell(x, ngl=""):
        if "error" in x:
            return "failed"
        return f"{x['ms_per_token']:.2f} / {x['prompt_ms']:.0f}{ngl}"
    best = lm.get("best", {})
    best_cell = cell(best, f" (-ngl {best.get('ngl')}{_on_device(best.get('buffers'))})") if best else "-"
    if "error" in r or "error" in best:
        return cell(lm["fit"]), best_cell, "-", "-"
    return (cell(lm["fit"]), best_cell, f"{r['ms_per_token'] / best['ms_per_token']:.2f}x",
            f"{r['ttft_ms'] / best['prompt_ms']:.2f}x")


def _on_device(buffers) -> str:
    """llama.cpp's weights on the device and in host memory, from its model buffers."""
    if not buffers:
        return ""
    dev = sum(v for k, v in buffers.items() if not k.startswith("CPU"))
    return f", weights {fmt_bytes(dev)} on the device, {fmt_bytes(sum(buffers.values()) - dev)} on the host"


def print_cards(res: Dict) -> str:
    llama = bool(res.get("llama_bench"))
    rows = []
    for r in res["rows"]:
        extra = _llama_cells(r) if llama else ()
        if "error" in r:
            rows.append((fmt_bytes(r["card"]), r["prompt"], r["batch"], _host_cell(r), "FAILED", "-", "-", "-", "-", "-", "-",
                         fmt_bytes(r["peak"]) if r.get("peak") else "-", "-", "-", r["error"][:80]) + extra)
            continue
        used = (f"{fmt_bytes(r['peak'])} of {fmt_bytes(r['card_free'])}" if r.get("peak") is not None else "-")
        rows.append((fmt_bytes(r["card"]), r["prompt"], r["batch"], _host_cell(r), f"{r['ms_per_token']:.2f}",
                     f"{r['ttft_ms']:.0f}", fmt_bytes(r["resident"]), f"{r['bound_ms']:.2f}",
                     f"{r['ms_per_token'] / r['bound_ms']:.2f}x", f"{r['prefill_bound_ms']:.0f}",
                     f"{r['ttft_ms'] / r['prefill_bound_ms']:.2f}x", used,
                     fmt_bytes(r["could_reside"]) if "could_reside" in r else "-",
                     "yes" if r["tokens_equal"] else "NO", r["engine"]) + extra)
    head = (f"bench cards ({res['kind']}): {'int4 (llama.cpp: Q4_0) ' if res.get('int4') else ''}weights "
            f"{fmt_bytes(res['weights'])}, pinned H2D {res['h2d_gbps']:.1f} "
            f"GB/s, {res['new']} new tokens, the second generate() of each session; with host compute on, the bound "
            f"is max(resident step, non-resident bytes / (H2D + the host rate the session measured))")
    heads = ("card", "prompt", "batch", "host compute", "ms/token", "first token ms", "resident", "bound ms", "vs bound",
             "prefill bound ms", "vs bound", "device used of card", "could reside", "tokens = ORT", "engine")
    if llama:
        heads += ("llama.cpp fit ms/token / prompt ms", "llama.cpp best", "ms/token vs best", "first token vs best")
    text = head + "\n" + table(rows, heads)
    if res.get("levers"):
        text += "\n\nORT's levers, the all-resident step (whole device, batch 1):\n" + table(
            [(x["lever"], f"{x['ms_per_token']:.2f}" if "ms_per_token" in x else x.get("error", "")[:60],
              f"{x['ms_per_token'] / res['levers'][0]['ms_per_token']:.3f}x"
              if "ms_per_token" in x and "ms_per_token" in res["levers"][0] else "-",
              "yes" if x.get("tokens_equal") else "NO", " ".join(f"{k}={v}" for k, v in x["options"].items()))
             for x in res["levers"]], ("lever", "ms/token", "vs none", "tokens = none", "options"))
    return text
