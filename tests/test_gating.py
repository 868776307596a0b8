"""resolve_graph_capture_enabled: the precedence matrix, and structural safety."""
import pytest
from onnx import TensorProto, helper

from onnx_offload import resolve_graph_capture_enabled
from onnx_offload.engines.graph_capture import structural_safety
from onnx_offload.models import mlp_stack


def decide(**kw):
    base = dict(on_cuda=True, offload=False, stable_addresses=True, override=None, env_value=None,
                structurally_safe=True, safety_reason="safe")
    base.update(kw)
    return resolve_graph_capture_enabled(**base)


@pytest.mark.parametrize("override", [None, True, False])
@pytest.mark.parametrize("env", [None, True, False])
@pytest.mark.parametrize("safe", [True, False])
def test_offload_without_stable_addresses_always_declines(override, env, safe):
    d = decide(offload=True, stable_addresses=False, override=override, env_value=env, structurally_safe=safe)
    assert not d.enabled and "stable addresses" in d.reason


@pytest.mark.parametrize("env", [None, True, False])
@pytest.mark.parametrize("safe", [True, False])
@pytest.mark.parametrize("override", [True, False])
def test_override_beats_env_and_auto(override, env, safe):
    d = decide(override=override, env_value=env, structurally_safe=safe)
    assert d.enabled is override and "caller" in d.reason


@pytest.mark.parametrize("env", [True, False])
@pytest.mark.parametrize("safe", [True, False])
def test_env_beats_auto(env, safe):
    d = decide(env_value=env, structurally_safe=safe)
    assert d.enabled is env and f"ONNX_GENAI_CUDA_GRAPH={int(env)}" in d.reason


def test_auto_follows_structural_safety():
    assert decide(structurally_safe=True).enabled
    d = decide(structurally_safe=False, safety_reason="input 'x' has a dynamic shape")
    assert not d.enabled and "dynamic shape" in d.reason


def test_offload_with_stable_addresses_may_capture():
    assert decide(offload=True, stable_addresses=True).enabled


@pytest.mark.parametrize("override", [None, True])
def test_cpu_never_captures(override):
    d = decide(on_cuda=False, override=override)
    assert not d.enabled and "CUDA execution provider" in d.reason


def test_structural_safety():
    assert structural_safety(mlp_stack(batch=4))[0]
    safe, why = structural_safety(mlp_stack(batch=None))
    assert not safe and "dynamic shape" in why
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["o"])], "b", [],
                               [helper.make_tensor_value_info("o", TensorProto.FLOAT, [1])])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)], "g",
                          [cond, helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    safe, why = structural_safety(helper.make_model(g))
    assert not safe and "control flow (If)" in why
