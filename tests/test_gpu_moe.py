"""Mixture-of-experts decoders on CUDA. ORT's CUDA MoE kernel, run by a session that streams
the experts by route (experts="routed", in segments), finds every expert the router did not
pick unmapped behind its stable address: a read of one would be an illegal address, so
each run is a process of its own, and the tokens must equal the same segments' with every
expert streamed (experts="dense").
By default ("auto") a CUDA session streams the experts whole and says so."""
import subprocess
import sys

import numpy as np
import pytest

from onnx_offload import OffloadSession
from onnx_offload.models import gpt_oss, weight_bytes

from conftest import reference_greedy

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"

# Experts of whole granules (fc1 4 MiB, fc2 2 MiB in fp16): an expert's pages are its own.
SHAPE = dict(layers=2, hidden=1024, heads=16, kv_heads=4, experts=8, top_k=2, expert_intermediate=1024, vocab=4000,
             max_length=128, dtype=np.float16)

CHILD = r"""
import json, os, sys
# ORT's CUDA MoE kernels pick their GEMM tactics by timing them, per session: tactics differ
# between sessions and round differently. Tactic 0 in every session makes the runs comparable.
os.environ["ORT_FORCE_DETERMINISTIC_MOE"] = "1"
import numpy as np
sys.path.insert(0, sys.argv[2])
from conftest import reference_greedy
from onnx_offload import OffloadSession
from onnx_offload.models import gpt_oss, weight_bytes
from test_gpu_moe import SHAPE
model = gpt_oss(**SHAPE)
ids = np.random.default_rng(0).integers(0, SHAPE["vocab"], (int(sys.argv[3]), 8))
want = reference_greedy(model, ids, 16, providers=["CUDAExecutionProvider"])
out = {}
for experts in ("routed", "dense"):
    with OffloadSession(model.SerializeToString(), providers=["CUDAExecutionProvider"], offload=True, vmm=True,
                        weight_bytes=int(weight_bytes(model) * float(sys.argv[1])), experts=experts,
                        engine="segments") as s:
        got = s.generate(ids, 16)
        c, last = s.stats().counters, s.stats().last_step
        out[experts] = dict(tokens=got.tolist(), plain=bool(np.array_equal(got, want)), engine=s.engine,
                            expert_accesses=c.expert_accesses, last_expert_accesses=last.expert_accesses)
        final = s.close()
    out[experts]["committed_after_close"] = final.committed
print(json.dumps(out))
"""


def _child(fraction: float, batch: int) -> dict:
    import json
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(fraction), here, str(batch)], capture_output=True,
                          text=True, timeout=600, cwd=here)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Measured on the H200 (ORT 1.31.1): the segments, routed or dense, captured or not, give
# the same tokens as each other and part from one plain ORT session at the 12th token of
# this fp16 model; the routing changes no bit of what the segments compute.
@pytest.mark.parametrize("fraction", [0.1, 0.25])
def test_the_cuda_moe_kernel_reads_only_the_routed_experts_and_routing_changes_no_token(fraction):
    out = _child(fraction, 1)
    routed, dense = out["routed"], out["dense"]
    assert routed["engine"] == "segments"
    assert routed["tokens"] == dense["tokens"], out
    # k of 8 experts of fc1 and fc2 in 2 layers, more where fp16 logits tie at the k-th
    assert 2 * 2 * 2 <= routed["last_expert_accesses"] < 2 * 2 * 8
    assert dense["expert_accesses"] == 0
    assert routed["committed_after_close"] == dense["committed_after_close"] == 0


def test_a_batch_of_rows_routes_the_union_of_their_experts():
    out = _child(0.25, 3)
    assert out["routed"]["tokens"] == out["dense"]["tokens"], out
    assert 8 <= out["routed"]["last_expert_accesses"] <= 2 * 2 * 8


@pytest.mark.parametrize("experts", ["in_place", "auto"])
def test_experts_in_place_are_read_from_host_memory_by_the_captured_moe_kernel(monkeypatch, experts):
    """experts="in_place", and by default on CUDA: the streaming engine leaves the stacks
    the budget cannot hold in pinned host memory, and the captured MoE kernel reads the
    picked experts there."""
    monkeypatch.setenv("ORT_FORCE_DETERMINISTIC_MOE", "1")  # see CHILD
    model = gpt_oss(**SHAPE)
    ids = np.random.default_rng(1).integers(0, SHAPE["vocab"], (1, 8))
    want = reference_greedy(model, ids, 8, providers=[CUDA])
    with OffloadSession(model.SerializeToString(), providers=[CUDA], offload=True, vmm=True,
                        weight_bytes=int(weight_bytes(model) * 0.25), experts=experts) as s:
        got = s.generate(ids, 8)
        plan = s._engines.runner.plan
        assert s.engine == "graph"
        stacks = [n for n in plan.in_host if n.endswith((".fc1", ".fc2"))]
        assert stacks and not set(stacks) & set(plan.streamed), plan.in_host
        assert s.stats().graph_steps > 0
        np.testing.assert_array_equal(got, want)
        final = s.close()
    assert final.committed == 0


def test_the_most_picked_experts_read_in_place_hold_device_pages_and_every_pick_is_counted(monkeypatch):
    """The stacks read in place map host pages behind a stable address; the experts the
    budget leaves room for hold device pages there instead, and every REBALANCE_STEPS steps
    the most picked take the place of colder ones. Each step's picks are counted from the
    routers (hits on device pages, misses read over the link), and the tokens stay plain
    ORT's."""
    from onnx_offload.memory import REBALANCE_STEPS
    monkeypatch.setenv("ORT_FORCE_DETERMINISTIC_MOE", "1")
    model = gpt_oss(**SHAPE)
    ids = np.random.default_rng(2).integers(0, SHAPE["vocab"], (1, 8))
    new = 2 * REBALANCE_STEPS + 4
    want = reference_greedy(model, ids, new, providers=[CUDA])
    with OffloadSession(model.SerializeToString(), providers=[CUDA], offload=True, vmm=True,
                        weight_bytes=int(weight_bytes(model) * 0.4), experts="in_place") as s:
        runner = s._engines.runner
        assert s.engine == "graph" and runner.experts is not None, s.stats().notes
        pages = runner.experts
        assert pages.resident and len(pages.resident) < len(pages.counts), s.stats().notes
        zone = s._device.ledger.snapshot().zones["weights"]
        assert zone.committed.current <= zone.allowance and zone.outside >= pages.committed > 0
        got = s.generate(ids, new)
        np.testing.assert_array_equal(got, want)
        c = s.stats().counters
        assert c.expert_hits > 0 and c.expert_misses > 0 and c.expert_read_bytes > 0
        assert c.expert_accesses >= c.steps * SHAPE["top_k"] * SHAPE["layers"] // 2
        # Between rebalances, no step moves a page.
        def moved(*a):
            raise AssertionError("an expert's page moved in a step between rebalances")
        pages._steps = 0
        monkeypatch.setattr(pages, "_to_device", moved)
        monkeypatch.setattr(pages, "_to_host", moved)
        np.testing.assert_array_equal(s.generate(ids, 3), want[:, :ids.shape[1] + 3])
        monkeypatch.undo()
        final = s.close()
    assert final.committed == 0


def test_the_builders_int4_gpt_oss_reads_its_experts_in_place(builder_gpt_oss, monkeypatch):
    """onnxruntime-genai's builder's int4 gpt-oss (QMoE experts, window-sized caches), with
    nothing set but the budget: the streaming engine reads the experts the budget leaves
    out in place, counts their picks, and gives plain ORT's tokens."""
    import os
    import onnx
    from onnx_offload.tools.bench_decode import anchor
    monkeypatch.setenv("ORT_FORCE_DETERMINISTIC_MOE", "1")
    path = os.path.join(builder_gpt_oss, "model.onnx")
    model = onnx.load(path)
    ids = np.random.default_rng(4).integers(0, 2048, (1, 140))
    # Plain ORT's loop (past and present one buffer, as CUDA's window-sized caches need), its
    # kernels reading the weights as they are, as the package's sessions do; without graphs,
    # whose capturing Run runs a step twice (engines/step_state.py).
    shape = dict(layers=4, hidden=1024, heads=16, kv_heads=2, vocab=2048, dtype="float16")
    want = anchor(path, shape, ids, 24, "cuda", prepack=False, graphs=False)["tokens"]
    with OffloadSession(builder_gpt_oss, providers=[CUDA], offload=True, vmm=True,
                        weight_bytes=int(weight_bytes(model) * 0.5)) as s:
        got = s.generate(ids, 24)[:, ids.shape[1]:]
        plan = s._engines.runner.plan
        assert s.engine == "graph", s.stats().notes
        stacks = [n for n in plan.in_host if n.endswith(".qweight")]
        assert stacks, (plan.in_host, s.stats().notes)
        c = s.stats().counters
        assert c.expert_accesses > 0 and c.expert_read_bytes > 0 and s.stats().graph_steps > 0
        np.testing.assert_array_equal(got, want)
        final = s.close()
    assert final.committed == 0
