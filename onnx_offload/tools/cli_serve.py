"""`onnx-offload serve FOLDER`: the model's session behind the OpenAI-compatible server
(serve.py), on 127.0.0.1 unless --host says otherwise.
"""
from __future__ import annotations

import errno
import os
import signal
import socket

SERVE_EXTRA = "pip install 'onnx-offload[serve]'"


def cmd_serve(args) -> int:
    from ..generation import need
    from ..session import OffloadSession
    from .cli_args import check_config_flags, config_kwargs, device_kind, provider
    from .cli_chat import sampling_sources, settings_line
    check_config_flags(args)
    for module in ("starlette", "uvicorn"):
        try:
            __import__(module)
        except ImportError:
            raise ImportError(f"serve needs the '{module}' package, of onnx-offload's [serve] extra: {SERVE_EXTRA}",
                              name=module) from None
    need("tokenizers")
    need("jinja2")
    import uvicorn
    from .serve import Server
    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"{args.model!r}: no such model folder (serve needs the folder, with its "
                                f"tokenizer.json and chat template)")
    model_id = args.model_id or os.path.basename(os.path.abspath(args.model))
    # Bound before the weights load: a port in use fails at once.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            sock.bind((args.host, args.port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise OSError(e.errno, f"{args.host}:{args.port} is in use (another server?): pass --port N for another "
                                   f"port, or --port 0 for a free one") from None
        sock.listen(2048)  # connections queue while the weights load
        with OffloadSession(args.model, providers=[provider(device_kind(args))], **config_kwargs(args)) as s:
            server = Server(s, model_id)
            print(settings_line(sampling_sources(s, {}), None, "request") +
                  "; a request's temperature, top_p, top_k and seed override them", flush=True)
            host, port = sock.getsockname()[:2]
            print(f"serving '{model_id}' at http://{host}:{port}/v1 (one generation at a time; Ctrl-C stops)",
                  flush=True)
            config = uvicorn.Config(server.app(), log_level=args.log_level, lifespan="off")
            # uvicorn shuts down on SIGTERM, then raises the signal again: exit then, with
            # the session closed (its folder and memory given back), not killed by it.
            term = signal.signal(signal.SIGTERM, _exit)
            uv = uvicorn.Server(config)
            server.stopping = lambda: uv.should_exit
            try:
                uv.run(sockets=[sock])
            finally:
                signal.signal(signal.SIGTERM, term)
                server.worker.shutdown(wait=True)
    finally:
        sock.close()
    return 0


def _exit(signum, frame):
    raise SystemExit(0)


def add_serve_parser(sub, config_flags) -> None:
    from .cli_args import count
    c = sub.add_parser("serve", help="an OpenAI-compatible HTTP server of a decoder LLM (/v1/models, "
                                     "/v1/completions, /v1/chat/completions; the [serve] extra)")
    c.add_argument("model", help="the model's folder: the decoder's ONNX file, tokenizer.json and its chat template")
    c.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine "
                                                       "only; 0.0.0.0 opens it to the network, with no "
                                                       "authentication)")
    c.add_argument("--port", type=count, default=8000, help="the port (default 8000; 0 picks a free one)")
    c.add_argument("--model-id", help="the model's id in /v1/models and requests (default: the folder's name)")
    c.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default warning)")
    config_flags(c)
    c.set_defaults(fn=cmd_serve)
