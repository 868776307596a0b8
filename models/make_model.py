"""Writes one of onnx-offload's test models to disk, from random weights (no download).

    python models/make_model.py mlp out/mlp.onnx --layers 16 --hidden 1024
    python models/make_model.py decoder out/decoder.onnx --layers 22 --hidden 2048 --ffn 5632 --dtype float16
    python models/make_model.py llm out/llm --layers 22 --hidden 2048 --heads 32 --kv-heads 4 \
        --ffn 5632 --vocab 32000 --dtype float16        # onnxruntime-genai builder layout (GQA)
    python models/make_model.py llm-standard out/llm-std ...   # Optimum / torch.onnx layout

An LLM (``llm``, ``llm-standard``) is a folder: model.onnx, model.onnx.data and
genai_config.json, as onnxruntime-genai lays it out, and, where the ``tokenizers`` package is
installed, a word-level tokenizer.json and a chat template (words ``w0`` to ``w<vocab - 1>``; any other word is
``w0``), so that ``onnx-offload generate FOLDER --prompt TEXT`` runs on it as on a real folder.

The generators live in the package (``onnx_offload.models``), which its tests, demo and
benchmarks import; this script is how a person makes a model to run with
``onnx-offload run``.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from onnx_offload.models import decoder_like, mlp_stack, residual_mlp, save, transformer_block
from onnx_offload.models.decoder import decoder_lm, genai_config, save_decoder


def write_tokenizer(folder: str, vocab: int) -> str:
    """Writes FOLDER/tokenizer.json, a word-level tokenizer over the words w0 .. w<vocab - 1>,
    with the tokenizers package; returns what it did, for the user."""
    try:
        import tokenizers
    except ImportError:
        return "no tokenizer.json: pip install tokenizers for one (--prompt-ids runs without it)"
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    # A chat template as a model folder carries one, so chat() and `onnx-offload chat` run.
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    return f"wrote {path} and chat_template.jinja"


# Each message on a line of its own, its role first; then the assistant's turn.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kind", choices=("mlp", "residual", "transformer", "decoder", "llm", "llm-standard"))
    p.add_argument("path", help="where to write the .onnx file (weights go beside it, in PATH.data); "
                                "for an LLM, the folder to write")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024, help="feed-forward width (transformer, decoder)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    p.add_argument("--heads", type=int, default=4, help="attention heads (llm)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (llm)")
    p.add_argument("--vocab", type=int, default=1000, help="vocabulary size (llm)")
    p.add_argument("--max-length", type=int, default=512, help="longest sequence (llm)")
    args = p.parse_args(argv)
    dtype = np.dtype(args.dtype)
    if args.kind in ("llm", "llm-standard"):
        layout = "gqa" if args.kind == "llm" else "standard"
        model = decoder_lm(layout, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                           intermediate=args.ffn, vocab=args.vocab, max_length=args.max_length, dtype=dtype)
        cfg = genai_config(args.layers, args.hidden, args.heads, args.kv_heads, args.vocab, args.max_length,
                           layout=layout)
        print(f"wrote {save_decoder(model, args.path, config=cfg)}")
        print(write_tokenizer(args.path, args.vocab))
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.path)), exist_ok=True)
    if args.kind == "decoder":
        decoder_like(args.path, layers=args.layers, hidden=args.hidden, ffn=args.ffn, dtype=dtype)
    elif args.kind == "mlp":
        save(mlp_stack(layers=args.layers, hidden=args.hidden, dtype=dtype), args.path)
    elif args.kind == "residual":
        save(residual_mlp(layers=args.layers, hidden=args.hidden), args.path)
    else:
        save(transformer_block(hidden=args.hidden, ffn=args.ffn), args.path)
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
