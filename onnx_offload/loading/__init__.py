"""The model layer: a path or bytes becomes a prepared model.

The model is materialized where ORT would read it (its external data checked by ORT's
rules), optimized once for the target provider, cached under a key of its content, and
read as a weights table; the segmenter splits it where the weights must stream.
``pipeline.prepare`` is the one entry point. Nothing here touches device memory.
"""

from .cache import (HeldFiles, MANIFEST, cache_entries, cache_folder, cache_key, clear_cache, hold_made, make_partial,
                    open_entry, remove_set_aside, set_aside, sweep_partials, write_manifest)
from .model import (Files, OPTIMIZED, OPTIMIZED_DATA, WeightInfo, external_data_folder, keep_in_model, load_optimized,
                    materialize, model_file, opened, optimization_level, optimize_once, point_weights_at_placeholder,
                    read_weights, save_model, share_unchanged, weights_as_inputs, write_optimized)
from .ort_options import (CUDA_EP, SessionFactory, choose_providers, copy_options, normalize_providers, options_key,
                          unseen)
from .segmenter import (Segment, check_bindable, dims, elem_name, onnx_type_string, plan_segments, segment_weights,
                        split, value_types)
from .workdir import disown, make_workdir, remove_workdir
from .decoder import DecoderSpec, SAMPLING_DEFAULTS, decoder_spec, rotary_rows
from .values import IOInfo, numpy_dtype
from .pipeline import LoadRequest, ModelMeta, PreparedModel, prepare
