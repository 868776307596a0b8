"""OffloadSession on the CUDA EP (H200): bitwise equality with plain ORT, capture on and
off, ORT's graph behaviours through the session, weights read in place, and the ledger
against what the driver reports."""
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import onnxruntime as ort
import pytest

from onnx_offload import OffloadSession
from onnx_offload.stats import invariant_violations
from onnx_offload.models import mlp_stack, transformer_block, weight_bytes

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
MiB = 1 << 20


def plain(model, capture=False):
    opts = {"enable_cuda_graph": "1"} if capture else {}
    return ort.InferenceSession(model.SerializeToString(), providers=[(CUDA, opts)])


def bound_run(sess, x, runner=None):
    xin = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    out = ort.OrtValue.ortvalue_from_shape_and_type(list(x.shape), x.dtype, "cuda", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", xin)
    io.bind_ortvalue_output("y", out)
    for _ in range(3):  # warm-up, capture, replay
        (runner or sess).run_with_iobinding(io)
    return out.numpy(), (io, xin, out)


def driver_free():
    from cuda.bindings import driver as cu
    err, free, _ = cu.cuMemGetInfo()
    assert int(err) == 0
    return int(free)


MODELS = {
    "mlp": (lambda: mlp_stack(layers=6, hidden=1024, batch=8), (8, 1024)),
    "transformer": (lambda: transformer_block(hidden=512, heads=8, seq=64, batch=2, ffn=2048, blocks=2), (2, 64, 512)),
}


@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_bitwise_equal_to_plain_cuda(name, capture):
    make, shape = MODELS[name]
    model = make()
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    ref = plain(model, capture)
    want, _ = bound_run(ref, x)
    with OffloadSession(model.SerializeToString(), providers=[CUDA], offload=True, vmm=True,
                        vram_limit="4GiB", cuda_graph=capture) as s:
        assert s.graph_capture.enabled is capture, s.graph_capture.reason
        got, _ = bound_run(s, x, s)
        np.testing.assert_array_equal(got, want)
        if not capture:
            np.testing.assert_array_equal(s.run(None, {"x": x})[0], ref.run(None, {"x": x})[0])


def test_update_inplace_then_replay():
    model = transformer_block(hidden=256, heads=4, seq=32, batch=2, ffn=1024)
    rng = np.random.default_rng(1)
    x1, x2 = (rng.standard_normal((2, 32, 256)).astype(np.float32) for _ in range(2))
    ref = plain(model)
    with OffloadSession(model.SerializeToString(), providers=[CUDA], vram_limit="2GiB") as s:
        assert s.graph_capture.enabled and s.graph_capture.reason.startswith("auto")
        got1, (io, xin, out) = bound_run(s, x1, s)
        xin.update_inplace(x2)  # same device buffer, new values: the captured graph replays on them
        s.run_with_iobinding(io)
        got2 = out.numpy()
    np.testing.assert_array_equal(got1, ref.run(None, {"x": x1})[0])
    np.testing.assert_array_equal(got2, ref.run(None, {"x": x2})[0])


def test_several_gpu_graph_ids_with_different_shapes():
    model = mlp_stack(layers=4, hidden=512, batch=None)
    ref = ort.InferenceSession(model.SerializeToString(), providers=[CUDA])
    with OffloadSession(model.SerializeToString(), providers=[CUDA], vram_limit="2GiB", cuda_graph=True) as s:
        assert s.graph_capture.enabled
        results = {}
        for graph_id, batch in ((1, 2), (2, 16), (1, 2), (2, 16)):
            x = np.full((batch, 512), 0.01 * graph_id, np.float32)
            ro = ort.RunOptions()
            ro.add_run_config_entry("gpu_graph_id", str(graph_id))
            xin = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
            out = ort.OrtValue.ortvalue_from_shape_and_type([batch, 512], np.float32, "cuda", 0)
            io = s.io_binding()
            io.bind_ortvalue_input("x", xin)
            io.bind_ortvalue_output("y", out)
            for _ in range(2):
                s.run_with_iobinding(io, ro)
            results.setdefault(graph_id, []).append(out.numpy())
            np.testing.assert_array_equal(out.numpy(), ref.run(None, {"x": x})[0])
        for outs in results.values():
            np.testing.assert_array_equal(outs[0], outs[1])


def test_weights_are_read_in_place_from_their_slots():
    model = mlp_stack(layers=3, hidden=512, batch=4)
    x = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    with OffloadSession(model.SerializeToString(), providers=[CUDA], vram_limit="1GiB", cuda_graph=False) as s:
        before = s.run(None, {"x": x})[0]
        slot = s.residency.slots["w2"]
        dev = s.device
        dev.backend.fill(slot.va, 0, slot.length, dev.copy_stream)  # zero the slot's device memory
        dev.copy_stream.synchronize()
        after = s.run(None, {"x": x})[0]
    bias = next(np.frombuffer(t.raw_data, np.float32) for t in model.graph.initializer if t.name == "b2")
    assert not np.allclose(before, after)
    np.testing.assert_array_equal(after, np.broadcast_to(bias, after.shape))


@pytest.mark.parametrize("capture", [False, True])
def test_ledger_matches_the_driver_and_returns_to_zero(capture):
    model = mlp_stack(layers=8, hidden=2048, batch=16)
    x = np.ones((16, 2048), np.float32)
    free0 = driver_free()
    s = OffloadSession(model.SerializeToString(), providers=[CUDA], vram_limit="4GiB", cuda_graph=capture)
    for _ in range(4):
        s.run(None, {"x": x})
    used = free0 - driver_free()
    snap = s.stats().ledger
    ours = snap["committed"] + snap["pooled"]
    assert snap["zones"]["weights"]["content"]["current"] == weight_bytes(model)
    # What the driver lost is what the ledger holds, within two granules of slack for
    # allocations the driver rounds on its own.
    assert abs(used - ours) <= 4 * MiB, (used, ours, snap)
    final = s.close()
    assert final["committed"] == 0 and final["pooled"] == 0


@pytest.mark.parametrize("policy", ["planned", "lru"])
def test_offload_on_cuda_matches_plain_and_keeps_addresses(policy):
    model = mlp_stack(layers=16, hidden=2048, batch=8)
    x = np.random.default_rng(3).standard_normal((8, 2048)).astype(np.float32)
    want = plain(model).run(None, {"x": x})[0]
    # A quarter of the weights may stay resident. ORT's own device memory is measured and
    # charged to the scratch zone: each segment's session takes about 70 MB (its arena and
    # cuBLAS workspace), so the scratch reserve is sized for the segments.
    budget = 3 << 30
    with OffloadSession(model.SerializeToString(), providers=[CUDA], offload=True, vmm=True, vram_limit=budget,
                        weight_bytes=weight_bytes(model) // 4, policy=policy, scratch_bytes=2 << 30) as s:
        assert len(s.segments) > 1
        addresses = {n: sl.va for n, sl in s.residency.slots.items()}
        for _ in range(2):
            np.testing.assert_array_equal(s.run(None, {"x": x})[0], want)
        warm = s.stats().driver
        for _ in range(3):
            np.testing.assert_array_equal(s.run(None, {"x": x})[0], want)
        st = s.stats()
        assert {n: sl.va for n, sl in s.residency.slots.items()} == addresses
        assert st.counters.page_ins > 0 and (policy != "lru" or st.counters.evictions > 0)
        assert st.driver["creates"] == warm["creates"] and st.driver["releases"] == warm["releases"]
        assert st.peak_committed <= budget
        assert invariant_violations(st.arena) == {}


def test_plain_baseline_declines_capture_and_matches():
    model = mlp_stack(layers=8, hidden=1024, batch=4)
    x = np.random.default_rng(4).standard_normal((4, 1024)).astype(np.float32)
    with OffloadSession(model.SerializeToString(), providers=[CUDA], offload=True, vmm=False, vram_limit="1GiB",
                        weight_bytes=weight_bytes(model) // 2, scratch_bytes=256 * MiB, cuda_graph=True) as s:
        assert len(s.segments) > 1
        assert not s.graph_capture.enabled and "stable addresses" in s.graph_capture.reason
        for _ in range(2):
            np.testing.assert_array_equal(s.run(None, {"x": x})[0], plain(model).run(None, {"x": x})[0])
        assert s.stats().driver["plain_allocs"] > 0


def test_capture_is_declined_with_its_reason_when_the_graph_runs_in_segments():
    model = mlp_stack(layers=8, hidden=1024, batch=4)
    x = np.random.default_rng(5).standard_normal((4, 1024)).astype(np.float32)
    want = plain(model).run(None, {"x": x})[0]
    with OffloadSession(model.SerializeToString(), providers=[CUDA], offload=True, vmm=True, vram_limit="1GiB",
                        weight_bytes=weight_bytes(model) // 2, scratch_bytes=256 * MiB, cuda_graph=True) as s:
        assert len(s.segments) > 1 and not s.graph_capture.enabled
        assert "segments" in s.graph_capture.reason
        for _ in range(3):
            np.testing.assert_array_equal(s.run(None, {"x": x})[0], want)


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not on PATH")
def test_compute_sanitizer_memcheck_is_clean_on_an_offload_run(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        from onnx_offload import OffloadSession
        from onnx_offload.models import mlp_stack, weight_bytes
        m = mlp_stack(layers=8, hidden=512, batch=4)
        x = np.ones((4, 512), np.float32)
        with OffloadSession(m.SerializeToString(), providers=["CUDAExecutionProvider"], offload=True, vmm=True,
                            vram_limit="1GiB", weight_bytes=weight_bytes(m) // 2, scratch_bytes=256 << 20,
                            cuda_graph=False) as s:
            assert len(s.segments) > 1
            for _ in range(2):
                s.run(None, {"x": x})
            print("pages", s.stats().counters.page_ins)
    """))
    r = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-P",
                        str(script)], capture_output=True, text=True, timeout=540, env=dict(os.environ))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in r.stdout + r.stderr
