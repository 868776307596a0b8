"""The caller's SessionOptions and providers, as the package's ORT sessions take them.

ORT has no getter for some SessionOptions calls (config entries, free-dimension
overrides, custom-op libraries), so the package records them on every SessionOptions made
after it is imported: the options are copied with them onto the optimization pass and
the sessions that run, and what of them can change the optimized graph keys the cache.
Initializers given through the options are refused: the package places every weight.
The providers are those ORT would take, kept to the CUDA and CPU ones the package runs.
"""
from __future__ import annotations

import functools
import os
import weakref
from typing import List, Optional, Tuple

import onnxruntime as ort

CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"

# SessionOptions settings the package sets itself: the graph was optimized once already
# (and written where the package keeps it).
_OWN_OPTIONS = ("graph_optimization_level", "optimized_model_filepath")
# Config entries a caller may set, copied when set: ORT offers no way to list them.
KNOWN_CONFIG_KEYS = (
    "session.use_env_allocators", "session.set_denormal_as_zero", "session.enable_quant_qdq",
    "session.inter_op.allow_spinning", "session.intra_op.allow_spinning", "session.intra_op_thread_affinities",
    "session.dynamic_block_base", "session.force_spinning_stop", "session.strict_shape_type_inference",
    "session.allow_released_opsets_only", "session.use_device_allocator_for_initializers",
    "session.disable_cpu_ep_fallback", "session.use_deterministic_compute", "session.x64quantprecision",
    "session.qdqisint8allowed", "session.enable_quant_qdq_cleanup", "session.disable_quant_qdq",
    "session.disable_double_qdq_remover", "session.disable_aot_function_inlining",
    "session.node_partition_config_file",
    "session.record_ep_graph_assignment_info", "session.inter_op.thread_pool_size",
    "optimization.enable_gelu_approximation", "optimization.disable_specified_optimizers",
    "optimization.enable_cast_chain_elimination", "mlas.enable_gemm_fastmath_arm64_bfloat16",
    "mlas.use_lut_gemm", "ep.context_enable", "ep.context_file_path", "ep.context_embed_mode",
)


# SessionOptions calls that ORT offers no getter for. The package records them on every
# SessionOptions made after it is imported, and replays them on the options of the ORT
# sessions it makes; the replayed ones also key the optimized-model cache.
_REPLAYED = ("add_session_config_entry", "add_free_dimension_override_by_name",
             "add_free_dimension_override_by_denotation", "register_custom_ops_library")
# Initializers given through the options: the package places every weight itself.
_REFUSED = ("add_initializer", "add_external_initializers", "add_external_initializers_from_files_in_memory")
_calls: "weakref.WeakKeyDictionary[ort.SessionOptions, list]" = weakref.WeakKeyDictionary()
# Where a model given as bytes finds its external data.
EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"
# Config entries about where the caller's model file and its data are, which the package
# answers itself (its sessions read models it wrote): not copied.
# So are those on how an optimized model is saved: the package saves its own, as ONNX.
_FILE_KEYS = (EXTERNAL_FOLDER_KEY,
              "session.optimized_model_external_initializers_file_name",
              "session.optimized_model_external_initializers_min_size_in_bytes", "session.save_model_format")


def _record(name: str) -> None:
    original = getattr(ort.SessionOptions, name, None)
    if original is None or getattr(original, "_offload_recorded", False):
        return

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        # The refused ones are only named: their values stay the caller's.
        _calls.setdefault(self, []).append((name, args, kwargs) if name in _REPLAYED else (name, (), {}))
        return result

    call._offload_recorded = True
    setattr(ort.SessionOptions, name, call)


for _name in _REPLAYED + _REFUSED:
    _record(_name)


def _record_creation() -> None:
    """Gives each SessionOptions made from now on an (empty) record, so that options made
    before the package was imported, whose calls it could not see, are told apart."""
    original = ort.SessionOptions.__init__
    if getattr(original, "_offload_recorded", False):
        return

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _calls.setdefault(self, [])

    init._offload_recorded = True
    ort.SessionOptions.__init__ = init


_record_creation()


def unseen(user: Optional[ort.SessionOptions]) -> bool:
    """True for options made before the package was imported: calls on them that ORT
    has no getter for (overrides, libraries, initializers) cannot be known."""
    return user is not None and user not in _calls


def recorded(user: Optional[ort.SessionOptions]) -> List[tuple]:
    """The replayed calls made on `user`, in order: (method, args, kwargs)."""
    return [c for c in _calls.get(user, ()) if c[0] in _REPLAYED] if user is not None else []


def options_key(user: Optional[ort.SessionOptions]) -> str:
    """What of the caller's options can change the optimized graph, as text: every
    recorded call and known config entry, and each custom-op library's size and mtime."""
    parts = []
    for name, args, kwargs in recorded(user):
        parts.append(f"{name}{args}{sorted(kwargs.items())}")
        if name == "register_custom_ops_library" and args:
            try:
                st = os.stat(args[0])
                parts.append(f"{st.st_size}:{st.st_mtime_ns}")
            except OSError:
                pass
    if user is not None:
        parts += [f"{key}={value}" for key in KNOWN_CONFIG_KEYS if (value := config_entry(user, key)) is not None]
    return "|".join(parts)


def config_entry(so: ort.SessionOptions, key: str) -> Optional[str]:
    """A config entry's value, None when it is not set (ORT raises then)."""
    try:
        return so.get_session_config_entry(key)
    except RuntimeError:
        return None


def set_config(so: ort.SessionOptions, key: str, value: str) -> None:
    """Sets a config entry (ORT logs a warning when it overwrites one)."""
    if config_entry(so, key) != value:
        so.add_session_config_entry(key, value)


def copy_options(user: Optional[ort.SessionOptions]) -> ort.SessionOptions:
    """A SessionOptions with every setting the caller made: each property, each recorded
    call (config entries, free-dimension overrides, custom-op libraries), and each known
    config entry that is set (for options made before the package was imported)."""
    so = ort.SessionOptions()
    if user is None:
        return so
    refused = sorted({c[0] for c in _calls.get(user, ()) if c[0] in _REFUSED})
    if refused:
        raise ValueError(f"OffloadSession places every weight itself and cannot take initializers given through "
                         f"SessionOptions.{refused[0]}; put them in the model instead")
    for name in dir(type(user)):
        attr = getattr(type(user), name, None)
        if isinstance(attr, property) and attr.fset is not None and name not in _OWN_OPTIONS \
                and not name.startswith("_"):
            setattr(so, name, getattr(user, name))
    for name, args, kwargs in recorded(user):
        if name == "add_session_config_entry" and args and args[0] in _FILE_KEYS:
            continue
        getattr(so, name)(*args, **kwargs)
    for key in KNOWN_CONFIG_KEYS:
        value = config_entry(user, key)
        if value is not None:
            set_config(so, key, value)
    return so


def choose_providers(names: List[str], options: List[dict], cuda_status) -> Tuple[List[str], List[dict], List[str]]:
    """The providers the session runs, as ORT takes a list: the ones the package does not
    run are skipped, and CUDA that cannot run here gives way to the CPU, as ORT's
    InferenceSession falls back to it. Returns (names, options, what to warn about). `cuda_status()` is '' when CUDA
    can run, else why not."""
    notes = []
    skipped = [n for n in names if n not in (CUDA_EP, CPU_EP)]
    kept = [(n, o) for n, o in zip(names, options) if n in (CUDA_EP, CPU_EP)]
    if not kept:  # as ORT falls back when no provider it was given can run
        notes.append(f"OffloadSession runs {CUDA_EP} and {CPU_EP}, and none of {', '.join(names)} can run here; "
                     f"running on {CPU_EP}")
        kept = [(CPU_EP, {})]
    elif skipped:
        notes.append(f"OffloadSession runs {CUDA_EP} and {CPU_EP}; skipping {', '.join(skipped)}")
    if kept[0][0] == CUDA_EP:
        why = cuda_status()
        if why:  # as ORT falls back to the CPU, listed or not; CUDA's options go with it
            notes.append(f"{CUDA_EP} cannot run here ({why}); running on {CPU_EP}, with the host backend, "
                         f"which plays the GPU in host memory and saves no RAM (providers=['{CPU_EP}'] says so "
                         f"without this warning)")
            kept = [(n, o) for n, o in kept if n == CPU_EP] or [(CPU_EP, {})]
    return [n for n, _ in kept], [o for _, o in kept], notes


def normalize_providers(providers, provider_options) -> Tuple[List[str], List[dict]]:
    if not providers:  # None or []: the CPU, as ORT's CPU build defaults
        providers = [CPU_EP]
    if provider_options is not None and len(provider_options) != len(providers):
        raise ValueError("'providers' and 'provider_options' should be the same length if both are given")
    names, options = [], []
    for i, p in enumerate(providers):
        if isinstance(p, tuple):
            names.append(p[0])
            options.append(dict(p[1]))
        else:
            names.append(p)
            options.append(dict(provider_options[i]) if provider_options else {})
    return names, options


# ORT's CUDA levers that bench cards --ort-levers measures on the all-resident step, by
# name: each a set of CUDA provider options, with the same tokens asked of every one.
CUDA_LEVERS = {
    "tunable_op": {"tunable_op_enable": "1", "tunable_op_tuning_enable": "1",
                   "tunable_op_max_tuning_duration_ms": "50"},
    "tunable_op (tuned, no tuning)": {"tunable_op_enable": "1"},
    "unified stream": {"use_ep_level_unified_stream": "1"},
    "cudnn max workspace": {"cudnn_conv_use_max_workspace": "1"},
}
# The CUDA provider options every session starts from, where the caller gives none of
# them: the levers of CUDA_LEVERS that the measurement showed to help (none adopted yet;
# add a lever's options here to adopt it).
CUDA_DEFAULTS: dict = {}
