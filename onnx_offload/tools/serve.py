"""`onnx-offload serve FOLDER`: an OpenAI-compatible HTTP server (Starlette on uvicorn, the
[serve] extra) over one session: /v1/models, /v1/completions, /v1/chat/completions, each
with `stream: true` as server-sent events.

Requests queue on the one session, in the order they came: one generation runs at a time,
its steps on one worker thread. A /v1/completions request with a list of prompts is one
generation, its rows batched (left-padded). A client whose request waits gets nothing
meanwhile (a streaming one, the response's headers, then its first chunk when its
generation starts). A client that disconnects stops its generation at the next step, and
the next request runs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import numpy as np

from ..generation import text_model
from .serve_requests import (RequestError, RowText, check_request, chunk_body, completion_id, error_body,
                             response_body, usage_chunk)

_END = object()


class _Generation:
    """One request's generation: its rows' token ids, and each step's text of every row."""

    def __init__(self, app: "Server", request: dict, chat: bool):
        tm, s = app.text, app.session
        self.chat = chat
        try:
            rows = ([tm.encode(tm.render(request["messages"]), special=False)] if chat
                    else [tm.encode(p) if isinstance(p, str) else p for p in request["prompt"]])
        except (TypeError, ValueError) as e:  # a template that refuses the messages, text that is no Unicode
            raise RequestError(str(e), "messages" if chat else "prompt") from None
        vocab = s.decoder_spec.vocab or tm.tokenizer.get_vocab_size()
        if any(not 0 <= t < vocab for r in rows for t in r):
            raise RequestError(f"token ids must lie in [0, {vocab})", "prompt")
        if not all(rows):
            raise RequestError("a prompt encodes to no tokens", "messages" if chat else "prompt")
        limit = s.decoder_spec.max_length or tm.context or 0
        longest = max(len(r) for r in rows)
        new = request["max_tokens"]
        if new is None:  # a chat request that sets no max_tokens: what the context leaves, at most 4096
            new = max(1, min(4096, (limit or longest + 4096) - longest + 1))
        if limit and longest + new - 1 > limit:
            raise RequestError(f"this model's context is {limit} tokens; the prompt takes {longest} and max_tokens "
                               f"asks for {new}", "max_tokens", code="context_length_exceeded")
        self.rows, self.new, self.tm = rows, new, tm
        self.prompt_tokens = sum(len(r) for r in rows)
        pad = tm.pad_id()
        self.ids = np.array([[pad] * (longest - len(r)) + r for r in rows], np.int64)
        mask = np.array([[0] * (longest - len(r)) + [1] * len(r) for r in rows], np.int64)
        self.mask = None if mask.all() else mask
        self.sampling = {k: v for k, v in request["sampling"].items() if v is not None}
        self.include_usage = request.get("include_usage", False)
        self.eos = set(int(e) for e in s.decoder_spec.eos_token_id)
        self.texts = [RowText(request["stop"]) for _ in rows]
        self.streams = [tm.stream() for _ in rows]
        self.counts = [0] * len(rows)
        self.steps = None

    def start(self, session):
        """Runs on the worker thread: the generation's iterator (its arguments checked)."""
        self.steps = session.generate_iter(self.ids, self.new, attention_mask=self.mask, **self.sampling)

    def step(self):
        """Runs on the worker thread: [(row, text)] of the next step, or _END when every row
        is done."""
        if all(t.reason for t in self.texts):
            return _END
        tokens = next(self.steps, None)
        if tokens is None:
            out = []
            for r, t in enumerate(self.texts):
                if not t.reason:
                    t.reason = "length"
                    out.append((r, t.flush()))
            return out or _END
        out = []
        for r, token in enumerate(tokens):
            t = self.texts[r]
            if t.reason:
                continue
            if int(token) in self.eos:
                t.reason = "stop"
                out.append((r, t.flush()))
                continue
            self.counts[r] += 1
            out.append((r, t.add(self.streams[r].step(int(token)))))
            if self.counts[r] == self.new and not t.reason:
                t.reason = "length"
                out.append((r, t.flush()))
        return out

    def close(self):
        if self.steps is not None:
            self.steps.close()

    def usage(self) -> dict:
        done = sum(self.counts)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}


class Server:
    """The app's state: the session, its text model, the queue of generations."""

    def __init__(self, session, model_id: str):
        self.session, self.model_id = session, model_id
        self.text = text_model(session)
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="onnx-offload-serve")
        self.turn = None  # asyncio.Lock, made on the server's loop
        self.created = int(time.time())
        # Whether the server is shutting down (uvicorn's should_exit, set by Ctrl-C or
        # SIGTERM): a generation ends at its next step rather than run to its end first.
        self.stopping = lambda: False

    async def _on_worker(self, fn, *args):
        return await asyncio.wrap_future(self.worker.submit(fn, *args))

    async def run(self, gen: _Generation, request):
        """Yields each step's [(row, text)], holding the session's turn; stops when the client
        disconnects (checked between steps) and gives the turn to the next request."""
        import anyio
        if self.turn is None:
            self.turn = asyncio.Lock()
        async with self.turn:
            try:
                await self._on_worker(gen.start, self.session)
                while True:
                    if await request.is_disconnected():
                        return
                    if self.stopping():
                        raise RequestError("the server is shutting down", status=503, kind="server_error")
                    out = await self._on_worker(gen.step)
                    if out is _END:
                        return
                    yield out
            finally:
                with anyio.CancelScope(shield=True):  # a cancelled response still closes its generation
                    await self._on_worker(gen.close)

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": self.model_id, "object": "model",
                                                             "created": self.created, "owned_by": "onnx-offload"}]})

        async def generate(request, chat: bool):
            try:
                try:
                    body = await request.json()
                except (ValueError, UnicodeDecodeError):
                    raise RequestError("the request body is not JSON") from None
                except RecursionError:
                    raise RequestError("the request body is not JSON this server reads: nested too deep") from None
                req = check_request(body, self.model_id, chat)
                gen = _Generation(self, req, chat)
            except RequestError as e:
                return JSONResponse(e.body(), status_code=e.status)
            rid = completion_id(chat)
            if req["stream"]:
                return StreamingResponse(self._events(gen, request, rid, chat), media_type="text/event-stream")
            texts = [""] * len(gen.rows)
            try:
                async for out in self.run(gen, request):
                    for r, text in out:
                        texts[r] += text
            except RequestError as e:
                return JSONResponse(e.body(), status_code=e.status)
            except (ValueError, TypeError) as e:
                return JSONResponse(error_body(str(e)), status_code=400)
            except Exception as e:  # noqa: BLE001 - the model's failure is the client's answer, the server goes on
                return JSONResponse(error_body(f"{type(e).__name__}: {e}", "server_error"), status_code=500)
            reasons = [t.reason or "length" for t in gen.texts]
            return JSONResponse(response_body(rid, self.model_id, chat, texts, reasons, gen.usage()))

        async def completions(request):
            return await generate(request, False)

        async def chat_completions(request):
            return await generate(request, True)

        async def not_found(request, exc):
            return JSONResponse(error_body(f"no such endpoint: {request.method} {request.url.path}"),
                                status_code=getattr(exc, "status_code", 404))

        async def server_error(request, exc):  # Starlette's own is plain text; it logs the exception after
            return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", "server_error"), status_code=500)

        routes = [Route("/v1/models", models, methods=["GET"]),
                  Route("/v1/completions", completions, methods=["POST"]),
                  Route("/v1/chat/completions", chat_completions, methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found,
                                                                 Exception: server_error})

    async def _events(self, gen: _Generation, request, rid: str, chat: bool):
        """The server-sent events of a streamed generation: a chunk per row per step that
        has text, one with each row's finish_reason, then [DONE]."""
        def event(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"
        first = [True] * len(gen.rows)
        try:
            async for out in self.run(gen, request):
                for r, text in out:
                    if text or (chat and first[r]):
                        yield event(chunk_body(rid, self.model_id, chat, r, text, None, first[r]))
                        first[r] = False
        except RequestError as e:  # headers are sent: the error is the stream's last event
            yield event(e.body())
            return
        except Exception as e:  # noqa: BLE001 - as above
            yield event(error_body(f"{type(e).__name__}: {e}", "server_error"))
            return
        if await request.is_disconnected():
            return
        for r, t in enumerate(gen.texts):
            yield event(chunk_body(rid, self.model_id, chat, r, None, t.reason or "length"))
        if gen.include_usage:
            yield event(usage_chunk(rid, self.model_id, chat, gen.usage()))
        yield "data: [DONE]\n\n"
