"""llama.cpp beside the package in ``bench cards``: the same weights as a GGUF (F16, or
Q4_0 for an int4 model), and ``llama-bench`` run under the same simulated card.

``write_gguf`` writes the builder-layout decoder's weights (``models.decoder``) with the
``gguf`` package (the optional extra ``[bench]``) under llama.cpp's names for its
``llama`` architecture (``token_embd``, ``blk.N.attn_q`` ...): an ONNX MatMul weight is
[in, out] and GGML's is [out, in] as numpy sees it, so projections are transposed. Q and
K are not permuted to GGML's rotary layout: the tokens differ from ours, the time per
token does not. The vocabulary is one of the model's size (byte tokens and names), which
llama-bench needs only to load: it feeds random tokens. The tensors are written one at a
time, so the writer holds one in memory.

An int4 model's MatMulNBits weights (4 bits, blocks of 32 along K, one scale a block, zero
point 8: ``models.int4``, as the genai builder writes them) are GGML's Q4_0 blocks in
another order: Q4_0 holds a block's fp16 scale, then its 32 values two a byte with the
first 16 in the low nibbles, where MatMulNBits holds neighbours in one byte. ``q4_0_rows``
reorders the nibbles, so llama.cpp multiplies the very values ORT does. The embedding
stays F16, as in the ONNX model.

``bench_args`` is the command line of one run: llama.cpp's own fit (``-fitt 1024 -fitc
1024``) or a given ``-ngl``; ``parse`` reads its ``-o json`` output: ms/token of the decode
at the prompt's depth, and the prompt's time (its first token). ``probe_args`` is a run of
one token with llama.cpp's log on, whose ``model buffer size`` lines ``model_buffers``
reads: the weight bytes llama.cpp put on the device and those it left in host memory (it
keeps ``token_embd`` on the host at any ``-ngl``: each token reads one row of it). The
probe is a run of its own, so that the log does not touch the timed runs.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import warnings
from typing import Dict, List, Optional

import numpy as np

FIT_TARGET_MIB = 1024  # -fitt: the device memory llama.cpp's fit leaves free
FIT_CONTEXT = 1024  # -fitc: the context its fit sizes the cache for
REPETITIONS = 2  # -r: each test's repetitions (its default is 5)


def gguf_names(layers: int) -> Dict[str, tuple]:
    """ONNX initializer name -> (GGUF tensor name, whether it is transposed)."""
    names = {"embed_tokens": ("token_embd.weight", False), "norm": ("output_norm.weight", False),
             "lm_head": ("output.weight", True)}
    each = {"input_layernorm": ("attn_norm", False), "q_proj": ("attn_q", True), "k_proj": ("attn_k", True),
            "v_proj": ("attn_v", True), "o_proj": ("attn_output", True),
            "post_attention_layernorm": ("ffn_norm", False), "gate_proj": ("ffn_gate", True),
            "up_proj": ("ffn_up", True), "down_proj": ("ffn_down", True)}
    for i in range(layers):
        for onnx_name, (g, t) in each.items():
            names[f"layers.{i}.{onnx_name}"] = (f"blk.{i}.{g}.weight", t)
    return names


def _arrays(model_path: str) -> Dict[str, np.ndarray]:
    """The model's initializers, those in its external data file read lazily (memmap)."""
    import onnx
    from onnx import numpy_helper
    model = onnx.load(model_path, load_external_data=False)
    folder = os.path.dirname(os.path.abspath(model_path))
    out = {}
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            dtype = numpy_helper.helper.tensor_dtype_to_np_dtype(t.data_type)
            out[t.name] = np.memmap(os.path.join(folder, info["location"]), dtype=dtype, mode="r",
                                    offset=int(info.get("offset", 0)), shape=tuple(t.dims))
        else:
            out[t.name] = numpy_helper.to_array(t)
    return out


Q4_BLOCK = 32  # the values in one Q4_0 block


def q4_0_rows(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MatMulNBits' B [N, K / 32, 16] and scales [N * K / 32] (fp16) as Q4_0 rows [N, K / 32
    * 18] bytes: each block's scale, then its values q[j] | q[j + 16] << 4."""
    n, blocks, half = packed.shape
    if half * 2 != Q4_BLOCK or scales.dtype != np.float16:
        raise ValueError(f"Q4_0 takes blocks of {Q4_BLOCK} with fp16 scales, not {half * 2} with {scales.dtype}")
    q = np.empty((n, blocks, Q4_BLOCK), np.uint8)
    q[..., 0::2] = packed & 15
    q[..., 1::2] = packed >> 4
    qs = q[..., :16] | (q[..., 16:] << 4)
    d = np.ascontiguousarray(scales).reshape(n, blocks, 1).view(np.uint8)
    return np.concatenate([d, qs], axis=-1).reshape(n, blocks * 18)


def write_gguf(model_path: str, shape: dict, out_path: str, eps: float = 1e-5, rope_theta: float = 10000.0) -> str:
    """The decoder's weights at `model_path` (of `shape`, as bench cards makes it) as a GGUF
    of llama.cpp's llama architecture at `out_path` (Q4_0 where the model's MatMuls are
    int4, F16 otherwise); returns the path."""
    import gguf
    layers, hidden, heads, vocab = shape["layers"], shape["hidden"], shape["heads"], shape["vocab"]
    arrays = _arrays(model_path)
    names = gguf_names(layers)
    q4 = {n for n in names if n + "_Q4" in arrays and n + "_scales" in arrays}
    for n in q4:
        arrays[n] = None  # stands for its blocks, read when written
    missing = sorted(set(names) - set(arrays))
    if missing:
        raise ValueError(f"{model_path} is not the builder-layout decoder bench cards writes: no {missing[:3]}")
    w = gguf.GGUFWriter(out_path, "llama")
    w.add_name("onnx-offload bench cards")
    w.add_context_length(shape["max_length"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(shape["intermediate"])
    w.add_head_count(heads)
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(eps)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if q4 else gguf.LlamaFileType.MOSTLY_F16)
    special = ["<unk>", "<s>", "</s>"]
    tokens = special + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"t{i}" for i in range(len(tokens), vocab)]
    types += [gguf.TokenType.NORMAL] * (vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:vocab])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types[:vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    order = list(names)

    def as_written(onnx_name: str) -> np.ndarray:
        if onnx_name in q4:
            return q4_0_rows(np.asarray(arrays[onnx_name + "_Q4"]), np.asarray(arrays[onnx_name + "_scales"]))
        a = arrays[onnx_name]
        a = a.T if names[onnx_name][1] else a
        # Norms in F32, as llama.cpp's converter writes them; the rest in F16.
        return np.ascontiguousarray(a, dtype=np.float32 if a.ndim == 1 else np.float16)

    for n in order:
        if n in q4:
            rows, blocks, _ = arrays[n + "_Q4"].shape
            w.add_tensor_info(names[n][0], (rows, blocks * 18), np.dtype(np.uint8), rows * blocks * 18,
                              raw_dtype=gguf.GGMLQuantizationType.Q4_0)
            continue
        a = arrays[n]
        shape_np = a.shape[::-1] if names[n][1] else a.shape
        dtype = np.float32 if a.ndim == 1 else np.float16
        w.add_tensor_info(names[n][0], shape_np, np.dtype(dtype), int(np.prod(shape_np)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for n in order:
        w.write_tensor_data(as_written(n))
    w.close()
    return out_path


def find_llama_bench(given: Optional[str]) -> Optional[str]:
    """The llama-bench to run: `given` (which must exist), else the one on PATH, else None.
    Running it needs the gguf package (the [bench] extra), which writes its weights: without
    it, a llama-bench given is an error, and one on PATH is left aside with a warning."""
    if given:
        path = given if os.path.sep in given else shutil.which(given)
        if not path or not os.access(path, os.X_OK):
            raise FileNotFoundError(f"--llama-bench {given}: no such executable")
    else:
        path = shutil.which("llama-bench")
    if path and importlib.util.find_spec("gguf") is None:
        why = (f"llama.cpp's llama-bench ({path}) runs on the same weights written as a GGUF, which needs the gguf "
               "package: pip install 'onnx-offload[bench]'")
        if given:
            raise RuntimeError(why)
        warnings.warn(why + "; the bench runs without llama.cpp", stacklevel=2)
        return None
    return path


def bench_args(llama_bench: str, gguf_path: str, prompt: int, new: int, ngl: Optional[int] = None,
               threads: Optional[int] = None) -> List[str]:
    """One llama-bench run: the prompt at depth 0 and `new` tokens at the prompt's depth,
    with flash attention; llama.cpp's own fit when `ngl` is None, else `-ngl ngl`."""
    placement = (["-fitt", str(FIT_TARGET_MIB), "-fitc", str(FIT_CONTEXT)] if ngl is None
                 else ["-ngl", str(ngl)])
    return [llama_bench, "-m", gguf_path, *placement, "-p", str(prompt), "-n", str(new), "-d", f"0,{prompt}",
            "-fa", "1", "-t", str(threads or os.cpu_count() or 1), "-r", str(REPETITIONS), "-o", "json"]


def probe_args(llama_bench: str, gguf_path: str, ngl: int) -> List[str]:
    """One token at `-ngl ngl`, once, with llama.cpp's log on (on stderr)."""
    return [llama_bench, "-m", gguf_path, "-ngl", str(ngl), "-p", "0", "-n", "1", "-r", "1", "-v", "-o", "json"]


_BUFFER = re.compile(r"(\S+) model buffer size =\s*([0-9.]+) MiB")


def model_buffers(log: str) -> Dict[str, int]:
    """Bytes of each of llama.cpp's model buffers (``CUDA0``, ``CPU_Mapped`` ...) in a log:
    the last value of each name, so that of the last model load."""
    return {name: int(float(mib) * 2**20) for name, mib in _BUFFER.findall(log)}


def _results(text: str) -> List[Dict]:
    """The records of llama-bench's `-o json` output (one JSON array on stdout)."""
    start = text.find("[")
    if start < 0:
        raise ValueError(f"no JSON array in llama-bench's output: {text[:200]!r}")
    return json.loads(text[start:text.rindex("]") + 1])


def parse_gen(text: str, new: int) -> Dict:
    """The record of the decode of `new` tokens at depth 0 (its `avg_ts`: tokens a second)."""
    tg = [r for r in _results(text) if r.get("n_gen") == new and not r.get("n_prompt") and not r.get("n_depth")]
    if not tg:
        raise ValueError(f"llama-bench's output has no tg{new} at depth 0")
    return tg[0]


def parse(text: str, prompt: int, new: int) -> Dict:
    """ms/token of the decode at the prompt's depth, the prompt's time in ms (its first
    token) and the layers on the device, from llama-bench's `-o json` output."""
    results = _results(text)
    pp = [r for r in results if r.get("n_prompt") == prompt and not r.get("n_gen") and not r.get("n_depth")]
    tg = [r for r in results if r.get("n_gen") == new and not r.get("n_prompt") and r.get("n_depth") == prompt]
    if not pp or not tg:
        raise ValueError(f"llama-bench's output has no pp{prompt} at depth 0 or tg{new} at depth {prompt}: "
                         f"{[(r.get('n_prompt'), r.get('n_gen'), r.get('n_depth')) for r in results]}")
    return dict(ms_per_token=1e3 / tg[0]["avg_ts"], prompt_ms=pp[0]["avg_ns"] / 1e6,
                ngl=tg[0].get("n_gpu_layers"))


def layer_bytes(shape: dict) -> int:
    """One layer's weight bytes: F16, or Q4_0's 18 bytes a block of 32 for an int4 shape."""
    h, kv = shape["hidden"], shape["kv_heads"] * shape["hidden"] // shape["heads"]
    values = 2 * h * h + 2 * h * kv + 3 * h * shape["intermediate"]
    return values * 18 // Q4_BLOCK if shape.get("quant") == "int4" else 2 * values
