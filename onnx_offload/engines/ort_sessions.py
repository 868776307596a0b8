"""The ORT sessions the engines run: their options and providers.

Every session runs a graph that was optimized once already, so optimizations and
prepacking are off and the weights ORT runs are the ones in the slots. On CUDA it runs
on the device's compute stream (``user_compute_stream``), with ORT's own arena capped by
the budget plan, and with ``enable_cuda_graph`` when capture is on.
"""
from __future__ import annotations

from typing import Optional, Tuple

import onnxruntime as ort

from ..loading import CPU_EP, CUDA_EP, copy_options, set_config


class SessionFactory:
    """Creates segment sessions with the caller's settings and the package's own."""

    def __init__(self, device, user_options: Optional[ort.SessionOptions], cuda_options: dict,
                 device_id: int, ort_memory_cap: int):
        self._device = device
        self._user = user_options
        self._cuda_options = cuda_options
        self._device_id = device_id
        self._ort_memory_cap = ort_memory_cap

    def session_options(self, prepack: bool = False) -> ort.SessionOptions:
        """The options of a session over weights in slots. ORT's kernels may prepack a
        weight (a copy of it in their own layout, read instead of the slot from then on),
        which a weight that pages in and out cannot allow: the copy would keep what the
        slot held when the session was made. `prepack`, on the host backend: an int4
        session whose weights stay resident for its life, whose MatMulNBits kernels
        without their packed layout run a slower path that also rounds otherwise (35x
        slower on a builder int4 decoder); as plain ORT does, ORT then prepacks, and its
        copies are ORT's process memory, as all of ORT's memory is there."""
        so = copy_options(self._user)
        # The graph was optimized once already: nothing may replace the weights now.
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if not (prepack and not self._device.is_cuda):
            set_config(so, "session.disable_prepacking", "1")
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
        nodes on the CPU; such a session runs without it. So does a session that reads
        an input in host memory (see `host_inputs`): a replay would not read it again."""
        if not capture:
            return ort.InferenceSession(path, so, providers=self.providers(False)), False, ""
        try:
            session = ort.InferenceSession(path, so, providers=self.providers(True))
        except Exception as e:  # noqa: BLE001 - ORT raises its own types
            msg = str(e)
            if "CUDA Graph" not in msg:
                raise
            why = f"ORT refused capture: {msg.strip()[:200]}"
            return ort.InferenceSession(path, so, providers=self.providers(False)), False, why
        read_on_host = self.host_inputs(session)
        if not read_on_host:
            return session, True, ""
        del session
        why = (f"ORT reads {', '.join(read_on_host[:4])}{' ...' if len(read_on_host) > 4 else ''} in host memory "
               f"(its nodes there run on the CPU), which a replayed graph would not read again")
        return ort.InferenceSession(path, so, providers=self.providers(False)), False, why

    def host_inputs(self, session: ort.InferenceSession) -> list:
        """The inputs of a CUDA session that ORT takes in host memory: every node reading
        them runs on the CPU, or reads them there (a CPU-side input of a CUDA kernel, as
        GroupQueryAttention's total_sequence_length). The package binds every value in
        device memory, and IOBinding copies such an input to the host when it is bound, not
        when the session runs: a binding kept from step to step must bind them again."""
        if not self._device.is_cuda:
            return []
        infos = session.get_input_memory_infos()
        return [i.name for i, m in zip(session.get_inputs(), infos) if m.name == "Cpu"]
