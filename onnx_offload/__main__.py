"""``python -m onnx_offload``: the command line, as ``onnx-offload``."""
import sys

from .tools.cli import main

sys.exit(main())
