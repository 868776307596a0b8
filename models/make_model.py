"""Writes one of onnx-offload's test models to disk, from random weights (no download).

    python models/make_model.py mlp out/mlp.onnx --layers 16 --hidden 1024
    python models/make_model.py decoder out/decoder.onnx --layers 22 --hidden 2048 --ffn 5632 --dtype float16

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kind", choices=("mlp", "residual", "transformer", "decoder"))
    p.add_argument("path", help="where to write the .onnx file (weights go beside it, in PATH.data)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024, help="feed-forward width (transformer, decoder)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    args = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.path)), exist_ok=True)
    dtype = np.dtype(args.dtype)
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
