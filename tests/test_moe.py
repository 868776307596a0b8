"""Mixture-of-experts decoders (models/moe.py) on the CPU host backend: they run in plain ORT,
generate() gives plain ORT's greedy tokens all resident and streamed, and each layer's stacked
experts are one weight of the session; ORT's CPU MoE kernel reads only the routed experts'
weights."""
import os

import numpy as np
import onnxruntime as ort
import pytest

from onnx_offload import OffloadSession
from onnx_offload.models import expert_share, gpt_oss, qwen3_moe, weight_bytes

from conftest import reference_greedy

CPU = ["CPUExecutionProvider"]
# "gpt-oss windows": its even layers keep a window-sized cache of 8 positions, as the
# builder writes gpt-oss's sliding-window layers; the tests' tokens run past the window.
PRESETS = {"gpt-oss": gpt_oss, "qwen3-moe": qwen3_moe,
           "gpt-oss windows": lambda **kw: gpt_oss(window_cache=8, **kw)}
_MODELS = {}


def model_of(preset):
    if preset not in _MODELS:
        _MODELS[preset] = PRESETS[preset](max_length=64)
    return _MODELS[preset]


def session(model, **kw):
    kw.setdefault("host_granularity", 4096)
    kw.setdefault("vram_limit", "64MiB")
    return OffloadSession(model.SerializeToString(), providers=CPU, **kw)


def prompt(batch=2, length=6):
    return np.random.default_rng(0).integers(0, 97, (batch, length))


@pytest.mark.parametrize("preset", PRESETS)
def test_the_model_runs_in_plain_ort_with_experts_most_of_its_bytes(preset):
    model = model_of(preset)
    moe = [n for n in model.graph.node if n.op_type == "MoE"]
    assert len(moe) == 2 and all(n.domain == "com.microsoft" for n in moe)
    assert expert_share(model) > 0.8  # as in gpt-oss and Qwen3-MoE, the experts are most of the weights
    s = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    assert {o.name for o in s.get_outputs()} >= {"logits", "present.0.key", "present.1.value"}
    tokens = reference_greedy(model, prompt(), 8)
    assert tokens.shape == (2, 14)


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_equal_plain_ort_all_resident(preset):
    model = model_of(preset)
    want = reference_greedy(model, prompt(), 12)
    with session(model) as s:
        assert len(s.segments) == 1
        np.testing.assert_array_equal(s.generate(prompt(), 12), want)


# Streamed: the weights zone's allowance (weight_bytes) or the whole budget (vram_limit, which
# also holds the KV cache and the step's scratch) below the weights' bytes.
@pytest.mark.parametrize("limit", ["weight_bytes", "vram_limit"])
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_equal_plain_ort_streamed(preset, limit):
    model = model_of(preset)
    want = reference_greedy(model, prompt(), 12)
    total = weight_bytes(model)
    budget = {"weight_bytes": total // 2, "vram_limit": total * 6 // 10}[limit]
    with session(model, offload=True, vmm=True, **{limit: budget}) as s:
        assert len(s.segments) > 1
        np.testing.assert_array_equal(s.generate(prompt(), 12), want)
        assert s.stats().counters.page_ins > 0


@pytest.mark.parametrize("preset", PRESETS)
def test_each_stack_of_experts_is_one_weight_of_the_session(preset):
    model = model_of(preset)
    with session(model) as s:
        min_bytes = s.config.min_weight_bytes
        big = {t.name: int(np.prod(t.dims)) * 4 for t in model.graph.initializer
               if int(np.prod(t.dims)) * 4 >= min_bytes}  # float32
        held = {w for seg in s.segments for w in seg.weights}
        stats = s.stats()
    # Every initializer of min_weight_bytes or more is one weight of the session, a layer's
    # fc1 (and fc2) stack of all its experts too; streamed by route, its residency gives
    # each expert a slot of its own (test_moe_routed.py).
    assert stats.weights == len(big) and stats.weight_bytes == sum(big.values())
    assert held == set(big)
    stacks = {n for n in big if ".moe.fc" in n and not n.endswith("_bias")}
    assert len(stacks) == 4  # fc1 and fc2 of each of the 2 layers


# A child that runs one MoE (or QMoE, 4-bit) node with its stacked experts in mmap'd memory,
# every expert but `mapped` PROT_NONE: a read of any other expert's weights kills it with SIGSEGV.
READS = r"""
import ctypes, mmap, sys
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper
E, H, I, T = 8, 256, 512, int(sys.argv[1])
mapped = [int(e) for e in sys.argv[2].split(",")]
op = sys.argv[3]
rng = np.random.default_rng(0)
w1 = (rng.standard_normal((E, 2 * I, H)) * 0.05).astype(np.float32)
w2 = (rng.standard_normal((E, H, I)) * 0.05).astype(np.float32)
extra, inputs = {}, ["x", "router", "fc1", "", "fc2"]
if op == "QMoE":
    from onnx_offload.models.moe import quantize_experts
    (w1, s1), (w2, s2) = quantize_experts(w1), quantize_experts(w2)
    extra = {"s1": s1, "s2": s2}
    inputs = ["x", "router", "fc1", "s1", "", "fc2", "s2"]
dt = np.uint8 if op == "QMoE" else np.float32
per1, per2 = w1[0].size * w1.itemsize, w2[0].size * w2.itemsize
buf = mmap.mmap(-1, E * (per1 + per2))
fc1 = np.frombuffer(buf, dtype=dt, count=w1.size).reshape(w1.shape)
fc2 = np.frombuffer(buf, dtype=dt, count=w2.size, offset=E * per1).reshape(w2.shape)
fc1[:], fc2[:] = w1, w2
logits = np.full((T, E), -10.0, np.float32)
logits[:, [1, 5]] = [2.0, 1.0]  # every token routes to experts 1 and 5
x = rng.standard_normal((T, H)).astype(np.float32)
attrs = dict(expert_weight_bits=4) if op == "QMoE" else {}
node = helper.make_node(op, inputs, ["y"], domain="com.microsoft", k=2, activation_type="swiglu", swiglu_fusion=1,
                        normalize_routing_weights=1, **attrs)
elem = TensorProto.UINT8 if op == "QMoE" else TensorProto.FLOAT
values = [("x", [T, H], TensorProto.FLOAT), ("router", [T, E], TensorProto.FLOAT), ("fc1", list(fc1.shape), elem),
          ("fc2", list(fc2.shape), elem)] + [(n, list(a.shape), TensorProto.FLOAT) for n, a in extra.items()]
g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, s) for n, s, t in values],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, H])])
m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("com.microsoft", 1)])
so = ort.SessionOptions()
so.add_session_config_entry("session.disable_prepacking", "1")  # as a streamed session's: the kernel reads the slots
s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
feeds = dict({"x": x, "router": logits, "fc1": fc1, "fc2": fc2}, **extra)
want = s.run(None, feeds)[0]
base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
for e in set(range(E)) - set(mapped):
    for off, n in ((e * per1, per1), (E * per1 + e * per2, per2)):
        assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(base + off), ctypes.c_size_t(n), 0) == 0
io = s.io_binding()  # bound in place: the kernel reads the mmap'd memory itself
for n, a in feeds.items():
    io.bind_cpu_input(n, a)
io.bind_output("y")
s.run_with_iobinding(io)
print(np.array_equal(io.copy_outputs_to_cpu()[0], want))
"""


@pytest.mark.parametrize("op", ["MoE", "QMoE"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_ort_s_cpu_moe_kernel_reads_only_the_routed_experts(tokens, op):
    """What streaming only the routed experts rests on, on the CPU: ORT's MoE kernel reads
    the weights of the experts the router picked and no others. With every other expert's
    pages unreadable the step runs and gives the same output; with a routed expert's
    pages unreadable too, it faults (the check can fail)."""
    import subprocess
    import sys
    import tempfile

    def run(mapped):
        # From another folder: `python -c` looks in its working folder first, and the
        # source tree's package has no built core.
        return subprocess.run([sys.executable, "-c", READS, str(tokens), mapped, op], capture_output=True, text=True,
                              timeout=120, cwd=tempfile.gettempdir())
    routed = run("1,5")
    assert routed.returncode == 0 and routed.stdout.strip() == "True", routed.stderr[-2000:]
    assert run("5").returncode == -11  # expert 1 unreadable: SIGSEGV


def test_the_builders_int4_gpt_oss_generates_plain_orts_tokens_resident_and_streamed(builder_gpt_oss):
    import onnx
    model = onnx.load(os.path.join(builder_gpt_oss, "model.onnx"))
    ids = np.random.default_rng(0).integers(0, 2048, (1, 150))  # a prompt longer than the window of 128
    with OffloadSession(builder_gpt_oss, providers=CPU, host_granularity=64 << 10) as s:
        assert s.decoder_spec.window_caches == ((0, 128), (2, 128)) and s.decoder_spec.head_size == 64
        np.testing.assert_array_equal(s.generate(ids, 12), reference_greedy(model, ids, 12, head_size=64))
    # Streamed, ORT's CPU kernels read the int4 weights as they are, without prepacking them
    # (test_int4.py): plain ORT's tokens without prepacking.
    want = reference_greedy(model, ids, 12, head_size=64, prepack=False)
    with OffloadSession(builder_gpt_oss, providers=CPU, host_granularity=64 << 10, offload=True, vmm=True,
                        weight_bytes=weight_bytes(model) // 4) as s:
        assert len(s.segments) > 1
        np.testing.assert_array_equal(s.generate(ids, 12), want)
        assert s.stats().counters.page_ins > 0
    assert s.close().committed == 0
