"""The host kernels (`_core.host_matmul`, `_core.host_matmul_nbits`): x @ W on the host's
cores for dense fp16/bf16/fp32 weights and MatMulNBits int4 weights, on every ISA this
CPU has, against float64 numpy, against onnxruntime's CPU kernels, across threads and fork.

The bound. The kernels take x and W to fp32 exactly (fp16, bf16 and fp32 are exact in
fp32; int4's (q - z) is exact and one rounding multiplies by the scale), then sum the K
products in fp32, in an order that depends on the ISA, the split between threads and
FMA. For any summation order (Higham, Accuracy and Stability, 3.1),
    |y32 - y| <= gamma(K + 2) * sum_k |x_k| |W_k|,   gamma(n) = n u / (1 - n u), u = 2^-24,
y being the exact product of the upcast values (float64 here). A float16 output adds its
rounding: half an ulp, u16 |y32| (u16 = 2^-11), or 2^-25 among the subnormals. Two
results that each meet the bound (two ISAs, ORT and the kernels) differ by at most twice it.
"""
import ctypes
import os
import re
import threading
import time

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import CHILD_CWD, child_env
from onnx_offload import _core

U32 = 2.0 ** -24
U16 = 2.0 ** -11
ISAS = _core.host_cpu()["isa_available"]
RNG = np.random.default_rng(45)
WEIGHT_TYPES = (np.float16, ml_dtypes.bfloat16, np.float32)


def bound(x, w64, y_dtype):
    """The stated bound of |y - x @ w| for each output, and the exact product."""
    x64 = x.astype(np.float64)
    exact = x64 @ w64
    n = x.shape[1] + 2
    err = n * U32 / (1 - n * U32) * (np.abs(x64) @ np.abs(w64))
    if y_dtype == np.float16:
        err = err + U16 * (np.abs(exact) + err) + 2.0 ** -25
    return exact, err


def check(y, exact, err, factor=1.0):
    """The largest error as a fraction of the bound; fails past `factor` bounds."""
    diff = np.abs(y.astype(np.float64) - exact)
    ratio = float(np.max(diff / (factor * err)))
    assert ratio <= 1.0, f"error {diff.max():.3g} past {factor} x the bound (ratio {ratio:.3g})"
    return ratio


def int4_weight(k, n, block_size, scale_dtype, zero_points):
    """Random MatMulNBits inputs (every nibble, the padding of the last block too, random)
    and the weight they stand for, [K, N] in float64."""
    blocks = -(-k // block_size)
    b = RNG.integers(0, 256, (n, blocks, block_size // 2), dtype=np.uint8)
    scales = (RNG.standard_normal(n * blocks) * 0.05).astype(scale_dtype)
    zp = RNG.integers(0, 256, (n, (blocks + 1) // 2), dtype=np.uint8) if zero_points else None
    q = np.empty((n, blocks, block_size), np.float64)
    q[..., 0::2] = b & 15
    q[..., 1::2] = b >> 4
    if zp is None:
        z = np.full((n, blocks), 8.0)
    else:
        z = np.empty((n, 2 * zp.shape[1]), np.float64)
        z[:, 0::2] = zp & 15
        z[:, 1::2] = zp >> 4
        z = z[:, :blocks]
    w = (q - z[..., None]) * scales.astype(np.float64).reshape(n, blocks)[..., None]
    return b, scales, zp, w.reshape(n, blocks * block_size)[:, :k].T


def test_host_cpu_describes_the_machine():
    info = _core.host_cpu()
    assert info["isa_available"][0] == "scalar" and info["isa"] == info["isa_available"][-1]
    assert 1 <= info["physical_cores"] <= info["logical_cpus"] == len(os.sched_getaffinity(0))
    assert info["threads"] == info["physical_cores"]


@pytest.mark.parametrize("isa", ISAS)
def test_dense_within_the_bound_on_every_isa(isa):
    worst = 0.0
    for k, n in ((1, 1), (7, 33), (33, 7), (1000, 17), (64, 1000), (1000, 1000)):
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 13):
            if k * n > 100_000 and m not in (1, 8, 13):
                continue
            for wt in WEIGHT_TYPES:
                w = RNG.standard_normal((k, n)).astype(wt)
                for xt in (np.float16, np.float32):
                    x = RNG.standard_normal((m, k)).astype(xt)
                    y = _core.host_matmul(x, w, isa=isa)
                    assert y.dtype == xt and y.shape == (m, n)
                    exact, err = bound(x, w.astype(np.float64), xt)
                    worst = max(worst, check(y, exact, err))
    assert worst > 0  # the comparison saw rounding: it compares real sums


@pytest.mark.parametrize("isa", ISAS)
def test_int4_within_the_bound_on_every_isa(isa):
    for block_size in (16, 32, 64, 128):
        for k, n in ((block_size, 1), (100, 33), (3 * block_size + 5, 17), (1000, 40)):
            for zero_points in (False, True):
                for xt in (np.float16, np.float32):
                    b, scales, zp, w64 = int4_weight(k, n, block_size, xt, zero_points)
                    for m in (1, 3, 8, 11):
                        x = RNG.standard_normal((m, k)).astype(xt)
                        y = _core.host_matmul_nbits(x, b, scales, zp, k=k, n=n, block_size=block_size, isa=isa)
                        exact, err = bound(x, w64, xt)
                        check(y, exact, err)


def test_the_isas_agree_within_the_bound():
    if len(ISAS) < 2:
        pytest.skip("this CPU has the scalar path only")
    for wt in WEIGHT_TYPES:
        x = RNG.standard_normal((5, 777)).astype(np.float32)
        w = RNG.standard_normal((777, 301)).astype(wt)
        ys = [_core.host_matmul(x, w, isa=isa) for isa in ISAS]
        exact, err = bound(x, w.astype(np.float64), np.float32)
        for y in ys[1:]:
            check(y, ys[0].astype(np.float64), err, factor=2.0)
    b, scales, zp, w64 = int4_weight(333, 65, 32, np.float32, True)
    x = RNG.standard_normal((4, 333)).astype(np.float32)
    ys = [_core.host_matmul_nbits(x, b, scales, zp, k=333, n=65, block_size=32, isa=isa) for isa in ISAS]
    exact, err = bound(x, w64, np.float32)
    for y in ys[1:]:
        check(y, ys[0].astype(np.float64), err, factor=2.0)


def one_node(node, inputs, outputs, inits):
    g = helper.make_graph([node], "g", inputs, outputs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # what onnxruntime 1.31 reads
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("xt", (np.float32, np.float16))
@pytest.mark.parametrize("zero_points", (False, True))
def test_int4_matches_onnxruntime_matmulnbits(xt, zero_points):
    elem = TensorProto.FLOAT if xt == np.float32 else TensorProto.FLOAT16
    for k, n, block_size, m in ((64, 8, 32, 1), (100, 33, 16, 3), (1000, 70, 128, 4), (520, 96, 64, 8)):
        b, scales, zp, w64 = int4_weight(k, n, block_size, xt, zero_points)
        inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S")]
        if zp is not None:
            inits.append(numpy_helper.from_array(zp.reshape(-1), "Z"))
        node = helper.make_node("MatMulNBits", ["x", "B", "S"] + (["Z"] if zero_points else []), ["y"],
                                domain="com.microsoft", K=k, N=n, bits=4, block_size=block_size, accuracy_level=0)
        s = one_node(node, [helper.make_tensor_value_info("x", elem, [m, k])],
                     [helper.make_tensor_value_info("y", elem, [m, n])], inits)
        x = RNG.standard_normal((m, k)).astype(xt)
        want = s.run(None, {"x": x})[0]
        got = _core.host_matmul_nbits(x, b, scales, zp, k=k, n=n, block_size=block_size)
        exact, err = bound(x, w64, xt)
        check(want, exact, err)  # ORT itself meets the bound on the same layout
        check(got, want.astype(np.float64), err, factor=2.0)


@pytest.mark.parametrize("wt", WEIGHT_TYPES)
def test_dense_matches_onnxruntime_matmul(wt):
    for k, n, m in ((7, 33, 1), (1000, 17, 4), (257, 1000, 8)):
        w = RNG.standard_normal((k, n)).astype(wt)
        # ORT's CPU MatMul in fp32 over the same (upcast) weight values
        node = helper.make_node("MatMul", ["x", "W"], ["y"])
        s = one_node(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
                     [numpy_helper.from_array(w.astype(np.float32), "W")])
        x = RNG.standard_normal((m, k)).astype(np.float32)
        want = s.run(None, {"x": x})[0]
        exact, err = bound(x, w.astype(np.float64), np.float32)
        check(want, exact, err)
        check(_core.host_matmul(x, w), want.astype(np.float64), err, factor=2.0)


def test_dense_splits_and_thread_counts_agree():
    cores = _core.host_cpu()["physical_cores"]
    x = RNG.standard_normal((3, 4096)).astype(np.float32)
    w = RNG.standard_normal((4096, 1000)).astype(np.float16)
    exact, err = bound(x, w.astype(np.float64), np.float32)
    for split in ("columns", "rows"):
        for threads in sorted({1, cores}):
            check(_core._host_matmul_split(x, w, split, threads=threads), exact, err)
    # Each column of a columns split is one thread's sum in one order, whatever the count.
    ref = _core._host_matmul_split(x, w, "columns", threads=1)
    assert np.array_equal(_core._host_matmul_split(x, w, "columns", threads=cores), ref)


def test_int4_same_bits_for_any_thread_count():
    b, scales, zp, _ = int4_weight(2048, 515, 32, np.float32, True)  # 0.5 MiB: large enough for the pool
    for m in (1, 2, 5):
        x = RNG.standard_normal((m, 2048)).astype(np.float32)
        one = _core.host_matmul_nbits(x, b, scales, zp, k=2048, n=515, block_size=32, threads=1)
        assert np.array_equal(_core.host_matmul_nbits(x, b, scales, zp, k=2048, n=515, block_size=32), one)


def test_concurrent_callers_each_get_their_own_product():
    jobs = []
    for i in range(6):
        x = RNG.standard_normal((1 + i % 4, 600)).astype(np.float32)
        w = RNG.standard_normal((600, 300 + 7 * i)).astype(np.float16)
        jobs.append((x, w, _core.host_matmul(x, w)))
    b, scales, zp, _ = int4_weight(256, 77, 32, np.float32, False)
    xq = RNG.standard_normal((2, 256)).astype(np.float32)
    want_q = _core.host_matmul_nbits(xq, b, scales, zp, k=256, n=77, block_size=32)
    bad = []

    def caller(i):
        for _ in range(25):
            x, w, want = jobs[i]
            if not np.array_equal(_core.host_matmul(x, w), want):
                bad.append(("dense", i))
            if not np.array_equal(_core.host_matmul_nbits(xq, b, scales, zp, k=256, n=77, block_size=32), want_q):
                bad.append(("int4", i))

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "callers still waiting on the pool after 120 s"
    assert not bad


def test_a_forked_child_computes_with_a_pool_of_its_own():
    x = RNG.standard_normal((4, 2048)).astype(np.float32)
    w = RNG.standard_normal((2048, 512)).astype(np.float16)
    want = _core.host_matmul(x, w)
    if _core.host_cpu()["physical_cores"] > 1:
        assert _core.host_cpu()["pool_workers"] >= 1  # the parent's pool is up
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its pool starts empty and is built on first use
        try:
            fresh = _core.host_cpu()["pool_workers"] == 0
            ok = np.array_equal(_core.host_matmul(x, w), want) and fresh
            os.write(wfd, b"ok" if ok else b"bad")
        finally:
            os._exit(0)
    os.close(wfd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish its product in 60 s")
    with os.fdopen(r, "rb") as f:
        assert f.read() == b"ok"
    assert np.array_equal(_core.host_matmul(x, w), want)  # the parent's pool still runs


def test_wrong_inputs_raise_typed_errors_and_lose_nothing():
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    w = RNG.standard_normal((64, 48)).astype(np.float16)
    cases = [
        (TypeError, "x must be float16 or float32", lambda: _core.host_matmul(x.astype(np.float64), w)),
        (TypeError, "x must be", lambda: _core.host_matmul(x.astype(np.int32), w)),
        (TypeError, "w must be float16, bfloat16", lambda: _core.host_matmul(x, w.astype(np.int8))),
        (ValueError, "x must be 2-D", lambda: _core.host_matmul(x[0], w)),
        (ValueError, "w must be 2-D", lambda: _core.host_matmul(x, w[None])),
        (ValueError, "K is 63", lambda: _core.host_matmul(x, w[:63])),
        (ValueError, "x has 0 rows", lambda: _core.host_matmul(x[:0], w)),
        (ValueError, "both must be >= 1", lambda: _core.host_matmul(x[:, :0], w[:0])),
        (ValueError, "both must be >= 1", lambda: _core.host_matmul(x, w[:, :0])),
        (ValueError, "x must be C-contiguous", lambda: _core.host_matmul(np.asfortranarray(x), w)),
        (ValueError, "w must be C-contiguous", lambda: _core.host_matmul(x, w[:, ::2])),
        (ValueError, "w must be C-contiguous", lambda: _core.host_matmul(x[:, :48], w.T)),
        (ValueError, "isa must be None, 'scalar'", lambda: _core.host_matmul(x, w, isa="sse9")),
        (ValueError, "threads must be None or in", lambda: _core.host_matmul(x, w, threads=0)),
        (ValueError, "threads must be None or in", lambda: _core.host_matmul(x, w, threads=10 ** 6)),
        (TypeError, "threads must be None or an int", lambda: _core.host_matmul(x, w, threads="2")),
        (TypeError, "threads must be None or an int", lambda: _core.host_matmul(x, w, threads=True)),
    ]
    b, scales, zp, _ = int4_weight(64, 48, 32, np.float32, True)
    q = dict(k=64, n=48, block_size=32)
    cases += [
        (ValueError, "block_size must be a power of two >= 16",
         lambda: _core.host_matmul_nbits(x, b, scales, zp, **{**q, "block_size": 8})),
        (ValueError, "block_size must be a power of two >= 16",
         lambda: _core.host_matmul_nbits(x, b, scales, zp, **{**q, "block_size": 48})),
        (ValueError, "b_quant must be [N, n_blocks, block_size / 2]",
         lambda: _core.host_matmul_nbits(x, b.reshape(48, -1), scales, zp, **q)),
        (ValueError, "b_quant must be [N, n_blocks, block_size / 2]",
         lambda: _core.host_matmul_nbits(x, b, scales, zp, **{**q, "n": 47})),
        (TypeError, "b_quant must be uint8", lambda: _core.host_matmul_nbits(x, b.view(np.int8), scales, zp, **q)),
        (TypeError, "scales must have x's dtype",
         lambda: _core.host_matmul_nbits(x, b, scales.astype(np.float16), zp, **q)),
        (ValueError, "scales must be [N * n_blocks]", lambda: _core.host_matmul_nbits(x, b, scales[:-1], zp, **q)),
        (TypeError, "zero_points must be uint8", lambda: _core.host_matmul_nbits(x, b, scales, zp.astype(np.int16), **q)),
        (ValueError, "zero_points must be [N, ceil(n_blocks / 2)]",
         lambda: _core.host_matmul_nbits(x, b, scales, zp[:-1], **q)),
        (TypeError, "zero_points must be None or a uint8",
         lambda: _core.host_matmul_nbits(x, b, scales, [1, 2], **q)),
        (ValueError, "the weight's K is 64", lambda: _core.host_matmul_nbits(np.ascontiguousarray(x[:, :60]), b, scales, zp, **q)),
        (ValueError, "k and n must be >= 1", lambda: _core.host_matmul_nbits(x[:, :0], b, scales, zp, **{**q, "k": 0})),
        (ValueError, "b_quant must be C-contiguous",
         lambda: _core.host_matmul_nbits(x, np.asfortranarray(b), scales, zp, **q)),
    ]
    for err, words, call in cases:
        with pytest.raises(err, match=re.escape(words)):
            call()
    # Nothing was lost: the kernels and a plain ORT session still work.
    exact, bnd = bound(x, w.astype(np.float64), np.float32)
    check(_core.host_matmul(x, w), exact, bnd)
    node = helper.make_node("MatMul", ["x", "W"], ["y"])
    s = one_node(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 48])],
                 [numpy_helper.from_array(w.astype(np.float32), "W")])
    check(s.run(None, {"x": x})[0], exact, bnd)


def test_an_isa_the_cpu_lacks_is_refused_by_name():
    missing = [isa for isa in ("avx2", "avx512") if isa not in ISAS]
    if not missing:
        pytest.skip("this CPU has every ISA the kernels know")
    x = np.ones((1, 16), np.float32)
    with pytest.raises(ValueError, match=f"isa '{missing[-1]}' is not available on this CPU"):
        _core.host_matmul(x, np.ones((16, 16), np.float16), isa=missing[-1])


class _Weight(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("dtype", ctypes.c_int32), ("k", ctypes.c_int64), ("n", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("zero_points", ctypes.c_void_p),
                ("block_size", ctypes.c_int64)]


class _Job(ctypes.Structure):
    """HostMatmulJob of ep_plugin/host_matmul.h."""
    _fields_ = [("weight", _Weight), ("x_dtype", ctypes.c_int32), ("threads", ctypes.c_int32),
                ("isa", ctypes.c_int32), ("split", ctypes.c_int32), ("m", ctypes.c_int64), ("x", ctypes.c_void_p),
                ("y", ctypes.c_void_p), ("status", ctypes.c_int32), ("error", ctypes.c_char * 256)]


def test_the_c_entry_for_a_cuda_host_node_runs_a_job_and_reports_a_refusal():
    address, size, status_at = _core._host_job_entry()
    assert (size, status_at) == (ctypes.sizeof(_Job), _Job.status.offset)
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(address)  # CUhostFn's signature
    b, scales, zp, w64 = int4_weight(200, 50, 64, np.float16, True)
    x = RNG.standard_normal((3, 200)).astype(np.float16)
    y = np.full((3, 50), np.nan, np.float16)
    job = _Job(weight=_Weight(kind=1, dtype=1, k=200, n=50, data=b.ctypes.data, scales=scales.ctypes.data,
                              zero_points=zp.ctypes.data, block_size=64),
               x_dtype=1, threads=0, isa=-1, split=0, m=3, x=x.ctypes.data, y=y.ctypes.data, status=-1)
    run(ctypes.addressof(job))
    assert job.status == 0 and job.error == b""
    exact, err = bound(x, w64, np.float16)
    check(y, exact, err)
    job.weight.block_size = 48
    run(ctypes.addressof(job))
    assert job.status == 1 and b"block_size must be a power of two" in job.error
    job.weight.block_size, job.y = 64, None
    run(ctypes.addressof(job))
    assert job.status == 1 and b"y must not be null" in job.error


def test_bench_host_runs_from_the_command_line(tmp_path, capsys):
    import json

    from onnx_offload.tools import cli
    out = tmp_path / "host.json"
    assert cli.main(["bench", "host", "--weights-mib", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    cores = _core.host_cpu()["physical_cores"]
    assert len(res["rows"]) == 3 * 3 * cores  # fp16, bf16, int4 x M = 1, 4, 8 x 1 .. every core
    for r in res["rows"]:
        assert r["gbps"] > 0 and r["read_gbps"] > 0
        assert (r["ort_gbps"] is None) == (r["kind"] == "bf16")  # ORT's CPU has no bf16 MatMul
        assert (r["ort_int8_gbps"] is None) == (r["kind"] != "int4")
    assert "read bound" in text and "ORT CPU GB/s" in text


def test_the_gil_is_free_while_a_product_runs():
    x = RNG.standard_normal((8, 8192)).astype(np.float32)
    w = RNG.standard_normal((8192, 4096)).astype(np.float16)  # the scalar path: a few hundred ms
    started = threading.Event()

    def product():
        started.set()
        _core.host_matmul(x, w, isa="scalar", threads=1)

    t = threading.Thread(target=product)
    t.start()
    started.wait()
    t0 = time.perf_counter()
    ticks = 0
    while t.is_alive():
        ticks += 1
        time.sleep(0.001)
    elapsed = time.perf_counter() - t0
    t.join()
    # With the GIL held, this thread could not run until the product returned: one tick.
    assert elapsed < 0.05 or ticks >= 10, (elapsed, ticks)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block_size", (16, 32, 64, 128))
def test_int4_dequantizes_every_nibble_exactly(isa, block_size):
    # x = I: y[k, n] = 1 * w[k, n] plus zeros, exact in any order, so y is the dequantized
    # weight itself, each value fp32((q - z) * s): every nibble, both halves of each byte,
    # every zero point, through each path (the block tables of 32 and more, blocks of 16).
    k, n = 4 * block_size, 37
    for zero_points in (False, True):
        b, scales, zp, _ = int4_weight(k, n, block_size, np.float32, zero_points)
        q = np.empty((n, k // block_size, block_size), np.int32)
        q[..., 0::2], q[..., 1::2] = b & 15, b >> 4
        if zp is None:
            z = np.full((n, k // block_size), 8, np.int32)
        else:
            z = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :k // block_size].astype(np.int32)
        want = ((q - z[..., None]).astype(np.float32) * scales.reshape(n, -1, 1)).reshape(n, k).T
        for threads in sorted({1, _core.host_cpu()["logical_cpus"]}):
            y = _core.host_matmul_nbits(np.eye(k, dtype=np.float32), b, scales, zp, k=k, n=n, block_size=block_size,
                                        isa=isa, threads=threads)
            assert np.array_equal(y, want), (isa, block_size, zero_points, threads)


@pytest.mark.parametrize("isa", ISAS)
def test_int4_same_bits_for_any_thread_count_on_every_isa(isa):
    b, scales, zp, _ = int4_weight(1024, 1031, 32, np.float16, True)  # 0.5 MiB: large enough for the pool
    for m in (1, 2, 3, 8):
        x = RNG.standard_normal((m, 1024)).astype(np.float16)
        ys = [_core.host_matmul_nbits(x, b, scales, zp, k=1024, n=1031, block_size=32, threads=t, isa=isa)
              for t in range(1, _core.host_cpu()["logical_cpus"] + 1)]
        assert all(np.array_equal(y, ys[0]) for y in ys[1:]), (isa, m)


def _pool_cpu_seconds():
    """CPU time (user + system) the pool's worker threads have used, from /proc."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "offload-host":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    return total / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(_core.host_cpu()["logical_cpus"] < 2, reason="the pool has no workers on one CPU")
def test_pool_threads_spin_for_the_bound_then_sleep():
    """After a job the worker spins (it is not asleep) until the bound, then sleeps and uses
    no CPU; told by the pool's count of sleeping workers, which holds whatever share of a
    CPU a loaded machine gives the worker, and by its CPU time once asleep."""
    default = _core.host_cpu()["spin_us"]
    buf = np.zeros(1 << 16, np.uint8)

    def asleep_within(seconds):
        deadline = time.monotonic() + seconds
        while _core._host_pool_sleeping() < _core.host_cpu()["pool_workers"]:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    try:
        _core.host_set_spin_us(1_000_000)  # 1 s
        assert _core.host_cpu()["spin_us"] == 1_000_000
        _core._host_read(buf, threads=2)
        start = time.monotonic()
        assert _core.host_cpu()["pool_workers"] >= 1
        time.sleep(0.2)
        if time.monotonic() - start < 0.9:  # within the bound, as far as this thread could tell
            assert _core._host_pool_sleeping() == 0
        assert asleep_within(30)
        assert time.monotonic() - start >= 0.9  # not before the bound
        t1 = _pool_cpu_seconds()
        time.sleep(0.5)
        assert _pool_cpu_seconds() - t1 <= 0.02  # asleep: no CPU
        for us in (default, 0):  # the default goes quiet as well, and 0 sleeps at once
            _core.host_set_spin_us(us)
            _core._host_read(buf, threads=2)
            assert asleep_within(30), us
            t2 = _pool_cpu_seconds()
            time.sleep(0.5)
            assert _pool_cpu_seconds() - t2 <= 0.02, us
    finally:
        _core.host_set_spin_us(default)
    # Still one job at a time, each with its own product, and its own result after the waits.
    x = RNG.standard_normal((2, 512)).astype(np.float32)
    w = RNG.standard_normal((512, 512)).astype(np.float32)
    check(_core.host_matmul(x, w, threads=2), *bound(x, w.astype(np.float64), np.float32))


def test_spin_bound_setting_and_environment_variable():
    import subprocess
    import sys

    from onnx_offload import env_names
    with pytest.raises(ValueError, match=r"spin_us must be in \[0, 1000000\], got -1"):
        _core.host_set_spin_us(-1)
    with pytest.raises(ValueError, match=r"spin_us must be in \[0, 1000000\], got 1000001"):
        _core.host_set_spin_us(1_000_001)
    assert _core.host_cpu()["spin_us"] >= 0  # unchanged by the refusals
    assert env_names.unknown_env_names({"ONNX_OFFLOAD_HOST_SPIN_US": "5"}) == []
    code = ("import numpy as np\nfrom onnx_offload import _core\n"
            "try:\n    print(_core.host_cpu()['spin_us'])\nexcept ValueError as e:\n    print('ValueError', e)\n")
    for value, want in (("250", "250"), ("", "ValueError ONNX_OFFLOAD_HOST_SPIN_US must be an integer in "
                                              "[0, 1000000] (microseconds), got ''"),
                        ("2e3", "ValueError ONNX_OFFLOAD_HOST_SPIN_US must be an integer"),
                        ("1000001", "ValueError ONNX_OFFLOAD_HOST_SPIN_US must be an integer")):
        env = dict(child_env(), ONNX_OFFLOAD_HOST_SPIN_US=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=CHILD_CWD, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stdout.startswith(want), (value, out.stdout, out.stderr)


@pytest.mark.gpu
def test_the_link_bench_measures_the_gemv_and_the_h2d_at_once():
    from onnx_offload.tools.bench_host_link import bench_link, print_link
    res = bench_link(weights_mib=1024, runs=5, kinds=("fp16",), thread_counts=[2])
    (row,) = res["rows"]
    assert res["h2d_alone_gbps"] > 1 and row["gemv_alone_gbps"] > 0.1 and row["gemv_with_link_gbps"] > 0.1
    # At least one 256 MiB copy ran wholly inside the GEMV's calls, so the rate is measured.
    assert row["h2d_with_gemv_gbps"] > 1, row
    assert "together GB/s" in print_link(res)


def test_the_link_bench_raises_a_failed_copy_instead_of_waiting_for_it(monkeypatch):
    """The link bench's copies run on a thread of their own: one that fails (here on a
    closed stream of the host backend) is raised by start() and stop(), not waited for."""
    from onnx_offload.errors import StateError
    from onnx_offload.tools import bench_host_link
    monkeypatch.setattr(bench_host_link, "COPY", 1 << 20)  # the host backend plays the device
    copier = bench_host_link._Copier(_core.make_host_backend(64 << 10))
    copier.start()
    copier.stop()
    assert copier.done and all(ms >= 0 for _, _, ms in copier.done)
    copier.stream.close()
    with pytest.raises(StateError, match="closed"):
        copier.start()
    copier.close()
