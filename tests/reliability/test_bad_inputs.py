"""Bad inputs raise a clear, typed error and leave the session usable."""
import numpy as np
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from onnx_offload import BudgetExceeded, CorruptModel, OffloadError, OffloadSession, StateError

# ORT checks names itself, before the session's own code: its InvalidArgument is as clear.
NAME_ERRORS = (InvalidArgument, ValueError, OffloadError)
INPUT_ERRORS = (InvalidArgument, ValueError, TypeError, OffloadError)


def _x(**kw):
    return np.random.default_rng(3).standard_normal(kw.get("shape", (4, 512))).astype(kw.get("dtype", np.float32))


# (case, output names, feeds, accepted errors, words the message must hold)
RUN_CASES = [
    ("wrong input name", None, lambda: {"nope": _x()}, NAME_ERRORS, ["nope"]),
    ("missing input", None, lambda: {}, NAME_ERRORS, ["x"]),
    ("unknown output name", ["nope"], lambda: {"x": _x()}, NAME_ERRORS, ["nope"]),
    ("wrong dtype", None, lambda: {"x": _x(dtype=np.float64)}, INPUT_ERRORS, ["double"]),
    ("wrong rank", None, lambda: {"x": _x(shape=(1, 4, 512))}, INPUT_ERRORS, ["x", "rank"]),
    ("wrong dimension", None, lambda: {"x": _x(shape=(4, 5))}, INPUT_ERRORS, ["x"]),
]


@pytest.fixture(scope="module")
def sessions():
    """One split and one whole session, shared by the run cases: each case must leave it usable."""
    made = {}
    yield made
    for s in made.values():
        assert s.close().committed == 0


@pytest.mark.parametrize("case,outputs,feeds,errors,words", RUN_CASES, ids=[c[0] for c in RUN_CASES])
@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_a_bad_run_raises_clearly_and_the_session_runs_on(helpers, sessions, split, case, outputs, feeds, errors,
                                                          words):
    s = sessions.get(split) or sessions.setdefault(split, helpers.open_session(split=split))
    with pytest.raises(errors) as caught:
        s.run(outputs, feeds())
    if isinstance(caught.value, RuntimeError) and not isinstance(caught.value, OffloadError):
        # a plain RuntimeError (ORT's "Error in execution") is not a typed error
        pytest.fail(f"{case}: untyped {type(caught.value).__name__}: {caught.value}")
    msg = str(caught.value)
    for w in words:
        assert w in msg, f"{case}: the message does not name {w!r}: {msg}"
    assert helpers.outputs_match(s.run(None, helpers.feed(9)), 9), f"the session is broken after {case}"
    from onnx_offload.stats import invariant_violations
    assert invariant_violations(s.stats().arena) == {}


def test_a_budget_below_the_largest_weight_raises_budget_exceeded(helpers):
    with pytest.raises(BudgetExceeded, match="largest weight"):
        OffloadSession(helpers.model_bytes(), providers=["CPUExecutionProvider"], offload=True, vram_limit="2MiB")


def test_a_corrupt_model_raises_corrupt_model():
    with pytest.raises(CorruptModel):
        OffloadSession(b"this is not an onnx model" * 10, providers=["CPUExecutionProvider"])


def test_a_bad_environment_value_raises_value_error(helpers, monkeypatch):
    monkeypatch.setenv("ONNX_GENAI_WEIGHT_OFFLOAD", "maybe")
    with pytest.raises(ValueError, match="ONNX_GENAI_WEIGHT_OFFLOAD.*maybe"):
        OffloadSession(helpers.model_bytes(), providers=["CPUExecutionProvider"])


def test_no_providers_means_the_cpu(helpers):
    # As ORT's CPU build takes an empty list: its default provider.
    with OffloadSession(helpers.model_bytes(), providers=[]) as s:
        assert s.get_providers() == ["CPUExecutionProvider"]


def test_get_inputs_after_close_raises_state_error(helpers):
    s = helpers.open_session(split=True)
    assert s.close().committed == 0
    with pytest.raises(StateError, match="closed"):
        s.get_inputs()
    with pytest.raises(StateError, match="closed"):
        s.run(None, helpers.feed(0))


def test_a_failed_construction_leaves_the_next_session_working(helpers):
    with pytest.raises(BudgetExceeded):
        OffloadSession(helpers.model_bytes(), providers=["CPUExecutionProvider"], offload=True, vram_limit="2MiB")
    s = helpers.open_session(split=True)
    assert helpers.outputs_match(s.run(None, helpers.feed(2)), 2)
    assert s.close().committed == 0
