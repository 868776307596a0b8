"""`onnx-offload chat FOLDER`: a multi-turn chat in the terminal, through the model's chat
template, each reply printed as it decodes.

The KV cache stays across turns (generation.chat_cache): a turn feeds only the tokens its
rendering of the conversation adds, and the first time the whole conversation runs again
a line says why. Ctrl-C during a reply ends the reply, which stays in the history (and its
tokens fed so far in the cache) as far as it came; Ctrl-C at the prompt, Ctrl-D or /exit end
the chat. --stats prints, after each reply, the prompt tokens the turn fed and kept.

In a terminal the chat takes Ctrl-C itself, as llama-cli does, even where it was started
with SIGINT ignored (a job started with `&` or nohup, then brought to the foreground):
the terminal's user has no other way to stop a reply.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Optional

_KEYS = ("do_sample", "temperature", "top_k", "top_p")


def sampling_sources(session, given: dict) -> dict:
    """{key: (value, where it came from)} of the decoding settings a generation runs with:
    the flag or request field given, else the model's genai_config.json (its search
    section), else its generation_config.json, else the package's default."""
    from ..generation import sampling_sources as resolved
    folder = session.model_folder or ""
    search = _json(os.path.join(folder, "genai_config.json")).get("search", {})
    out = {}
    for key, (value, where) in resolved(dict(session.decoder_spec.sampling), given).items():
        if where == "model":
            where = "genai_config.json" if isinstance(search, dict) and key in search else "generation_config.json"
        elif where != "given":
            where = "the model's top_k 1 left out: sampling was asked" if where != "default" else "default"
        out[key] = (value, where)
    return out


def given_sampling(args) -> dict:
    """The decoding flags given, as a generation's keywords: --temperature 0 decodes greedily,
    and --temperature, --top-k or --top-p without --do-sample samples, as a server request
    that sets them does and as llama.cpp's users mean them (args is updated to match)."""
    if args.temperature == 0:  # greedy, as llama.cpp and Hugging Face users mean it
        args.do_sample, args.temperature = False, None
    elif args.do_sample is None and any(v is not None for v in (args.temperature, args.top_k, args.top_p)):
        args.do_sample, args.sample_implied = True, True
    return dict(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def _json(path: str) -> dict:
    from ..loading import read_json
    try:
        value = read_json(path) if os.path.exists(path) else {}
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def settings_line(sources: dict, max_new_tokens: Optional[int], given_as: str = "flag") -> str:
    """One line: greedy or sampling, and each setting in force with where it came from."""
    limit = f"; up to {max_new_tokens} new tokens a reply" if max_new_tokens else ""
    def source(key):
        value, where = sources[key]
        return given_as if where == "given" else where

    do_sample, where = sources["do_sample"]
    if not do_sample:
        why = {"given": "--temperature 0" if given_as == "--flag" else given_as,
               "default": "the model's generation config sets no sampling"}.get(
            where, f"do_sample false in {where}")
        return f"decoding: greedy ({why}){limit}"
    shown = ", ".join(f"{k} {sources[k][0]} ({source(k)})" for k in _KEYS[1:])
    why = {"given": "--do-sample" if given_as == "--flag" else given_as,
           "implied": "--temperature, --top-k or --top-p given"}.get(
        where, f"do_sample true in {where}: sampling follows the model's generation config")
    return f"decoding: sampling ({why}), {shown}{limit}; temperature 0 decodes greedily"


@contextlib.contextmanager
def _ctrl_c_interrupts():
    """Ctrl-C raises KeyboardInterrupt while the chat runs in a terminal; the previous handler after."""
    if not sys.stdin.isatty() or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler set outside Python, which cannot be put back
            signal.signal(signal.SIGINT, previous)


def cmd_chat(args) -> int:
    with _ctrl_c_interrupts():
        return _chat(args)


def _chat(args) -> int:
    from ..generation import text_model
    from ..session import OffloadSession
    from .cli_args import check_config_flags, config_kwargs, device_kind, provider
    check_config_flags(args)
    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"{args.model!r}: no such model folder (chat needs the folder, with its "
                                f"tokenizer.json and chat template)")
    given = given_sampling(args)
    with OffloadSession(args.model, providers=[provider(device_kind(args))], **config_kwargs(args)) as s:
        tm = text_model(s)
        history = [{"role": "system", "content": args.system}] if args.system else []
        tm.render(history + [{"role": "user", "content": "hello"}])  # a template that cannot render fails now
        sources = sampling_sources(s, given)
        if getattr(args, "sample_implied", False):
            sources["do_sample"] = (True, "implied")
        print(settings_line(sources, args.max_new_tokens, "--flag"), flush=True)
        print("Ctrl-C ends a reply; Ctrl-D, /exit or Ctrl-C at the prompt ends the chat.", flush=True)
        told = set()  # the reasons already shown for running the conversation again
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            reply, start = [], time.perf_counter()
            try:
                for piece in s.chat_iter(history, args.max_new_tokens, seed=args.seed, **given):
                    reply.append(piece)
                    print(piece, end="", flush=True)
                print(flush=True)
            except KeyboardInterrupt:
                print(" [reply stopped]", flush=True)
            history.append({"role": "assistant", "content": "".join(reply)})
            turn = s.last_chat
            if turn is not None and turn.note and turn.note not in told:
                told.add(turn.note)
                print(f"[{turn.note}]", flush=True)
            if args.stats and turn is not None:
                print(f"[{turn.fed} prompt tokens fed, {turn.reused} kept in the cache; "
                      f"{time.perf_counter() - start:.2f} s]", flush=True)


def sampling_flags(p) -> None:
    from .cli_args import count, temperature, top_p
    p.add_argument("--do-sample", action="store_true", default=None,
                   help="sample instead of greedy decoding (default: on where --temperature, --top-k or --top-p is "
                        "given, else the model's generation config, else greedy)")
    p.add_argument("--temperature", type=temperature,
                   help="sampling temperature (default: the model's, else 1.0); 0 decodes greedily")
    p.add_argument("--top-k", type=count, help="sample from the k likeliest tokens only (default: the model's, else 0: "
                                               "all)")
    p.add_argument("--top-p", type=top_p, help="sample from the likeliest tokens whose probability adds up to p "
                                               "(default: the model's, else 1.0: all)")
    p.add_argument("--seed", type=count, help="the sampling seed (default: a fresh one)")


def add_chat_parser(sub, config_flags) -> None:
    c = sub.add_parser("chat", help="chat with a decoder LLM in the terminal (its folder's tokenizer and chat "
                                    "template; the [llm] extra)")
    c.add_argument("model", help="the model's folder: the decoder's ONNX file, tokenizer.json and "
                                 "tokenizer_config.json (its chat_template) or chat_template.jinja")
    from .cli_args import positive_int
    c.add_argument("--max-new-tokens", type=positive_int, default=512,
                   help="the most tokens a reply takes (default 512)")
    c.add_argument("--system", help="a system message that starts the conversation")
    c.add_argument("--stats", action="store_true",
                   help="after each reply, print the prompt tokens the turn fed, those kept in the KV cache from "
                        "earlier turns, and the turn's time")
    sampling_flags(c)
    config_flags(c)
    c.set_defaults(fn=cmd_chat)
