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

from ..config import (ENV_CACHE_DIR, ENV_CUDA_GRAPH, ENV_DEVICE_BYTES, ENV_OFFLOAD, ENV_POLICY, ENV_VMM,
                      ENV_VRAM_LIMIT, POLICIES, env_is_set)
from ..errors import OffloadError
from ..memory import cuda_available


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
    from ..engines import numpy_dtype
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
    from ..config import parse_bytes, parse_vram_limit
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


def _finite(text: str, zero: bool, what: str) -> float:
    """A finite number above 0 (at least 0 with `zero`), or the argparse error `what` names."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(x) or x < 0 or (x == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return x


def temperature(text: str) -> float:
    """An argparse type: a finite number of at least 0; 0 is greedy decoding, as llama.cpp
    and Hugging Face users mean it."""
    return _finite(text, True, "a finite number of at least 0 (0: greedy)")


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    return _finite(text, False, "a finite number above 0")


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
    from ..engines import numpy_dtype
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
    from ..session import OffloadSession
    check_config_flags(args)  # everything the arguments allow is checked before any weight loads
    feeds = load_feeds(args.inputs) if args.inputs else None
    kind = _kind(args)
    kw = config_kwargs(args)
    kw["record_timeline"] = bool(args.timeline)
    with OffloadSession(args.model, providers=[_provider(kind)], **kw) as s:
        if feeds is not None:
            check_feeds(feeds, s.get_inputs())
        elif s._decoder_spec is not None and not isinstance(s._decoder_spec, Exception):
            # Random feeds with every free dimension 1 are no step of a decoder (a past of
            # one position beside a mask of one): ORT fails in its attention.
            raise ValueError(f"{args.model} is a decoder with a KV cache: generate tokens with 'onnx-offload "
                             f"generate {args.model} --prompt-ids 1,2,3', or give the feeds of a step with --inputs "
                             f"FEEDS.npz")
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
    folder = model if os.path.isdir(model) else os.path.dirname(os.path.abspath(model))
    path = os.path.join(folder, "tokenizer.json")
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
    from ..session import OffloadSession
    check_config_flags(args)
    if not os.path.exists(args.model):
        raise FileNotFoundError(f"{args.model!r}: no such model file or folder")
    from ..generation import SAMPLING_DEFAULTS, Sampling
    if args.temperature == 0:  # greedy, as llama.cpp and Hugging Face users mean it
        args.do_sample, args.temperature = False, None
    given = dict(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    # Checked before any weight loads; what is not given is the model's, read once it loads.
    Sampling(**{k: SAMPLING_DEFAULTS[k] if v is None else v for k, v in given.items()})
    eos = None
    if args.eos_token_id is not None:
        try:
            eos = [int(t) for t in args.eos_token_id.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--eos-token-id {args.eos_token_id!r}: expected integers separated by commas") from None
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
        # One row's tokens print as they come (the text, with --prompt; else the ids);
        # a batch's rows print at the end. Ctrl-C keeps what came.
        stream = tok is None and len(ids) == 1
        if stream:
            print("tokens: ", end="", flush=True)
        try:
            for step in s.generate_iter(ids, args.max_new_tokens, do_sample=args.do_sample,
                                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                        seed=args.seed, eos_token_id=eos):
                if first is None:
                    first = time.perf_counter() - t0
                new.append(step)
                if tok is not None:
                    text = tok.decode([int(t[0]) for t in new])
                    print(text[len(shown):], end="", flush=True)
                    shown = text
                elif stream:
                    print(("," if len(new) > 1 else "") + str(int(step[0])), end="", flush=True)
        except KeyboardInterrupt:
            print()
            if not stream:
                for row in (np.stack(new, axis=1) if new else np.zeros((len(ids), 0), np.int64)):
                    print("tokens: " + ",".join(str(int(t)) for t in row))
            print(f"onnx-offload: interrupted after {len(new)} new tokens", file=sys.stderr)
            return 130
        elapsed = time.perf_counter() - t0
        if tok is not None or stream:
            print()
        tokens = np.stack(new, axis=1) if new else np.zeros((len(ids), 0), np.int64)
        if not stream:
            for row in tokens:
                print("tokens: " + ",".join(str(int(t)) for t in row))
        decode = elapsed - (first or 0)
        n = tokens.shape[1]
        rate = (n - 1) / decode if n > 1 and decode > 0 else float("nan")
        print(f"{n} new tokens x batch {len(ids)} in {elapsed:.3f} s: prompt {1e3 * (first or 0):.1f} ms, "
              f"{rate:.1f} tokens/s after it ({spec.layout} layout, {len(s.segments)} segment(s), "
              f"graphs {'on' if s.graph_capture.enabled else 'off'})")
    return 0


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
    kind = _kind(args)
    model = mlp_stack(layers=16, hidden=1024, batch=4)
    weights = weight_bytes(model)
    budget = weights // 4
    where = "the GPU (CUDA VMM)" if kind == "cuda" else "the CPU (the host backend plays the GPU)"
    with tempfile.TemporaryDirectory() as tmp:
        path = save(model, os.path.join(tmp, "demo.onnx"))
        x = np.random.default_rng(0).standard_normal((4, 1024)).astype(np.float32)
        print(f"demo: a 16-layer MLP with {weights / 2**20:.0f} MiB of weights, run within a {budget / 2**20:.0f} "
              f"MiB budget on {where}")
        plain = ort.InferenceSession(path, providers=[_provider(kind)])
        want = plain.run(None, {"x": x})[0]
        plain_ms = _median_ms(lambda: plain.run(None, {"x": x}))
        plain = None  # its memory goes back before the OffloadSession takes any
        # The demo's model is made anew each run: a cache entry of it would never be used.
        with OffloadSession(path, providers=[_provider(kind)], offload=True, vmm=True, vram_limit=budget,
                            cache_dir="off") as s:
            got = s.run(None, {"x": x})[0]
            ms = _median_ms(lambda: s.run(None, {"x": x}))
            st = s.stats()
            streamed = st.last_step.htod_bytes
            if args.stats:
                print(st)
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
    print("demo passed: the model ran within a quarter of its weights' memory and gave plain ORT's outputs"
          + ("" if args.stats else " (--stats prints the session's counters)"))
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
    out = os.path.abspath(args.out)  # the benchmarks' child processes start in another folder
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
        res = bench_compare(kind, out, int4=args.int4)
        text = print_compare(res)
    elif args.what == "cards":
        from .bench_cards import BATCHES, PROMPTS, bench_cards, print_cards
        from ..config import parse_bytes

        def listed(text, parse, default):
            return default if not text else [parse(t.strip()) for t in text.split(",") if t.strip()]
        res = bench_cards(kind, out, cards=listed(args.cards, lambda t: parse_bytes(t, "--cards"), None),
                          prompts=listed(args.prompts, positive_int, PROMPTS),
                          batches=listed(args.batches, positive_int, BATCHES))
        text = print_cards(res)
    elif args.what == "int4":
        from .bench_int4 import bench_int4, print_int4
        res = bench_int4(kind, out)
        text = print_int4(res)
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
    from ..config import OffloadConfig, parse_cache_dir
    from ..loading import cache_entries, clear_cache
    from ..stats import fmt_bytes, table
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
        rows = [(e.model or "(not recorded)", fmt_bytes(e.nbytes),
                 time.strftime("%Y-%m-%d %H:%M", time.localtime(e.made)), os.path.basename(e.path)[:12])
                for e in entries]
        print(table(rows, ("made from", "size", "made", "entry")))
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
    from .. import __version__
    p = _Parser(prog="onnx-offload", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version",
                   version=f"onnx-offload {__version__} (onnxruntime {onnxruntime.__version__})")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a model under a VRAM budget and print the offload counters")
    r.add_argument("model", help="an ONNX model file, or a folder holding one")
    _config_flags(r)
    r.add_argument("--steps", type=positive_int, default=3, help="steps to run, at least 1 (default 3)")
    r.add_argument("--inputs", help=".npz file of feeds; default: random feeds from the input shapes")
    r.add_argument("--profile", action="store_true", help="print step times and the segment plan")
    r.add_argument("--timeline", help="write the residency timeline to this PNG")
    r.set_defaults(fn=cmd_run)
    g = sub.add_parser("generate", help="generate tokens with a decoder LLM (KV cache on the device)")
    g.add_argument("model", help="a decoder's ONNX file, or its folder (genai_config.json, tokenizer.json, ...)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help="token ids, comma-separated (rows of a batch separated by ';')")
    src.add_argument("--prompt", help="text, encoded by the tokenizer.json beside the model ('tokenizers' package)")
    g.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--do-sample", action="store_true", default=None,
                   help="sample instead of greedy decoding (default: the model's generation config, else greedy)")
    g.add_argument("--temperature", type=temperature,
                   help="sampling temperature (default: the model's, else 1.0); 0 decodes greedily")
    g.add_argument("--top-k", type=count,
                   help="sample from the k likeliest tokens only (default: the model's, else 0: all)")
    g.add_argument("--top-p", type=float,
                   help="sample from the likeliest tokens whose probability adds up to p (default: the model's, "
                        "else 1.0: all)")
    g.add_argument("--seed", type=count, help="the sampling seed (default: a fresh one)")
    g.add_argument("--eos-token-id", help="token ids that end a row, comma-separated (default: the model's, "
                                          "from generation_config.json, config.json or genai_config.json)")
    _config_flags(g)
    g.set_defaults(fn=cmd_generate)
    d = sub.add_parser("demo", help="a small model under a budget below its weights (GPU if present, else CPU)")
    d.add_argument("--cpu", action="store_true", help="run on the CPU host backend even with a GPU")
    d.add_argument("--stats", action="store_true", help="also print the session's counters")
    d.set_defaults(fn=cmd_demo)
    c = sub.add_parser("cache", help="the optimized models kept between runs: show them, or remove them all")
    c.add_argument("action", nargs="?", choices=("info", "clear"), default="info",
                   help="info: list the entries, what each was made from and its size (the default); clear: "
                        "remove them all, but those a session is reading")
    c.add_argument("--cache-dir",
                   help=f"the cache folder (overrides {ENV_CACHE_DIR}; default: the user cache directory)")
    c.set_defaults(fn=cmd_cache)
    b = sub.add_parser("bench", help="benchmarks: arena page-in costs, session overhead, offloaded step time")
    b.add_argument("what", choices=("arena", "session", "offload", "decode", "compare", "cards", "int4",
                                     "reliability"))
    b.add_argument("--cards", help="bench cards: card sizes, comma-separated (default 8GiB,12GiB,16GiB,24GiB)")
    b.add_argument("--prompts", help="bench cards: prompt lengths, comma-separated (default 512,4096)")
    b.add_argument("--batches", help="bench cards: batch sizes, comma-separated (default 1,4)")
    b.add_argument("--out", default="onnx-offload-bench",
                   help="the folder for the models and files a benchmark makes (default ./onnx-offload-bench)")
    b.add_argument("--json", help="also write the results to this JSON file")
    b.add_argument("--weight-gb", type=positive_float, default=8.0,
                   help="bench offload: the model's weights in GB (default 8; on the CPU at most 0.05)")
    b.add_argument("--cpu", action="store_true", help="run on the CPU host backend even with a GPU")
    b.add_argument("--int4", action="store_true",
                   help="bench compare: the model's MatMuls as int4 MatMulNBits, the streaming engine's rows only")
    b.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("onnx-offload: interrupted", file=sys.stderr)
        return 130
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
