"""Token-by-token generation with the KV cache on the device: the KV caches of each
export layout, sampling, and the generation's steps at fixed shapes and addresses.
"""

from ..loading import SAMPLING_DEFAULTS
from .advice import default_generation, own_probe, probing, with_generation
from .kept import release_kept
from .buffers import DeviceBuffers, write
from .kv_cache import ExactKV, SharedKV, peak_bytes
from .loop import last_logits, prompt_chunk, prompt_pieces
from .members import GenerationMembers
from .needs import first_needs
from .sampling import Sampling

__all__ = ["DeviceBuffers", "ExactKV", "GenerationMembers", "SAMPLING_DEFAULTS", "Sampling", "SharedKV",
           "default_generation", "probing", "first_needs", "last_logits", "own_probe", "peak_bytes", "prompt_chunk",
           "prompt_pieces", "release_kept", "with_generation", "write"]
