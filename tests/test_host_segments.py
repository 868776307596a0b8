"""Host compute between streamed segments on the host backend (engines/host_segments.py):
the same split, rewrite and kernels as in the streaming engine's captured step, run by the
segment runner with ORT's CPU kernels for the rest.

The bound (docs/host_compute.md): the host sums in float32 and rounds each product once;
every logit stays within BOUND_ULPS * eps * max|logit| of plain ORT's (eps of the logits'
type), and a greedy token may part from plain ORT's only where ORT's top two logits are
within twice that of each other. A prompt's host MatMuls run ORT's own kernel on the
weights where they lie: a prompt is bitwise what it is with host compute off.
"""
import signal

import numpy as np
import onnxruntime as ort
import pytest

from onnx_offload import OffloadSession
from onnx_offload.engines.host_segments import HostSteps
from onnx_offload.loading import plan_segments
from onnx_offload.models import decoder_lm, int4, weight_bytes
from onnx_offload.models.decoder import save_decoder
from onnx_offload.tools.bench_decode import anchor

from conftest import generate_on_two_threads

CPU = ["CPUExecutionProvider"]
BOUND_ULPS = 16
SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=97)
# int4: scales of 4 KiB or more are weights that stream (min_weight_bytes); smaller ones stay
# in the model, and with them their MatMul on the device.
SHAPE_INT4 = dict(SHAPE, hidden=128, intermediate=256)
MODELS = [pytest.param(np.float32, False, id="float32"), pytest.param(np.float16, False, id="float16"),
          pytest.param(np.float16, True, id="float16-int4")]


def _shape(quantized):
    return SHAPE_INT4 if quantized else SHAPE


def _model(dtype, quantized=False, layout="gqa"):
    model = decoder_lm(layout, max_length=64, dtype=dtype, **_shape(quantized))
    return int4(model, block_size=16, accuracy_level=0) if quantized else model


def _session(model, mode, **kw):
    return OffloadSession(model.SerializeToString(), providers=CPU, offload=True, vmm=True,
                          weight_bytes=weight_bytes(model) // 3, host_compute=mode, **kw)


def _bound(logits):
    return BOUND_ULPS * float(np.finfo(logits.dtype).eps) * float(np.abs(logits.astype(np.float32)).max())


def _first_difference_is_a_near_tie(got, want, ref, bound):
    """Greedy tokens equal up to the first that differs, which must be a near tie of ORT's."""
    differ = np.nonzero(got != want)[0]
    if len(differ):
        t = int(differ[0])
        top2 = np.sort(ref[t])[-2:]
        assert top2[1] - top2[0] <= 2 * bound, (t, top2, bound)
    return len(differ)


@pytest.mark.parametrize("dtype,quantized", MODELS)
def test_a_decoder_generates_under_a_budget_with_the_host_computing_part_of_each_step(tmp_path, dtype, quantized):
    model = _model(dtype, quantized)
    ids = np.random.default_rng(3).integers(0, SHAPE["vocab"], (1, 6))
    new = 12
    logits = str(tmp_path / "logits.npy")
    # ORT's kernels read the streamed weights unpacked, as the segments' sessions do.
    want = anchor(save_decoder(model, str(tmp_path / "m")), dict(_shape(quantized), dtype=np.dtype(dtype).name), ids,
                  new, "cpu",
                  logits_out=logits, prepack=False)["tokens"]
    ref = np.load(logits)[:, 0]
    with _session(model, "off") as s:
        np.testing.assert_array_equal(s.generate(ids, new)[:, 6:], want)  # off: plain ORT's, bit for bit
        off = s.stats()
    with _session(model, 2) as s:
        got = s.generate(ids, new)[:, 6:]
        st = s.stats()
    h = st.host_compute
    assert h["on"], h
    assert h["matmuls"] and h["weights"] and h["host_bytes_per_step"] > 0 and h["threads"] == 2
    assert h["steps"] == new  # the prompt and every decode step ran the split
    assert h["link_rate"] > 0 and all(r[1] > 0 for r in h["host_rates"].values())
    # The host's weights never page in: each step copies less than with host compute off.
    assert st.last_step.htod_bytes < off.last_step.htod_bytes
    assert any("host compute: the host's cores multiply" in n for n in st.notes)
    _first_difference_is_a_near_tie(got[0], want[0], ref, _bound(ref))


@pytest.mark.parametrize("layout", ["gqa", "standard"])
@pytest.mark.parametrize("dtype,quantized", MODELS)
def test_a_decode_step_within_the_bound_and_a_prompt_bitwise(layout, dtype, quantized):
    """The drop-in run(): a prompt of 12 tokens (its host MatMuls on ORT's kernel: bitwise as
    with host compute off), then a decode step from its cache (the host kernels: every output
    within the bound of plain ORT's)."""
    model = _model(dtype, quantized, layout)
    plain = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    names = [o.name for o in plain.get_outputs()]
    rng = np.random.default_rng(4)
    shape = _shape(quantized)
    feeds = _feeds(plain, rng.integers(0, SHAPE["vocab"], (1, 12)), None, dtype, shape)
    with _session(model, "off") as s:
        prompt_off = s.run(names, feeds)
    with _session(model, 2) as s:
        prompt = s.run(names, feeds)
        for a, b in zip(prompt, prompt_off):
            np.testing.assert_array_equal(a, b)
        past = dict(zip(names, plain.run(names, feeds)))
        step = _feeds(plain, rng.integers(0, SHAPE["vocab"], (1, 1)), past, dtype, shape)
        got = s.run(names, step)
        assert s.stats().host_compute["steps"] == 2
    for name, a, b in zip(names, got, plain.run(names, step)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max())
        assert err <= _bound(b), (name, err, _bound(b))


def _feeds(session, ids, past, dtype, shape=SHAPE):
    """A decoder's feeds: `ids` after `past` (the present outputs of the step before, or None)."""
    b, n = ids.shape
    before = 0 if past is None else next(v for k, v in past.items() if k.startswith("present")).shape[2]
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = ids.astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((b, before + n), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(before, before + n, dtype=np.int64)[None].repeat(b, 0)
        elif i.name.startswith("past_key_values"):
            present = i.name.replace("past_key_values", "present")
            feeds[i.name] = past[present] if past is not None else np.zeros(
                (b, shape["kv_heads"], 0, shape["hidden"] // shape["heads"]), dtype)
        else:
            raise AssertionError(f"unexpected input {i.name}")
    return feeds


@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_in_a_host_computed_step_leaves_the_session_as_it_was(monkeypatch):
    model = _model(np.float32)
    ids = np.random.default_rng(6).integers(0, SHAPE["vocab"], (1, 5))
    with _session(model, 2) as s:
        want = s.generate(ids, 8)
        committed = s.stats().ledger.committed
        original, calls = HostSteps.after, []

        def after(self, index, *args):
            calls.append(index)
            if len(calls) == 3:
                signal.raise_signal(signal.SIGINT)  # lands between two host MatMuls of a decode step
            return original(self, index, *args)
        with monkeypatch.context() as m:
            m.setattr(HostSteps, "after", after)
            with pytest.raises(KeyboardInterrupt):
                s.generate(ids, 8)
        assert s.stats().ledger.committed == committed
        np.testing.assert_array_equal(s.generate(ids, 8), want)  # the host's sums: one order, every step
        final = s.close()
    assert final.committed == 0
    # A plain ORT session in the same process runs as ever.
    plain = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    assert plain.run(None, _feeds(plain, ids, None, np.float32))[0].shape == (1, 5, SHAPE["vocab"])


def test_two_sessions_on_two_threads_share_the_host_s_cores():
    model = _model(np.float16)
    prompts = [np.random.default_rng(k).integers(0, SHAPE["vocab"], (1, 6)) for k in (7, 8)]
    with _session(model, 2) as a, _session(model, 1) as b:
        generate_on_two_threads((a, b), prompts, 8)
        assert a.stats().host_compute["on"] and b.stats().host_compute["on"]


def test_where_host_compute_does_not_run_the_session_says_why():
    model = _model(np.float32)
    ids = np.random.default_rng(0).integers(0, SHAPE["vocab"], (1, 5))
    cases = {"every weight is resident": dict(offload=False),
             "without stable addresses": dict(vmm=False),
             "host compute is off": dict(host_compute="off"),
             "a thread count (host_compute=N) runs it": dict(host_compute="auto")}
    for why, kw in cases.items():
        args = dict(providers=CPU, offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3, host_compute=2)
        args.update(kw)
        if not args["offload"]:
            args.pop("weight_bytes")
        with OffloadSession(model.SerializeToString(), **args) as s:
            s.generate(ids, 2)
            h = s.stats().host_compute
        assert not h["on"] and why in h["why"], (kw, h)


def test_a_hard_cut_starts_a_segment_where_no_weight_was_read():
    from onnx import TensorProto, helper
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
             helper.make_node("MatMul", ["b", "w"], ["c"]), helper.make_node("Relu", ["c"], ["d"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("d", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor("w", TensorProto.FLOAT, [4, 4], [0.0] * 16)])
    model = helper.make_model(g)
    is_weight = {"w"}.__contains__
    assert plan_segments(model, len, is_weight, 100, cuts={1}) == [[0, 1, 2, 3]]  # no weight read before it
    assert plan_segments(model, len, is_weight, 100, cuts={3}) == [[0, 1, 2], [3]]
    assert plan_segments(model, len, is_weight, 100, hard={1, 3}) == [[0], [1, 2], [3]]
    assert plan_segments(model, len, is_weight, 100, hard={0}) == [[0, 1, 2, 3]]
