"""The rest of InferenceSession's public members, for OffloadSession.

Where one ORT session runs underneath (the streaming engine, or an unsplit model) a
member forwards to it; where several do (segments), the answer is made from all of
them: profiles are merged into one file, fallback is switched on each. What cannot
work under offload raises an error that says why.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import List

import onnxruntime as ort

from .engines import IOInfo, InvalidArgument, check_feeds, check_required, detached
from .errors import StateError
from .loading import ModelMeta


class FanOutMembers:
    """InferenceSession's members that a session made of parts (its segments' ORT sessions,
    or a split session's stages) answers from its first part, where the question is one the
    parts share (providers, options), or passes to every part, joining their answers."""

    def _parts(self) -> list:
        raise NotImplementedError

    def get_input_epdevices(self):
        return self._parts()[0].get_input_epdevices()

    def create_ortvalue_from_shape_and_type(self, shape, element_type, device_type, device_id=0, vendor_id=-1):
        return self._parts()[0].create_ortvalue_from_shape_and_type(shape, element_type, device_type, device_id,
                                                                     vendor_id)

    def get_provider_graph_assignment_info(self):
        return [info for part in self._parts() for info in part.get_provider_graph_assignment_info()]

    def get_tuning_results(self):
        return [r for part in self._parts() for r in part.get_tuning_results()]

    def disable_fallback(self) -> None:
        for part in self._parts():
            part.disable_fallback()

    def enable_fallback(self) -> None:
        for part in self._parts():
            part.enable_fallback()

    def set_tuning_results(self, results, *, error_on_invalid=False):
        for part in self._parts():
            part.set_tuning_results(results, error_on_invalid=error_on_invalid)

    def set_ep_dynamic_options(self, options):
        for part in self._parts():
            part.set_ep_dynamic_options(options)

    def release_captured_graph(self, graph_annotation_id: int = 0) -> None:
        """Releases what ORT captured under the caller's own gpu_graph_id, in every part (the
        package's own graphs live as long as the session)."""
        for part in self._parts():
            part.release_captured_graph(graph_annotation_id)


class InferenceSessionMembers(FanOutMembers):
    """Mixed into OffloadSession; uses its _step(), _runner, _ask_runner(), _with_fallback(),
    _check_call() and the model facts it records at construction
    (_modelmeta, _overridable)."""

    # ------------------------------------------------------------------ introspection
    def get_inputs(self):
        # As ORT lists them: the inputs a caller feeds, never the weights (which a session
        # without stable addresses receives as inputs of its own).
        fed = set(self._feed_inputs)

        def listed(runner):
            return self._graph_inputs if runner.streaming else runner.single.get_inputs()
        return [i for i in self._ask_runner(listed) if i.name in fed]

    def get_outputs(self):
        return self._ask_runner(lambda r: r.single.get_outputs() if not r.streaming else list(self._graph_outputs))

    def get_providers(self):
        return self._ask_runner(lambda r: r.single.get_providers())

    def get_session_options(self):
        """The SessionOptions as the caller gave them (ORT's defaults when none were).
        The ORT sessions underneath run the graph optimized once, with optimizations
        off; those settings are the package's own, not reported here."""
        self._check_open()
        return self._user_options if self._user_options is not None else ort.SessionOptions()

    def _live_runner(self):
        """The runner, for members that take no lock (as ORT's do not): None only while
        another thread moves the session to another runner (a fallback), which this
        waits out; once closing, StateError (the runner's `single` raises it too)."""
        self._check_open()
        runner = self._runner
        if runner is None:
            with self._lock:
                self._check_open()
                runner = self._runner
        return runner

    def _ask_runner(self, question):
        """question(runner) of the runner in force, for members that take no lock. A
        runner that another thread closes meanwhile (the session moving to segments) is
        no answer: the question goes to the runner made in its place. Once the session
        closes, StateError."""
        while True:
            runner = self._live_runner()
            try:
                return question(runner)
            except StateError:
                if self._runner is runner:  # the runner in force raised it: the answer
                    raise

    def _refuse_overrides(self, names) -> None:
        """An initializer the model also lists as an input is a weight in a slot here:
        feeding it would be silently ignored by the segments, so it is refused."""
        fed = sorted({i.name for i in self._overridable}.intersection(names))
        if fed:
            raise InvalidArgument(f"{fed[0]!r} is an initializer the model lets callers override, but under offload "
                                  f"it is a weight in a slot: overriding it is not supported (its value would be "
                                  f"ignored)")

    def _check_call(self, input_feed, output_names, run_options=None) -> None:
        """What ORT checks of a call, raising what ORT raises, where ORT does not check
        it itself."""
        if not self._runner.plain:  # else ORT checks feeds and applies overridden initializers itself
            self._refuse_overrides(input_feed)
            check_feeds(self._required_inputs, self._graph_inputs, [o.name for o in self._graph_outputs],
                        input_feed, output_names, run_options)

    def get_modelmeta(self) -> ModelMeta:
        self._check_open()
        return self._modelmeta

    def get_overridable_initializers(self) -> List[IOInfo]:
        """Initializers the model also lists as inputs. Under offload they are weights in
        slots, so feeding one is refused (as an unknown input) rather than silently ignored."""
        self._check_open()
        return list(self._overridable)

    def get_provider_options(self) -> dict:
        return self._ask_runner(lambda runner: runner.single.get_provider_options())

    def set_providers(self, providers=None, provider_options=None) -> None:
        raise StateError("an OffloadSession's providers are fixed when it is made: its weights, budget, streams and "
                         "memory belong to that device. Create a new OffloadSession with the providers you want")

    def get_profiling_start_time_ns(self) -> int:
        return min(sess.get_profiling_start_time_ns() for sess in self._sessions())

    def end_profiling(self) -> str:
        """Ends profiling; returns the profile's file. With several segment sessions their
        profiles are merged into one file: each event's time is moved onto the earliest
        session's clock, and its args name its segment."""
        with self._step():
            runs = self._runner.runs
            starts = [run.session.get_profiling_start_time_ns() for run in runs]
            files = [run.session.end_profiling() for run in runs]
            # ORT names the file relative to the working directory the session was made in.
            files = [(os.path.join(self._cwd, f) if f else "", t) for f, t in zip(files, starts)]
            prefix = self._user_options.profile_file_prefix if self._user_options is not None else ""
            return merge_profiles(files, self._cwd, prefix, "offload_segment")

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None) -> List[ort.OrtValue]:
        """As InferenceSession.run_with_ort_values: OrtValues in, OrtValues out (each in
        memory of its own, on the device the output was made on)."""
        with self._step():
            if self._runner.plain:
                return self._runner.run_single_with_ort_values(output_names, input_dict_ort_values, run_options)
            self._check_call(input_dict_ort_values, output_names, run_options)
            values = self._with_fallback(lambda: self._runner.run_segments(input_dict_ort_values, run_options))
            names = output_names or [o.name for o in self._graph_outputs]
            return [detached(self._device, values[n], self.config.device_id) for n in names]

    # Members about the ORT session underneath: forwarded where there is one; with several
    # segment sessions, questions are answered by the first (they share providers and
    # options) and settings go to each.
    def _sessions(self) -> list:
        def sessions(runner):
            if not runner.runs:  # closed by another thread since the check
                raise StateError("the session is closed")
            return [run.session for run in runner.runs]
        return self._ask_runner(sessions)

    def _parts(self) -> list:
        return self._sessions()

    def get_input_memory_infos(self):
        return self._runner_single("get_input_memory_infos", "the caller's inputs feed the first segment only")

    def get_output_memory_infos(self):
        return self._runner_single("get_output_memory_infos", "the outputs come from several segments")

    def run_with_ortvaluevector(self, run_options, feed_names, feeds, fetch_names, fetches, fetch_devices):
        with self._step():
            single = self._runner_single("run_with_ortvaluevector",
                                         "ORT's internal value vectors cannot carry values between segments; "
                                         "use run_with_ort_values")
            single.run_with_ortvaluevector(run_options, feed_names, feeds, fetch_names, fetches, fetch_devices)

    def _runner_single(self, member: str, why: str):
        """The one ORT session that runs the whole model as given (no segments, graphs of
        the package's own, or weights as inputs in between), for members that pass
        straight through; else an error saying why not."""
        def single(runner):
            if not runner.plain:
                raise StateError(f"{member} needs the model to run as one plain ORT session, and this session runs "
                                 f"{len(runner.runs)} segment(s) with weights paged in between: {why}")
            return getattr(runner.single, member)() if member.startswith("get_") else runner.single
        return self._ask_runner(single)

    def run_async(self, output_names, input_feed, callback, user_data, run_options=None) -> None:
        """As InferenceSession.run_async: runs on a thread of its own and calls
        callback(outputs, user_data, error message), the message empty on success."""
        self._check_open()
        run_async(self, self._required_inputs, output_names, input_feed, callback, user_data, run_options)


def merge_profiles(files, cwd: str, prefix: str, tag: str) -> str:
    """One profile of several ORT profiles, `files` as [(path or '', the profile's start
    in ns)]: each event's time moved onto the earliest profile's clock, and its args
    naming (as `tag`) the index of the profile it came from. The parts are removed; a
    single profile is returned as it is, none as ''. The merged file is named as ORT
    names a profile (`prefix`, or ORT's own), in `cwd`."""
    files = [(f, t) for f, t in files if f]
    if len(files) <= 1:
        return files[0][0] if files else ""
    first = min(t for _, t in files)
    events = []
    for k, (path, start) in enumerate(files):
        with open(path) as f:
            for event in json.load(f):
                if isinstance(event.get("ts"), (int, float)):
                    event["ts"] += (start - first) / 1000.0  # ORT's ts: microseconds from its start
                event.setdefault("args", {})[tag] = k
                events.append(event)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S") + f"-{time.time_ns() % 10**9:09d}"
    merged = os.path.join(cwd, f"{prefix or 'onnxruntime_profile_'}_{stamp}_merged.json")
    with open(merged, "w") as f:
        json.dump(events, f)
    for path, _ in files:
        os.remove(path)
    return merged


def run_async(session, required, output_names, input_feed, callback, user_data, run_options) -> None:
    """`session.run(...)` on a thread of its own, its outputs or its error handed to
    `callback` as ORT hands them. ORT refuses missing inputs (`required`) before it
    returns; every other error reaches the callback."""
    check_required(required, input_feed)

    def work():
        try:
            out = session.run(output_names, input_feed, run_options)
        except Exception as e:  # noqa: BLE001 - handed to the callback, as ORT does
            callback([], user_data, str(e))
            return
        callback(out, user_data, "")

    threading.Thread(target=work, name=f"{type(session).__name__}.run_async", daemon=True).start()
