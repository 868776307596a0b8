"""Host compute in the streaming engine (engines/host_step.py): the option, the rates
measured at start, the split's predictions per step size, and on the GPU a decoder
generating with host compute on against plain ORT (docs/host_compute.md)."""
import subprocess
import sys

import numpy as np
import pytest

from onnx_offload import OffloadSession
from onnx_offload.config import OffloadConfig
from onnx_offload.engines.host_step import HOST_ROWS, HostPlan, measure_rates, plan_host_compute
from onnx_offload.loading import WeightInfo
from onnx_offload.memory import Device, HostStore, StepWeight, ZonePlan, plan_host_split
from onnx_offload.models import decoder_lm, weight_bytes
from onnx_offload.models.int4 import quantize_block

from conftest import child_env, generate_on_two_threads

G = 1 << 20


@pytest.mark.parametrize("value, want", [("auto", "auto"), ("OFF", "off"), (" 4 ", 4), (16, 16), (np.int64(2), 2)])
def test_the_option_takes_auto_off_or_a_thread_count(value, want):
    assert OffloadConfig(host_compute=value).host_compute == want
    if isinstance(value, str):
        assert OffloadConfig.from_env({"ONNX_OFFLOAD_HOST_COMPUTE": value}).host_compute == want


@pytest.mark.parametrize("value", ["on", "", 0, -1, 4097, True, 2.5, "1e3", "\u0663", "\uff14"])
def test_a_bad_option_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="host_compute=.*auto, off or a number of host threads"):
        OffloadConfig(host_compute=value)
    with pytest.raises(ValueError, match="ONNX_OFFLOAD_HOST_COMPUTE="):
        OffloadConfig.from_env({"ONNX_OFFLOAD_HOST_COMPUTE": str(value) or "x"})


def test_the_cli_flag_is_checked_before_any_weight_loads(tmp_path):
    r = subprocess.run([sys.executable, "-m", "onnx_offload", "run", str(tmp_path / "absent.onnx"),
                        "--host-compute", "lots"], capture_output=True, text=True, env=child_env(), timeout=120,
                       cwd=str(tmp_path))
    assert r.returncode == 2 and "--host-compute" in r.stderr and "number of host threads" in r.stderr


def _plan(link, rates, gpu=0.0):
    # A step of 8 layers, each a 32 MiB MatMul the host can compute and a 16 MiB weight it cannot.
    weights = []
    for i in range(8):
        weights += [StepWeight(f"w{i}", 32 * G, "float16", f"mm{i}"), StepWeight(f"n{i}", 16 * G)]
    split = plan_host_split(weights, link, rates, gpu, 1)
    return HostPlan(split, [], None, link, rates, None, gpu, weights, 0.0)


def test_the_split_helps_a_decode_step_and_not_a_batch_the_host_is_slow_at_or_a_prompt():
    plan = _plan(50e9, {"float16": {1: 40e9, 4: 30e9, 8: 2e9}})
    assert plan.split.host and plan.split.streamed_bytes < 8 * 48 * G
    one, whole = plan.predicted(1)
    assert whole == pytest.approx(8 * 48 * G / 50e9)
    assert one < whole * 0.8  # both sides work: about 48/ (50 + 40) of the link alone
    assert plan.helps(1) and plan.helps(4)
    assert not plan.helps(8)  # at 2 GB/s the host's share takes longer than streaming it
    assert not plan.helps(9)  # a prompt streams every weight
    report = plan.report(3)
    assert report["on"] and report["steps"] == 3 and report["host_bytes_per_step"] == plan.split.host_bytes
    assert report["predicted_ms"] == pytest.approx(one * 1e3)


def test_a_host_slower_than_any_gain_gets_nothing():
    plan = _plan(50e9, {"float16": {1: 0.1e9}})
    assert not plan.split.host


def test_the_rates_are_measured_on_the_stores_own_weights_while_copies_run():
    dev = Device("host", OffloadConfig(vram_limit=1 << 30, host_granularity=2 * G))
    dev.set_zones({z: ZonePlan(1 << 30, 0) for z in ("weights", "kv", "scratch", "transient")})
    k, n, block = 256, 512, 32
    b, scales = quantize_block(np.random.default_rng(0).standard_normal((k, n)).astype(np.float16), block)
    infos = [WeightInfo("dense", np.dtype(np.float16), (k, n), k * n * 2, 0, 0),
             WeightInfo("b", np.dtype(np.uint8), b.shape, b.nbytes, 0, 1),
             WeightInfo("scales", np.dtype(np.float16), scales.shape, scales.nbytes, 0, 1)]
    store = HostStore(dev.backend, infos)
    dst = dev.backend.plain_alloc(4 * G)
    try:
        store.view("dense")[:] = np.ones((k, n), np.float16).view(np.uint8).reshape(-1)
        store.view("b")[:] = b.reshape(-1)
        store.view("scales")[:] = scales.view(np.uint8).reshape(-1)
        from onnx_offload.engines.host_step import weight_views
        views = {"float16": [weight_views(store, "float16", infos[:1])], "int4": [weight_views(store, "int4", infos[1:])]}
        link, rates = measure_rates(dev, store, views, (dst, store.ptr("dense"), k * n * 2), threads=1)
    finally:
        dev.backend.plain_free(dst, 4 * G)
        store.close()
        dev.close()
    assert link > 0 and np.isfinite(link)
    assert set(rates) == {"float16", "int4"}
    for by_rows in rates.values():
        assert set(by_rows) == set(HOST_ROWS) and all(r > 0 and np.isfinite(r) for r in by_rows.values())


def test_the_streaming_engine_s_split_needs_a_captured_step():
    """On the host backend the segments run the split (tests/test_host_segments.py); the
    streaming engine's, inside a step graph, is CUDA's."""
    model = decoder_lm("gqa", layers=2, hidden=64, intermediate=128, vocab=97)
    dev = Device("host", OffloadConfig(vram_limit=1 << 30))
    try:
        assert plan_host_compute(2, dev, None, model, None, {}, {}) == (
            None, "host compute is off: it runs inside a captured step graph, and the host backend captures no graphs")
    finally:
        dev.close()


@pytest.mark.gpu
def test_a_decoder_generates_with_the_host_computing_part_of_each_decode_step(tmp_path):
    # fp16 GQA decoder, two thirds of its weights streamed; host compute on with 8 threads
    # (a thread count turns it on wherever the split gives the host a MatMul).
    from onnx_offload.models.decoder import save_decoder
    from onnx_offload.tools.bench_decode import anchor
    shape = dict(layers=4, hidden=1024, heads=8, kv_heads=2, intermediate=4096, vocab=4096, max_length=256,
                 dtype="float16")
    model = decoder_lm("gqa", **{**shape, "dtype": np.float16})
    ids = np.random.default_rng(5).integers(0, 4096, (1, 24))
    new = 16
    logits = str(tmp_path / "logits.npy")
    want = anchor(save_decoder(model, str(tmp_path / "m")), shape, ids, new, "cuda", logits_out=logits)["tokens"]
    ref = np.load(logits)[:, 0]  # [new, vocab], plain ORT's, along its own tokens
    got, stats = {}, {}
    for mode in ("off", 8):
        with OffloadSession(model.SerializeToString(), providers=["CUDAExecutionProvider"], vram_limit="2GiB",
                            offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3, host_compute=mode) as s:
            got[mode] = s.generate(ids, new)[:, 24:]
            stats[mode] = s.stats()
    np.testing.assert_array_equal(got["off"], want)  # off: plain ORT's tokens, bit for bit
    h = stats[8].host_compute
    assert h["on"], h
    assert h["matmuls"] and h["host_bytes_per_step"] > 0 and h["steps"] >= new - 1
    assert h["link_rate"] > 1e9 and all(r[1] > 1e8 for r in h["host_rates"].values())
    # A host-computed step copies only what the host does not compute.
    assert stats[8].last_step.htod_bytes == h["streamed_bytes_per_step"] < stats["off"].last_step.htod_bytes
    # The host's fp32 sums differ from cuBLAS's in the last bits: a token may part from plain
    # ORT's only where ORT's top two logits are within twice the bound of each other.
    bound = 16 * float(np.finfo(np.float16).eps) * float(np.abs(ref).max())
    differ = np.nonzero(got[8][0] != want[0])[0]
    if len(differ):
        t = int(differ[0])
        top2 = np.sort(ref[t])[-2:]
        assert top2[1] - top2[0] <= 2 * bound, (t, top2, bound)


def _host_decoder():
    shape = dict(layers=4, hidden=1024, heads=8, kv_heads=2, intermediate=4096, vocab=4096, dtype=np.float16)
    return decoder_lm("gqa", max_length=256, **shape)


def _host_session(model):
    return OffloadSession(model.SerializeToString(), providers=["CUDAExecutionProvider"], vram_limit="2GiB",
                          offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3, host_compute=8)


@pytest.mark.gpu
@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_after_a_host_computed_step_leaves_the_session_as_it_was(monkeypatch):
    import signal
    from onnx_offload.engines.streaming import StreamEngine
    model = _host_decoder()
    ids = np.random.default_rng(6).integers(0, 4096, (1, 12))
    with _host_session(model) as s:
        want = s.generate(ids, 12)
        steps = s.stats().host_compute["steps"]
        assert steps >= 11
        original = StreamEngine._launch

        def launch(self, g):
            original(self, g)
            if g.host is not None:
                signal.raise_signal(signal.SIGINT)  # lands as the host-computed step ends
        with monkeypatch.context() as m:
            m.setattr(StreamEngine, "_launch", launch)
            with pytest.raises(KeyboardInterrupt):
                s.generate(ids, 12)
        # The host's sums are made in one order whatever the step: the same tokens again.
        np.testing.assert_array_equal(s.generate(ids, 12), want)
        assert s.stats().host_compute["steps"] > steps
        final = s.close()
    assert final.committed == 0


@pytest.mark.gpu
def test_two_sessions_on_two_threads_share_the_host_s_cores(tmp_path):
    model = _host_decoder()
    prompts = [np.random.default_rng(k).integers(0, 4096, (1, 10)) for k in (7, 8)]
    with _host_session(model) as a, _host_session(model) as b:
        generate_on_two_threads((a, b), prompts, 10)
        assert a.stats().host_compute["on"] and b.stats().host_compute["on"]


def test_bench_cards_bounds_a_host_row_by_both_rates_as_its_json_gives_them():
    import json
    from onnx_offload.tools.bench_cards import _bounds
    host = dict(on=True, steps=31, host_rates={"float16": {1: 40e9, 4: 30e9, 8: 10e9}})
    a = dict(ms_per_token=5.0, prompt_ms=100.0, tokens=np.zeros((1, 4), np.int64))
    off = dict(step_htod=int(9.5e9), prompt_htod=0)
    row = json.loads(json.dumps(dict(batch=1, step_htod=int(4e9), prompt_htod=0, host=host, tokens=[[0, 0, 0, 0]])))
    row["tokens"] = np.asarray(row["tokens"])
    _bounds(row, a, 55e9, off)
    assert row["bound_ms"] == pytest.approx(9.5e9 / (55e9 + 40e9) * 1e3)
    assert row["tokens_equal"]
    idle = json.loads(json.dumps(dict(batch=4, step_htod=int(9.5e9), prompt_htod=0, host={**host, "steps": 0},
                                      tokens=[[0, 0, 0, 0]])))
    _bounds(idle, a, 55e9, off)  # on, but no step ran on the host: the link's bound
    assert idle["bound_ms"] == pytest.approx(9.5e9 / 55e9 * 1e3)
