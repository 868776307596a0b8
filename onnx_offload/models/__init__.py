"""Generators of the models that onnx-offload's tests, demo and benchmarks run."""
from .decoder import decoder_lm, genai_config, save_decoder
from .generators import decoder_like, mlp_stack, residual_mlp, save, transformer_block, weight_bytes
from .int4 import int4

__all__ = ["decoder_like", "decoder_lm", "genai_config", "int4", "mlp_stack", "residual_mlp", "save", "save_decoder",
           "transformer_block", "weight_bytes"]
