"""llama.cpp beside the package in bench cards: the GGUF the bench writes holds the
model's tensors and llama's metadata as gguf's reader reads them back; llama-bench's
command line; its JSON output parsed."""
import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from onnx_offload.models.decoder import decoder_lm, genai_config, save_decoder  # noqa: E402
from onnx_offload.tools import llama_cpp  # noqa: E402

SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=300, max_length=256, dtype="float16")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    shape = {k: v for k, v in SHAPE.items() if k != "dtype"}
    m = decoder_lm("gqa", dtype=np.float16, **shape)
    folder = str(tmp_path_factory.mktemp("gguf") / "llm")
    cfg = genai_config(SHAPE["layers"], SHAPE["hidden"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["vocab"],
                       SHAPE["max_length"], eos_token_id=-1)
    return save_decoder(m, folder, config=cfg), m


def test_the_gguf_holds_the_models_tensors_under_llamas_names(model, tmp_path):
    import onnx.numpy_helper as nh
    path, m = model
    out = llama_cpp.write_gguf(path, SHAPE, str(tmp_path / "m.gguf"))
    r = gguf.GGUFReader(out)
    tensors = {t.name: t for t in r.tensors}
    names = llama_cpp.gguf_names(SHAPE["layers"])
    assert set(tensors) == {g for g, _ in names.values()}
    weights = {t.name: nh.to_array(t) for t in m.graph.initializer}
    for onnx_name, (g, transposed) in names.items():
        want = weights[onnx_name].T if transposed else weights[onnx_name]
        got = np.asarray(tensors[g].data).reshape(want.shape)
        # GGML's dims are numpy's reversed: [in, out] for a projection, as llama.cpp reads it.
        assert list(tensors[g].shape) == list(want.shape[::-1]), g
        np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=g)
        assert got.dtype == (np.float32 if want.ndim == 1 else np.float16), g

    def field(key):
        f = r.fields[key]
        return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]][0]
    assert field("general.architecture") == "llama"
    assert field("llama.block_count") == 2 and field("llama.embedding_length") == 64
    assert field("llama.attention.head_count") == 4 and field("llama.attention.head_count_kv") == 2
    assert field("llama.feed_forward_length") == 96 and field("llama.rope.dimension_count") == 16
    assert field("general.file_type") == int(gguf.LlamaFileType.MOSTLY_F16)
    assert len(r.fields["tokenizer.ggml.tokens"].data) == SHAPE["vocab"]  # a vocabulary of the model's size


def test_llama_bench_command_lines():
    fit = llama_cpp.bench_args("/x/llama-bench", "m.gguf", 512, 32, threads=16)
    assert fit == ["/x/llama-bench", "-m", "m.gguf", "-fitt", "1024", "-fitc", "1024", "-p", "512", "-n", "32",
                   "-d", "0,512", "-fa", "1", "-t", "16", "-r", str(llama_cpp.REPETITIONS), "-o", "json"]
    best = llama_cpp.bench_args("/x/llama-bench", "m.gguf", 512, 32, ngl=15, threads=16)
    assert best[3:5] == ["-ngl", "15"] and "-fitt" not in best


def _result(n_prompt, n_gen, n_depth, avg_ns, ngl=15):
    tokens = n_prompt + n_gen
    return {"build_commit": "abc", "model_type": "llama 8B F16", "n_gpu_layers": ngl, "n_prompt": n_prompt,
            "n_gen": n_gen, "n_depth": n_depth, "avg_ns": avg_ns, "stddev_ns": 1000,
            "avg_ts": tokens / (avg_ns / 1e9), "stddev_ts": 0.1, "samples_ns": [avg_ns, avg_ns],
            "samples_ts": [tokens / (avg_ns / 1e9)] * 2}


def test_llama_bench_json_is_parsed():
    # llama-bench -o json's shape: the log on stderr, then one JSON array on stdout, a record
    # per test (pp at each depth, tg at each depth).
    results = [_result(512, 0, 0, 937_000_000), _result(512, 0, 512, 990_000_000),
               _result(0, 32, 0, 32 * 93_000_000), _result(0, 32, 512, 32 * 94_500_000)]
    got = llama_cpp.parse("some line\n" + json.dumps(results, indent=2) + "\n", 512, 32)
    assert got["ms_per_token"] == pytest.approx(94.5) and got["prompt_ms"] == pytest.approx(937.0)
    assert got["ngl"] == 15
    with pytest.raises(ValueError, match="tg32 at depth 512"):
        llama_cpp.parse(json.dumps(results[:2]), 512, 32)


def test_no_llama_bench_is_none_and_a_wrong_path_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert llama_cpp.find_llama_bench(None) is None
    with pytest.raises(FileNotFoundError, match="--llama-bench"):
        llama_cpp.find_llama_bench(str(tmp_path / "nope"))


def test_the_probe_reads_where_llama_cpp_put_the_weights():
    probe = llama_cpp.probe_args("/x/llama-bench", "m.gguf", 33)
    assert probe[probe.index("-ngl") + 1] == "33" and "-v" in probe and probe[probe.index("-n") + 1] == "1"
    # llama-model.cpp's lines ("%s: %12s model buffer size = %8.2f MiB"), a load's worth.
    log = ("load_tensors: offloading 32 repeating layers to GPU\n"
           "load_tensors:   CPU_Mapped model buffer size =  1002.00 MiB\n"
           "load_tensors:        CUDA0 model buffer size = 14315.03 MiB\n"
           "llama_context: n_ctx = 512\n")
    got = llama_cpp.model_buffers(log)
    assert got == {"CPU_Mapped": 1002 * 2**20, "CUDA0": int(14315.03 * 2**20)}
    assert llama_cpp.model_buffers("no buffers here") == {}
    from onnx_offload.tools.bench_cards_table import _on_device
    assert _on_device(got) == ", weights 13.98 GiB on the device, 1002.00 MiB on the host"
    assert _on_device({}) == ""


def test_bench_cards_prints_llama_cpps_columns_only_with_llama_bench():
    from onnx_offload.tools.bench_cards import print_cards
    row = dict(card=8 << 30, prompt=512, batch=1, ms_per_token=100.0, ttft_ms=300.0, resident=6 << 30,
               bound_ms=95.0, prefill_bound_ms=250.0, peak=7 << 30, card_free=8 << 30, could_reside=7 << 30,
               tokens_equal=True, engine="graph")
    res = dict(kind="cuda", weights=15 << 30, h2d_gbps=54.9, new=32, rows=[row], llama_bench=None)
    without = print_cards(res)
    assert "llama.cpp" not in without and "7.00 GiB of 8.00 GiB" in without and "could reside" in without
    lm = dict(fit=dict(ms_per_token=116.3, prompt_ms=937.0, ngl=-1),
              best=dict(ms_per_token=94.5, prompt_ms=900.0, ngl=15))
    text = print_cards(dict(res, rows=[dict(row, llama=lm)], llama_bench="/x/llama-bench"))
    assert "llama.cpp fit" in text and "116.30 / 937" in text and "94.50 / 900 (-ngl 15)" in text
    assert f"{100.0 / 94.5:.2f}x" in text and f"{300.0 / 900.0:.2f}x" in text
    from onnx_offload.tools.bench_cards import _line
    line = _line(dict(row, llama=lm, budget=7 << 30, margin=256 << 20, ledger_peak=6 << 30, ort_bytes=1 << 28))
    assert "94.50 / 900 (-ngl 15)" in line and "margin 256.00 MiB" in line, line
    failed = dict(lm, best=dict(error="out of memory"))
    assert "failed" in print_cards(dict(res, rows=[dict(row, llama=failed)], llama_bench="/x/llama-bench"))


def test_an_int4_model_s_gguf_holds_the_very_values_orts_blocks_hold(model, tmp_path):
    # The int4 model (MatMulNBits, blocks of 32, zero point 8) written as Q4_0: gguf's own
    # dequantizer gives back exactly (q - 8) * scale of every block ORT multiplies.
    import onnx
    import onnx.numpy_helper as nh
    from onnx_offload.models import int4
    path, m = model
    q = int4(m)
    folder = str(tmp_path / "int4")
    cfg = genai_config(SHAPE["layers"], SHAPE["hidden"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["vocab"],
                       SHAPE["max_length"], eos_token_id=-1)
    qpath = save_decoder(q, folder, config=cfg)
    shape = dict(SHAPE, quant="int4")
    out = llama_cpp.write_gguf(qpath, shape, str(tmp_path / "q4.gguf"))
    r = gguf.GGUFReader(out)
    tensors = {t.name: t for t in r.tensors}
    weights = {t.name: nh.to_array(t) for t in onnx.load(qpath).graph.initializer}
    names = llama_cpp.gguf_names(SHAPE["layers"])
    quantized = 0
    for onnx_name, (g, _) in names.items():
        t = tensors[g]
        if onnx_name + "_Q4" not in weights:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16 or t.tensor_type == gguf.GGMLQuantizationType.F32
            continue
        quantized += 1
        packed, scales = weights[onnx_name + "_Q4"], weights[onnx_name + "_scales"]
        n, blocks, _ = packed.shape
        values = np.empty((n, blocks, 32), np.float32)
        values[..., 0::2] = (packed & 15).astype(np.float32) - 8
        values[..., 1::2] = (packed >> 4).astype(np.float32) - 8
        want = (values * scales.astype(np.float32).reshape(n, blocks, 1)).reshape(n, blocks * 32)
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0, g
        assert list(t.shape) == [blocks * 32, n], g  # GGML's [in, out]
        got = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.Q4_0).reshape(n, blocks * 32)
        np.testing.assert_array_equal(got, want, err_msg=g)
    assert quantized == 7 * SHAPE["layers"] + 1  # every projection and the head
    f = r.fields["general.file_type"]
    assert f.parts[f.data[0]][0] == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    assert llama_cpp.layer_bytes(shape) * 32 == llama_cpp.layer_bytes(SHAPE) * 9  # 18 bytes a block of 32


def test_q4_0_takes_only_blocks_of_32_with_fp16_scales():
    with pytest.raises(ValueError, match="blocks of 32"):
        llama_cpp.q4_0_rows(np.zeros((2, 1, 8), np.uint8), np.ones(2, np.float16))
    with pytest.raises(ValueError, match="float32"):
        llama_cpp.q4_0_rows(np.zeros((2, 1, 16), np.uint8), np.ones(2, np.float32))


def test_bench_hosts_peer_reads_the_bytes_a_token_reads_and_prints_beside_ours(model, tmp_path):
    from onnx_offload.tools.bench_host_llama import bytes_a_token, print_llama_host
    path, m = model
    out = llama_cpp.write_gguf(path, SHAPE, str(tmp_path / "m.gguf"))
    tensors = gguf.GGUFReader(out).tensors
    embd = [t for t in tensors if t.name == "token_embd.weight"][0]
    assert embd.n_bytes == SHAPE["vocab"] * SHAPE["hidden"] * 2  # F16
    assert bytes_a_token(out) == sum(int(t.n_bytes) for t in tensors) - embd.n_bytes > 0
    rec = _result(0, 16, 0, 16 * 40_000_000)
    assert llama_cpp.parse_gen(json.dumps([rec]), 16)["avg_ts"] == pytest.approx(25.0)
    with pytest.raises(ValueError, match="tg16 at depth 0"):
        llama_cpp.parse_gen(json.dumps([_result(0, 16, 512, 1)]), 16)
    rows = [dict(kind="fp16", threads=1, bytes=800 << 20, ms_per_token=40.0, gbps=(800 << 20) / 40.0 / 1e6),
            dict(kind="int4", threads=2, bytes=200 << 20, error="llama-bench: model failed to load")]
    ours = [dict(kind="fp16", m=1, threads=1, gbps=21.0), dict(kind="fp16", m=4, threads=1, gbps=9.0),
            dict(kind="int4", m=1, threads=2, gbps=9.2)]
    text = print_llama_host(rows, ours)
    assert "800.00 MiB" in text and "40.00" in text and "21.0" in text
    assert f"{21.0 / ((800 << 20) / 40.0 / 1e6):.2f}x" in text
    assert "FAILED: llama-bench: model failed to load" in text and "9.2" in text


def test_bench_hosts_peer_runs_llama_bench_on_the_cpu(tmp_path):
    """With llama-bench at hand (on PATH, or LLAMA_BENCH), a small model's decode on one
    thread: a rate from llama.cpp's own run."""
    import os
    from onnx_offload.tools.bench_host_llama import bench_llama_host
    exe = llama_cpp.find_llama_bench(os.environ.get("LLAMA_BENCH"))
    if exe is None:
        pytest.skip("no llama-bench on PATH (or LLAMA_BENCH)")
    shape = dict(SHAPE, layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=512)
    rows = bench_llama_host(exe, str(tmp_path), [1], kinds=("fp16", "int4"), runs=1, shape=shape)
    assert [r["kind"] for r in rows] == ["fp16", "int4"]
    for r in rows:
        assert "error" not in r, r
        assert r["ms_per_token"] > 0 and r["gbps"] == pytest.approx(r["bytes"] / r["ms_per_token"] / 1e6)


def test_a_llama_bench_without_the_gguf_package_is_a_clear_error_or_left_aside(tmp_path, monkeypatch):
    import importlib.util
    exe = tmp_path / "llama-bench"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"pip install 'onnx-offload\[bench\]'"):
        llama_cpp.find_llama_bench(str(exe))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.warns(UserWarning, match="runs without llama.cpp"):
        assert llama_cpp.find_llama_bench(None) is None
