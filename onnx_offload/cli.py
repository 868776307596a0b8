"""The onnx-offload command line.

    onnx-offload run MODEL --vram-limit 2GiB [--policy planned] [--profile] [--steps N] [--inputs f.npz]
    onnx-offload generate MODEL --prompt-ids 1,2,3 | --prompt TEXT [--max-new-tokens N] [--vram-limit ...]
    onnx-offload demo [--cpu]
    onnx-offload bench arena|session|offload|decode|reliability [--out DIR] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

import numpy as np

from .config import (ENV_CACHE_DIR, ENV_CUDA_GRAPH, ENV_DEVICE_BYTES, ENV_OFFLOAD, ENV_POLICY, ENV_VMM, ENV_VRAM_LIMIT,
                     env_is_set)
from .device import cuda_available
from .errors import OffloadError
from .policies import NAMES as POLICIES


def _kind(args) -> str:
    if getattr(args, "cpu", False):
        return "host"
    ok, _ = cuda_available()
    if ok:
        import onnxruntime as ort
        if "CUDAExecutionProvider" in ort.get_available_providers():
            return "cuda"
    return "host"


def _provider(kind: str) -> str:
    return "CUDAExecutionProvider" if kind == "cuda" else "CPUExecutionProvider"


def make_feeds(inputs, seed: int = 0):
    """Random feeds from the model's input shapes; dynamic dimensions become 1."""
    from .ortvalues import numpy_dtype
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in inputs:
        try:
            dtype = numpy_dtype(i.type)
        except OffloadError:
            raise OffloadError(f"cannot generate a feed for input {i.name!r} of type {i.type}: pass --inputs") from None
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
        if np.issubdtype(dtype, np.floating):
            feeds[i.name] = (rng.standard_normal(shape) * 0.1).astype(dtype)
        else:
            feeds[i.name] = rng.integers(0, 2, shape).astype(dtype)
    return feeds


# (flag attribute, OffloadConfig field, the variable the flag overrides, the command's
# default where neither the flag nor the variable is given)
_CONFIG_FLAGS = (
    ("vram_limit", "vram_limit", ENV_VRAM_LIMIT, None),
    ("weight_bytes", "weight_bytes", ENV_DEVICE_BYTES, None),
    ("policy", "policy", ENV_POLICY, None),
    ("offload", "offload", ENV_OFFLOAD, True),
    ("vmm", "vmm", ENV_VMM, True),
    ("cuda_graph", "cuda_graph", ENV_CUDA_GRAPH, None),
    ("cache_dir", "cache_dir", ENV_CACHE_DIR, None),
    ("kv_bytes", "kv_bytes", None, None),
    ("scratch_bytes", "scratch_bytes", None, None),
    ("prefill_chunk", "prefill_chunk", None, None),
)

# The configuration's keywords as this command's flags, for the advice an error gives.
_FLAG_OF = {"vram_limit": "--vram-limit", "weight_bytes": "--weight-bytes", "kv_bytes": "--kv-bytes",
            "scratch_bytes": "--scratch-bytes", "prefill_chunk": "--prefill-chunk"}
_KEYWORD = re.compile(r"\b(" + "|".join(_FLAG_OF) + r")=(\w+)")


def as_flags(message: str) -> str:
    """An error's advice in this command's terms: `kv_bytes=N` becomes `--kv-bytes N`,
    `offload=True` becomes `--offload`."""
    message = _KEYWORD.sub(lambda m: f"{_FLAG_OF[m.group(1)]} {m.group(2)}", message)
    return message.replace("offload=True", "--offload")


def config_kwargs(args) -> dict:
    """The configuration the user asked for: the flags given win, then the environment,
    then the command's own defaults (offload with stable addresses)."""
    kw = {}
    for attr, field, env, default in _CONFIG_FLAGS:
        value = getattr(args, attr, None)
        if value is not None:
            kw[field] = value
        elif default is not None and not env_is_set(env):
            kw[field] = default
    return kw


def check_config_flags(args) -> None:
    """The budget flags, parsed before any weight loads (their errors name the flag)."""
    from .config import parse_bytes, parse_vram_limit
    if args.vram_limit is not None:
        parse_vram_limit(args.vram_limit, "--vram-limit")
    if args.weight_bytes is not None:
        parse_bytes(args.weight_bytes, "--weight-bytes")
    for flag in ("kv_bytes", "scratch_bytes"):
        if getattr(args, flag, None) is not None:
            setattr(args, flag, parse_bytes(getattr(args, flag), "--" + flag.replace("_", "-")))


def positive_int(text: str, least: int = 1) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {text!r}")
    return n


def count(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    return positive_int(text, least=0)


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return x


def load_feeds(path: str) -> dict:
    """The arrays of an .npz file of feeds, read before the session loads any weight."""
    import zipfile
    if not os.path.exists(path):
        raise FileNotFoundError(f"--inputs {path!r}: no such file")
    if os.path.isdir(path):
        raise IsADirectoryError(f"--inputs {path!r} is a folder, not an .npz file of feeds")
    bad = f"--inputs {path!r} is not an .npz file of feeds (np.savez)"
    with open(path, "rb") as f:  # np.load leaves a path it opened unclosed where the zip is bad
        magic = f.read(6)
        f.seek(0)
        if magic.startswith(b"\x93NUMPY"):
            raise ValueError(f"{bad}: it is an .npy file of one array; save the feeds by name with "
                             f"np.savez(path, name=array)")
        if not magic.startswith(b"PK"):
            raise ValueError(f"{bad}: it is not a zip archive" + ("" if magic else " (the file is empty)"))
        try:
            data = np.load(f, allow_pickle=False)
            with data:
                return {k: data[k] for k in data.files}
        except (EOFError, zipfile.BadZipFile) as e:
            raise ValueError(f"{bad}: {e or type(e).__name__}") from None
        except ValueError as e:
            raise ValueError(f"{bad}: {e}") from None


def check_feeds(feeds: dict, inputs, source: str = "--inputs") -> None:
    """Refuses feeds that do not match the model's inputs by name, dtype or static shape;
    nothing is converted."""
    from .ortvalues import numpy_dtype
    wanted = {i.name: i for i in inputs}
    missing = [n for n in wanted if n not in feeds]
    unknown = [n for n in feeds if n not in wanted]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing feeds for the model inputs {missing}")
        if unknown:
            parts.append(f"unknown names {unknown}")
        raise ValueError(f"{source}: {'; '.join(parts)}; the model's inputs are {list(wanted)}")
    for name, i in wanted.items():
        value = np.asarray(feeds[name])
        try:
            expected = numpy_dtype(i.type)
        except OffloadError:
            expected = None
        if expected is not None and value.dtype != expected:
            raise ValueError(f"{source}: input {name!r} is {value.dtype}, the model expects {expected} ({i.type}); "
                             f"convert it before saving (nothing is converted silently)")
        shape = list(i.shape) if i.shape is not None else None
        if shape is not None and (len(shape) != value.ndim or any(
                isinstance(d, int) and d > 0 and d != v for d, v in zip(shape, value.shape))):
            want = "(" + ", ".join(str(d) if isinstance(d, int) and d > 0 else str(d or "?") for d in shape) + ")"
            raise ValueError(f"{source}: input {name!r} has shape {tuple(value.shape)}, the model expects {want}")


def cmd_run(args) -> int:
    from .session import OffloadSession
    check_config_flags(args)  # everything the arguments allow is checked before any weight loads
    feeds = load_feeds(args.inputs) if args.inputs else None
    kind = _kind(args)
    kw = config_kwargs(args)
    kw["record_timeline"] = bool(args.timeline)
    with OffloadSession(args.model, providers=[_provider(kind)], **kw) as s:
        if feeds is not None:
            check_feeds(feeds, s.get_inputs())
        else:
            feeds = make_feeds(s.get_inputs())
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            s.run(None, feeds)
            times.append((time.perf_counter() - t0) * 1e3)
        print(s.stats())
        if args.profile:
            print(f"\nstep time: median {statistics.median(times):.2f} ms, first {times[0]:.2f} ms, "
                  f"min {min(times):.2f} ms over {len(times)} steps")
            print("segments: " + ", ".join(f"{i}:{len(seg.weights)}w" for i, seg in enumerate(s.segments)))
        if args.timeline:
            print(f"residency timeline: {s.timeline_png(args.timeline)}")
    return 0


def parse_prompt_ids(text: str) -> np.ndarray:
    """'1,2,3' -> [[1, 2, 3]]; rows separated by ';' make a batch of equal lengths."""
    try:
        rows = [[int(t) for t in row.split(",")] for row in text.split(";")]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected integers separated by commas (rows by ';')") from None
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"--prompt-ids {text!r}: every row needs the same number of token ids")
    if any(not 0 <= t < 2 ** 63 for r in rows for t in r):
        raise ValueError(f"--prompt-ids {text!r}: token ids are non-negative 64-bit integers")
    return np.array(rows, np.int64)


def load_tokenizer(model: str):
    """The tokenizer.json beside the model, through the `tokenizers` package."""
    path = os.path.join(os.path.dirname(os.path.abspath(model)), "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--prompt needs a tokenizer.json beside the model ({path}); pass --prompt-ids instead")
    try:
        import tokenizers
    except ImportError:
        raise ValueError("--prompt needs the 'tokenizers' package (pip install tokenizers); "
                         "pass --prompt-ids instead") from None
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
        raise ValueError(f"{path} cannot be read by tokenizers: {e}") from None


def cmd_generate(args) -> int:
    from .session import OffloadSession
    check_config_flags(args)
    if not os.path.exists(args.model):
        raise FileNotFoundError(f"{args.model!r}: no such model file")
    from .generation import Sampling
    Sampling(args.do_sample, args.temperature, args.top_k, args.top_p)  # checked before any weight loads
    tok = None
    if args.prompt is not None:
        tok = load_tokenizer(args.model)
        ids = np.array([tok.encode(args.prompt).ids], np.int64)
        if ids.shape[1] == 0:
            raise ValueError("--prompt encodes to no tokens")
    else:
        ids = parse_prompt_ids(args.prompt_ids)
    kind = _kind(args)
    with OffloadSession(args.model, providers=[_provider(kind)],
                        **config_kwargs(args)) as s:
        spec = s.decoder_spec  # an unsupported model fails here, before any step
        t0 = time.perf_counter()
        new, first = [], None
        shown = ""
        for step in s.generate_iter(ids, args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, seed=args.seed):
            if first is None:
                first = time.perf_counter() - t0
            new.append(step)
            if tok is not None:
                text = tok.decode([int(t[0]) for t in new])
                print(text[len(shown):], end="", flush=True)
                shown = text
        elapsed = time.perf_counter() - t0
        if tok is not None:
            print()
        tokens = np.stack(new, axis=1) if new else np.zeros((len(ids), 0), np.int64)
        for row in tokens:
            print("tokens: " + ",".join(str(int(t)) for t in row))
        decode = elapsed - (first or 0)
        n = tokens.shape[1]
        rate = (n - 1) / decode if n > 1 and decode > 0 else float("nan")
        print(f"{n} new tokens x batch {len(ids)} in {elapsed:.3f} s: prompt {1e3 * (first or 0):.1f} ms, "
              f"{rate:.1f} tokens/s after it ({spec.layout} layout, {len(s.segments)} segment(s), "
              f"graphs {'on' if s.graph_capture.enabled else 'off'})")
    return 0


def cmd_demo(args) -> int:
    import onnxruntime as ort

    from .models import mlp_stack, save, weight_bytes
    from .session import OffloadSession
    kind = _kind(args)
    model = mlp_stack(layers=16, hidden=1024, batch=4)
    weights = weight_bytes(model)
    budget = weights // 4
    with tempfile.TemporaryDirectory() as tmp:
        path = save(model, os.path.join(tmp, "demo.onnx"))
        x = np.random.default_rng(0).standard_normal((4, 1024)).astype(np.float32)
        print(f"demo: a 16-layer MLP with {weights / 2**20:.0f} MiB of weights under a {budget / 2**20:.0f} MiB "
              f"budget, on {'the GPU (CUDA VMM)' if kind == 'cuda' else 'the CPU (host backend)'}")
        want = ort.InferenceSession(path, providers=[_provider(kind)]).run(None, {"x": x})[0]
        # The demo's model is made anew each run: a cache entry of it would never be used.
        with OffloadSession(path, providers=[_provider(kind)], offload=True, vmm=True, vram_limit=budget,
                            cache_dir="off") as s:
            for _ in range(3):
                got = s.run(None, {"x": x})[0]
            st = s.stats()
            print(st)
        err = float(np.max(np.abs(got - want)))
        print(f"\nmax |offloaded - plain ORT| = {err:.3g}; peak committed {st.peak_committed / 2**20:.2f} MiB "
              f"of a {budget / 2**20:.2f} MiB budget")
        if err > 1e-3 or st.peak_committed > budget:
            print("demo FAILED", file=sys.stderr)
            return 1
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
    from . import bench
    kind = _kind(args)
    out = args.out
    os.makedirs(out, exist_ok=True)
    if args.what == "arena":
        res = bench.bench_arena(kind)
        text = bench.print_arena(res)
    elif args.what == "decode":
        from .bench_decode import bench_decode, print_decode
        res = bench_decode(kind, out)
        text = print_decode(res)
    elif args.what == "compare":
        from .bench_compare import bench_compare, print_compare
        res = bench_compare(kind, out)
        text = print_compare(res)
    elif args.what == "cards":
        from .bench_cards import BATCHES, PROMPTS, bench_cards, print_cards
        from .config import parse_bytes

        def listed(text, parse, default):
            return default if not text else [parse(t.strip()) for t in text.split(",") if t.strip()]
        res = bench_cards(kind, out, cards=listed(args.cards, lambda t: parse_bytes(t, "--cards"), None),
                          prompts=listed(args.prompts, positive_int, PROMPTS),
                          batches=listed(args.batches, positive_int, BATCHES))
        text = print_cards(res)
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
    from .config import OffloadConfig, parse_cache_dir
    from .model_cache import cache_entries, clear_cache
    from .stats import fmt_bytes, table
    # Only the cache's own flag and variable: the others configure sessions, not the cache.
    folder = args.cache_dir if args.cache_dir is not None else os.environ.get(ENV_CACHE_DIR)
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
        also = "".join(f", {n} {what}" for n, what in ((cleared.links, "symbolic links"),
                                                        (cleared.partials, "partial folders of passes that are over"))
                       if n)
        print(f"removed {cleared.removed} optimized models ({fmt_bytes(cleared.freed)}){also} from {cache}{kept}")
        return 0
    entries = cache_entries(cache)
    print(f"{cache}: {len(entries)} optimized models, {fmt_bytes(sum(e.nbytes for e in entries))} "
          f"(weights that optimization left unchanged are read from the models' own files, not kept here)")
    if entries:
        rows = [(os.path.basename(e.path), fmt_bytes(e.nbytes), time.strftime("%Y-%m-%d %H:%M", time.localtime(e.made)))
                for e in entries]
        print(table(rows, ("entry", "size", "made")))
    return 0


def _config_flags(p) -> None:
    p.add_argument("--vram-limit", help=f"6GiB, 6000000000, 0.9 or auto (overrides {ENV_VRAM_LIMIT})")
    p.add_argument("--weight-bytes", help=f"allowance of the weights zone (overrides {ENV_DEVICE_BYTES})")
    p.add_argument("--policy", choices=POLICIES, help=f"residency policy (overrides {ENV_POLICY}; default planned)")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction,
                   help=f"stream weights that exceed their allowance (overrides {ENV_OFFLOAD}; default on)")
    p.add_argument("--vmm", action=argparse.BooleanOptionalAction,
                   help=f"stable VMM addresses; --no-vmm is the plain baseline, cudaMalloc per page-in "
                        f"(overrides {ENV_VMM}; default on)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction,
                   help=f"capture CUDA graphs (overrides {ENV_CUDA_GRAPH}; default: when the graph is safe)")
    p.add_argument("--cache-dir", help=f"where optimized models are kept between runs: a folder, auto (the user "
                                         f"cache directory, the default) or off (overrides {ENV_CACHE_DIR})")
    p.add_argument("--kv-bytes", help="bytes set aside for the KV cache from the start (default: planned for each "
                                      "generation)")
    p.add_argument("--scratch-bytes", help="bytes set aside for a step's memory, ORT's included (default: planned "
                                           "from the model's widths and the prompt chunk)")
    p.add_argument("--prefill-chunk", type=positive_int, help="the most prompt tokens one step feeds (default 512)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU host backend even with a GPU")


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument on one line of stderr, with exit code 2 (subcommands too)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def main(argv=None) -> int:
    import onnxruntime
    from . import __version__
    p = _Parser(prog="onnx-offload", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version",
                   version=f"onnx-offload {__version__} (onnxruntime {onnxruntime.__version__})")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a model under a VRAM budget and print the offload counters")
    r.add_argument("model")
    _config_flags(r)
    r.add_argument("--steps", type=positive_int, default=3, help="steps to run, at least 1 (default 3)")
    r.add_argument("--inputs", help=".npz file of feeds; default: random feeds from the input shapes")
    r.add_argument("--profile", action="store_true", help="print step times and the segment plan")
    r.add_argument("--timeline", help="write the residency timeline to this PNG")
    r.set_defaults(fn=cmd_run)
    g = sub.add_parser("generate", help="generate tokens with a decoder LLM (KV cache on the device)")
    g.add_argument("model")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help="token ids, comma-separated (rows of a batch separated by ';')")
    src.add_argument("--prompt", help="text, encoded by the tokenizer.json beside the model ('tokenizers' package)")
    g.add_argument("--max-new-tokens", type=positive_int, default=32)
    g.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=positive_float, default=1.0)
    g.add_argument("--top-k", type=count, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=count)
    _config_flags(g)
    g.set_defaults(fn=cmd_generate)
    d = sub.add_parser("demo", help="a small model under a budget below its weights (GPU if present, else CPU)")
    d.add_argument("--cpu", action="store_true")
    d.set_defaults(fn=cmd_demo)
    c = sub.add_parser("cache", help="the optimized models kept between runs: show them, or remove them all")
    c.add_argument("action", nargs="?", choices=("info", "clear"), default="info")
    c.add_argument("--cache-dir",
                   help=f"the cache folder (overrides {ENV_CACHE_DIR}; default: the user cache directory)")
    c.set_defaults(fn=cmd_cache)
    b = sub.add_parser("bench", help="benchmarks: arena page-in costs, session overhead, offloaded step time")
    b.add_argument("what", choices=("arena", "session", "offload", "decode", "compare", "cards", "reliability"))
    b.add_argument("--cards", help="bench cards: card sizes, comma-separated (default 8GiB,12GiB,16GiB,24GiB)")
    b.add_argument("--prompts", help="bench cards: prompt lengths, comma-separated (default 512,4096)")
    b.add_argument("--batches", help="bench cards: batch sizes, comma-separated (default 1,4)")
    b.add_argument("--out", default="onnx-offload-bench")
    b.add_argument("--json")
    b.add_argument("--weight-gb", type=positive_float, default=8.0)
    b.add_argument("--cpu", action="store_true")
    b.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (OffloadError, MemoryError, ValueError, TypeError, OSError, ArithmeticError, RuntimeError,
            ImportError) + _ort_errors() as e:
        # OSError: FileNotFoundError, PermissionError, ...; RuntimeError and ORT's own types
        # (Fail, InvalidArgument, ...: not RuntimeErrors) from ORT.
        print(f"onnx-offload: {type(e).__name__}: {as_flags(' '.join(str(e).split()))}", file=sys.stderr)
        return 2


def _ort_errors() -> tuple:
    """ORT's own exception types (Fail, InvalidArgument, NoSuchFile, ...)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state
    return tuple(t for t in vars(state).values() if isinstance(t, type) and issubclass(t, Exception))


if __name__ == "__main__":
    sys.exit(main())
