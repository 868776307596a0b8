"""What the OpenAI-compatible server takes and gives: the requests' fields checked (a bad one
is a 400 in OpenAI's error shape, naming the field), the text of each row of a generation
cut at its EOS or a stop string, and the response bodies.
"""
from __future__ import annotations

import math
import time
import uuid
from typing import Optional


class RequestError(ValueError):
    """A request the server refuses: OpenAI's error body, with its HTTP status."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 kind: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def body(self) -> dict:
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> Optional[float]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"'{key}' must be a number, got {value!r}", key)
    if value > high or value < low or (low_open and value == low):
        raise RequestError(f"'{key}' must be in {'(' if low_open else '['}{low}, {high}], got {value}", key)
    return float(value)


def _integer(body: dict, key: str, low: int) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer, got {value!r}", key)
    if value < low:
        raise RequestError(f"'{key}' must be >= {low}, got {value}", key)
    return value


# Fields that change what OpenAI's API computes, which this server does not: refused
# unless they ask for what it does (one choice, no logprobs, no penalties). The values
# that do are those OpenAI's API takes as "off", which clients send spelled out
# (logprobs false, logit_bias {}, tools []).
_UNSUPPORTED = {"n": (1,), "best_of": (1,), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,),
                "suffix": ("",), "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
                "tools": ([],), "response_format": ({"type": "text"},)}


def _off(key: str, value) -> bool:
    """Whether `value` of the field `key` asks for nothing this server would not do."""
    def same(a, b):  # 0.0 is 0, but False is not 0
        return isinstance(a, bool) == isinstance(b, bool) and a == b
    return value is None or any(same(value, v) for v in _UNSUPPORTED[key])


def check_request(body, model_id: str, chat: bool) -> dict:
    """The generation a request asks for: {prompt or messages, max_tokens, sampling
    keywords, stop strings, stream}; RequestError for a field that is missing, of the
    wrong type, out of range, or asking for what the server does not do."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError("'model' is required: a string, the id /v1/models lists", "model")
    if model != model_id:
        raise RequestError(f"the model '{model}' does not exist; this server serves '{model_id}'", "model", 404,
                           code="model_not_found")
    out = {"stream": body.get("stream", False)}
    if not isinstance(out["stream"], bool):
        raise RequestError(f"'stream' must be a boolean, got {out['stream']!r}", "stream")
    for key in _UNSUPPORTED:
        if key in body and not _off(key, body[key]):
            raise RequestError(f"'{key}' = {body[key]!r} is not supported by this server", key)
    options = body.get("stream_options")
    if options is not None:
        if not out["stream"]:
            raise RequestError("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise RequestError("'stream_options' must be an object, its 'include_usage' a boolean", "stream_options")
    out["include_usage"] = bool(options and options.get("include_usage"))
    if chat:
        out["messages"] = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str) or _ids(prompt):  # a text, or one prompt's token ids
            out["prompt"] = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _ids(p) for p in prompt):
            out["prompt"] = prompt
        else:
            raise RequestError("'prompt' is required: a string, a non-empty list of token ids, or a non-empty list "
                               "of either", "prompt")
        out["batched"] = isinstance(prompt, list)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    new = _integer(body, key, 1)
    out["max_tokens"] = new if new is not None or chat else 16  # chat: None, what the context leaves (resolved later)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", 0)  # llama-server's and vLLM's extension
    seed = _integer(body, "seed", 0)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    if temperature == 0:  # greedy, as OpenAI's API means it
        sampling.update(do_sample=False, temperature=None)
    elif temperature is not None or top_p is not None or top_k is not None:
        sampling["do_sample"] = True  # a request that sets sampling samples, whatever the model's default
    out["sampling"] = sampling
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and len(stop) <= 4
                                 and all(isinstance(s, str) and s for s in stop)):
        raise RequestError("'stop' must be a non-empty string or a list of at most 4 of them", "stop")
    out["stop"] = stop or []
    return out


def _ids(value) -> bool:
    """Whether `value` is a prompt's token ids: a non-empty list of integers."""
    return (isinstance(value, list) and len(value) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _messages(messages) -> list:
    """Chat messages with string content (a list of text parts joined, as OpenAI takes it)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' is required: a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts",
                               f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    return out


class RowText:
    """One row's reply text as it decodes: cut before the first stop string, and what is
    handed on never holds the start of a stop string that may still complete."""

    def __init__(self, stops: list):
        self.stops, self.text, self.sent, self.reason = stops, "", 0, None

    def add(self, piece: str) -> str:
        """The text that can be handed on now, given the row's next piece."""
        self.text += piece
        for s in self.stops:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                self.text, self.reason = self.text[:at], "stop"
                return self.flush()
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def response_body(rid: str, model_id: str, chat: bool, texts: list, reasons: list, usage: dict) -> dict:
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r, "logprobs": None}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
    else:
        choices = [{"index": i, "text": t, "finish_reason": r, "logprobs": None}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_id, "choices": choices, "usage": usage}


def usage_chunk(rid: str, model_id: str, chat: bool, usage: dict) -> dict:
    """The last chunk of a stream whose request asked for stream_options.include_usage:
    no choices, the usage of the whole request."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model_id, "choices": [], "usage": usage}


def chunk_body(rid: str, model_id: str, chat: bool, index: int, text: Optional[str], reason: Optional[str],
               first: bool = False) -> dict:
    if chat:
        delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model_id, "choices": [choice]}
