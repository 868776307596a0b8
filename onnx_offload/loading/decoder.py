"""What a decoder's graph and the files beside it say about generating with it.

``decoder_spec`` reads the export layout from the graph's inputs and outputs:
``input_ids``, ``attention_mask``, ``past_key_values.N.key/value`` in, ``logits`` and
``present.N.key/value`` out, and ``position_ids`` when the model takes them. A graph
with ``GroupQueryAttention`` is onnxruntime-genai's builder layout (the cache is shared
between past and present); any other is standard attention: with position_ids the
cache grows in buckets; without, the model may count positions from the past's
length, so the past is fed at its exact length. ``genai_config.json`` beside the model
supplies what the graph leaves symbolic (head counts, the context length), the EOS ids
and the sampling defaults; Hugging Face's ``generation_config.json`` and ``config.json``
supply what it leaves out, and the attention's sliding window.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import reprlib
from typing import Optional, Protocol, Sequence

import numpy as np

from ..errors import UnsupportedModel
from .files import read_json

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


class Port(Protocol):
    """A graph input or output as decoder_spec reads it (the engines' IOInfo)."""
    name: str
    type: str  # ONNX's type string, as "tensor(float16)"
    shape: Optional[list]  # of ints and symbolic names; None or [] where not declared
    dtype: Optional[np.dtype]


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    layout: str  # "gqa" (shared past/present), "standard" (bucketed) or "exact" (the past at its length)
    layers: int
    kv_heads: int
    head_size: int
    kv_dtype: np.dtype
    logits_dtype: np.dtype
    position_ids: bool
    # the longest sequence: the least of genai_config.json's, the position tables' and config.json's
    max_length: Optional[int]
    eos_token_id: tuple
    ids_dtype: np.dtype = np.dtype(np.int64)  # of input_ids, attention_mask and position_ids,
    mask_dtype: np.dtype = np.dtype(np.int64)  # as the model declares them
    pos_dtype: np.dtype = np.dtype(np.int64)
    vocab: Optional[int] = None  # the logits' last dimension, when the graph gives it
    sliding_window: Optional[int] = None  # of the attention, as config.json beside the model gives it
    # (layer, positions) for each layer whose GroupQueryAttention keeps a window-sized cache
    # (window_caches): its past and present hold that many positions, not the whole length
    window_caches: tuple = ()
    # do_sample, temperature, top_k and top_p as the model's files give them (key, value) pairs:
    # the defaults of the generate() arguments a caller leaves unset
    sampling: tuple = ()
    # the total lengths t at which the graph chooses otherwise between t and t + 1 (an If on
    # the mask's length: lengths.length_thresholds); None where it chooses by the lengths in
    # a way not read, and its prompt runs in one step
    length_thresholds: Optional[tuple] = ()


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
        cfg = read_json(path)
        if not isinstance(cfg, dict):
            raise ValueError(f"it holds {type(cfg).__name__}, not an object")
        model, search = cfg.get("model", {}), cfg.get("search", {})
        decoder = model.get("decoder", {}) if isinstance(model, dict) else {}
        for key, x in (("model", model), ("search", search), ("model.decoder", decoder)):
            if not isinstance(x, dict):
                raise ValueError(f"{key!r} must be an object, got {type(x).__name__} {_shown(x)}")
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
        out["sampling"] = _sampling_of(search, strict=True)
        return out
    except (OSError, ValueError, AttributeError) as e:  # json.JSONDecodeError is a ValueError
        raise UnsupportedModel(f"{path} cannot be used: {e}") from None


SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def _sampling_of(section: dict, strict: bool = False) -> dict:
    """The sampling settings of a genai_config.json search section or a Hugging Face
    generation_config.json: those present, of their type (a value of another is left out).
    A temperature of 0 decodes greedily, as Hugging Face and llama.cpp users mean it. A
    value of its type that no sampling takes (a negative temperature, a top_p outside
    (0, 1]) is left out, or with `strict` a ValueError."""
    out = {}
    for key, default in SAMPLING_DEFAULTS.items():
        value = section.get(key)
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            continue
        if key == "temperature" and value == 0:
            out["do_sample"] = False
            continue
        if (key == "temperature" and value < 0) or (key == "top_p" and not 0 < value <= 1):
            if strict:
                raise ValueError(f"search.{key} is {_shown(value)}: a temperature must be >= 0 and top_p in (0, 1]")
            continue
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
        cfg = read_json(path)
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
    # GPT-Neo names its local layers
    local = _mentions(cfg.get("attention_layers"), "local") or _mentions(cfg.get("attention_types"), "local")
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


def _dim(info: Port, axis: int, fallback, what: str) -> int:
    d = info.shape[axis] if info.shape is not None and len(info.shape) > axis else None
    if isinstance(d, int) and d > 0:
        return d
    if fallback:
        return int(fallback)
    raise UnsupportedModel(f"{what} is symbolic in {info.name!r} and genai_config.json does not give it")


def decoder_spec(inputs: Sequence[Port], outputs: Sequence[Port], op_types, model_dir: Optional[str],
                 rotary_rows: Optional[int] = None, windows: tuple = (),
                 thresholds: Optional[tuple] = ()) -> DecoderSpec:
    """`inputs`: the inputs a caller must feed; `rotary_rows`: the positions the model's
    rotary table holds, where it has one; `windows`: window_caches of the model;
    `thresholds`: its length_thresholds."""
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
    bounds = [n for n in (cfg.get("max_length"), rotary_rows, read_context(model_dir)) if n]
    vocab = logits.shape[-1] if logits.shape else None
    # The standard layout pads the past to a bucket, which needs the positions from
    # position_ids and a mask that places nothing by the past's length (nor chooses by
    # the mask's length): else the past goes in at its exact length.
    window = read_sliding_window(model_dir) if "GroupQueryAttention" not in op_types else None
    layout = "gqa" if "GroupQueryAttention" in op_types else \
        "standard" if "position_ids" in ins and window is None and thresholds == () else "exact"
    return DecoderSpec(layout, max(layers) + 1, kv_heads, head_size, past0.dtype, logits.dtype, "position_ids" in ins,
                       min(bounds) if bounds else None, cfg.get("eos", ()), dtypes["input_ids"],
                       dtypes["attention_mask"], dtypes["position_ids"],
                       vocab if isinstance(vocab, int) and vocab > 0 else None, window,
                       tuple(windows), read_sampling(model_dir, cfg.get("sampling", {})), thresholds)


def window_caches(model) -> tuple:
    """(layer, positions) for each layer whose GroupQueryAttention has sliding_window_cache=1
    (onnxruntime-genai's builder writes it for the sliding-window layers of gpt-oss, Gemma
    and others): its past and present are window-sized and the op evicts from them itself.
    ORT's CUDA kernel takes exactly local_window_size positions, its CPU kernel at least
    that many: the cache holds local_window_size, whatever the generation's length."""
    found = {}
    for n in model.graph.node:
        if n.op_type != "GroupQueryAttention":
            continue
        attrs = {a.name: a for a in n.attribute}
        if "sliding_window_cache" not in attrs or attrs["sliding_window_cache"].i == 0:
            continue
        window = attrs["local_window_size"].i if "local_window_size" in attrs else -1
        past = _PAST.match(n.input[3]) if len(n.input) > 3 else None
        if window <= 0 or past is None:
            raise UnsupportedModel(
                f"generate() gives a window-sized KV cache (sliding_window_cache=1) local_window_size positions, "
                f"fed as past_key_values.N.key: GroupQueryAttention {n.name!r} has local_window_size {window} and "
                f"reads its past from {n.input[3] if len(n.input) > 3 else 'nothing'!r}")
        found[int(past.group(1))] = window
    return tuple(sorted(found.items()))


def window_cache_inputs(model) -> frozenset:
    """The graph inputs that are window-sized caches (the past key and value of each
    GroupQueryAttention with sliding_window_cache=1): the op evicts from them in place, so
    a step run twice on them evicts twice."""
    inputs = {i.name for i in model.graph.input}
    found = set()
    for n in model.graph.node:
        if n.op_type == "GroupQueryAttention" and any(a.name == "sliding_window_cache" and a.i for a in n.attribute):
            found.update(x for x in list(n.input)[3:5] if x in inputs)
    return frozenset(found)


def rotary_rows(model) -> Optional[int]:
    """The positions the model's position tables hold: a GroupQueryAttention's rotary table
    (its cos_cache input), or a table of 2-D weights gathered by the position_ids input
    itself (a rotary cos/sin table, GPT-2's position embeddings). A position past them
    fails in ORT's Gather: the longest sequence the model can run, whatever its files say."""
    dims = {t.name: t.dims for t in model.graph.initializer}
    rows = [int(dims[n.input[7]][0]) for n in model.graph.node
            if n.op_type == "GroupQueryAttention" and len(n.input) > 7 and n.input[7] in dims and dims[n.input[7]]]
    inputs = {i.name for i in model.graph.input}
    rows += [int(dims[n.input[0]][0]) for n in model.graph.node
             if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == "position_ids" and "position_ids" in inputs
             and len(dims.get(n.input[0], ())) == 2 and all(a.i == 0 for a in n.attribute if a.name == "axis")]
    return min(rows) if rows else None


def read_context(model_dir: Optional[str]) -> Optional[int]:
    """The context config.json beside the model gives (max_position_embeddings, GPT-2's
    n_positions): the longest sequence the model was made for, which llama.cpp and this
    package's server hold a generation to as well."""
    cfg = _hf_json(model_dir, "config.json")
    for key in ("max_position_embeddings", "n_positions"):
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None

