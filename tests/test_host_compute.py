"""The rewrite that hands MatMuls to the host's cores, proved on real onnxruntime (CPU EP):
the rewritten model, its X outputs multiplied with numpy and fed back as its Y inputs,
gives plain ORT's outputs within a stated bound.

The bound: every output within 16 * eps * max|output| of plain ORT's (eps of the output's
type: 2**-10 for float16, 2**-23 for float32). The host sums in float32 and rounds Y once,
where ORT's CPU kernels round on their own schedule; over a few layers that moves outputs
by a few units in the last place of their largest values.
"""
import pickle
import shutil

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_offload.errors import UnsupportedModel
from onnx_offload.loading import (HostComputeRefused, core_matmul, host_candidates, load_host_weights, numpy_matmul,
                                  rewrite_for_host, run_host_split)
from onnx_offload.memory import StepWeight, plan_host_split
from onnx_offload.loading.host_run import chain_depth, dequantize_nbits
from onnx_offload.models import decoder_like, decoder_lm, int4, transformer_block
from onnx_offload.models.decoder import save_decoder

CPU = ["CPUExecutionProvider"]
ULPS = 16


def matmul_weights(model):
    inits = {t.name for t in model.graph.initializer}
    return [n.input[1] for n in model.graph.node
            if n.op_type in ("MatMul", "MatMulNBits") and len(n.input) > 1 and n.input[1] in inits]


def make_feeds(model, seq=1, past=5, seed=0):
    """Random inputs of a decode step of `seq` tokens after `past` (a decoder's ids, mask,
    positions and cache; any other model's float inputs)."""
    rng = np.random.default_rng(seed)
    dims = {"batch_size": 1, "sequence_length": seq, "past_sequence_length": past, "total_sequence_length": past + seq}
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for v in model.graph.input:
        if v.name in inits:
            continue
        shape = [d.dim_value if d.HasField("dim_value") else dims[d.dim_param] for d in v.type.tensor_type.shape.dim]
        elem = helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
        if v.name == "input_ids":
            feeds[v.name] = rng.integers(0, 97, shape)
        elif v.name == "attention_mask":
            feeds[v.name] = np.ones(shape, np.int64)
        elif v.name == "position_ids":
            feeds[v.name] = np.broadcast_to(np.arange(past, past + seq), shape).copy()
        else:
            feeds[v.name] = rng.standard_normal(shape).astype(elem)
    return feeds


def plain(model_or_path, feeds):
    source = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    s = ort.InferenceSession(source, providers=CPU)
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))


def assert_within_bound(out, ref):
    for name, want in ref.items():
        got = out[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        eps = np.finfo(want.dtype).eps
        scale = float(np.abs(want.astype(np.float32)).max())
        err = float(np.abs(got.astype(np.float32) - want.astype(np.float32)).max())
        assert err <= ULPS * eps * scale, f"{name}: {err} > {ULPS} * {eps} * {scale}"


def check(model, names, feeds, folder="", ref=None):
    """Rewrites `model` for `names`, runs it with the host's part in numpy, compares with
    plain ORT; returns the hosts and the runs it took."""
    ref = plain(model, feeds) if ref is None else ref
    rewritten, hosts = rewrite_for_host(model, names)
    out, runs = run_host_split(rewritten, hosts, feeds, load_host_weights(model, hosts, folder), folder=folder)
    assert_within_bound({k: out[k] for k in ref}, ref)
    assert runs == chain_depth(rewritten, hosts) + 1
    return rewritten, hosts, runs


DECODERS = [pytest.param(layout, dtype, q, id=f"{layout}-{np.dtype(dtype).name}{'-int4' if q else ''}")
            for layout in ("gqa", "standard") for dtype in (np.float32, np.float16) for q in (False, True)]


@pytest.mark.parametrize("layout,dtype,quantized", DECODERS)
def test_every_matmul_on_the_host_gives_plain_ort_s_outputs(layout, dtype, quantized):
    model = decoder_lm(layout, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, dtype=dtype)
    if quantized:
        model = int4(model, block_size=32, accuracy_level=0)  # float compute, as the host's
    rewritten, hosts, runs = check(model, matmul_weights(model), make_feeds(model))
    assert len(hosts) == 2 * 7 + 1
    assert {h.kind for h in hosts} == {"int4" if quantized else np.dtype(dtype).name}
    # q, k and v share their X, and gate and up theirs: 15 MatMuls read 9 Xs.
    assert len({h.x_output for h in hosts}) == 9
    assert [n.op_type for n in rewritten.graph.node].count("IsNaN") == 9
    assert runs == 10  # q -> o -> gate -> down per layer, then the LM head: a chain of 9


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_one_weight_several_and_a_whole_layer(dtype):
    model = decoder_lm("standard", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, dtype=dtype)
    feeds, names = make_feeds(model, seq=2), matmul_weights(model)
    ref = plain(model, feeds)
    _, hosts, runs = check(model, [names[0]], feeds, ref=ref)
    assert len(hosts) == 1 and runs == 2
    check(model, names[::3], feeds, ref=ref)
    layer = [n for n in names if n.startswith("layers.1.")]
    _, hosts, _ = check(model, layer, feeds, ref=ref)
    assert len(hosts) == 7


def test_a_transformer_and_a_prompt_of_several_tokens():
    model = transformer_block(hidden=64, heads=4, seq=4, batch=2, ffn=128, blocks=2)
    _, hosts, _ = check(model, matmul_weights(model), make_feeds(model))
    assert hosts[0].y_shape == (2, 4, 64)


def test_external_data_is_not_read(tmp_path):
    """The rewrite runs with the data file gone; the harness reads it back afterwards."""
    path = decoder_like(str(tmp_path / "m.onnx"), layers=2, hidden=64, ffn=128, dtype=np.float16)
    feeds = make_feeds(onnx.load(path, load_external_data=False))
    ref = plain(path, feeds)
    model = onnx.load(path, load_external_data=False)
    shutil.move(path + ".data", tmp_path / "away")
    rewritten, hosts = rewrite_for_host(model, matmul_weights(model)[:5])
    kept = {t.name: t for t in rewritten.graph.initializer}
    assert all(kept[w].data_location == TensorProto.EXTERNAL for w in matmul_weights(model)[5:])
    shutil.move(tmp_path / "away", path + ".data")
    rewritten_path = str(tmp_path / "rewritten.onnx")
    onnx.save(rewritten, rewritten_path)
    onnx.checker.check_model(rewritten_path)
    out, _ = run_host_split(rewritten, hosts, feeds, load_host_weights(model, hosts, str(tmp_path)),
                            folder=str(tmp_path))
    assert_within_bound({k: out[k] for k in ref}, ref)


@pytest.mark.parametrize("layout", ["gqa", "standard"])
def test_an_llm_folder_with_its_data_file(tmp_path, layout):
    """make_model.py's llm and llm-standard folders: model.onnx beside model.onnx.data."""
    path = save_decoder(decoder_lm(layout, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128,
                                   dtype=np.float16), str(tmp_path / "llm"))
    model = onnx.load(path, load_external_data=False)
    feeds = make_feeds(model, seq=1, past=3)
    _, hosts, _ = check(model, matmul_weights(model), feeds, folder=str(tmp_path / "llm"), ref=plain(path, feeds))
    assert len(hosts) == 15


@pytest.mark.parametrize("quantized", [False, True])
def test_the_candidates_the_planner_is_given_and_its_plan_rewritten(quantized):
    """host_candidates names every MatMul weight (B, and scales for int4) and nothing else;
    the planner's host set, rewritten, gives plain ORT's outputs."""
    model = decoder_lm("gqa", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, dtype=np.float16)
    if quantized:
        model = int4(model, block_size=32, accuracy_level=0)
    found = host_candidates(model)
    b_names = matmul_weights(model)
    scales = [n + "_scales" for n in (w[:-len("_Q4")] for w in b_names)] if quantized else []
    assert set(found) == set(b_names) | set(scales)
    assert {kind for _, kind in found.values()} == {"int4" if quantized else "float16"}
    assert len({matmul for matmul, _ in found.values()}) == 15
    sizes = {t.name: len(t.raw_data) for t in model.graph.initializer}
    ws = [StepWeight(t.name, sizes[t.name], *reversed(found.get(t.name, ("", "")))) for t in model.graph.initializer
          if sizes[t.name] >= 1024]
    rate = 1e9
    plan = plan_host_split(ws, 2 * rate, {"int4" if quantized else "float16": {1: rate}}, gpu_seconds=0, tokens=1,
                           node_seconds=0)
    assert 0 < len(plan.host) < 15
    feeds = make_feeds(model)
    _, hosts, _ = check(model, plan.host_weights, feeds)
    assert sorted(h.node for h in hosts) == sorted(plan.host)


def tiny(dtype=TensorProto.FLOAT, opset=17, extra_nodes=(), weights=("w1", "w2", "w3")):
    """x [b, 8] -> MatMul w1, w2, w3 (each [8, 4]) -> Add -> y, plus `extra_nodes`."""
    rng = np.random.default_rng(0)
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np_type), w) for w in weights]
    nodes = [helper.make_node("MatMul", ["x", w], [f"{w}_out"], name=f"mm_{w}") for w in weights]
    nodes.append(helper.make_node("Sum", [f"{w}_out" for w in weights], ["y"]))
    nodes.extend(extra_nodes)
    outputs = [helper.make_tensor_value_info("y", dtype, ["b", 4])]
    outputs += [helper.make_tensor_value_info(n.output[0], dtype, None) for n in extra_nodes]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", dtype, ["b", 8])], outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_the_rewrite_s_graph():
    model = tiny()
    rewritten, hosts = rewrite_for_host(model, ["w1", "w3"])
    onnx.checker.check_model(rewritten, full_check=True)
    assert [t.name for t in model.graph.initializer] == ["w1", "w2", "w3"]  # the caller's model is unchanged
    assert not {"w1", "w3"} & {t.name for t in rewritten.graph.initializer}
    h1, h3 = hosts
    assert (h1.node, h1.weights, h1.kind, h1.k, h1.n, h1.block_size) == ("mm_w1", ("w1",), "float32", 8, 4, 0)
    assert h1.x_output == h3.x_output == "x" and h1.output == "w1_out"
    assert h1.y_dtype == np.float32 and h1.y_shape == ("b", 4) and h1.weight_bytes == 8 * 4 * 4
    assert "x" in [o.name for o in rewritten.graph.output]
    y_in = {v.name: v for v in rewritten.graph.input}[h1.y_input]
    assert [d.dim_param or d.dim_value for d in y_in.type.tensor_type.shape.dim] == ["b", 4]
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("Slice") == ops.count("IsNaN") == 1 and ops.count("Where") == 2 and ops.count("MatMul") == 1
    where = next(n for n in rewritten.graph.node if n.op_type == "Where")
    assert where.input[1] == where.input[2] == h1.y_input


def test_orts_optimizations_keep_the_dependency(tmp_path):
    """ORT's optimizations keep the Where that orders Y's readers after X. (float32: on the
    CPU EP, ORT wraps float16 ops it has no CPU kernel for in casts.)"""
    model = decoder_lm("standard", layers=1, hidden=64, heads=4, kv_heads=2, intermediate=128)
    rewritten, hosts = rewrite_for_host(model, matmul_weights(model))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(rewritten.SerializeToString(), options, providers=CPU)
    optimized = onnx.load(str(tmp_path / "opt.onnx"))
    wheres = [n for n in optimized.graph.node if n.op_type == "Where"]
    assert sorted(n.output[0] for n in wheres if n.input[1] == n.input[2]) == sorted(h.output for h in hosts)


def test_opset_9_slices_with_attributes():
    model = tiny(opset=9)
    rewritten, hosts = rewrite_for_host(model, ["w2"])
    onnx.checker.check_model(rewritten, full_check=True)
    feeds = {"x": np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)}
    out, runs = run_host_split(rewritten, hosts, feeds, load_host_weights(model, hosts))
    assert_within_bound({"y": out["y"]}, plain(model, feeds)) and runs == 2


def test_bfloat16_rewrites_at_opset_16_and_is_refused_below():
    rewritten, hosts = rewrite_for_host(tiny(TensorProto.BFLOAT16, opset=16), ["w1"])
    onnx.checker.check_model(rewritten, full_check=True)
    assert hosts[0].kind == "bfloat16" and hosts[0].y_dtype == ml_dtypes.bfloat16
    with pytest.raises(HostComputeRefused, match="opset 16"):
        rewrite_for_host(tiny(TensorProto.BFLOAT16, opset=15), ["w1"])


@pytest.mark.parametrize("case", ["unknown", "gather", "also add", "not 2-D", "graph output"])
def test_weights_the_host_cannot_take_are_refused_by_name(case):
    extra, names = (), ["w1"]
    if case == "unknown":
        names = ["w1", "nope"]
    elif case == "gather":
        extra = (helper.make_node("Gather", ["w2", "idx"], ["g"]),)
        names = ["w2"]
    elif case == "also add":
        extra = (helper.make_node("Add", ["w3", "w3"], ["a"]),)
        names = ["w3"]
    model = tiny(extra_nodes=extra)
    if case == "gather":
        model.graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), "idx"))
    elif case == "not 2-D":
        model.graph.initializer[0].dims[:] = [2, 4, 4]
    elif case == "graph output":
        model.graph.output.append(helper.make_tensor_value_info("w1", TensorProto.FLOAT, [8, 4]))
    with pytest.raises(HostComputeRefused) as e:
        rewrite_for_host(model, names)
    assert isinstance(e.value, UnsupportedModel) and isinstance(e.value, ValueError)
    assert e.value.names == (names[-1],) and repr(names[-1]) in str(e.value)
    again = pickle.loads(pickle.dumps(e.value))  # as multiprocessing sends it
    assert type(again) is HostComputeRefused and again.names == e.value.names and str(again) == str(e.value)


def test_an_input_of_unknown_rank_is_refused():
    """Y's declared shape comes from X's: where no inference gives X's rank, no rewrite."""
    model = tiny()
    model.graph.node.insert(0, helper.make_node("Source", [], ["x2"], domain="test.custom"))
    model.graph.node[1].input[0] = "x2"
    model.opset_import.append(helper.make_opsetid("test.custom", 1))
    with pytest.raises(HostComputeRefused, match="rank") as e:
        rewrite_for_host(model, ["w1"])
    assert e.value.names == ("w1",)
    assert "w1" in {t.name for t in model.graph.initializer}


def test_a_weight_two_matmuls_read_goes_with_both():
    model = tiny(weights=("w1", "w2"))
    model.graph.node[1].input[1] = "w1"
    rewritten, hosts = rewrite_for_host(model, ["w1"])
    assert [h.node for h in hosts] == ["mm_w1", "mm_w2"]
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 8)).astype(np.float32)}
    out, _ = run_host_split(rewritten, hosts, feeds, load_host_weights(model, hosts))
    assert_within_bound({"y": out["y"]}, plain(model, feeds))


def nbits_model(zero_points: bool, k=64, n=24, block=32):
    """One MatMulNBits with random 4-bit blocks, scales, and packed zero points."""
    rng = np.random.default_rng(5)
    blocks = -(-k // block)
    b = rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8)
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(rng.random(n * blocks).astype(np.float32), "S")]
    ins = ["x", "B", "S"]
    if zero_points:
        inits.append(numpy_helper.from_array(rng.integers(0, 256, (n, -(-blocks // 2)), dtype=np.uint8), "Z"))
        ins.append("Z")
    node = helper.make_node("MatMulNBits", ins, ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block,
                            accuracy_level=0)
    g = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("k", [64, 80])  # 80: K not a multiple of the block, padded in B
def test_int4_dequantized_as_orts_kernel_reads_it(zero_points, k):
    model = nbits_model(zero_points, k=k)
    rewritten, (host,) = rewrite_for_host(model, ["B"])
    assert host.weights == (("B", "S", "Z") if zero_points else ("B", "S")) and host.zero_points == ("Z" if zero_points else None)
    assert (host.kind, host.k, host.n, host.block_size) == ("int4", k, 24, 32)
    assert not rewritten.graph.initializer[3:] and {t.name for t in rewritten.graph.initializer}.isdisjoint({"B", "S", "Z"})
    feeds = {"x": np.random.default_rng(3).standard_normal((3, k)).astype(np.float32)}
    out, _ = run_host_split(rewritten, [host], feeds, load_host_weights(model, [host]))
    assert_within_bound({"y": out["y"]}, plain(model, feeds))
    w = dequantize_nbits(host, load_host_weights(model, [host]))
    assert w.shape == (k, 24)


@pytest.mark.parametrize("layout,dtype,quantized", DECODERS[:4])
def test_the_compiled_kernels_as_the_host_s_part(layout, dtype, quantized):
    """The compiled core's host kernels in place of numpy."""
    model = decoder_lm(layout, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, dtype=dtype)
    if quantized:
        model = int4(model, block_size=32, accuracy_level=0)
    feeds = make_feeds(model)
    ref = plain(model, feeds)
    rewritten, hosts = rewrite_for_host(model, matmul_weights(model))
    out, _ = run_host_split(rewritten, hosts, feeds, load_host_weights(model, hosts), compute=core_matmul())
    assert_within_bound({k: out[k] for k in ref}, ref)
    numpy_out, _ = run_host_split(rewritten, hosts, feeds, load_host_weights(model, hosts), compute=numpy_matmul)
    assert_within_bound({k: out[k] for k in ref}, {k: numpy_out[k] for k in ref})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_the_cuda_ep_runs_the_dependency_on_the_device(dtype):
    """Slice, IsNaN and Where are all the CUDA EP's (no CPU fallback), float16 and bfloat16;
    Y passes bitwise (float16: ORT's Python API takes no bfloat16 arrays)."""
    model = tiny(dtype, opset=21)
    model.graph.node.pop()  # the Sum: read the MatMuls' outputs themselves
    del model.graph.output[:]
    model.graph.output.extend(helper.make_tensor_value_info(f"{w}_out", dtype, ["b", 4]) for w in ("w1", "w2", "w3"))
    rewritten, hosts = rewrite_for_host(model, ["w1", "w2", "w3"])
    options = ort.SessionOptions()
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    s = ort.InferenceSession(rewritten.SerializeToString(), options,
                             providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    placed = [(node.op_type, info.ep_name) for info in s.get_provider_graph_assignment_info()
              for node in info.get_nodes() if node.op_type in ("Slice", "IsNaN", "Where")]
    assert sorted(placed) == [("IsNaN", "CUDAExecutionProvider"), ("Slice", "CUDAExecutionProvider")] + \
        [("Where", "CUDAExecutionProvider")] * 3
    if dtype == TensorProto.BFLOAT16:
        return
    y = np.array([[1.5, -0.0, np.inf, np.nan]] * 3, np.float16)
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float16)
    out = s.run(None, {"x": x, **{h.y_input: y for h in hosts}})
    for got in out[:3]:
        assert got.view(np.uint16).tobytes() == y.view(np.uint16).tobytes()
