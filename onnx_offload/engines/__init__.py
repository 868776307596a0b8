"""The engines that run a prepared model on ORT under the budget.

The streaming engine (one ORT session, captured, with the page-ins in its graph) and the
segment runner (one ORT session per segment) offer one surface, ``base.Engine``;
``switch.Engines`` holds the one in force and every move between them. OrtValues over
the package's memory, a split session's IOBinding, the graph-capture decision and the
factory of the ORT sessions they run live here too.
"""

from .base import Engine
from .graph_capture import CONTROL_FLOW_OPS, GraphCaptureDecision, resolve_graph_capture_enabled, structural_safety
from .host_nodes import HostNodes
from .iobinding import OffloadIOBinding
from .ortvalues import (FixedBuffer, IOInfo, InvalidArgument, as_arrays, as_ortvalue, check_feeds, check_required,
                        detached, nbytes_of, numpy_dtype, shareable)
from .runner import SegmentRunner
from .stream_plan import StreamingUnavailable, choose_engine
from .streaming import StreamEngine
from .switch import Engines, RunInputs

__all__ = ["CONTROL_FLOW_OPS", "Engine", "Engines", "FixedBuffer", "GraphCaptureDecision", "HostNodes", "IOInfo",
           "InvalidArgument", "OffloadIOBinding", "RunInputs", "SegmentRunner", "StreamEngine", "StreamingUnavailable",
           "as_arrays", "as_ortvalue", "check_feeds", "check_required", "choose_engine", "detached", "nbytes_of",
           "numpy_dtype", "resolve_graph_capture_enabled", "shareable", "structural_safety"]
