"""Token-by-token generation with the KV cache on the device: the KV caches of each
export layout, sampling, and the generation's steps at fixed shapes and addresses.
"""

from ..loading import SAMPLING_DEFAULTS
from .kept import release_kept
from .members import GenerationMembers
from .needs import first_needs
from .sampling import Sampling

__all__ = ["GenerationMembers", "SAMPLING_DEFAULTS", "Sampling", "first_needs", "release_kept"]
