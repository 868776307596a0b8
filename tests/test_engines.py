"""Both engines offer the one surface the session, generation, the drop-in members and
the split IOBinding use (``Engine``): every abstract member is implemented, and every
member the session asks of its engine is there on a real one of each kind."""
import inspect

import pytest

from onnx_offload import OffloadSession
from onnx_offload.engines import Engine, SegmentRunner, StreamEngine
from onnx_offload.models import mlp_stack, weight_bytes
from onnx_offload.models.decoder import decoder_lm

# What the session, generation, dropin.py and iobinding.py call or read on the engine.
CALLS = ["run", "run_bound", "run_segments", "run_single_with_ort_values", "run_single_with_iobinding",
         "drop_plans", "close", "host_report"]
PROPERTIES = ["single", "plan_count"]
DATA = ["device", "streaming", "plain", "runs", "capture", "notes", "steps", "graph_steps", "last_step"]


@pytest.mark.parametrize("cls", [StreamEngine, SegmentRunner])
def test_each_engine_implements_every_abstract_member(cls):
    assert issubclass(cls, Engine)
    assert not cls.__abstractmethods__
    for name in Engine.__abstractmethods__:
        assert getattr(cls, name) is not getattr(Engine, name), name


def test_the_surface_declares_what_the_session_uses():
    assert set(Engine.__abstractmethods__) <= set(CALLS + PROPERTIES)
    for name in CALLS:
        assert inspect.isfunction(getattr(Engine, name)), name
    for name in PROPERTIES:
        assert isinstance(getattr(Engine, name), property), name
    assert set(DATA) <= set(Engine.__annotations__)
    for name in CALLS + PROPERTIES:
        assert getattr(Engine, name).__doc__, name
    for name in DATA:
        assert f"``{name}``" in Engine.__doc__, name


def _check_members(runner):
    for name in CALLS:
        assert callable(getattr(runner, name)), name
    assert runner.single is not None
    assert isinstance(runner.plan_count, int)
    for name in DATA:
        assert hasattr(runner, name), name
    assert isinstance(runner.streaming, bool) and isinstance(runner.plain, bool)
    assert all(hasattr(r, "seg") and hasattr(r, "session") and hasattr(r, "captured") for r in runner.runs)


def test_the_segment_runner_has_every_member_the_session_uses():
    m = mlp_stack(layers=4, hidden=64, batch=2)
    with OffloadSession(m.SerializeToString(), offload=True, vmm=True, host_granularity=4096,
                        vram_limit="64MiB", weight_bytes=weight_bytes(m) // 2) as s:
        assert type(s._runner) is SegmentRunner
        _check_members(s._runner)


def test_the_streaming_engine_has_every_member_the_session_uses(monkeypatch):
    # The engine is built on the CPU too (ring, addresses, one ORT session); only its
    # first step, which captures, needs CUDA.
    import onnx_offload.session as session_module
    monkeypatch.setattr(session_module, "choose_engine", lambda *a, **kw: "graph")
    model = decoder_lm("gqa", layers=2, hidden=64, max_length=64)
    with OffloadSession(model.SerializeToString(), offload=True, vmm=True, host_granularity=4096,
                        vram_limit="64MiB", weight_bytes=weight_bytes(model) // 2) as s:
        assert type(s._runner) is StreamEngine
        _check_members(s._runner)
        with pytest.raises(NotImplementedError):
            s._runner.run_single_with_ort_values(None, {}, None)
