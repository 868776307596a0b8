"""The onnx-offload command line.

    onnx-offload run MODEL --vram-limit 2GiB [--policy planned] [--profile] [--steps N] [--inputs f.npz]
    onnx-offload generate MODEL --prompt-ids 1,2,3 | --prompt TEXT [--max-new-tokens N] [--vram-limit ...]
    onnx-offload chat FOLDER [--max-new-tokens N] [--system TEXT] [--vram-limit ...]
    onnx-offload serve FOLDER [--host 127.0.0.1] [--port 8000] [--vram-limit ...]
    onnx-offload demo [--cpu]
    onnx-offload bench arena|session|offload|decode|host|reliability [--out DIR] [--json FILE]

This module builds the parser, dispatches to the commands (cli_models: run, generate;
cli_bench: demo, bench, cache) and turns their errors into one line of stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from ..config import (ENGINES, ENV_HOST_COMPUTE, ENV_CACHE_DIR, ENV_CUDA_GRAPH, ENV_DEVICE_BYTES, ENV_ENGINE, ENV_EXPERTS, ENV_OFFLOAD,
                      ENV_POLICY, ENV_VMM, ENV_VRAM_LIMIT, EXPERTS, POLICIES)
from ..errors import OffloadError, OffloadWarning
from .cli_args import as_flags, count, device_list, host_compute, positive_float, positive_int, temperature, top_p
from .cli_bench import cmd_bench, cmd_cache, cmd_demo
from .cli_chat import add_chat_parser
from .cli_models import cmd_generate, cmd_run


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
    p.add_argument("--engine", choices=ENGINES, help=f"how streamed weights run: graph (CUDA), segments, or auto "
                                                     f"(overrides {ENV_ENGINE}; default auto)")
    p.add_argument("--experts", choices=EXPERTS,
                   help=f"a mixture-of-experts model's experts: routed (only those the router picks page in), dense, "
                        f"in_place (CUDA: stacks the budget cannot hold stay in pinned host memory, where the MoE "
                        f"kernel reads the picked experts), or auto, routed on the CPU and in_place on CUDA "
                        f"(overrides {ENV_EXPERTS}; default auto)")
    p.add_argument("--host-compute", type=host_compute,
                   help=f"the host's cores multiply part of a decode step's streamed weights while the link carries "
                        f"the rest (CUDA's streaming engine; on the CPU, given a thread count, between segments): "
                        f"auto (where the rates measured at start say the step gets faster), off, or a number of "
                        f"host threads (overrides {ENV_HOST_COMPUTE}; default off)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU host backend even with a GPU")
    p.add_argument("--devices", type=device_list,
                   help="split the model across these devices, a stage each (comma-separated ids, such as 0,1); "
                        "each budget flag (--vram-limit, --weight-bytes, --kv-bytes, --scratch-bytes) gives every "
                        "device its value, or one value per device in this order (such as 8GiB,12GiB; auto for "
                        "the package's own). On the CPU each device is a host backend of its own")


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
                   help="sample instead of greedy decoding (default: on where --temperature, --top-k or --top-p is "
                        "given, else the model's generation config, else greedy)")
    g.add_argument("--temperature", type=temperature,
                   help="sampling temperature (default: the model's, else 1.0); 0 decodes greedily")
    g.add_argument("--top-k", type=count,
                   help="sample from the k likeliest tokens only (default: the model's, else 0: all)")
    g.add_argument("--top-p", type=top_p,
                   help="sample from the likeliest tokens whose probability adds up to p (default: the model's, "
                        "else 1.0: all)")
    g.add_argument("--seed", type=count, help="the sampling seed (default: a fresh one)")
    g.add_argument("--eos-token-id", help="token ids that end a row, comma-separated (default: the model's, "
                                          "from generation_config.json, config.json or genai_config.json)")
    _config_flags(g)
    g.set_defaults(fn=cmd_generate)
    add_chat_parser(sub, _config_flags)
    from .cli_serve import add_serve_parser
    add_serve_parser(sub, _config_flags)
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
    b.add_argument("what", choices=("arena", "session", "offload", "decode", "compare", "cards", "int4", "moe",
                                     "host", "reliability"))
    b.add_argument("--cards", help="bench cards: card sizes, comma-separated (default 8GiB,12GiB,16GiB,24GiB)")
    b.add_argument("--prompts", help="bench cards: prompt lengths, comma-separated (default 512,4096)")
    b.add_argument("--batches", help="bench cards: batch sizes, comma-separated (default 1,4)")
    b.add_argument("--llama-bench", metavar="PATH",
                   help="bench cards: llama.cpp's llama-bench, run beside each batch-1 row on the same card; "
                        "bench host: its decode on the host's cores alone (default: llama-bench on PATH, if any; "
                        "needs the [bench] extra for the GGUF)")
    b.add_argument("--ort-levers", action="store_true",
                   help="bench cards: also the all-resident step with each of ORT's CUDA levers (TunableOp ...)")
    b.add_argument("--out", default="onnx-offload-bench",
                   help="the folder for the models and files a benchmark makes (default ./onnx-offload-bench)")
    b.add_argument("--json", help="also write the results to this JSON file")
    b.add_argument("--weight-gb", type=positive_float, default=8.0,
                   help="bench offload: the model's weights in GB (default 8; on the CPU at most 0.05)")
    b.add_argument("--weights-mib", type=positive_int, default=256,
                   help="bench host: MiB of weights for each kind (default 256; larger leaves the caches further)")
    b.add_argument("--isa", choices=("scalar", "avx2", "avx512"),
                   help="bench host: the kernels of this ISA (default: the best this CPU has)")
    b.add_argument("--dispatch-calls", type=positive_int, default=2000,
                   help="bench host: back-to-back calls a row of the dispatch table (default 2000)")
    b.add_argument("--cpu", action="store_true", help="run on the CPU host backend even with a GPU")
    b.add_argument("--widths", choices=("gpt-oss-20b", "narrow"), default="gpt-oss-20b",
                   help="bench moe on CUDA: gpt-oss-20b's layer widths in 4 layers (default), or hidden 1024 in 12")
    b.add_argument("--int4", action="store_true",
                   help="bench compare: the model's MatMuls as int4 MatMulNBits, the streaming engine's rows only; "
                        "bench cards: the same, on 4 and 6 GiB cards, beside llama.cpp's Q4_0")
    b.add_argument("--devices", type=device_list,
                   help="bench compare: one device against the model split across these (such as 0,1), at a total "
                        "weights budget of 25%%")
    b.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    shown = warnings.showwarning

    def show(message, category, *rest, **kw):
        # The package's warnings in this command's terms, on one line, as its errors are.
        if not issubclass(category, OffloadWarning):
            return shown(message, category, *rest, **kw)
        _flush_stdout()
        print(f"onnx-offload: {category.__name__}: {as_flags(' '.join(str(message).split()), args)}",
              file=sys.stderr)
    warnings.showwarning = show
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        _flush_stdout()
        print("onnx-offload: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of the output went away (`| head`): nothing more to say, as a command
        # killed by SIGPIPE says nothing. What is still buffered goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (OffloadError, MemoryError, ValueError, TypeError, OSError, ArithmeticError, RuntimeError,
            ImportError) + _ort_errors() as e:
        # OSError: FileNotFoundError, PermissionError, ...; RuntimeError and ORT's own types
        # (Fail, InvalidArgument, ...: not RuntimeErrors) from ORT.
        _flush_stdout()
        print(f"onnx-offload: {type(e).__name__}: {as_flags(' '.join(str(e).split()), args)}", file=sys.stderr)
        return 2
    finally:
        warnings.showwarning = shown


def _flush_stdout() -> None:
    """What the command printed goes out before its error, so that a terminal or a file
    taking both shows them in the order they came."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):  # the reader went away; stdout closed
        pass


def _ort_errors() -> tuple:
    """ORT's own exception types (Fail, InvalidArgument, NoSuchFile, ...)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state
    return tuple(t for t in vars(state).values() if isinstance(t, type) and issubclass(t, Exception))


if __name__ == "__main__":
    sys.exit(main())
