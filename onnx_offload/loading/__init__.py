"""The model layer: a path or bytes becomes a prepared model.

The model is materialized where ORT would read it (its external data checked by ORT's
rules), optimized once for the target provider, cached under a key of its content, and
read as a weights table; the segmenter splits it where the weights must stream.
``pipeline.prepare`` is the one entry point. Nothing here touches device memory.
"""

from .cache_clear import cache_entries, cache_tagged, clear_cache
from .decoder import DecoderSpec, SAMPLING_DEFAULTS, decoder_spec, rotary_rows, window_cache_inputs, window_caches
from .experts import MoENode, Routing, find_routing, read_in_place, routed_experts, routing_for
from .files import (CONFIG_BYTES, Files, check_external_data, config_problem, copy_regular, external_data_folder,
                    materialize, model_file, open_regular, opened, read_config, read_json, read_range, saving)
from .fingerprints import MANIFEST
from .graphs import external_info, node_inputs, read_as_tables
from .host_compute import HostComputeRefused, HostMatMul, host_candidates, rewrite_for_host
from .host_run import core_matmul, load_host_weights, numpy_matmul, run_host_split
from .lengths import length_thresholds
from .optimize import OPTIMIZED, OPTIMIZED_DATA, optimization_level, optimize_once
from .ort_options import (CPU_EP, CUDA_DEFAULTS, CUDA_EP, CUDA_LEVERS, choose_providers, copy_options, normalize_providers,
                          set_config, unseen)
from .pipeline import LoadRequest, ModelMeta, prepare
from .segmenter import (Segment, check_bindable, elem_name, plan_segments, recomputed_values, segment_weights, split,
                        value_types)
from .values import IOInfo, numpy_dtype
from .weights import (WeightInfo, load_optimized, point_weights_at_placeholder, save_model, weights_as_inputs,
                      write_optimized)
from .workdir import make_workdir, remove_workdir

__all__ = ["CONFIG_BYTES", "CPU_EP", "CUDA_DEFAULTS", "CUDA_EP", "CUDA_LEVERS", "DecoderSpec", "Files", "IOInfo", "LoadRequest",
           "MANIFEST", "MoENode", "ModelMeta",
           "OPTIMIZED", "OPTIMIZED_DATA", "Routing", "SAMPLING_DEFAULTS", "Segment", "WeightInfo", "cache_entries",
           "check_bindable", "check_external_data", "choose_providers", "clear_cache", "copy_options", "copy_regular",
           "decoder_spec", "elem_name", "external_data_folder", "external_info", "find_routing", "length_thresholds", "make_workdir",
           "materialize", "model_file", "node_inputs", "normalize_providers", "numpy_dtype", "opened", "plan_segments",
           "point_weights_at_placeholder", "prepare", "read_as_tables", "read_in_place", "read_json", "read_range",
           "recomputed_values",
           "remove_workdir", "rotary_rows", "routed_experts", "routing_for", "save_model", "saving", "segment_weights",
           "set_config", "split", "unseen", "value_types", "weights_as_inputs", "window_cache_inputs", "window_caches",
           "cache_tagged", "config_problem", "open_regular", "read_config"]
# The optimization pass, for a model split across devices (optimized whole, then split).
__all__ += ["load_optimized", "optimization_level", "optimize_once", "write_optimized"]
# Host compute: the graph rewrite, and the run that checks it on plain ORT.
__all__ += ["HostComputeRefused", "HostMatMul", "core_matmul", "host_candidates", "load_host_weights", "numpy_matmul",
            "rewrite_for_host", "run_host_split"]
