"""The model layer: a path or bytes becomes a prepared model.

The model is materialized where ORT would read it (its external data checked by ORT's
rules), optimized once for the target provider, cached under a key of its content, and
read as a weights table; the segmenter splits it where the weights must stream.
``pipeline.prepare`` is the one entry point. Nothing here touches device memory.
"""

from .cache import cache_entries, clear_cache
from .decoder import DecoderSpec, SAMPLING_DEFAULTS, decoder_spec, rotary_rows
from .experts import MoENode, Routing, find_routing, routed_experts, routing_for
from .files import Files, model_file, opened
from .fingerprints import MANIFEST
from .optimize import OPTIMIZED, OPTIMIZED_DATA
from .ort_options import CPU_EP, CUDA_EP, choose_providers, copy_options, normalize_providers, set_config, unseen
from .pipeline import LoadRequest, ModelMeta, prepare
from .segmenter import Segment, check_bindable, elem_name, plan_segments, segment_weights, split, value_types
from .values import IOInfo, numpy_dtype
from .weights import WeightInfo, point_weights_at_placeholder, save_model, weights_as_inputs
from .workdir import make_workdir, remove_workdir

__all__ = ["CPU_EP", "CUDA_EP", "DecoderSpec", "Files", "IOInfo", "LoadRequest", "MANIFEST", "MoENode", "ModelMeta",
           "OPTIMIZED", "OPTIMIZED_DATA", "Routing", "SAMPLING_DEFAULTS", "Segment", "WeightInfo", "cache_entries",
           "check_bindable", "choose_providers", "clear_cache", "copy_options", "decoder_spec", "elem_name",
           "find_routing", "make_workdir", "model_file", "normalize_providers", "numpy_dtype", "opened",
           "plan_segments", "point_weights_at_placeholder", "prepare", "remove_workdir", "rotary_rows",
           "routed_experts", "routing_for", "save_model", "segment_weights", "set_config", "split", "unseen",
           "value_types", "weights_as_inputs"]
