"""The ORT sessions that run a model's segments: their options and providers.

Every segment session runs a graph that was optimized once already, so optimizations
and prepacking are off and the weights ORT runs are the ones in the slots. On CUDA it
runs on the device's compute stream (``user_compute_stream``), with ORT's own arena
capped by the budget plan, and with ``enable_cuda_graph`` when capture is on.
"""
from __future__ import annotations

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
    "session.disable_double_qdq_remover", "session.disable_aot_function_inlining", "session.node_partition_config_file",
    "session.record_ep_graph_assignment_info", "session.inter_op.thread_pool_size",
    "optimization.enable_gelu_approximation", "optimization.disable_specified_optimizers",
    "optimization.enable_cast_chain_elimination", "mlas.enable_gemm_fastmath_arm64_bfloat16",
    "mlas.use_lut_gemm", "ep.context_enable", "ep.context_file_path", "ep.context_embed_mode",
)


def copy_options(user: Optional[ort.SessionOptions]) -> ort.SessionOptions:
    """A SessionOptions with every setting the caller made that ORT lets us read: each
    property, and each known config entry that is set."""
    so = ort.SessionOptions()
    if user is None:
        return so
    for name in dir(type(user)):
        attr = getattr(type(user), name, None)
        if isinstance(attr, property) and attr.fset is not None and name not in _OWN_OPTIONS \
                and not name.startswith("_"):
            setattr(so, name, getattr(user, name))
    for key in KNOWN_CONFIG_KEYS:
        try:
            so.add_session_config_entry(key, user.get_session_config_entry(key))
        except RuntimeError:  # not set
            pass
    return so


def choose_providers(names: List[str], options: List[dict], cuda_status) -> Tuple[List[str], List[dict], List[str]]:
    """The providers the session runs, as ORT takes a list: the ones the package does not
    run are skipped, and CUDA that cannot run here gives way to the CPU when the list has
    it. Returns (names, options, what to warn about). `cuda_status()` is '' when CUDA
    can run, else why not."""
    notes = []
    skipped = [n for n in names if n not in (CUDA_EP, CPU_EP)]
    kept = [(n, o) for n, o in zip(names, options) if n in (CUDA_EP, CPU_EP)]
    if not kept:
        raise ValueError(f"OffloadSession runs {CUDA_EP} and {CPU_EP}, and none of {', '.join(names)}")
    if skipped:
        notes.append(f"OffloadSession runs {CUDA_EP} and {CPU_EP}; skipping {', '.join(skipped)}")
    if kept[0][0] == CUDA_EP and any(n == CPU_EP for n, _ in kept):
        why = cuda_status()
        if why:
            notes.append(f"{CUDA_EP} cannot run here ({why}); running on {CPU_EP}, with the host backend")
            kept = [(n, o) for n, o in kept if n == CPU_EP]
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


class SessionFactory:
    """Creates segment sessions with the caller's settings and the package's own."""

    def __init__(self, device, user_options: Optional[ort.SessionOptions], cuda_options: dict,
                 device_id: int, ort_memory_cap: int):
        self._device = device
        self._user = user_options
        self._cuda_options = cuda_options
        self._device_id = device_id
        self._ort_memory_cap = ort_memory_cap

    def session_options(self) -> ort.SessionOptions:
        so = copy_options(self._user)
        # The graph was optimized once already: nothing may replace the weights now.
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.add_session_config_entry("session.disable_prepacking", "1")
        return so

    def providers(self, capture: bool):
        if not self._device.is_cuda:
            return [CPU_EP]
        opts = {k: str(v) for k, v in self._cuda_options.items()}
        opts["device_id"] = str(self._device_id)
        opts["has_user_compute_stream"] = "1"
        opts["user_compute_stream"] = str(self._device.compute_stream.native)
        # ORT's own arena, capped by the budget plan; what it takes is measured and
        # charged. (With ORT 1.31.1 the external allocator cannot be used here: with it
        # ORT reads initializers from the model file instead of the add_initializer
        # values, and it breaks capture.)
        opts["arena_extend_strategy"] = "kSameAsRequested"
        opts["gpu_mem_limit"] = str(self._ort_memory_cap)
        if capture:
            opts["enable_cuda_graph"] = "1"
        return [(CUDA_EP, opts), CPU_EP]

    def create(self, path: str, so: ort.SessionOptions, capture: bool) -> Tuple[ort.InferenceSession, bool, str]:
        """(session, captured, why not captured). ORT refuses capture when it places
        nodes on the CPU; such a session runs without it."""
        if not capture:
            return ort.InferenceSession(path, so, providers=self.providers(False)), False, ""
        try:
            return ort.InferenceSession(path, so, providers=self.providers(True)), True, ""
        except Exception as e:  # noqa: BLE001 - ORT raises its own types
            msg = str(e)
            if "CUDA Graph" not in msg:
                raise
            why = f"ORT refused capture: {msg.strip()[:200]}"
            return ort.InferenceSession(path, so, providers=self.providers(False)), False, why
