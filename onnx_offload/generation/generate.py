"""Token-by-token generation with the KV cache on the device.

``decoder_spec`` reads the export layout from the graph's inputs and outputs:
``input_ids``, ``attention_mask``, ``past_key_values.N.key/value`` in, ``logits`` and
``present.N.key/value`` out, and ``position_ids`` when the model takes them. A graph
with ``GroupQueryAttention`` is onnxruntime-genai's builder layout (the cache is shared
between past and present); any other is standard attention: with position_ids the
cache grows in buckets; without, the model may count positions from the past's
length, so the past is fed at its exact length. ``genai_config.json`` beside the model
supplies what the graph leaves symbolic (head counts, the context length) and the EOS
ids.

A generation runs the prompt uncaptured, then one step per token at fixed shapes and
addresses: token ids, attention mask, positions and logits live in device buffers the
step writes in place, so under capture every decode step replays the same graphs (one
per segment when the weights stream). The exact layout's shapes grow every step: its
steps run uncaptured.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import operator
import os
import re
import reprlib
import warnings
from typing import Dict, Iterator, Optional, Sequence

import numpy as np
import onnxruntime as ort

from ..engines import FixedBuffer, IOInfo, numpy_dtype
from ..engines import StreamEngine
from ..errors import BudgetExceeded, OffloadError, OffloadWarning, UnsupportedModel
from ..interrupts import deferred_interrupts
from .kv_cache import BucketKV, DeviceBuffers, ExactKV, SharedKV, bucket_for, peak_bytes, write

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
# The positions the streaming engine plans a decoder's KV cache for at construction; a
# generation that needs more plans again.
DEFAULT_CONTEXT = 4096
_GENERATIONS = itertools.count()  # names each generation's step plans
MAX_POSITIONS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    layout: str  # "gqa" (shared past/present), "standard" (bucketed) or "exact" (the past at its length)
    layers: int
    kv_heads: int
    head_size: int
    kv_dtype: np.dtype
    logits_dtype: np.dtype
    position_ids: bool
    max_length: Optional[int]  # the longest sequence: the lesser of genai_config.json's and the rotary table's
    eos_token_id: tuple
    ids_dtype: np.dtype = np.dtype(np.int64)  # of input_ids, attention_mask and position_ids,
    mask_dtype: np.dtype = np.dtype(np.int64)  # as the model declares them
    pos_dtype: np.dtype = np.dtype(np.int64)
    vocab: Optional[int] = None  # the logits' last dimension, when the graph gives it
    sliding_window: Optional[int] = None  # of the attention, as config.json beside the model gives it
    # do_sample, temperature, top_k and top_p as the model's files give them (key, value) pairs:
    # the defaults of the generate() arguments a caller leaves unset
    sampling: tuple = ()


def _load_json(path: str):
    """The JSON value in `path`; ValueError for a file that is no JSON, or one nested too
    deeply for the parser (which recurses once per level)."""
    with open(path) as f:
        try:
            return json.load(f)
        except RecursionError:
            raise ValueError("it is nested too deeply to read") from None


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 8, 80, 80


def _shown(value) -> str:
    """A config value for an error message: its repr, cut short in depth and length."""
    return _REPR.repr(value)


def read_genai_config(model_dir: Optional[str]) -> dict:
    """The parts of genai_config.json that generate() reads, checked; without one, the EOS
    ids of Hugging Face's generation_config.json or config.json beside the model."""
    path = os.path.join(model_dir, "genai_config.json") if model_dir else None
    if not path or not os.path.exists(path):
        eos = read_hf_eos(model_dir)
        return {"eos": tuple(eos)} if eos else {}
    try:
        cfg = _load_json(path)
        model = cfg.get("model", {})
        decoder = model.get("decoder", {})
        search = cfg.get("search", {})
        if not all(isinstance(x, dict) for x in (model, decoder, search)):
            raise ValueError("'model', 'model.decoder' and 'search' must be objects")
        out = {}
        for key, value in (("kv_heads", decoder.get("num_key_value_heads")), ("head_size", decoder.get("head_size")),
                           ("max_length", search.get("max_length") or model.get("context_length"))):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{key} must be a positive integer, got {_shown(value)}")
                out[key] = value
        eos = model.get("eos_token_id", [])
        eos = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
        if eos == [] and "eos_token_id" not in model:  # none given here: Hugging Face's files say it
            eos = read_hf_eos(model_dir)
        if not isinstance(eos, list) or not all(isinstance(e, int) and not isinstance(e, bool) and -2**63 <= e < 2**63
                                                for e in eos):
            raise ValueError(f"model.eos_token_id must be a token id (a 64-bit integer) or a list of them, got "
                             f"{_shown(eos)}")
        out["eos"] = tuple(eos)
        out["sampling"] = _sampling_of(search)
        return out
    except (OSError, ValueError, AttributeError) as e:  # json.JSONDecodeError is a ValueError
        raise UnsupportedModel(f"{path} cannot be used: {e}") from None


SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def _sampling_of(section: dict) -> dict:
    """The sampling settings of a genai_config.json search section or a Hugging Face
    generation_config.json: those present, of their type (a value of another is left out)."""
    out = {}
    for key, default in SAMPLING_DEFAULTS.items():
        value = section.get(key)
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok:
            out[key] = value
    return out


def _hf_json(model_dir: Optional[str], name: str) -> dict:
    """The object in Hugging Face's file `name` beside the model (config.json,
    generation_config.json); {} where there is none, or it cannot be read, or it holds no
    object: such a file only ever supplies defaults."""
    path = os.path.join(model_dir, name) if model_dir else None
    if not path or not os.path.exists(path):
        return {}
    try:
        cfg = _load_json(path)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def read_sampling(model_dir: Optional[str], genai: dict) -> tuple:
    """The sampling defaults of a model, as onnxruntime-genai and Hugging Face read them:
    genai_config.json's search section, then generation_config.json for what it leaves
    out. (key, value) pairs."""
    found = dict(genai)
    for key, value in _sampling_of(_hf_json(model_dir, "generation_config.json")).items():
        found.setdefault(key, value)
    return tuple(sorted(found.items()))


def read_hf_eos(model_dir: Optional[str]) -> list:
    """The EOS ids Hugging Face's generate() would stop at: generation_config.json's
    eos_token_id, else config.json's (an id or a list of them); [] without either. A file
    that cannot be read, or an id that is not one, is no EOS."""
    for name in ("generation_config.json", "config.json"):
        eos = _hf_json(model_dir, name).get("eos_token_id")
        eos = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
        if isinstance(eos, list) and eos and all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < 2**63
                                                 for e in eos):
            return eos
    return []


def read_sliding_window(model_dir: Optional[str]) -> Optional[int]:
    """The sliding window of attention that config.json beside the model (as transformers
    saves it: Mistral, Phi-3, Gemma 2 and 3, Qwen2 with use_sliding_window, ...) gives,
    or None. Such a model places the window by the past's length, so a padded past would
    move it. A config.json that is not a model's is no window."""
    cfg = _hf_json(model_dir, "config.json")
    return _window_of(cfg, depth=3) if cfg else None


def _mentions(value, word: str, depth: int = 4) -> bool:
    """Whether a string in `value` (a string, or lists of them down to `depth` levels, as
    GPT-Neo's attention_types nests them) holds `word`."""
    if isinstance(value, str):
        return word in value
    return depth > 0 and isinstance(value, list) and any(_mentions(v, word, depth - 1) for v in value)


def _window_of(cfg: dict, depth: int) -> Optional[int]:
    """The window of `cfg` or of the configs nested in it (a multimodal model keeps its
    decoder's in text_config, or deeper: thinker_config.text_config)."""
    def count(v):
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    longest = count(cfg.get("max_position_embeddings"))
    local = _mentions(cfg.get("attention_layers"), "local") or _mentions(cfg.get("attention_types"), "local")  # GPT-Neo
    for w in (count(cfg.get("sliding_window")) if cfg.get("use_sliding_window") is not False else None,
              count(cfg.get("attention_chunk_size")),  # Llama 4's chunked attention, placed the same way
              count(cfg.get("window_size")) if local else None):
        if w is not None and (longest is None or w < longest):  # a window as long as the model is none
            return w
    if depth > 1:
        for k, v in cfg.items():
            if k.endswith("_config") and isinstance(v, dict) and (w := _window_of(v, depth - 1)) is not None:
                return w
    return None


def _dim(info: IOInfo, axis: int, fallback, what: str) -> int:
    d = info.shape[axis] if info.shape is not None and len(info.shape) > axis else None
    if isinstance(d, int) and d > 0:
        return d
    if fallback:
        return int(fallback)
    raise UnsupportedModel(f"{what} is symbolic in {info.name!r} and genai_config.json does not give it")


def decoder_spec(inputs: Sequence[IOInfo], outputs: Sequence[IOInfo], op_types, model_dir: Optional[str],
                 rotary_rows: Optional[int] = None) -> DecoderSpec:
    """`inputs`: the inputs a caller must feed; `rotary_rows`: the positions the model's
    rotary table holds, where it has one."""
    ins = {i.name: i for i in inputs}
    outs = {o.name: o for o in outputs}
    missing = [n for n in ("input_ids", "attention_mask") if n not in ins]
    missing += [n for n in ("logits",) if n not in outs]
    layers = sorted({int(m.group(1)) for n in ins if (m := _PAST.match(n))})
    if not layers:
        missing.append("past_key_values.N.key/value inputs")
    else:
        for i in range(max(layers) + 1):
            for kv in ("key", "value"):
                if f"past_key_values.{i}.{kv}" not in ins:
                    missing.append(f"past_key_values.{i}.{kv}")
                if f"present.{i}.{kv}" not in outs:
                    missing.append(f"present.{i}.{kv}")
    if missing:
        raise UnsupportedModel(
            "generate() needs a decoder with a KV cache (the layout of onnxruntime-genai's builder or of "
            f"Optimum / torch.onnx); this model lacks: {', '.join(missing)}")
    extra = [n for n in ins if n not in ("input_ids", "attention_mask", "position_ids") and not _PAST.match(n)]
    if extra:
        raise UnsupportedModel(f"generate() feeds input_ids, attention_mask, position_ids and the KV cache; this "
                               f"model also requires {', '.join(extra)}")
    dtypes = {}
    for name in ("input_ids", "attention_mask", "position_ids"):
        dt = ins[name].dtype if name in ins else np.dtype(np.int64)
        if dt is None or dt not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise UnsupportedModel(f"generate() feeds {name} as int32 or int64; the model declares {ins[name].type}")
        dtypes[name] = dt
    cfg = read_genai_config(model_dir)
    past0 = ins["past_key_values.0.key"]
    kv_heads = _dim(past0, 1, cfg.get("kv_heads"), "the KV head count")
    head_size = _dim(past0, 3, cfg.get("head_size"), "the head size")
    for i in range(max(layers) + 1):
        for kv in ("key", "value"):
            info = ins[f"past_key_values.{i}.{kv}"]
            rank = len(info.shape) if info.shape else None  # [] or None: not declared
            if rank not in (None, 4):
                raise UnsupportedModel(f"generate() feeds the past as [batch, kv_heads, length, head_size]; "
                                       f"{info.name} has rank {rank}")
            got = [info.shape[a] if rank else None for a in (1, 3)]
            differs = any(isinstance(g, int) and g != w for g, w in zip(got, (kv_heads, head_size)))
            if differs or info.dtype != past0.dtype:
                raise UnsupportedModel(
                    f"generate() keeps one KV shape and type for every layer, keys and values: {info.name} is "
                    f"{info.type} [.., {got[0]}, .., {got[1]}], {past0.name} {past0.type} [.., {kv_heads}, .., "
                    f"{head_size}]")
    logits = outs["logits"]
    if logits.shape and len(logits.shape) not in (2, 3):
        raise UnsupportedModel(f"generate() reads logits as [batch, sequence, vocab] or, of the last position "
                               f"only, [batch, vocab]; this model's have rank {len(logits.shape)}")
    bounds = [n for n in (cfg.get("max_length"), rotary_rows) if n]
    vocab = logits.shape[-1] if logits.shape else None
    # The standard layout pads the past to a bucket, which needs the positions from
    # position_ids and a mask that places nothing by the past's length: else the past
    # goes in at its exact length.
    window = read_sliding_window(model_dir) if "GroupQueryAttention" not in op_types else None
    layout = "gqa" if "GroupQueryAttention" in op_types else \
        "standard" if "position_ids" in ins and window is None else "exact"
    return DecoderSpec(layout, max(layers) + 1, kv_heads, head_size, past0.dtype, logits.dtype, "position_ids" in ins,
                       min(bounds) if bounds else None, cfg.get("eos", ()), dtypes["input_ids"], dtypes["attention_mask"],
                       dtypes["position_ids"], vocab if isinstance(vocab, int) and vocab > 0 else None, window,
                       read_sampling(model_dir, cfg.get("sampling", {})))


def rotary_rows(model) -> Optional[int]:
    """The positions a GroupQueryAttention rotary table (its cos_cache input) holds: the
    longest sequence the model can run without a genai_config.json saying so."""
    dims = {t.name: t.dims for t in model.graph.initializer}
    rows = [int(dims[n.input[7]][0]) for n in model.graph.node
            if n.op_type == "GroupQueryAttention" and len(n.input) > 7 and n.input[7] in dims and dims[n.input[7]]]
    return min(rows) if rows else None


# ---------------------------------------------------------------------- sampling
@dataclasses.dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if operator.index(self.top_k) < 0:  # TypeError for a non-integer
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:  # False for nan too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def pick(self, logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One token per row of `logits` [batch, vocab]."""
        if not self.do_sample:
            return logits.argmax(axis=-1).astype(np.int64)
        logits = logits.astype(np.float64)
        out = np.empty(len(logits), np.int64)
        # Shifted before scaling: the largest becomes 0, so no temperature overflows exp
        # (a tiny one sends the others to -inf, whose exp is 0).
        with np.errstate(over="ignore"):
            scaled = (logits - logits.max(axis=-1, keepdims=True)) / self.temperature
        for r, row in enumerate(scaled):
            order = np.argsort(-row, kind="stable")
            if self.top_k:
                order = order[:self.top_k]
            p = np.exp(row[order])
            p /= p.sum()
            if self.top_p < 1:
                keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
                order, p = order[:keep], p[:keep] / p[:keep].sum()
            out[r] = order[rng.choice(len(order), p=p)]
        return out


# ---------------------------------------------------------------------- the loop
class Generation:
    """One generation's device state: the KV cache and the step buffers, freed on close."""

    def __init__(self, session, spec: DecoderSpec, batch: int, prompt: int, total: int):
        dev = session.device
        self.session, self.spec, self.batch = session, spec, batch
        self._name = next(_GENERATIONS)
        self._keys = set()  # the runner's plans for this generation's buffers
        self._closed = False
        # What this generation holds at most, for a shortage to plan with: the cache, and
        # the step buffers (ids, positions, mask, logits) in scratch.
        self.chunk = chunk = prompt_chunk(prompt, session.config.prefill_chunk)
        peak = kv_peak(spec, batch, prompt, total, dev.granularity, session.config.prefill_chunk)
        mask_peak = total if spec.layout == "gqa" else bucket_for(total) + max(1, chunk)
        rows = chunk_rows(spec, batch, prompt, chunk)
        io_peak = batch * (2 * 8 + 8 * mask_peak + 4 * (spec.vocab or 0))
        io_peak += rows * (chunk * (3 * 8 + 4 * (spec.vocab or 0)) + 8 * mask_peak)
        # and, per segment boundary, a mask-sized value (as the mask a split model's
        # layers pass on; the hidden state of one position is smaller), twice: the
        # buffers of each bucket's steps are kept until the generation ends, and the
        # buckets double
        boundary = 2 * batch * 8 * (total + 1)
        self.kv_bufs = DeviceBuffers(dev, "kv",
                                     lambda nbytes, full: session._kv_shortage(nbytes, peak, io_peak, boundary,
                                                                               full))
        # A step buffer short of room is the same shortage, seen from the scratch zone.
        self.io_bufs = DeviceBuffers(dev, "scratch",
                                     lambda nbytes, full: session._kv_shortage(0, peak, io_peak + nbytes,
                                                                               boundary, full))
        try:
            if spec.layout == "gqa":
                self.cache = SharedKV(self.kv_bufs, spec.layers, batch, spec.kv_heads, total, spec.head_size,
                                      spec.kv_dtype)
                mask_len = total
            else:
                form = ExactKV if spec.layout == "exact" else BucketKV
                self.cache = form(self.kv_bufs, spec.layers, batch, spec.kv_heads, spec.head_size, spec.kv_dtype,
                                  prompt, *((max(1, chunk),) if form is BucketKV else ()))
                mask_len = None
            self.ids = self.io_bufs.new([batch, 1], spec.ids_dtype)
            self.pos = self.io_bufs.new([batch, 1], spec.pos_dtype) if spec.position_ids else None
            self.mask = self.io_bufs.new([batch, mask_len], spec.mask_dtype) if mask_len else None
            self.logits = None
            self.prompt_mask: Optional[np.ndarray] = None  # the prompt's padding, None for none
            self._tokens = None  # each row's tokens so far (the next one's position)
            self._logits_shape = None  # the prompt's logits' shape: [b, p, vocab], or [b, vocab] of the last
            self._bound = None  # (key, feeds, outputs) of the decode steps
            self._chunk_bufs = None  # ids, mask, positions and logits of a prompt chunk (GQA)
            self._first_bufs: Dict[tuple, FixedBuffer] = {}  # a GQA prompt's first step's, by shape
            # The zero fills are queued on the compute stream; the CPU EP runs on this thread.
            dev.compute_stream.synchronize()
        except BaseException:
            self.close()
            raise

    def fits(self, spec: DecoderSpec, batch: int, prompt: int, total: int) -> bool:
        """Whether a generation of these sizes runs on this one's buffers, and so replays the
        graphs captured on them: the builder layout's shared cache, of the same length (the
        steps' shapes, and so ORT's kernels, stay those of a new generation) and batch,
        its prompt chunked alike."""
        return (self.reusable() and spec == self.spec and batch == self.batch and total == self.cache.length
                and prompt_chunk(prompt, self.session.config.prefill_chunk) == self.chunk)

    def reusable(self) -> bool:
        """Whether the next generation may take these buffers: the shared cache, whose
        length is fixed at creation. (Only a generation whose steps all completed is
        offered: generate_tokens closes one that raised.)"""
        return not self._closed and self.spec.layout == "gqa"

    def close(self) -> None:
        """Gives every buffer back; idempotent, and whole even when Ctrl-C or an error
        arrives half way (the interrupt is raised once everything is back)."""
        s = self.session
        with s._lock, deferred_interrupts():
            if self._closed:
                return
            self._closed = True
            try:
                # The plans (and graphs) of these buffers go first: nothing may replay
                # onto memory the buffers below give back.
                if not s._closed and s._runner is not None:
                    s._runner.drop_plans(self._keys)
            finally:
                try:
                    self.io_bufs.close()
                finally:
                    self.kv_bufs.close()

    # ---------------------------------------------------------------- steps
    # Each step, cache growth included, runs under the session's lock with Ctrl-C held
    # back: allocations may make the weights give way, which the residency manager must
    # not see from two threads at once.
    def prompt(self, input_ids: np.ndarray, mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Runs the prompt (`mask`: its attention mask, None for all ones); returns the last
        position's logits [batch, vocab]."""
        with self.session._step():
            return self._prompt(input_ids, mask)

    def decode(self, tokens: np.ndarray, length: int) -> tuple:
        """One token per row at position `length - 1` (so `length` positions in all).
        Returns (logits [batch, vocab], whether the step ran under a plan made before it)."""
        with self.session._step():
            return self._decode(tokens, length)

    def _prompt(self, input_ids: np.ndarray, mask: Optional[np.ndarray]) -> np.ndarray:
        b, p = input_ids.shape
        self.prompt_mask = mask
        # A row's positions count its tokens, not its padding (as HF's generate sets them).
        self._tokens = np.full(b, p, np.int64) if mask is None else mask.sum(axis=1)
        if self.chunk:
            return self._prompt_in_chunks(input_ids, mask)
        logits = self._no_past_step(input_ids, mask)
        self._logits_shape = tuple(logits.shape())
        return last_logits(self.session.device, logits)

    def _no_past_step(self, ids: np.ndarray, mask: Optional[np.ndarray], row: Optional[int] = None) -> ort.OrtValue:
        """The first tokens of the prompt (all of it, when it runs in one step) with no past;
        the cache takes their keys and values (the shared layout's ORT writes in place:
        every row's buffers, or row `row`'s, on buffers kept for the next generation, see
        _gqa_first; the standard layouts' step runs once, its present copied into the
        cache). Returns the step's logits (their value)."""
        spec, s = self.spec, self.session
        b, p = ids.shape
        arrays = {"input_ids": np.ascontiguousarray(ids, spec.ids_dtype),
                  "attention_mask": np.ascontiguousarray(np.ones((b, p)) if mask is None else mask, spec.mask_dtype)}
        if spec.position_ids:
            pos = np.tile(np.arange(p), (b, 1)) if mask is None else np.where(mask == 1, np.cumsum(mask, 1) - 1, 1)
            arrays["position_ids"] = np.ascontiguousarray(pos, spec.pos_dtype)
        if spec.layout == "gqa":
            return self._gqa_first(arrays, row)
        feeds = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in arrays.items()}
        empty = ort.OrtValue.ortvalue_from_numpy(np.zeros((b, spec.kv_heads, 0, spec.head_size), spec.kv_dtype))
        for i in range(spec.layers):
            for kv in ("key", "value"):
                feeds[f"past_key_values.{i}.{kv}"] = empty
        values = s._run_bound(feeds, {}, fixed=False)[0]
        self.cache.fill_from([values[f"present.{i}.{kv}"] for i in range(spec.layers) for kv in ("key", "value")], p)
        return values["logits"]

    def _gqa_first(self, arrays: Dict[str, np.ndarray], row: Optional[int]) -> ort.OrtValue:
        """The first step of a prompt of the shared layout (`arrays`: its ids, mask and
        positions), on buffers of this generation's for its shape, so that its graph is
        kept and the next generation of the shape replays it. The logits of the rows after
        the first of a prompt in chunks go to the chunks' buffer (the first row's chunks
        made it); else to the runner's own buffer."""
        s, dev = self.session, self.session.device
        feeds: Dict[str, ort.OrtValue] = {}
        outputs: Dict[str, ort.OrtValue] = {}
        self.cache.bind(feeds, outputs, row=row)
        writes = []
        for name, array in arrays.items():
            buf = self._first_bufs.get((name, array.shape))
            if buf is None:
                buf = self._first_bufs[(name, array.shape)] = self.io_bufs.new(list(array.shape), array.dtype)
            writes.append((buf, array))
            feeds[name] = buf.value
        write(dev, *writes)
        rows, n = arrays["input_ids"].shape
        if row:  # the same for every generation of these buffers: the key stands for it
            clogits = self._chunk_bufs[3]
            shape = [rows, n] + clogits.shape[2:] if len(clogits.shape) == 3 else clogits.shape
            outputs["logits"] = FixedBuffer.on(dev, clogits.ptr, shape, clogits.dtype).value
        key = ("prompt", self._name, row, n)
        self._keys.add(key)
        # Kept by the streaming engine, whose graph of the step holds its page-ins; the
        # segment runner captures a few shapes for the session's life, the decode steps'.
        values = s._run_bound(feeds, outputs, fixed=isinstance(s._runner, StreamEngine), key=key)[0]
        return values["logits"]

    # ------------------------------------------------------------ the prompt in chunks
    def _pieces(self, p: int) -> list:
        """(start, length) of each chunk: the remainder first, then whole chunks, so that
        every chunk after the first has one shape (one captured graph)."""
        c = self.chunk
        first = p - c * ((p - 1) // c)
        return [(0, first)] + [(start, c) for start in range(first, p, c)]

    def _prompt_in_chunks(self, input_ids: np.ndarray, mask: Optional[np.ndarray]) -> np.ndarray:
        """The prompt fed `chunk` tokens at a time, each chunk appending to the cache, so a
        step's memory is bounded by the chunk whatever the prompt's length. Returns the
        last position's logits [batch, vocab]."""
        spec = self.spec
        if spec.layout == "gqa":
            rows = [self._gqa_row(input_ids[r:r + 1], r) for r in range(self.batch)] if self.batch > 1 else \
                [self._gqa_row(input_ids, None)]
            return np.concatenate(rows, axis=0)
        b, p = input_ids.shape
        pos = np.tile(np.arange(p), (b, 1)) if mask is None else np.where(mask == 1, np.cumsum(mask, 1) - 1, 1)
        full = np.ones((b, p), np.int64) if mask is None else mask
        logits = None
        for start, n in self._pieces(p):
            if start == 0 and spec.layout != "exact":  # as an unchunked prompt: no past
                logits = self._no_past_step(input_ids[:, :n], None if mask is None else mask[:, :n])
                continue
            feeds = {"input_ids": _host(input_ids[:, start:start + n], spec.ids_dtype)}
            if spec.position_ids:
                feeds["position_ids"] = _host(pos[:, start:start + n], spec.pos_dtype)
            outputs: Dict[str, ort.OrtValue] = {}
            self.cache.ensure(start + n)
            if spec.layout == "exact":
                feeds["attention_mask"] = _host(full[:, :start + n], spec.mask_dtype)
            else:  # the past padded to its bucket, the padding masked out, as a decode step
                m = np.zeros((b, self.cache.bucket + n), np.int64)
                m[:, :start] = full[:, :start]
                m[:, self.cache.bucket:] = full[:, start:start + n]
                feeds["attention_mask"] = _host(m, spec.mask_dtype)
            self.cache.bind(feeds, outputs, new=n)
            values = self.session._run_bound(feeds, outputs, fixed=False)[0]
            if spec.layout == "exact":
                self.cache.advance(n)
            else:
                self.cache.append(start, n)
            logits = values["logits"]
        self._logits_shape = (b,) + tuple(logits.shape())[1:]
        return last_logits(self.session.device, logits)

    def _gqa_row(self, ids: np.ndarray, row: Optional[int]) -> np.ndarray:
        """One row's prompt (all rows when `row` is None) in chunks, through views of its
        rows of the shared cache: ORT's CUDA GroupQueryAttention takes a chunk beside a
        past for one row at a time. The first chunk runs as an unchunked prompt (the mask
        as long as it); the others see the cache's whole length, ones up to their end, as
        a decode step does, and share one shape and one set of buffers (one graph)."""
        spec, s, dev = self.spec, self.session, self.session.device
        rows, p = ids.shape
        length = self.cache.length
        logits = None
        for start, n in self._pieces(p):
            if start == 0:
                logits = self._no_past_step(ids[:, :n], None, row)
                continue
            outputs: Dict[str, ort.OrtValue] = {}
            feeds: Dict[str, ort.OrtValue] = {}
            self.cache.bind(feeds, outputs, row=row)
            if self._chunk_bufs is None or self._chunk_bufs[0].shape[0] != rows:
                shape = logits.shape()
                self._chunk_bufs = (self.io_bufs.new([rows, n], spec.ids_dtype),
                                    self.io_bufs.new([rows, length], spec.mask_dtype),
                                    self.io_bufs.new([rows, n], spec.pos_dtype) if spec.position_ids else None,
                                    self.io_bufs.new([rows, n] + list(shape[2:]) if len(shape) == 3
                                                     else [rows] + list(shape[1:]), spec.logits_dtype))
            cids, cmask, cpos, clogits = self._chunk_bufs
            m = np.zeros((rows, length), np.int64)
            m[:, :start + n] = 1
            writes = [(cids, ids[:, start:start + n]), (cmask, m)]
            if cpos is not None:
                writes.append((cpos, np.tile(np.arange(start, start + n), (rows, 1))))
            write(dev, *writes)
            feeds.update({"input_ids": cids.value, "attention_mask": cmask.value})
            if cpos is not None:
                feeds["position_ids"] = cpos.value
            outputs["logits"] = clogits.value
            key = ("prefill", self._name, row, n)
            self._keys.add(key)
            s._run_bound(feeds, outputs, fixed=True, key=key)
            logits = clogits.value
        if self._logits_shape is None:
            self._logits_shape = (self.batch,) + tuple(logits.shape())[1:]
        return last_logits(dev, logits)

    def _decode(self, tokens: np.ndarray, length: int) -> tuple:
        spec, s, b = self.spec, self.session, self.batch
        cur = length - 1  # the new token's position; `cur` positions are cached
        if self.logits is None:
            self.logits = self.io_bufs.new([b, 1, self._logits_shape[-1]] if len(self._logits_shape) == 3
                                           else [b, self._logits_shape[-1]], spec.logits_dtype)
        if spec.layout == "exact":
            return self._decode_exact(tokens, cur)
        if spec.layout == "gqa":
            mask = np.zeros((b, self.mask.shape[1]), np.int64)
            mask[:, :length] = 1
        else:
            self.cache.ensure(cur + 1)  # a step boundary: the only place the cache grows
            if self.mask is None or self.mask.shape[1] != self.cache.bucket + 1:
                if self.mask is not None:
                    self.io_bufs.free(self.mask)
                self.mask = self.io_bufs.new([b, self.cache.bucket + 1], spec.mask_dtype)
            mask = np.zeros((b, self.cache.bucket + 1), np.int64)
            mask[:, :cur] = 1
            if self.prompt_mask is not None:
                mask[:, :self.prompt_mask.shape[1]] = self.prompt_mask
            mask[:, -1] = 1
        writes = [(self.ids, tokens.reshape(b, 1)), (self.mask, mask)]
        if self.pos is not None:
            writes.append((self.pos, self._tokens[:, None]))
        # One wait (on the CPU) for all of them; it also orders the last step's cache
        # copies before this step, as the stream does on CUDA.
        write(s.device, *writes)
        # The buffers' shapes and addresses change only with the bucket (a new mask and
        # cache): the key says so without reading every value, and the bindings are
        # built once per key.
        key = ("generate", self._name, self.cache.bucket if spec.layout != "gqa" else self.cache.length)
        if self._bound is None or self._bound[0] != key:
            feeds = {"input_ids": self.ids.value, "attention_mask": self.mask.value}
            if self.pos is not None:
                feeds["position_ids"] = self.pos.value
            outputs = {"logits": self.logits.value}
            self.cache.bind(feeds, outputs)
            self._bound = (key, feeds, outputs)
            self._keys.add(key)
        _, feeds, outputs = self._bound

        def step() -> bool:
            _, replayed = s._run_bound(feeds, outputs, fixed=True, key=key)
            if not replayed and s._runner.streaming and s._runner.capture.enabled:
                # The first step of these shapes learned the boundaries' sizes; the same step
                # again writes the same cache positions and runs under the new plan's graphs.
                _, replayed = s._run_bound(feeds, outputs, fixed=True, key=key)
            return replayed
        try:
            replayed = step()
        except RuntimeError as e:
            if spec.layout != "standard" or isinstance(e, OffloadError):
                raise
            try:  # once more as it was: a failure of the moment (memory short) is not the padding's
                replayed = step()
            except RuntimeError as again:
                if isinstance(again, OffloadError):
                    raise
                return self._pad_refused(tokens, cur, e)
        self._tokens = self._tokens + 1
        if spec.layout != "gqa":
            self.cache.append(cur)  # in order on the stream; the next step's write waits for it
        # ORT waited for its work before returning, so the logits are complete; numpy()
        # is a host copy of them.
        return last_position(self.logits.value.numpy()), replayed

    def _pad_refused(self, tokens: np.ndarray, cur: int, error: RuntimeError) -> tuple:
        """ORT failed twice on a step of the padded past (a model may size a table by the
        past's length, as GPT-2's causal mask is sliced from a fixed one): the cache is laid
        out at its exact length and the step runs again so. Should it pass, the session
        feeds this model's past at its exact length from then on (in segments, where the
        streaming engine ran it: it would capture a graph per step); should it fail too,
        ORT's first error is raised."""
        s, old = self.session, self.cache
        try:
            cache = ExactKV(self.kv_bufs, self.spec.layers, self.batch, self.spec.kv_heads, self.spec.head_size,
                            self.spec.kv_dtype, cur + 1)
        except BudgetExceeded as short:  # no room for the other layout: ORT's error stands
            raise error from short
        s._runner.drop_plans(self._keys)
        self.cache, self._bound = cache, None
        try:
            cache.take_from(old, cur)
            old.release()
            self.io_bufs.free(self.mask)
            self.mask = None
            self.spec = dataclasses.replace(self.spec, layout="exact")
            if isinstance(s._runner, StreamEngine) and s.config.engine != "graph":
                s._run_in_segments(s._segments_from[0])
            result = self._decode_exact(tokens, cur)
        except (RuntimeError, ValueError) as other:  # the other layout fails too: ORT's error stands
            raise error from other
        if s._decoder_spec.layout == "standard":
            s._decoder_spec = dataclasses.replace(s._decoder_spec, layout="exact")
            why = (f"generate(): ONNX Runtime failed on a past padded to {old.bucket} positions for a sequence of "
                   f"{cur + 1} ({str(error).strip().splitlines()[-1][:300]}); this model's past is fed at its exact "
                   f"length from now on, and its decode steps run uncaptured")
            s._notes.append(why)
            warnings.warn(why, OffloadWarning, stacklevel=5)
        return result

    def _decode_exact(self, tokens: np.ndarray, cur: int) -> tuple:
        """A step of the exact layout: the past of `cur` positions as it is, the mask at
        the front of a buffer with room for the cache's (all ones, and written once, when
        the prompt has no padding). Its shapes are new every step: it runs uncaptured."""
        spec, s, b = self.spec, self.session, self.batch
        self.cache.ensure(cur + 1)
        writes = [(self.ids, tokens.reshape(b, 1))]
        if self.mask is None or self.mask.shape[0] < b * (cur + 1):
            if self.mask is not None:
                self.io_bufs.free(self.mask)
                self.mask = None
            self.mask = self.io_bufs.new([b * (self.cache.capacity + 1)], spec.mask_dtype)
            if self.prompt_mask is None:
                writes.append((self.mask, np.ones(self.mask.shape, np.int64)))
        mask = FixedBuffer.on(s.device, self.mask.ptr, [b, cur + 1], spec.mask_dtype)
        if self.prompt_mask is not None:
            rows = np.ones((b, cur + 1), np.int64)
            rows[:, :self.prompt_mask.shape[1]] = self.prompt_mask
            writes.append((mask, rows))
        if self.pos is not None:  # a model with position_ids whose padded past ORT refused
            writes.append((self.pos, self._tokens[:, None]))
        write(s.device, *writes)
        feeds = {"input_ids": self.ids.value, "attention_mask": mask.value}
        if self.pos is not None:
            feeds["position_ids"] = self.pos.value
        outputs = {"logits": self.logits.value}
        self.cache.bind(feeds, outputs)
        s._run_bound(feeds, outputs, fixed=False)
        self._tokens = self._tokens + 1
        self.cache.advance()
        return last_position(self.logits.value.numpy()), False


def prompt_chunk(prompt: int, prefill_chunk: int) -> int:
    """The tokens of a prompt's chunks: `prefill_chunk` for a prompt longer than it, else 0
    (the prompt runs in one step)."""
    return prefill_chunk if prompt > prefill_chunk else 0


def kv_peak(spec: DecoderSpec, batch: int, prompt: int, total: int, granularity: int, prefill_chunk: int) -> int:
    """The most committed bytes the KV cache of a generation holds (kv_cache.peak_bytes),
    its prompt chunked as Generation chunks it."""
    return peak_bytes(spec.layout, spec.layers, batch, spec.kv_heads, spec.head_size, spec.kv_dtype, prompt, total,
                      granularity, chunk=prompt_chunk(prompt, prefill_chunk))


def chunk_rows(spec: DecoderSpec, batch: int, prompt: int, chunk: int) -> int:
    """The rows of one prompt chunk's step: GroupQueryAttention's prompt runs in chunks one
    row at a time; the standard layouts chunk the whole batch."""
    return 1 if spec.layout == "gqa" and chunk and prompt > chunk else batch


def _host(array: np.ndarray, dtype) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array, dtype))


def last_logits(device, value: ort.OrtValue) -> np.ndarray:
    """The last position's logits [batch, vocab], as float32, of a step's logits value:
    only those rows come to the host. (A prompt's logits of every position are the
    largest copy of its step: 131 MB for 512 tokens of a 128k vocabulary.)"""
    shape = value.shape()
    if len(shape) != 3 or shape[1] == 1:
        return last_position(np.asarray(value.numpy()))
    rows, n, vocab = shape
    dtype = numpy_dtype(value.data_type())
    row = vocab * dtype.itemsize
    ptr = value.data_ptr()
    tails = [FixedBuffer.on(device, ptr + ((r + 1) * n - 1) * row, [1, vocab], dtype).value.numpy() for r in range(rows)]
    return np.concatenate(tails).astype(np.float32)


def last_position(logits: np.ndarray) -> np.ndarray:
    """The last position's logits [batch, vocab], as float32, of [batch, sequence, vocab]
    logits or of [batch, vocab] ones (a model that returns the last position only)."""
    return (logits[:, -1, :] if logits.ndim == 3 else logits).astype(np.float32)


def check_generate_args(session, input_ids, max_new_tokens, eos_token_id, attention_mask=None, seed=None):
    """(ids [batch, prompt] int64, new tokens, EOS ids, the prompt's mask [batch, prompt]
    int64 or None for all ones) for a generation, or a clear error before anything runs."""
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
        raise ValueError(f"input_ids must be [batch, prompt] with a non-empty prompt, got shape {ids.shape}")
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"input_ids must be integers, got {ids.dtype}")
    new = operator.index(max_new_tokens)  # TypeError for 2.5 or "3"
    if new < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if seed is not None and (isinstance(seed, bool) or operator.index(seed) < 0):
        raise ValueError(f"seed must be an integer >= 0 or None, got {seed!r}")
    spec = session.decoder_spec
    if ids.min() < 0 or (spec.vocab and ids.max() >= spec.vocab):
        raise ValueError(f"token ids must lie in [0, {spec.vocab or 'the vocabulary size'}), got ids from "
                         f"{ids.min()} to {ids.max()}")
    ids = ids.astype(np.int64)
    positions = ids.shape[1] + max(new - 1, 0)  # the last token is never fed back
    if spec.max_length and positions > spec.max_length:
        raise ValueError(f"a prompt of {ids.shape[1]} and {new} new tokens need {positions} positions; the model "
                         f"holds {spec.max_length}")
    if positions > MAX_POSITIONS:
        raise ValueError(f"a prompt of {ids.shape[1]} and {new} new tokens need {positions} positions; generate() "
                         f"holds at most {MAX_POSITIONS} (positions and masks may be int32)")
    if eos_token_id is None:
        eos = spec.eos_token_id
    else:
        arr = np.atleast_1d(np.asarray(eos_token_id))
        if arr.ndim != 1 or (arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer))):
            raise TypeError(f"eos_token_id must be an integer or a sequence of integers, got {eos_token_id!r}")
        eos = tuple(int(e) for e in arr)
        if any(not -2**63 <= e < 2**63 for e in eos):
            raise ValueError(f"eos_token_id must be token ids (64-bit integers), got {eos_token_id!r}")
    return ids, new, eos, check_prompt_mask(spec, attention_mask, ids.shape)


def check_prompt_mask(spec: DecoderSpec, attention_mask, shape) -> Optional[np.ndarray]:
    """The prompt's attention mask as int64, or None when it is all ones (or not given)."""
    if attention_mask is None:
        return None
    mask = np.asarray(attention_mask)
    if mask.ndim == 1:
        mask = mask[None, :]
    if mask.shape != tuple(shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {list(shape)}, got {list(mask.shape)}")
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)) or not np.isin(mask, (0, 1)).all():
        raise ValueError("attention_mask must hold 0 (padding) and 1 (a token) only")
    mask = mask.astype(np.int64)
    if not mask.any(axis=1).all():
        raise ValueError("every row of attention_mask needs at least one token (a 1)")
    if mask.all():
        return None
    # Each new token goes after the prompt's last column: a 0 after a 1 would leave
    # padding inside a row's sequence, and its positions and cache out of step.
    falls = (np.diff(mask, axis=1) < 0).any(axis=1)
    if falls.any():
        raise ValueError(f"attention_mask row {int(np.flatnonzero(falls)[0])} has a 0 after a 1 (right padding, or a "
                         f"gap), which generate() does not support: it takes left padding, each row's zeros before "
                         f"its tokens, as a tokenizer with padding_side='left' gives it")
    if spec.layout == "gqa":
        raise ValueError("padding in attention_mask needs standard attention: GroupQueryAttention's cache "
                         "holds each row's tokens from position 0, so generate rows of different lengths "
                         "one at a time")
    return mask


def generate_tokens(session, ids: np.ndarray, new: int, sampling: Sampling, seed: Optional[int],
                    eos: tuple, mask: Optional[np.ndarray] = None) -> Iterator[np.ndarray]:
    """Yields each step's new tokens [batch]; rows that reached EOS repeat their EOS.
    The arguments come from check_generate_args."""
    if new == 0:
        return
    spec = session.decoder_spec
    rng = np.random.default_rng(seed)
    eos_ids = np.array(eos, np.int64)
    b, p = ids.shape
    gen = session._new_generation(spec, b, p, p + max(new - 1, 0))
    kept = False
    try:
        logits = gen.prompt(ids, mask)
        done = np.zeros(b, bool)
        ended = np.zeros(b, np.int64)  # the EOS id each finished row produced
        for step in range(new):
            tokens = sampling.pick(logits, rng)
            if eos:
                tokens = np.where(done, ended, tokens)
                now = ~done & (tokens[:, None] == eos_ids).any(axis=1)
                ended = np.where(now, tokens, ended)
                done |= now
            last = done.all() or step + 1 == new
            if last:
                # The cache goes to the session before the last token is handed over (kept
                # for the next generation of this shape, or given back): a caller that
                # takes exactly what it asked for never resumes this generator.
                session._park(gen)
                kept = True
            yield tokens
            if last:
                return
            logits, _ = gen.decode(tokens, p + step + 1)
    finally:
        if not kept:  # an error, an interrupt, or a caller that stopped early
            gen.close()  # idempotent
