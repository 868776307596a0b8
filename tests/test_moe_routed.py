"""Mixture-of-experts decoders streamed by route on the CPU host backend: each expert of a
stacked initializer has a slot of its own, a step pages in only the experts its router
picked (the others' pages unreadable while the MoE node runs), the hottest experts stay
resident as the budget allows, and the tokens are plain ORT's."""
import threading

import numpy as np
import pytest

from onnx_offload import OffloadSession
from onnx_offload.loading import find_routing, routed_experts
from onnx_offload.memory import ResidencyManager
from onnx_offload.models import gpt_oss, qwen3_moe, weight_bytes
from onnx_offload.stats import invariant_violations

from conftest import reference_greedy

CPU = ["CPUExecutionProvider"]
PRESETS = {"gpt-oss": gpt_oss, "qwen3-moe": qwen3_moe}
_MODELS = {}


def model_of(preset, layers=2):
    if (preset, layers) not in _MODELS:
        _MODELS[preset, layers] = PRESETS[preset](max_length=64, layers=layers)
    return _MODELS[preset, layers]


def session(model, fraction, **kw):
    kw = dict(dict(host_granularity=4096, offload=True, vmm=True), **kw)
    return OffloadSession(model.SerializeToString(), providers=CPU, weight_bytes=int(weight_bytes(model) * fraction),
                          **kw)


def weights_table(model):
    """The weights table of a float32 model as the session reads it: every initializer of 4 KiB or more."""
    from onnx_offload.loading import WeightInfo
    return [WeightInfo(t.name, np.dtype(np.float32), tuple(t.dims), int(np.prod(t.dims)) * 4, 0, 0)
            for t in model.graph.initializer if int(np.prod(t.dims)) * 4 >= 4096]


def prompt(batch=1, length=6, seed=0):
    return np.random.default_rng(seed).integers(0, 97, (batch, length))


class MappedAtRun:
    """Records, for each acquire of a segment with routed stacks, which experts of each
    stack are mapped (any state but evicted) when the segment runs."""

    def __init__(self, monkeypatch):
        self.seen = []
        original = ResidencyManager.acquire

        def acquire(res, k, routed=None):
            ready = original(res, k, routed)
            if routed:
                self.seen.append({stack: sorted(e for e, n in enumerate(res.parts[stack])
                                                if res.slots[n].state != "evicted") for stack in routed})
            return ready
        monkeypatch.setattr(ResidencyManager, "acquire", acquire)


def test_routed_experts_are_the_top_k_with_ties_and_all_for_a_row_not_finite():
    logits = np.array([[0.1, 3.0, 2.0, -1.0], [5.0, 0.0, 0.0, 4.0]], np.float32)
    assert routed_experts(logits, 2, 4) == [0, 1, 2, 3]
    assert routed_experts(logits[:1], 2, 4) == [1, 2]
    assert routed_experts(np.array([[1.0, 1.0, 1.0, 0.0]], np.float16), 1, 4) == [0, 1, 2]  # a tie: all of it
    assert routed_experts(np.array([[np.nan, 0, 0, 0]], np.float32), 1, 4) == [0, 1, 2, 3]
    assert routed_experts(np.zeros((0, 4), np.float32), 1, 4) == []
    assert routed_experts(np.zeros((2, 8), np.float32) + np.arange(8), 1, 4) == [0, 1, 2, 3]  # another width: all
    # Logits apart that float32 softmax rounds to one probability tie there (ORT ranks the
    # probabilities, a tie going by index): both are in.
    assert routed_experts(np.array([[8.0, 0.10000001, 0.1, -5]], np.float32), 2, 4) == [0, 1, 2]
    # The k-th probability underflows: every expert ties at 0.
    assert routed_experts(np.array([[100.0, 0, -200, -300]], np.float32), 3, 4) == [0, 1, 2, 3]
    rows = np.random.default_rng(0).standard_normal((500, 32)).astype(np.float32)
    assert np.mean([len(routed_experts(r[None], 4, 32)) for r in rows]) < 4.05  # the superset stays small


# One MoE node after a MatMul (so that a segment starts at it), its router's logits fed by
# the caller: logits near a tie at the k-th place, run routed with a small budget in a
# process of its own (an unmapped expert read is SIGSEGV), against plain ORT.
NEAR_TIE = r"""
import sys
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx_offload import OffloadSession
E, H, I = 8, 64, 64
rng = np.random.default_rng(0)
w = (rng.standard_normal((H, H)) * 0.1).astype(np.float32)
fc1 = (rng.standard_normal((E, 2 * I, H)) * 0.05).astype(np.float32)
fc2 = (rng.standard_normal((E, H, I)) * 0.05).astype(np.float32)
nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("MoE", ["h", "logits", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=2,
                          activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1)]
g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, H]),
                                   helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, E])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, H])],
                      [numpy_helper.from_array(a, n) for n, a in (("w", w), ("fc1", fc1), ("fc2", fc2))])
m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
feeds = {"x": rng.standard_normal((1, H)).astype(np.float32),
         "logits": np.array([[8.0, 0.10000001, 0.1, -5, -5, -5, -5, -5]], np.float32)}
so = ort.SessionOptions()
so.add_session_config_entry("session.disable_prepacking", "1")  # as the package's sessions: MatMul rounds alike
want = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
with OffloadSession(m.SerializeToString(), providers=["CPUExecutionProvider"], offload=True, vmm=True,
                    host_granularity=4096, weight_bytes=int(w.nbytes + 2 * fc1[0].nbytes + 2 * fc2[0].nbytes),
                    experts=sys.argv[1]) as s:
    got = s.run(None, feeds)[0]
    print(s.stats().last_step.expert_accesses, np.array_equal(got, want))
"""


@pytest.mark.parametrize("experts", ["routed", "dense"])
def test_logits_near_a_tie_page_in_every_expert_the_kernel_may_pick(experts):
    import subprocess
    import sys
    import tempfile
    out = subprocess.run([sys.executable, "-c", NEAR_TIE, experts], capture_output=True, text=True, timeout=120,
                         cwd=tempfile.gettempdir())  # not the source tree, whose package has no built core
    assert out.returncode == 0, out.stderr[-2000:]
    accesses, equal = out.stdout.split()
    assert equal == "True"
    assert int(accesses) == (6 if experts == "routed" else 0)  # experts 0, 1 and 2 of fc1 and fc2


@pytest.mark.parametrize("preset", PRESETS)
def test_find_routing_names_the_stacks_of_every_moe_node(preset):
    model = model_of(preset)
    weights = weights_table(model)
    routing = find_routing(model, weights)
    assert len(routing.nodes) == 2
    for node in routing.nodes:
        assert model.graph.node[node.index].op_type == "MoE"
        assert {s.rsplit(".", 1)[-1] for s in node.stacks} == {"fc1", "fc2"}  # the biases are under 4 KiB an expert
        assert (node.experts, node.k) == ((8, 2) if preset == "gpt-oss" else (16, 4))


def test_a_stack_a_subgraph_also_reads_streams_whole():
    """An If whose branch reads fc1 reads all of it: that stack is not routed."""
    from onnx import TensorProto, helper
    model = model_of("gpt-oss")
    stack = next(n for n in model.graph.node if n.op_type == "MoE").input[2]
    weights = weights_table(model)
    assert stack in find_routing(model, weights).stacks
    branch = helper.make_graph([helper.make_node("ReduceSum", [stack], ["s"], keepdims=0)], "b", [],
                               [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])])
    model.graph.node.append(helper.make_node("If", ["cond"], ["out"], then_branch=branch, else_branch=branch))
    try:
        assert stack not in find_routing(model, weights).stacks
    finally:
        del model.graph.node[-1]


def test_routed_experts_without_stable_addresses_stream_whole_and_say_so():
    model = model_of("gpt-oss")
    want = reference_greedy(model, prompt(), 4)
    with session(model, 0.25, vmm=False, experts="routed") as s:
        np.testing.assert_array_equal(s.generate(prompt(), 4), want)
        assert s.stats().counters.expert_accesses == 0
        assert any("needs stable addresses" in n for n in s.stats().notes)


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("preset", PRESETS)
def test_tokens_equal_plain_ort_and_a_decode_step_maps_only_routed_experts(preset, fraction, monkeypatch):
    model = model_of(preset)
    want = reference_greedy(model, prompt(), 12)
    mapped = MappedAtRun(monkeypatch)
    with session(model, fraction) as s:
        np.testing.assert_array_equal(s.generate(prompt(), 12), want)
        c, last = s.stats().counters, s.stats().last_step
        k, experts = (2, 8) if preset == "gpt-oss" else (4, 16)
        # A decode step reads k experts of each of the 4 stacks (fc1, fc2 of 2 layers), no more.
        assert last.expert_accesses == 4 * k
        assert 0 < c.expert_accesses == c.expert_hits + c.expert_misses and c.expert_misses > 0
        assert "routed experts: hits / misses" in str(s.stats())
        assert c.expert_htod_bytes <= c.htod_bytes
    decode = mapped.seen[-4:]  # the last step's two MoE segments, twice over (the last two steps)
    if fraction == 0.1:  # no expert stays resident: what is mapped at the run is what was routed
        assert all(len(es) == k for step in decode for es in step.values())
    assert all(len(es) < experts for step in decode for es in step.values())


@pytest.mark.parametrize("preset", PRESETS)
def test_int4_experts_qmoe_stream_by_route_with_plain_ort_s_tokens(preset, monkeypatch):
    """The builder's int4 MoE models hold their experts in QMoE nodes (4-bit stacks and
    their scales): the same routing, and the CPU kernel reads only the routed rows."""
    model = PRESETS[preset](max_length=64, hidden=128, heads=8, expert_intermediate=128, quant="int4")
    assert [n.op_type for n in model.graph.node].count("QMoE") == 2
    want = reference_greedy(model, prompt(), 10)
    mapped = MappedAtRun(monkeypatch)
    with session(model, 0.2) as s:
        np.testing.assert_array_equal(s.generate(prompt(), 10), want)
        k = 2 if preset == "gpt-oss" else 4
        assert s.stats().last_step.expert_accesses == 4 * k
    experts = 8 if preset == "gpt-oss" else 16
    assert all(len(es) < experts for step in mapped.seen[-2:] for es in step.values())


@pytest.mark.parametrize("preset", PRESETS)
def test_routed_streams_fewer_bytes_a_decode_step_than_dense(preset):
    model = model_of(preset)
    per_step = {}
    for experts in ("routed", "dense"):
        with session(model, 0.25, experts=experts) as s:
            tokens = s.generate(prompt(), 8)
            per_step[experts] = s.stats().last_step.htod_bytes
            if experts == "dense":
                assert s.stats().counters.expert_accesses == 0
        per_step[experts, "tokens"] = tokens
    np.testing.assert_array_equal(per_step["routed", "tokens"], per_step["dense", "tokens"])
    assert per_step["routed"] < per_step["dense"] / 2


def test_hot_experts_stay_resident_as_the_budget_allows():
    model = model_of("qwen3-moe", layers=4)
    rates = []
    for fraction in (0.25, 0.5, 0.75):
        with session(model, fraction) as s:
            s.generate(prompt(), 24)
            rates.append(s.stats().counters.expert_hit_rate)
            assert s.stats().last_step.htod_bytes <= s.stats().counters.htod_bytes
    assert rates[0] < rates[1] < rates[2]  # more budget, more experts kept
    assert rates[2] > 0.7


def test_an_expert_holds_only_its_own_pages():
    """An expert paged in shares no physical handle with its neighbours (a handle is given
    back only whole), so experts evicted give their pages back and the room goes to others:
    the weights zone's mapped bytes stay within a granule a resident weight of its content."""
    model = model_of("gpt-oss", layers=4)
    with session(model, 0.5, host_granularity=16 << 10) as s:
        s.generate(prompt(), 16)
        arena, res = s.stats().arena, s._engines.residency
        resident = [n for n, slot in res.slots.items() if slot.state != "evicted"]
        assert any(n in res.stack_of for n in resident)
        slack = arena.mapped_by_zone["weights"] - arena.content_by_zone["weights"]
        assert 0 <= slack <= len(resident) * arena.granularity


@pytest.mark.parametrize("policy", ["planned", "stable", "lru", "mru"])
def test_every_policy_gives_plain_ort_s_tokens_and_gives_every_byte_back(policy):
    model = model_of("gpt-oss")
    want = reference_greedy(model, prompt(2), 10)
    s = session(model, 0.25, policy=policy)
    try:
        np.testing.assert_array_equal(s.generate(prompt(2), 10), want)
        stats = s.stats()
        assert stats.counters.expert_accesses > 0
        assert invariant_violations(stats.arena) == {}
        device = s._device
    finally:
        s.close()
    assert device.ledger.committed == 0


def test_an_interrupt_while_routing_leaves_a_usable_session(monkeypatch):
    import onnx_offload.engines.routing as routing
    model = model_of("gpt-oss")
    want = reference_greedy(model, prompt(), 10)
    calls = {"n": 0}
    original = routing.routed_experts

    def interrupted(*a):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return original(*a)
    with session(model, 0.25) as s:
        monkeypatch.setattr(routing, "routed_experts", interrupted)
        with pytest.raises(KeyboardInterrupt):
            s.generate(prompt(), 10)
        monkeypatch.setattr(routing, "routed_experts", original)
        np.testing.assert_array_equal(s.generate(prompt(), 10), want)
        assert invariant_violations(s.stats().arena) == {}


@pytest.mark.parametrize("where", ["memory.residency.ResidencyManager._page_in", "memory.experts.ExpertPolicy.victim",
                                   "memory.experts.ExpertPolicy._count", "memory.residency.ResidencyManager.release"])
@pytest.mark.parametrize("nth", [1, 4, 9])
def test_an_interrupt_inside_the_experts_bookkeeping_leaves_a_usable_session(where, nth, monkeypatch):
    """A KeyboardInterrupt at the nth call of a step's expert paging, eviction choice, pick
    count or release: the next generation gives plain ORT's tokens, nothing stays pinned or
    in the transient zone, and every byte is given back at close."""
    import importlib
    module, cls, fn = where.rsplit(".", 2)
    owner = getattr(importlib.import_module("onnx_offload." + module), cls)
    original, calls = getattr(owner, fn), {"n": 0}

    def interrupted(*a, **kw):
        calls["n"] += 1
        if calls["n"] == nth:
            raise KeyboardInterrupt
        return original(*a, **kw)
    model = model_of("qwen3-moe")
    want = reference_greedy(model, prompt(), 8)
    s = session(model, 0.3)
    try:
        monkeypatch.setattr(owner, fn, interrupted)
        with pytest.raises(KeyboardInterrupt):
            s.generate(prompt(), 8)
        monkeypatch.setattr(owner, fn, original)
        np.testing.assert_array_equal(s.generate(prompt(), 8), want)
        assert s.device.ledger.snapshot().zones["transient"].committed.current == 0
        assert invariant_violations(s.stats().arena) == {}
    finally:
        final = s.close()
    assert final.committed == 0


def test_concurrent_runs_give_each_its_own_answer():
    model = model_of("qwen3-moe")
    feeds = []
    import onnxruntime as ort
    plain = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    for seed in range(4):
        ids = prompt(1, 5, seed)
        f = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones_like(ids, dtype=np.int64)}
        for i in plain.get_inputs():
            if i.name.startswith("past_key_values"):
                f[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
        feeds.append(f)
    if "position_ids" in {i.name for i in plain.get_inputs()}:
        for f in feeds:
            f["position_ids"] = np.arange(5, dtype=np.int64)[None]
    want = [plain.run(["logits"], f)[0] for f in feeds]
    got = [None] * 4
    with session(model, 0.25) as s:
        def run(i):
            for _ in range(3):
                got[i] = s.run(["logits"], feeds[i])[0]
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_experts_is_read_from_the_environment_and_checked(monkeypatch):
    model = model_of("gpt-oss")
    monkeypatch.setenv("ONNX_OFFLOAD_EXPERTS", "dense")
    with session(model, 0.25) as s:
        s.generate(prompt(), 3)
        assert s.stats().counters.expert_accesses == 0
    monkeypatch.setenv("ONNX_OFFLOAD_EXPERTS", "sometimes")
    with pytest.raises(ValueError, match="ONNX_OFFLOAD_EXPERTS='sometimes' is not valid"):
        session(model, 0.25)
    with pytest.raises(ValueError, match="experts='all' is not valid"):
        session(model, 0.25, experts="all")


def test_a_budget_below_a_stack_of_experts_is_a_typed_error_whose_advice_runs():
    """The session's advice (the smallest budget for the model), then generate()'s (for
    its cache too), taken as given: the second runs, streamed by route."""
    import re
    from onnx_offload.errors import BudgetExceeded
    model = model_of("gpt-oss")
    want = reference_greedy(model, prompt(), 6)
    kw = dict(host_granularity=4096, providers=CPU, offload=True, vmm=True, vram_limit=256 << 10)
    for attempt in range(3):
        try:
            with OffloadSession(model.SerializeToString(), **kw) as s:
                np.testing.assert_array_equal(s.generate(prompt(), 6), want)
                assert s.stats().counters.expert_accesses > 0
            break
        except BudgetExceeded as e:
            advice = str(e).rsplit("pass ", 1)[1]
            kw.update({k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", advice)})
    assert attempt > 0  # the first budget was short


def test_the_bench_moe_rows_run_in_processes_of_their_own(tmp_path):
    """`bench moe`'s rows, routed, dense and in place, on a small gpt-oss-shaped model: the same
    tokens, plain ORT's, and fewer bytes a token routed."""
    from onnx_offload.models import save_decoder
    from onnx_offload.tools.bench_decode import anchor, in_process_of_its_own
    model = model_of("gpt-oss", layers=4)
    path = save_decoder(model, str(tmp_path / "moe"))
    ids = prompt(1, 6, seed=2)
    want = reference_greedy(model, ids, 12)[:, ids.shape[1]:]
    # The anchor's logits, and each row fed the anchor's tokens (here its own too).
    shape = dict(layers=4, hidden=64, heads=4, kv_heads=1, vocab=97, dtype="float32")
    logits = str(tmp_path / "anchor.npy")
    np.testing.assert_array_equal(anchor(path, shape, ids, 12, "cpu", logits_out=logits)["tokens"], want)
    rows = {e: in_process_of_its_own("bench_moe", "streamed_row", path=path, ids=ids.tolist(), new=12, kind="cpu",
                                     fraction=0.25, weights=weight_bytes(model), experts=e, forced=want.tolist(),
                                     anchor_logits=logits)
            for e in ("routed", "dense", "in_place")}
    for r in rows.values():
        np.testing.assert_array_equal(r["tokens"], want)
        assert r["forced_agree"] == r["forced_steps"] == 12 and r["parted_margin"] is None
        assert r["max_logit_diff"] < 1e-4
    assert 0 < rows["routed"]["bytes_per_token"] < rows["dense"]["bytes_per_token"]
    # On the CPU nothing is read in place: in_place streams the experts whole, as dense.
    assert rows["in_place"]["in_place_bytes"] == 0 and rows["in_place"]["engine"] == rows["dense"]["engine"]
    assert rows["routed"]["expert_bytes"] > rows["routed"]["expert_resident"] >= 0


def test_bench_moe_s_cuda_model_has_gpt_oss_20b_s_layer_widths_and_builds_as_it_says():
    from onnx_offload.models import moe_lm
    from onnx_offload.tools.bench_moe import _shape
    wide, narrow = _shape("cuda"), _shape("cuda", "narrow")
    assert (wide["hidden"], wide["expert_intermediate"], wide["hidden"] // wide["heads"]) == (2880, 2880, 64)
    assert (wide["experts"], wide["top_k"]) == (32, 4) == (narrow["experts"], narrow["top_k"])
    assert narrow["hidden"] == 1024 and _shape("cpu", "narrow") == _shape("cpu")
    with pytest.raises(ValueError, match="widths"):
        _shape("cuda", "wide")
    # One layer of two experts of the default widths: each expert is 50 MB in fp16.
    m = moe_lm(**{**{k: v for k, v in wide.items() if k != "dtype"}, "layers": 1, "experts": 2, "top_k": 1},
               dtype=np.float16)
    stack = {t.name: t for t in m.graph.initializer}
    fc = sum(len(stack[f"layers.0.moe.{n}"].raw_data) for n in ("fc1", "fc2")) // 2
    assert fc == 3 * 2880 * 2880 * 2  # SwiGLU's gate and up (fc1), and down (fc2)


@pytest.mark.parametrize("preset", PRESETS)
def test_experts_in_place_name_the_stacks_the_streaming_engine_reads_where_they_are(preset):
    from onnx_offload.loading import read_in_place
    model = model_of(preset)
    weights = weights_table(model)
    stacks = read_in_place(model, weights, "in_place")
    assert stacks == list(find_routing(model, weights).stacks)
    assert {s.rsplit(".", 1)[-1] for s in stacks} == {"fc1", "fc2"}
    assert all(read_in_place(model, weights, mode) == [] for mode in ("auto", "routed", "dense"))


def test_experts_in_place_on_the_cpu_stream_whole_and_say_why():
    """The CPU execution provider runs segments, where nothing is read in place: the
    experts stream whole, the tokens are plain ORT's, and a note says what in_place needs."""
    model = model_of("gpt-oss")
    want = reference_greedy(model, prompt(), 4)
    with session(model, 0.25, experts="in_place") as s:
        np.testing.assert_array_equal(s.generate(prompt(), 4), want)
        assert s.stats().counters.expert_accesses == 0
        assert any("experts='in_place' needs the streaming engine" in n for n in s.stats().notes)
        final = s.close()
    assert final.committed == 0


def test_bench_moe_says_where_tokens_part_from_the_anchor_s():
    """The first new token at which any row parts (None: equal), as `bench moe` reports it
    for each row and for plain ORT run again."""
    from onnx_offload.tools.bench_moe import parted_at
    a = np.array([[5, 6, 7, 8], [1, 2, 3, 4]])
    assert parted_at(a.copy(), a) is None
    b = a.copy()
    b[1, 2] = 9
    assert parted_at(b, a) == 2
    b[0, 0] = 0
    assert parted_at(b, a) == 0
    assert parted_at(a[:, :3], a) == 0  # fewer tokens than the anchor's: apart from the start


def test_bench_moe_s_agreement_counts_the_picks_and_the_margins_where_they_differ():
    from onnx_offload.tools.bench_moe import agreement
    want = np.zeros((3, 1, 5), np.float32)  # [steps, batch, vocab]
    want[:, 0, 1], want[:, 0, 2] = 2.0, 1.5  # picks 1; margin 0.5
    want[2, 0, 2] = 1.99  # a near tie at step 2
    got = want.copy()
    assert agreement(got, want) == dict(forced_agree=3, forced_steps=3, max_logit_diff=0.0, parted_margin=None)
    got[2, 0, 2] = 2.01  # step 2 picks 2
    r = agreement(got, want)
    assert (r["forced_agree"], r["forced_steps"]) == (2, 3)
    assert r["max_logit_diff"] == pytest.approx(0.02) and r["parted_margin"] == pytest.approx(0.01)
