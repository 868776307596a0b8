"""OffloadSession on the CPU EP through the host backend, against plain onnxruntime."""
import ctypes
import os
import re
import warnings

import numpy as np
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnx_offload import BudgetExceeded, CorruptModel, OffloadSession, StateError, cuda_available
from onnx_offload.errors import OffloadWarning
from onnx_offload.models import mlp_stack, save, transformer_block, weight_bytes

CPU = ["CPUExecutionProvider"]
G = 64 << 10


def reference(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)


@pytest.fixture
def mlp():
    return mlp_stack(layers=4, hidden=256, batch=8)


@pytest.fixture
def x():
    return np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)


def session(model, **kw):
    kw.setdefault("host_granularity", G)
    kw.setdefault("vram_limit", "256MiB")
    return OffloadSession(model.SerializeToString(), providers=CPU, **kw)


@pytest.mark.parametrize("make,shape", [(lambda: mlp_stack(layers=4, hidden=256, batch=8), (8, 256)),
                                        (lambda: transformer_block(), (2, 16, 256))])
def test_outputs_equal_plain_onnxruntime(make, shape):
    model = make()
    feeds = {"x": np.random.default_rng(3).standard_normal(shape).astype(np.float32)}
    with session(model) as s:
        got = s.run(None, feeds)
        assert len(s.segments) == 1
    # Prepacking stays off on the CPU (it would copy the weights), so the GEMM path differs
    # from plain ORT's in the last bits.
    np.testing.assert_allclose(got[0], reference(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_weights_are_used_in_place(mlp, x):
    with session(mlp) as s:
        before = s.run(None, {"x": x})[0]
        w3 = s.residency.slots["w3"]
        ctypes.memset(w3.va, 0, w3.length)  # the slot is what ORT reads
        after = s.run(None, {"x": x})[0]
    bias = next(numpy_helper.to_array(t) for t in mlp.graph.initializer if t.name == "b3")
    assert not np.allclose(before, after)
    np.testing.assert_allclose(after, np.broadcast_to(bias, after.shape), rtol=1e-6)


def test_ledger_matches_the_weights_and_returns_to_zero(mlp, x):
    s = session(mlp)
    s.run(None, {"x": x})
    st = s.stats()
    w = st.ledger.zones["weights"]
    assert w.content.current == weight_bytes(mlp)
    assert w.committed.current >= w.content.current
    assert w.committed.current - w.content.current < G
    assert st.counters.accesses == st.counters.hits == 4 and st.counters.page_ins == 0
    # the last step's counters say the same of one step: every weight resident, read in place
    last = st.last_step
    assert (last.steps, last.hits, last.page_ins, last.htod_bytes) == (1, 4, 0, 0)
    assert last.hit_bytes == last.access_bytes == weight_bytes(mlp)
    last.steps += 10 ** 6  # the caller's copy: the session's counters are its own
    s.run(None, {"x": x})
    assert s.stats().last_step.steps == 1 and s.stats().counters.steps == 2
    assert "weights" in str(st) and "hit rate" in str(st)
    final = s.close()
    assert final.committed == 0 and final.pooled == 0
    with pytest.raises(StateError, match="closed"):
        s.run(None, {"x": x})


@pytest.mark.parametrize("slots", ["stable", "plain offload"])
def test_iobinding_and_introspection(mlp, x, slots):
    # Plain slots (offload without VMM) hand the weights to ORT as inputs: the caller's
    # binding and get_inputs() still see only the model's own inputs.
    kwargs = {} if slots == "stable" else dict(offload=True, vmm=False)
    with session(mlp, **kwargs) as s:
        assert len(s.segments) == 1
        io = s.io_binding()
        io.bind_cpu_input("x", x)
        io.bind_output("y")
        s.run_with_iobinding(io)
        np.testing.assert_allclose(io.copy_outputs_to_cpu()[0], reference(mlp, {"x": x})[0], rtol=1e-5, atol=1e-6)
        assert [i.name for i in s.get_inputs()] == ["x"] and [o.name for o in s.get_outputs()] == ["y"]
        assert s.get_providers() == CPU
        assert not s.graph_capture.enabled


def test_budget_below_weights_without_offload_is_refused(mlp):
    with pytest.raises(BudgetExceeded, match="ONNX_GENAI_WEIGHT_OFFLOAD=1") as e:
        session(mlp, vram_limit=weight_bytes(mlp) // 2)
    assert isinstance(e.value, MemoryError)


@pytest.mark.parametrize("offload", [False, True])
def test_a_budget_too_small_names_the_smallest_that_runs(mlp, x, offload):
    kw = dict(offload=True, vmm=True) if offload else {}
    with pytest.raises(BudgetExceeded, match="largest weight") as e:
        session(mlp, vram_limit=128 << 10, **kw)
    m = re.search(r"The smallest budget that runs it with this configuration is [^(]+\((\d+) bytes\)", str(e.value))
    assert m, str(e.value)
    least = int(m.group(1))
    with session(mlp, vram_limit=least, **kw) as s:  # it runs at that budget ...
        np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(mlp, {"x": x})[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(BudgetExceeded):  # ... and not one granule below
        session(mlp, vram_limit=least - G, **kw)


def test_corrupt_model_is_a_typed_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage that is not a protobuf model" * 3)
    with pytest.raises(CorruptModel):
        OffloadSession(str(bad), providers=CPU)
    with pytest.raises(FileNotFoundError):
        OffloadSession(str(tmp_path / "missing.onnx"), providers=CPU)


def test_env_flags_drive_the_session(mlp, x, monkeypatch):
    monkeypatch.setenv("ONNX_GENAI_WEIGHT_OFFLOAD", "1")
    monkeypatch.setenv("ONNX_GENAI_WEIGHT_OFFLOAD_VMM", "1")
    monkeypatch.setenv("ONNX_GENAI_VRAM_LIMIT", str(weight_bytes(mlp) // 2))
    with OffloadSession(mlp.SerializeToString(), providers=CPU, host_granularity=G) as s:
        assert len(s.segments) > 1 and s.config.offload and s.config.vmm
        np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(mlp, {"x": x})[0], rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("ONNX_GENAI_VRAM_LIMIT", "lots")
    with pytest.raises(ValueError, match="ONNX_GENAI_VRAM_LIMIT"):
        OffloadSession(mlp.SerializeToString(), providers=CPU)


@pytest.mark.skipif(cuda_available()[0], reason="checks the fallback on machines without CUDA")
def test_a_cuda_only_list_without_cuda_runs_on_the_cpu_with_a_warning(mlp, x):
    """As ORT's InferenceSession does: the warning says why CUDA cannot run, that the host
    backend saves no RAM, and the list that runs here without a warning. Without a driver
    it does not send the user to onnxruntime-gpu, which would not run either."""
    for providers in (["CUDAExecutionProvider"], [("CUDAExecutionProvider", {"device_id": 0})]):
        with pytest.warns(OffloadWarning) as caught:
            s = OffloadSession(mlp.SerializeToString(), providers=providers, host_granularity=G)
        text = " ".join(str(w.message) for w in caught)
        assert "cannot run here" in text and "saves no RAM" in text and "providers=['CPUExecutionProvider']" in text
        assert "onnxruntime-gpu" not in text and "driver" in text, text
        with s:
            assert s.get_providers() == ["CPUExecutionProvider"] and s.device.kind == "host"
            np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(mlp, {"x": x})[0], rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OffloadSession(mlp.SerializeToString(), providers=["CPUExecutionProvider"], host_granularity=G).close()


def test_why_cuda_cannot_run_names_onnxruntime_gpu_only_where_a_driver_is(monkeypatch):
    """The CPU build of onnxruntime on a machine with a driver: onnxruntime-gpu is the fix.
    Without a driver the reason is the driver, whichever onnxruntime is installed."""
    from onnx_offload import session as session_module
    monkeypatch.setattr(session_module, "cuda_available", lambda: (True, ""))
    monkeypatch.setattr(session_module.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert "pip install 'onnx-offload[gpu]'" in session_module._cuda_status()
    monkeypatch.setattr(session_module, "cuda_available", lambda: (False, "no NVIDIA driver on this machine"))
    assert session_module._cuda_status() == "no NVIDIA driver on this machine"


@pytest.mark.skipif(cuda_available()[0], reason="checks the fallback on machines without CUDA")
def test_providers_as_ort_takes_them_without_cuda(mlp, x):
    """CUDA then CPU on a machine without CUDA runs on the CPU with a warning, as ORT
    does; providers the package does not run are skipped with a warning; options of
    different lengths are refused as ORT refuses them."""
    want = reference(mlp, {"x": x})[0]
    cuda = ("CUDAExecutionProvider", {"device_id": 0, "gpu_mem_limit": str(96 << 20)})
    with pytest.warns(OffloadWarning) as caught:
        s = OffloadSession(mlp.SerializeToString(), providers=["TensorrtExecutionProvider", cuda, "CPUExecutionProvider"],
                           host_granularity=G)
    text = " ".join(str(w.message) for w in caught)
    assert "skipping TensorrtExecutionProvider" in text and "running on CPUExecutionProvider" in text, text
    with s:
        # The CUDA provider's options go with it: neither its device nor its limit apply to the CPU.
        assert s.device.kind == "host" and s.stats().ledger.budget != 96 << 20
        np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    with pytest.warns(OffloadWarning, match="running on CPUExecutionProvider"):
        with OffloadSession(mlp.SerializeToString(), providers=[cuda, "CPUExecutionProvider"], host_granularity=G,
                            vram_limit="64MiB") as s:
            assert s.stats().ledger.budget == 64 << 20  # the configuration's limit wins
    # Nothing the package runs in the list: the CPU, as ORT falls back to it.
    with pytest.warns(OffloadWarning, match="none of TensorrtExecutionProvider can run here"):
        with OffloadSession(mlp.SerializeToString(), providers=["TensorrtExecutionProvider"]) as s:
            assert s.get_providers() == ["CPUExecutionProvider"]
            np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="same length"):
        OffloadSession(mlp.SerializeToString(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
                       provider_options=[{}])


def test_model_from_path_with_sess_options(mlp, x, tmp_path):
    path = save(mlp, str(tmp_path / "m.onnx"))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    with OffloadSession(path, so, providers=CPU, host_granularity=G, vram_limit="64MiB") as s:
        assert s.get_session_options().intra_op_num_threads == 1
        np.testing.assert_allclose(s.run(["y"], {"x": x})[0], reference(mlp, {"x": x})[0], rtol=1e-5, atol=1e-6)
    assert os.path.exists(path)


def test_stats_after_close_still_name_the_segments(mlp, x):
    s = session(mlp, offload=True, vmm=True, weight_bytes=weight_bytes(mlp) // 3)
    s.run(None, {"x": x})
    before = s.stats().segments
    assert before > 1
    s.close()
    assert s.stats().segments == before and s.stats().ledger.committed == 0


def test_members_called_while_another_thread_closes_answer_or_say_closed():
    import threading
    from onnx_offload.models.decoder import decoder_lm
    model = decoder_lm("gqa", max_length=64).SerializeToString()
    for _ in range(5):
        s = OffloadSession(model, providers=["CPUExecutionProvider"], vram_limit="64MiB", host_granularity=4096)
        stop, errors, answers = threading.Event(), [], [0]

        def poll():
            while not stop.is_set():
                for fn in (s.get_inputs, s.get_outputs, s.get_providers, s.get_provider_options, s.get_modelmeta,
                           s.get_profiling_start_time_ns):
                    try:
                        fn()
                        answers[0] += 1
                    except StateError:
                        pass
                    except Exception as e:  # noqa: BLE001 - what the test is about
                        errors.append(e)
        t = threading.Thread(target=poll)
        t.start()
        while answers[0] == 0:
            pass
        s.close()
        stop.set()
        t.join()
        assert errors == [], errors[:3]


@pytest.mark.parametrize("gib", [3, 8, 32])
def test_a_session_runs_under_an_address_space_limit(gib):
    # ulimit -v, as containers and batch schedulers set it: the host backend's reservation
    # counts against it.
    import subprocess
    import sys
    code = f"""
import resource
resource.setrlimit(resource.RLIMIT_AS, ({gib} << 30, {gib} << 30))
import numpy as np, onnxruntime as ort
from onnx_offload import OffloadSession
from onnx_offload.models import mlp_stack
m = mlp_stack(layers=3, hidden=256, batch=4).SerializeToString()
x = np.ones((4, 256), np.float32)
with OffloadSession(m, providers=["CPUExecutionProvider"], offload=True, vmm=True, weight_bytes=300000) as s:
    want = ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, {{"x": x}})[0]
    assert np.allclose(s.run(None, {{"x": x}})[0], want, atol=1e-5)
print("ran")
"""
    import onnx_offload
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(onnx_offload.__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr[-2000:]
