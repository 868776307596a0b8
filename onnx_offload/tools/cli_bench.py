"""The commands about the package itself rather than a user's model: `demo` (a small model
under a budget below its weights, against plain ORT), `bench` (the benchmarks and the
reliability bench) and `cache` (the optimized models kept between runs).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from ..config import ENV_CACHE_DIR
from .cli_args import device_kind, positive_int, provider
from .cli_report import bound_lines, budget_lines, link_bandwidth


def _median_ms(fn, runs: int = 5) -> float:
    fn()  # the first run of a session sets it up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cmd_demo(args) -> int:
    import onnxruntime as ort

    from ..models import mlp_stack, save, weight_bytes
    from ..session import OffloadSession
    kind = device_kind(args)
    # On a GPU, ORT's sessions take device memory of their own when they are made (66 MiB
    # on an H100 with ORT 1.31.1), which a quarter of a small model cannot hold: there the
    # MLP is 1 GiB, so that a quarter of it holds ORT's memory beside the weights.
    hidden = 4096 if kind == "cuda" else 1024
    model = mlp_stack(layers=16, hidden=hidden, batch=4)
    weights = weight_bytes(model)
    budget = weights // 4
    where = "the GPU (CUDA VMM)" if kind == "cuda" else "the CPU (the host backend plays the GPU)"
    with tempfile.TemporaryDirectory() as tmp:
        path = save(model, os.path.join(tmp, "demo.onnx"))
        x = np.random.default_rng(0).standard_normal((4, hidden)).astype(np.float32)
        print(f"demo: a 16-layer MLP with {weights / 2**20:.0f} MiB of weights, run within a {budget / 2**20:.0f} "
              f"MiB budget on {where}")
        plain = ort.InferenceSession(path, providers=[provider(kind)])
        want = plain.run(None, {"x": x})[0]
        plain_ms = _median_ms(lambda: plain.run(None, {"x": x}))
        plain = None  # its memory goes back before the OffloadSession takes any
        # The demo's model is made anew each run: a cache entry of it would never be used.
        with OffloadSession(path, providers=[provider(kind)], offload=True, vmm=True, vram_limit=budget,
                            cache_dir="off") as s:
            got = s.run(None, {"x": x})[0]
            ms = _median_ms(lambda: s.run(None, {"x": x}))
            st = s.stats()
            streamed = st.last_step.htod_bytes
            if args.stats:
                print(st)
    bandwidth = link_bandwidth(kind)
    err = float(np.max(np.abs(got - want)))
    ok = err <= 1e-3 and st.peak_committed <= budget
    print(f"  plain ORT, every weight in memory: {plain_ms:8.2f} ms per step")
    print(f"  onnx-offload, weights streamed:    {ms:8.2f} ms per step ({st.segments} segments; "
          f"{streamed / 2**20:.0f} MiB of weights copied in per step)")
    print(f"  memory committed at its peak:      {st.peak_committed / 2**20:8.2f} MiB of the "
          f"{budget / 2**20:.0f} MiB budget")
    print(f"  outputs against plain ORT:           max difference {err:.3g}")
    if not ok:
        print("demo FAILED: " + ("the outputs differ from plain ORT's" if err > 1e-3 else "the budget was exceeded"),
              file=sys.stderr)
        return 1
    print("demo passed: the model ran within a budget of a quarter of its weights and gave plain ORT's outputs"
          + ("" if args.stats else " (--stats prints the session's counters)"))
    for line in budget_lines(kind, st) + bound_lines(kind, st, ms, bandwidth, resident_ms=plain_ms):
        print("  " + line)
    return 0


def cmd_bench(args) -> int:
    if args.what == "reliability":
        from . import reliability
        res = reliability.run_all()
        print(reliability.print_table(res))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return 0
    if args.what == "host":
        from .bench_host import bench_host, print_host
        from .llama_cpp import find_llama_bench
        llama = find_llama_bench(args.llama_bench)  # checked before the kernels run
        res = bench_host(weights_mib=args.weights_mib, isa=args.isa, dispatch_calls=args.dispatch_calls)
        print(print_host(res))
        if llama:  # the peer on the same cores
            from .bench_host_llama import bench_llama_host, print_llama_host
            out = os.path.abspath(args.out)
            os.makedirs(out, exist_ok=True)
            res["llama"] = bench_llama_host(llama, out, sorted({r["threads"] for r in res["rows"]}))
            print("\n" + print_llama_host(res["llama"], res["rows"]))
        if device_kind(args) == "cuda":  # the rates host compute's split rests on: the GEMV while H2D runs
            from .bench_host_link import bench_link, print_link
            res["link"] = bench_link()
            print("\n" + print_link(res["link"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return 0
    from . import bench
    kind = device_kind(args)
    out = os.path.abspath(args.out)  # the benchmarks' child processes start in another folder
    os.makedirs(out, exist_ok=True)
    if args.what == "arena":
        res = bench.bench_arena(kind)
        text = bench.print_arena(res)
    elif args.what == "decode":
        from .bench_decode import bench_decode, print_decode
        res = bench_decode(kind, out)
        text = print_decode(res)
    elif args.what == "compare" and args.devices:
        from .bench_devices import bench_devices, print_devices
        res = bench_devices(kind, out, args.devices)
        text = print_devices(res)
    elif args.what == "compare":
        from .bench_compare import bench_compare, print_compare
        res = bench_compare(kind, out, int4=args.int4)
        text = print_compare(res)
    elif args.what == "cards":
        from .bench_cards import BATCHES, PROMPTS, bench_cards, print_cards
        from ..config import parse_bytes

        def listed(text, parse, default):
            return default if not text else [parse(t.strip()) for t in text.split(",") if t.strip()]
        res = bench_cards(kind, out, cards=listed(args.cards, lambda t: parse_bytes(t, "--cards"), None),
                          prompts=listed(args.prompts, positive_int, PROMPTS),
                          batches=listed(args.batches, positive_int, BATCHES), llama_bench=args.llama_bench,
                          ort_levers=args.ort_levers, int4=args.int4)
        text = print_cards(res)
    elif args.what == "int4":
        from .bench_int4 import bench_int4, print_int4
        res = bench_int4(kind, out)
        text = print_int4(res)
    elif args.what == "moe":
        from .bench_moe import bench_moe, print_moe
        res = bench_moe(kind, out, widths=args.widths)
        text = print_moe(res)
    elif args.what == "session":
        res = bench.bench_session(kind, out)
        text = bench.print_session(res)
    else:
        res = bench.bench_offload(kind, out, weight_gb=args.weight_gb if kind == "cuda" else min(args.weight_gb, 0.05))
        text = bench.print_offload(res)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


def cmd_cache(args) -> int:
    from ..config import OffloadConfig, env_is_set, parse_cache_dir
    from ..loading import cache_entries, cache_tagged, clear_cache
    from ..stats import fmt_bytes, table
    # Only the cache's own flag and variable: the others configure sessions, not the cache.
    # An empty variable is unset, as a session reads it.
    folder = args.cache_dir if args.cache_dir is not None else (os.environ[ENV_CACHE_DIR] if env_is_set(ENV_CACHE_DIR)
                                                                else None)
    cache = OffloadConfig() if folder is None else OffloadConfig(cache_dir=parse_cache_dir(folder, ENV_CACHE_DIR
                                                                                           if args.cache_dir is None
                                                                                           else "--cache-dir"))
    cache = cache.cache_path
    if cache is None:
        print(f"the cache is off ({ENV_CACHE_DIR} or --cache-dir): there is nothing to show or clear")
        return 0
    if args.action == "clear":
        cleared = clear_cache(cache)
        kept = f"; kept {cleared.busy} that sessions are reading now" if cleared.busy else ""
        also = f", {cleared.partials} partial folders of passes that are over" if cleared.partials else ""
        left = (f"; left alone {cleared.kept} files and folders that onnx-offload did not make" if cleared.kept
                else "")
        print(f"removed {cleared.removed} optimized models ({fmt_bytes(cleared.freed)}){also} from {cache}{kept}"
              f"{left}")
        return 0
    entries = cache_entries(cache)
    print(f"{cache}: {len(entries)} optimized models, {fmt_bytes(sum(e.nbytes for e in entries))} "
          f"(weights that optimization left unchanged are read from the models' own files, not kept here)")
    if entries and not cache_tagged(cache):
        print("the folder is not marked as onnx-offload's cache (it has no CACHEDIR.TAG): `cache clear` refuses it "
              "while it holds anything onnx-offload did not make")
    if entries:
        rows = [(e.model or "(not recorded)", fmt_bytes(e.nbytes),
                 time.strftime("%Y-%m-%d %H:%M", time.localtime(e.made)), os.path.basename(e.path)[:12])
                for e in entries]
        print(table(rows, ("made from", "size", "made", "entry")))
    return 0
