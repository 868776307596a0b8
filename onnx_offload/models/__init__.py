"""Generators of the models that onnx-offload's tests, demo and benchmarks run."""
from .decoder import decoder_lm, genai_config, save_decoder
from .gpt2 import gpt2_lm
from .generators import decoder_like, mlp_stack, residual_mlp, save, transformer_block, weight_bytes
from .int4 import int4
from .longrope import longrope_lm
from .moe import expert_share, gpt_oss, moe_lm, qwen3_moe

__all__ = ["decoder_like", "decoder_lm", "expert_share", "genai_config", "gpt2_lm", "gpt_oss", "int4", "longrope_lm",
           "mlp_stack", "moe_lm", "qwen3_moe", "residual_mlp", "save", "save_decoder", "transformer_block", "weight_bytes"]
