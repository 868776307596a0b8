"""Token-by-token generation with the KV cache on the device: the KV caches of each
export layout, sampling, and the generation's steps at fixed shapes and addresses.
"""

from ..errors import UnsupportedModel
from ..loading import SAMPLING_DEFAULTS, decoder_spec, rotary_rows
from .kv_cache import bucket_for, describe_zones
from .loop import DEFAULT_CONTEXT, chunk_rows, generate_tokens, kv_peak
from .sampling import Sampling, check_generate_args
from .steps import Generation
from .members import GenerationMembers
