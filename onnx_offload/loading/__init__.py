"""The model layer: a path or bytes becomes a prepared model.

The model is materialized where ORT would read it (its external data checked by ORT's
rules), optimized once for the target provider, cached under a key of its content, and
read as a weights table; the segmenter splits it where the weights must stream.
``pipeline.prepare`` is the one entry point. Nothing here touches device memory.
"""

from .cache import (cache_entries, cache_folder, clear_cache, make_partial, open_entry, remove_set_aside, set_aside,
                    sweep_partials)
from .files import Files, SaveFailed, external_data_folder, materialize, model_file, opened
from .fingerprints import HeldFiles, MANIFEST, cache_key, hold_made, write_manifest
from .optimize import OPTIMIZED, OPTIMIZED_DATA, optimization_level, optimize_once
from .ort_options import (CPU_EP, CUDA_EP, choose_providers, copy_options, normalize_providers, options_key,
                          set_config, unseen)
from .segmenter import (Segment, check_bindable, dims, elem_name, onnx_type_string, plan_segments, segment_weights,
                        split, value_types)
from .weights import (WeightInfo, keep_in_model, load_optimized, point_weights_at_placeholder, read_weights,
                      save_model, share_unchanged, weights_as_inputs, write_optimized)
from .workdir import disown, make_workdir, remove_workdir
from .decoder import SAMPLING_DEFAULTS, DecoderSpec, decoder_spec, rotary_rows
from .values import IOInfo, numpy_dtype
from .pipeline import LoadRequest, ModelMeta, PreparedModel, prepare
