"""Text in and out of a decoder: the model folder's tokenizer (tokenizer.json, through the
`tokenizers` package), its chat template (tokenizer_config.json's ``chat_template``, or
chat_template.jinja) rendered by jinja2's sandbox as transformers renders it, and the text
of tokens streamed as they come (tokenizers' DecodeStream, which holds back a token whose
bytes end inside a character until the character is whole).

The packages are the ``[llm]`` extra; without them, an ImportError names it.
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
from typing import Optional

from ..loading import CONFIG_BYTES, opened, read_json, read_range

LLM_EXTRA = "pip install 'onnx-offload[llm]'"


def need(module: str):
    """The module `module` of the [llm] extra, or an ImportError that names the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"text and chat need the '{module}' package, of onnx-offload's [llm] extra: {LLM_EXTRA}",
                          name=module) from None


def read_text(path: str) -> str:
    """The text of the regular file `path` (a FIFO or a device is refused, as every file
    beside a model is), at most CONFIG_BYTES long."""
    with opened(path) as fd:
        size = os.fstat(fd).st_size
        if size > CONFIG_BYTES:
            raise ValueError(f"{path} is {size} bytes long; a tokenizer or template file holds at most {CONFIG_BYTES}")
        return read_range(fd, 0, size, path).decode("utf-8")


def _token_text(value) -> Optional[str]:
    """A special token of tokenizer_config.json: a string, or an AddedToken's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextModel:
    """The tokenizer and chat template of a model folder."""

    def __init__(self, folder: str):
        tokenizers = need("tokenizers")
        self.folder = folder
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"text needs the model's tokenizer.json beside it ({path}); pass token ids instead")
        try:
            self.tokenizer = tokenizers.Tokenizer.from_str(read_text(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
            raise ValueError(f"{path} cannot be read by tokenizers: {e}") from None
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        cfg = read_json(cfg_path) if os.path.exists(cfg_path) else {}
        self.config = cfg if isinstance(cfg, dict) else {}
        self.template, self.template_source = None, None
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.exists(jinja):
            self.template, self.template_source = read_text(jinja), jinja
        elif isinstance(self.config.get("chat_template"), str):
            self.template, self.template_source = self.config["chat_template"], cfg_path
        elif isinstance(self.config.get("chat_template"), list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.config["chat_template"] if isinstance(t, dict)}
            if isinstance(named.get("default"), str):
                self.template, self.template_source = named["default"], cfg_path
        config_path = os.path.join(folder, "config.json")
        model_cfg = read_json(config_path) if os.path.exists(config_path) else {}
        positions = model_cfg.get("max_position_embeddings") if isinstance(model_cfg, dict) else None
        # The positions the model holds, as its config.json gives them (a rotary table's rows).
        self.context = positions if isinstance(positions, int) and positions > 0 else None
        self.special = {k: _token_text(self.config.get(k)) for k in ("bos_token", "eos_token", "pad_token",
                                                                      "unk_token")}
        self._compiled = None

    # -- tokens ------------------------------------------------------------------------------
    def encode(self, text: str, special: bool = True) -> list:
        """The token ids of `text`. `special`: the tokenizer's own additions (a BOS where its
        post-processor adds one); a rendered chat template holds its special tokens itself."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")  # tokenizers takes UTF-8: a lone surrogate ("\ud800") has none
        except UnicodeEncodeError as e:
            raise ValueError(f"text must be valid Unicode: it holds the lone surrogate {text[e.start]!r} at index "
                             f"{e.start}") from None
        ids = self.tokenizer.encode(text, add_special_tokens=special).ids
        bos = self.special["bos_token"]
        if special and self.config.get("add_bos_token") and bos is not None:
            bos_id = self.tokenizer.token_to_id(bos)
            if bos_id is not None and (not ids or ids[0] != bos_id):
                ids = [bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def pad_id(self) -> int:
        """The id left padding uses: the pad token's, else the EOS's, else 0 (masked either way)."""
        for name in ("pad_token", "eos_token"):
            token = self.special[name]
            if token is not None and self.tokenizer.token_to_id(token) is not None:
                return self.tokenizer.token_to_id(token)
        return 0

    def stream(self):
        """A text stream of one row's tokens: step(id) gives the text it completes ('' while
        a character's bytes are still coming). Special tokens give no text."""
        decoders = need("tokenizers").decoders
        return _Stream(self.tokenizer, decoders.DecodeStream(skip_special_tokens=True))

    # -- chat --------------------------------------------------------------------------------
    def render(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        """The chat template applied to `messages` ([{"role": ..., "content": ...}, ...]), in
        jinja2's immutable sandbox with the globals and filters transformers gives it."""
        messages = check_messages(messages)
        if self.template is None:
            raise ValueError(f"the model in {self.folder} has no chat template (tokenizer_config.json's chat_template, "
                             f"or chat_template.jinja); text without a template goes through generate(), onnx-offload "
                             f"generate --prompt, or the server's /v1/completions")
        jinja2 = need("jinja2")
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.template)
            except jinja2.TemplateError as e:  # a TemplateSyntaxError, which names its line
                raise ValueError(f"the chat template of {self.template_source} cannot be read by jinja2: "
                                 f"{type(e).__name__}: {e}") from None
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{k: v for k, v in self.special.items() if v is not None}, **extra)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template of {self.template_source} failed on these messages: {e}") from None


class _Stream:
    def __init__(self, tokenizer, decode_stream):
        self._tokenizer, self._stream = tokenizer, decode_stream

    def step(self, token: int) -> str:
        return self._stream.step(self._tokenizer, int(token)) or ""


def check_messages(messages) -> list:
    """`messages` with each content a str: TypeError unless it is a non-empty list of
    {"role": str, "content": str or a list of text parts}. Text parts ({"type": "text",
    "text": ...}, as OpenAI's API and transformers' pipelines take them) are joined, as the
    server joins them: a text-only template renders a string."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            m = {**m, "content": "".join(p["text"] for p in content)}
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"messages[{i}] must be a dict with a str 'role' and a str 'content' (or a list of "
                            f"text parts), got {m!r:.200}")
        out.append(m)
    return out


def _environment():
    """transformers' environment for chat templates: ImmutableSandboxedEnvironment with
    trim_blocks and lstrip_blocks, the loopcontrols extension, a tojson filter that keeps
    non-ASCII text, raise_exception() for a template that refuses its messages, and
    strftime_now(format), today's date as Llama 3's templates write it."""
    sandbox = need("jinja2.sandbox")
    jinja2 = need("jinja2")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
