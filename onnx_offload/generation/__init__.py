"""Token-by-token generation with the KV cache on the device: the KV caches of each
export layout, sampling, and the generation's steps at fixed shapes and addresses.
"""

from .generate import (DEFAULT_CONTEXT, Generation, SAMPLING_DEFAULTS, Sampling, UnsupportedModel, check_generate_args,
                       chunk_rows, decoder_spec, generate_tokens, kv_peak, rotary_rows)
from .kv_cache import bucket_for, describe_zones
from .members import GenerationMembers
