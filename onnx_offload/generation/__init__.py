"""Token-by-token generation with the KV cache on the device: the KV caches of each
export layout, sampling, and the generation's steps at fixed shapes and addresses.
"""

from ..loading import SAMPLING_DEFAULTS
from .advice import default_generation, own_probe, with_generation
from .kept import release_kept
from .kv_cache import DeviceBuffers, ExactKV, SharedKV, peak_bytes, write
from .loop import FIRST_CONTEXT, last_logits, prompt_chunk, prompt_pieces
from .members import GenerationMembers
from .needs import first_generation, first_needs
from .sampling import Sampling

__all__ = ["DeviceBuffers", "FIRST_CONTEXT", "ExactKV", "GenerationMembers", "SAMPLING_DEFAULTS", "Sampling",
           "SharedKV", "default_generation", "first_generation", "first_needs", "last_logits", "own_probe", "peak_bytes",
           "prompt_chunk", "prompt_pieces", "release_kept", "with_generation", "write"]
