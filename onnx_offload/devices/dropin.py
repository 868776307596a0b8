"""The rest of InferenceSession's public members, for a session split across devices.

Each stage is an OffloadSession, which has them all; the answer is made from the
stages as OffloadSession makes it from its segments: profiles of every stage merged into
one file, settings given to each stage, lists joined in stage order. What cannot work
across devices raises an error that says why.
"""
from __future__ import annotations

from typing import List

from ..dropin import merge_profiles
from ..errors import StateError
from ..loading import IOInfo


class StagedMembers:
    """Mixed into StagedSession; uses its stages, _step(), _check_open(), _model, _cwd and
    _user_options."""

    def _stages(self) -> list:
        self._check_open()
        return list(self.stages)

    def get_overridable_initializers(self) -> List[IOInfo]:
        """Initializers the model also lists as inputs. Under offload they are weights in
        slots, so feeding one is refused (as an unknown input) rather than silently ignored."""
        self._check_open()
        return list(self._model.overridable)

    def set_providers(self, providers=None, provider_options=None) -> None:
        raise StateError("a session split across devices has its providers fixed when it is made: each stage's "
                         "weights, budget, streams and memory belong to its device. Create a new OffloadSession "
                         "with the providers you want")

    def disable_fallback(self) -> None:
        for stage in self._stages():
            stage.disable_fallback()

    def enable_fallback(self) -> None:
        for stage in self._stages():
            stage.enable_fallback()

    def get_profiling_start_time_ns(self) -> int:
        return min(stage.get_profiling_start_time_ns() for stage in self._stages())

    def end_profiling(self) -> str:
        """Ends profiling; returns the profile's file: every stage's profile merged into one,
        each event's time moved onto the earliest stage's clock, and its args naming its
        stage (offload_stage) and, within it, its segment (offload_segment)."""
        with self._step():
            starts = [stage.get_profiling_start_time_ns() for stage in self.stages]
            files = [stage.end_profiling() for stage in self.stages]
            prefix = self._user_options.profile_file_prefix if self._user_options is not None else ""
            return merge_profiles(list(zip(files, starts)), self._cwd, prefix, "offload_stage")

    def get_input_memory_infos(self):
        raise StateError("get_input_memory_infos needs the model to run as one plain ORT session, and this session "
                         f"runs {len(self._stages())} stages on devices {self.devices}: the caller's inputs feed "
                         f"several stages")

    def get_output_memory_infos(self):
        raise StateError("get_output_memory_infos needs the model to run as one plain ORT session, and this session "
                         f"runs {len(self._stages())} stages on devices {self.devices}: the outputs come from several "
                         f"devices")

    def run_with_ortvaluevector(self, run_options, feed_names, feeds, fetch_names, fetches, fetch_devices):
        raise StateError("run_with_ortvaluevector needs the model to run as one plain ORT session, and this session "
                         f"runs {len(self._stages())} stages on devices {self.devices}: ORT's internal value vectors "
                         f"cannot carry values between devices; use run_with_ort_values")

    def get_input_epdevices(self):
        """The first stage's (as OffloadSession answers with its first segment's)."""
        return self._stages()[0].get_input_epdevices()

    def create_ortvalue_from_shape_and_type(self, shape, element_type, device_type, device_id=0, vendor_id=-1):
        return self._stages()[0].create_ortvalue_from_shape_and_type(shape, element_type, device_type, device_id,
                                                                      vendor_id)

    def get_provider_graph_assignment_info(self):
        return [info for stage in self._stages() for info in stage.get_provider_graph_assignment_info()]

    def get_tuning_results(self):
        return [r for stage in self._stages() for r in stage.get_tuning_results()]

    def set_tuning_results(self, results, *, error_on_invalid=False):
        for stage in self._stages():
            stage.set_tuning_results(results, error_on_invalid=error_on_invalid)

    def set_ep_dynamic_options(self, options):
        for stage in self._stages():
            stage.set_ep_dynamic_options(options)

    def release_captured_graph(self, graph_annotation_id: int = 0) -> None:
        """Releases what ORT captured under the caller's own gpu_graph_id, on every stage
        (the package's own graphs live as long as the session)."""
        for stage in self._stages():
            stage.release_captured_graph(graph_annotation_id)
