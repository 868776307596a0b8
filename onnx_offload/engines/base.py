"""The one surface both engines offer to the session and to generation: ``Engine``.

The session holds one engine at a time (the streaming engine, or the segment runner
for streamed segments and for resident weights) and moves between them on a fallback;
everything it, generation, the drop-in members and the split IOBinding ask of the
engine in force is declared here.
"""
from __future__ import annotations

import abc
from typing import Dict, List, Optional, Sequence, Tuple

import onnxruntime as ort

from ..memory import Counters
from .graph_capture import GraphCaptureDecision


class Engine(abc.ABC):
    """Runs a prepared model on ORT under the budget.

    Data every engine has:
    - ``device``: the package's device (its streams, scratch zone and backend).
    - ``streaming``: whether weights page in while a step runs (else every weight stays
      resident for the session's life).
    - ``plain``: whether one plain ORT session runs the model as given (unsplit,
      uncaptured, weights as initializers): ORT's own members then answer for it.
    - ``runs``: one entry per ORT session, in step order, each with its segment
      (``seg``), its ``session`` and whether it was ``captured``; empty once closed.
    - ``capture``: the graph-capture decision in force, with its reason.
    - ``notes``: what the engine chose and why, for the session's stats.
    - ``steps``: steps run.
    - ``graph_steps``: steps run as a captured graph (captured once, then replayed).
    - ``last_step``: the residency counters of the last step.
    """

    device: object
    streaming: bool
    plain: bool
    runs: list
    capture: GraphCaptureDecision
    notes: List[str]
    steps: int
    graph_steps: int
    last_step: Counters

    @abc.abstractmethod
    def host_report(self) -> dict:
        """What stats() says of host compute (docs/host_compute.md): on, what the host
        computes and the rates, or why it is off; the steps it ran in."""

    @abc.abstractmethod
    def run(self, output_names: Optional[Sequence[str]], input_feed, run_options) -> list:
        """ORT's run(): one step on the caller's values; the outputs as host arrays."""

    @abc.abstractmethod
    def run_segments(self, input_feed, run_options=None) -> Dict[str, ort.OrtValue]:
        """One step on the caller's values (host arrays or OrtValues); every output's
        value (and every boundary's, for a split model), on the device."""

    @abc.abstractmethod
    def run_bound(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue], *,
                  fixed: bool, key: Optional[tuple] = None) -> Tuple[Dict[str, ort.OrtValue], bool]:
        """One step with the caller's inputs and outputs bound where they are. `fixed`:
        the caller keeps these shapes and addresses for the steps to come, so the engine
        keeps what it made for them (a plan, a graph) until ``drop_plans``. `key`, when
        given, stands for those shapes and addresses (the caller vouches that it changes
        whenever they do). Returns every value and whether the step reused what an
        earlier step made."""

    @property
    @abc.abstractmethod
    def single(self) -> ort.InferenceSession:
        """The one ORT session of a model that runs unsplit (StateError once closed)."""

    @property
    @abc.abstractmethod
    def plan_count(self) -> int:
        """The input-shape signatures the engine keeps buffers (or graphs) for."""

    @abc.abstractmethod
    def drop_plans(self, keys) -> None:
        """Forgets what ``run_bound`` kept under these keys: their buffers are about to
        be freed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Gives back the ORT sessions and everything the engine holds on the device."""

    def run_single_with_ort_values(self, output_names, feeds, run_options) -> list:
        """ORT's run_with_ort_values on the one session; only a ``plain`` engine has it."""
        raise NotImplementedError(f"{type(self).__name__} does not run the model as one plain ORT session")

    def run_single_with_iobinding(self, iobinding, run_options) -> None:
        """ORT's run_with_iobinding on the one session, with the caller's binding; only an
        engine that does not stream has it."""
        raise NotImplementedError(f"{type(self).__name__} streams its weights: its steps bind their own values")
