"""Host compute between streamed segments (engines/host_segments.py) on inputs and settings
the decoders of tests/test_host_segments.py do not reach: a host MatMul fed straight from a
graph input (empty inputs, another K), a thread count beyond the CPUs the process may use,
a card that a generation's KV cache fills, a session lost while its engine is replaced, and
the host pool's spin bound after the sessions close.

Outputs are compared with plain ORT's on the same model: equal in shape and type, and within
the bound of docs/host_compute.md (16 eps x max|output|) where the host's kernels multiply.
"""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_offload import OffloadSession, _core
from onnx_offload.errors import ModelRunError, OffloadWarning
from onnx_offload.models import weight_bytes

CPU = ["CPUExecutionProvider"]
BOUND_ULPS = 16
K = 64
LAYERS = 8


def _chain(dtype=np.float32) -> "onnx.ModelProto":  # noqa: F821
    """x [batch, seq, K] through LAYERS of Relu(x @ w): eight alike MatMuls, of which the split
    gives the host some (one or two are often too few for it on a busy machine); the first
    one's X is the graph input itself (the runner multiplies it before the first segment)."""
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for i in range(LAYERS):
        weights.append(numpy_helper.from_array((rng.standard_normal((K, K)) * 0.1).astype(dtype), f"w{i}"))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        x = f"r{i}"
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", t, ["batch", "seq", K])],
                          [helper.make_tensor_value_info(x, t, ["batch", "seq", K])], weights)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _fan(k="k") -> "onnx.ModelProto":  # noqa: F821
    """x [batch, seq, k] into LAYERS MatMuls side by side, summed: whichever the host takes, its
    X is the graph input. `k`: x's last dim as the graph declares it (a name: any the caller gives)."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal((K, K)) * 0.1).astype(np.float32), f"w{i}")
               for i in range(LAYERS)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]) for i in range(LAYERS)]
    nodes.append(helper.make_node("Sum", [f"m{i}" for i in range(LAYERS)], ["y"]))
    g = helper.make_graph(nodes, "fan", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", K])], weights)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _session(model, mode):
    return OffloadSession(model.SerializeToString(), providers=CPU, offload=True, vmm=True,
                          weight_bytes=weight_bytes(model) // 3, host_compute=mode)


@pytest.fixture
def even_rates(monkeypatch):
    """The split's rates fixed as this model's are on a 2-core machine (the copy of a 16 KiB
    weight into the arena at 0.1 GB/s, the host GEMV at 2.4 GB/s), so that the host takes its
    MatMuls whatever load the machine is under: these tests are of what the host's part
    does, not of how much of it there is (tests/test_host_step.py tests the split)."""
    from onnx_offload.engines import host_step
    monkeypatch.setattr(host_step, "measure_rates", lambda device, store, by_kind, copy, threads, rows=(1, 4, 8): (
        0.1e9, {k: {m: 2.4e9 for m in rows} for k in by_kind}))


def _within_bound(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.size:
        bound = BOUND_ULPS * float(np.finfo(want.dtype).eps) * float(np.abs(want.astype(np.float32)).max())
        assert float(np.abs(got.astype(np.float32) - want.astype(np.float32)).max()) <= bound


@pytest.mark.parametrize("shape", [(1, 0, K), (0, 1, K), (0, 3, K)], ids=["no-tokens", "no-rows", "no-rows-3"])
def test_an_empty_input_gives_plain_ort_s_empty_output_with_the_host_computing(shape, even_rates):
    model = _chain()
    plain = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    rng = np.random.default_rng(1)
    step = {"x": rng.standard_normal((1, 1, K)).astype(np.float32)}
    empty = {"x": np.zeros(shape, np.float32)}
    with _session(model, 2) as s:
        assert s.stats().host_compute["on"], s.stats().host_compute
        _within_bound(s.run(None, step)[0], plain.run(None, step)[0])
        committed = s.stats().ledger.committed
        for _ in range(2):  # the first of a shape, then under its plan's fixed buffers
            got = s.run(None, empty)[0]
            want = plain.run(None, empty)[0]
            assert got.shape == want.shape == shape and got.dtype == want.dtype
        assert s.stats().ledger.committed == committed
        _within_bound(s.run(None, step)[0], plain.run(None, step)[0])
        assert s.stats().host_compute["steps"] == 4


def test_a_thread_count_beyond_the_process_s_cpus_runs_on_those_it_may_use(even_rates):
    """A thread count valid anywhere (1 to 4096) runs on a machine with fewer CPUs, on as
    many threads as the process may use, and says so."""
    model = _chain()
    plain = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    cpus = int(_core.host_cpu()["logical_cpus"])
    x = {"x": np.random.default_rng(2).standard_normal((1, 1, K)).astype(np.float32)}
    for asked in (cpus + 1, 4096):
        with _session(model, asked) as s:
            _within_bound(s.run(None, x)[0], plain.run(None, x)[0])
            st = s.stats()
        assert st.host_compute["on"] and st.host_compute["threads"] == cpus, st.host_compute
        assert any(f"on {cpus} threads ({asked} asked for; this process may use {cpus} CPUs)" in n
                   for n in st.notes), st.notes


def test_an_input_of_another_k_than_the_host_s_weight_raises_ort_s_error_and_loses_nothing(even_rates):
    """x's last dim is a name in the graph: a caller may feed any. ORT's MatMul refuses one
    other than the weight's K (Fail); a host MatMul fed straight from x refuses it as that."""
    model = _fan()
    plain = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    good = {"x": np.random.default_rng(3).standard_normal((1, 1, K)).astype(np.float32)}
    with _session(model, 2) as s:
        assert s.stats().host_compute["on"], s.stats().host_compute
        want = s.run(None, good)[0]
        _within_bound(want, plain.run(None, good)[0])
        committed = s.stats().ledger.committed
        for shape in ((1, 1, K - 1), (1, 2, K // 2), (2, 1, K // 2)):
            bad = {"x": np.ones(shape, np.float32)}
            with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail):
                plain.run(None, bad)
            with pytest.raises(ModelRunError, match="MatMul dimension mismatch") as e:
                s.run(None, bad)
            assert isinstance(e.value, ort.capi.onnxruntime_pybind11_state.Fail)
        assert s.stats().ledger.committed == committed
        np.testing.assert_array_equal(s.run(None, good)[0], want)


def test_a_generation_that_plans_the_budget_again_runs_with_the_host_s_segments_on_a_full_card(monkeypatch):
    """A card of 5 MiB, which a batch of four sequences' KV cache fills: the generation plans
    the budget again (its weights stream in segments) with one segment's page-in set aside.
    The rewrite's segments lay the weights out otherwise than the model's; where one would
    page in more than the plan sets aside, the session uses segments that fit, or runs that
    plan without the host's part, and the generation runs as with host compute off.

    The split rests on rates measured on the machine, which vary run to run; they are fixed
    here at rates under which the split's segments at the plan's target page in a granule
    more than the plan sets aside (14.4 GB/s for the link, 1.2 GB/s for the host)."""
    from onnx_offload.engines import host_step
    from onnx_offload.models import decoder_lm
    model = decoder_lm("gqa", max_length=512, dtype=np.float32, layers=4, hidden=256, heads=4, kv_heads=2,
                       intermediate=512, vocab=97)
    ids = np.random.default_rng(0).integers(0, 97, (4, 40))
    kw = dict(providers=CPU, offload=True, vmm=True, vram_limit=5 << 20, host_granularity=64 << 10)
    with OffloadSession(model.SerializeToString(), host_compute="off", **kw) as s, \
            pytest.warns(OffloadWarning, match="the weights now stream in"):
        want = s.generate(ids, 200)
    monkeypatch.setattr(host_step, "measure_rates", lambda device, store, by_kind, copy, threads, rows=(1, 4, 8): (
        14.4e9, {k: {m: 1.2e9 for m in rows} for k in by_kind}))
    with OffloadSession(model.SerializeToString(), host_compute=2, **kw) as s:
        assert s.stats().host_compute["on"]
        with pytest.warns(OffloadWarning, match="the weights now stream in"):  # the generation planned again
            got = s.generate(ids, 200)
        st = s.stats()
    np.testing.assert_array_equal(got, want)
    assert st.host_compute["on"] and st.host_compute["steps"] == 200, st.host_compute  # segments that fit


def test_a_session_lost_while_its_engine_is_replaced_still_reports_its_stats(monkeypatch):
    """A generation that plans the budget again replaces the engine; where neither the new one
    nor the one in force can be made (here: every segment runner made after the start fails
    as a full device would), the session closes. Its stats() still answer, its calls say it
    is closed, and a plain ORT session in the process runs."""
    from onnx_offload.engines.switch import Engines
    from onnx_offload.errors import BudgetExceeded, StateError
    from onnx_offload.models import decoder_lm
    model = decoder_lm("gqa", max_length=512, dtype=np.float32, layers=4, hidden=256, heads=4, kv_heads=2,
                       intermediate=512, vocab=97)
    ids = np.random.default_rng(0).integers(0, 97, (4, 40))
    with OffloadSession(model.SerializeToString(), providers=CPU, offload=True, vmm=True, vram_limit=5 << 20,
                        host_granularity=64 << 10, host_compute=2) as s:
        def full(self, segments=None):
            raise BudgetExceeded("the device is full")
        monkeypatch.setattr(Engines, "make_segment_runner", full)
        with pytest.raises(BudgetExceeded, match="the device is full"):
            s.generate(ids, 200)
        st = s.stats()
        assert st.capture.startswith("off: the session closed") and not st.host_compute["on"]
        assert st.ledger.committed == 0
        with pytest.raises(StateError, match="closed"):
            s.generate(ids, 2)
    plain = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    feeds = {i.name: (ids if i.name == "input_ids" else np.ones_like(ids) if i.name == "attention_mask"
                      else np.zeros((4, 2, 0, 64), np.float32)) for i in plain.get_inputs()}
    assert plain.run(None, feeds)[0].shape == (4, 40, 97)


def test_the_host_pool_spins_again_as_before_once_the_sessions_that_quieted_it_close(monkeypatch, even_rates):
    """The host backend's segments have the pool's workers sleep after a job (a spin bound of
    0, a setting of the process's); once the last session that ran host MatMuls closes, the
    bound is what it was, for the sessions to come (the streaming engine's captured steps
    count on the spin)."""
    from onnx_offload.engines.host_segments import SPIN_ENV
    monkeypatch.delenv(SPIN_ENV, raising=False)
    model = _chain()
    x = {"x": np.ones((1, 1, K), np.float32)}
    before = _core.host_cpu()["spin_us"]
    _core.host_set_spin_us(777)
    try:
        with _session(model, 2) as a, _session(model, 1) as b:
            assert a.stats().host_compute["on"] and b.stats().host_compute["on"]
            assert _core.host_cpu()["spin_us"] == 777  # made, not run yet
            a.run(None, x)
            b.run(None, x)
            assert _core.host_cpu()["spin_us"] == 0
            a.close()
            assert _core.host_cpu()["spin_us"] == 0  # b still runs
            b.run(None, x)
        assert _core.host_cpu()["spin_us"] == 777
    finally:
        _core.host_set_spin_us(before)
