"""The rest of InferenceSession's public members, for a session split across devices.

Each stage is an OffloadSession, which has them all; the answer is made from the
stages as OffloadSession makes it from its segments: profiles of every stage merged into
one file, settings given to each stage, lists joined in stage order. What cannot work
across devices raises an error that says why.
"""
from __future__ import annotations

from typing import List

from ..dropin import FanOutMembers, merge_profiles
from ..errors import StateError
from ..loading import IOInfo


class StagedMembers(FanOutMembers):
    """Mixed into StagedSession; uses its stages, _step(), _check_open(), _model, _cwd and
    _user_options."""

    def _stages(self) -> list:
        self._check_open()
        return list(self.stages)

    def _parts(self) -> list:
        return self._stages()

    def get_overridable_initializers(self) -> List[IOInfo]:
        """Initializers the model also lists as inputs. Under offload they are weights in
        slots, so feeding one is refused (as an unknown input) rather than silently ignored."""
        self._check_open()
        return list(self._model.overridable)

    def set_providers(self, providers=None, provider_options=None) -> None:
        raise StateError("a session split across devices has its providers fixed when it is made: each stage's "
                         "weights, budget, streams and memory belong to its device. Create a new OffloadSession "
                         "with the providers you want")

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

