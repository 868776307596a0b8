"""Token-by-token generation with the KV cache on the device: the KV caches of each
export layout, sampling, and the generation's steps at fixed shapes and addresses.
"""

from ..loading import SAMPLING_DEFAULTS
from .advice import default_generation, hold_growth, own_probe, probing, with_generation
from .kept import release_kept
from .buffers import DeviceBuffers, write
from .kv_cache import ExactKV, SharedKV, peak_bytes
from .loop import FIRST_CONTEXT, last_logits, prompt_chunk, prompt_pieces
from .members import GenerationMembers, sampling_sources
from .needs import first_generation, first_needs
from .sampling import Sampling
from .text import LLM_EXTRA, TextModel, need
from .text_steps import model_folder, text_model

__all__ = ["DeviceBuffers", "ExactKV", "FIRST_CONTEXT", "GenerationMembers", "LLM_EXTRA", "SAMPLING_DEFAULTS", "Sampling",
           "SharedKV", "TextModel", "model_folder", "need", "text_model",
           "default_generation", "first_generation", "hold_growth", "first_needs", "last_logits", "own_probe", "peak_bytes",
           "probing", "prompt_chunk", "prompt_pieces", "release_kept", "sampling_sources", "with_generation",
           "write"]
