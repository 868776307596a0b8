"""Models larger than the budget on the CPU EP, through the host backend: the same
flags, budget and counters as on the GPU."""
import numpy as np
import onnxruntime as ort
import pytest

from onnx_offload import BudgetExceeded, OffloadSession
from onnx_offload.stats import invariant_violations
from onnx_offload.models import mlp_stack, residual_mlp, transformer_block, weight_bytes

CPU = ["CPUExecutionProvider"]
G = 64 << 10


def reference(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)


def offloaded(model, budget, **kw):
    kw.setdefault("host_granularity", G)
    kw.setdefault("vmm", True)
    return OffloadSession(model.SerializeToString(), providers=CPU, offload=True, vram_limit=budget, **kw)


def check_invariants(s):
    assert invariant_violations(s.stats().arena) == {}


@pytest.mark.parametrize("policy", ["planned", "stable", "lru", "mru"])
@pytest.mark.parametrize("vmm", [True, False])
def test_weights_four_times_the_budget(policy, vmm):
    model = mlp_stack(layers=16, hidden=256, batch=4)
    budget = weight_bytes(model) // 4
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    want = reference(model, {"x": x})[0]
    s = offloaded(model, budget, policy=policy, vmm=vmm)
    assert len(s.segments) > 1
    for _ in range(3):
        np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    st = s.stats()
    c = st.counters
    assert c.steps == 3 and c.page_ins + c.hits == c.accesses == 3 * 16
    assert c.page_ins > 0
    assert st.peak_committed <= budget
    if policy in ("planned", "stable"):
        assert c.evictions == 0
    if not vmm:
        assert not s.graph_capture.enabled
    check_invariants(s)
    final = s.close()
    assert final.committed == 0 and final.pooled == 0


def test_returned_outputs_are_not_overwritten_by_later_steps():
    model = mlp_stack(layers=8, hidden=128, batch=2)
    rng = np.random.default_rng(7)
    x1, x2 = (rng.standard_normal((2, 128)).astype(np.float32) for _ in range(2))
    with offloaded(model, weight_bytes(model) // 2) as s:
        outs = [s.run(None, {"x": x})[0] for x in (x1, x2, x1, x2)]
    np.testing.assert_allclose(outs[2], reference(model, {"x": x1})[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[3], reference(model, {"x": x2})[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(outs[2], outs[3])


def test_planned_moves_fewer_bytes_than_lru():
    model = mlp_stack(layers=12, hidden=256, batch=2)
    x = np.ones((2, 256), np.float32)
    moved = {}
    for policy in ("planned", "lru"):
        with offloaded(model, weight_bytes(model) // 2, policy=policy) as s:
            for _ in range(4):
                s.run(None, {"x": x})
            moved[policy] = s.stats().last_step.htod_bytes
    assert moved["planned"] < moved["lru"]


def test_residuals_shared_weight_and_two_outputs():
    model = residual_mlp(layers=8, hidden=128, batch=4)
    x = np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)
    want = reference(model, {"x": x})
    with offloaded(model, weight_bytes(model) // 2) as s:
        for _ in range(2):
            got = s.run(None, {"x": x})
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert s.run(["mid"], {"x": x})[0].shape == (4, 128)


def test_transformer_blocks_split():
    model = transformer_block(hidden=128, heads=4, seq=8, batch=2, ffn=512, blocks=3)
    x = np.random.default_rng(2).standard_normal((2, 8, 128)).astype(np.float32)
    with offloaded(model, weight_bytes(model) // 3) as s:
        assert len(s.segments) > 2
        for _ in range(2):
            np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)


def test_dynamic_batch_gets_a_plan_per_shape():
    model = mlp_stack(layers=8, hidden=128, batch=None)
    with offloaded(model, weight_bytes(model) // 2) as s:
        for batch in (1, 5, 1, 5, 3):
            x = np.random.default_rng(batch).standard_normal((batch, 128)).astype(np.float32)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)
        assert s._runner.plan_count == 3


def test_iobinding_on_a_split_session():
    model = mlp_stack(layers=8, hidden=128, batch=2)
    x = np.random.default_rng(4).standard_normal((2, 128)).astype(np.float32)
    with offloaded(model, weight_bytes(model) // 2) as s:
        io = s.io_binding()
        io.bind_cpu_input("x", x)
        io.bind_output("y")
        for _ in range(2):
            s.run_with_iobinding(io)
            np.testing.assert_allclose(io.copy_outputs_to_cpu()[0], reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)
        target = ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 128), np.float32))
        io.bind_ortvalue_output("y", target)
        s.run_with_iobinding(io)
        np.testing.assert_allclose(target.numpy(), reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_iobinding_outputs_of_earlier_steps_survive_later_steps():
    model = mlp_stack(layers=8, hidden=128, batch=2)
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal((2, 128)).astype(np.float32) for _ in range(3)]
    with offloaded(model, weight_bytes(model) // 2) as s:
        io = s.io_binding()
        io.bind_output("y")
        kept = []
        for x in xs:
            io.bind_cpu_input("x", x)
            s.run_with_iobinding(io)
            kept.append(io.get_outputs()[0])
        for x, v in zip(xs, kept):
            np.testing.assert_allclose(v.numpy(), reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_a_feed_of_the_wrong_shape_for_a_bound_output_is_a_clear_error():
    model = mlp_stack(layers=8, hidden=128, batch=2)
    x = np.ones((2, 128), np.float32)
    with offloaded(model, weight_bytes(model) // 2) as s:
        io = s.io_binding()
        io.bind_cpu_input("x", x)
        io.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(np.zeros((3, 128), np.float32)))
        with pytest.raises(ValueError, match="does not fit"):
            s.run_with_iobinding(io)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)
        check_invariants(s)


def test_budget_exhausted_mid_run_is_typed_and_leaves_the_ledger_consistent():
    model = mlp_stack(layers=12, hidden=256, batch=2)
    x = np.ones((2, 256), np.float32)
    s = offloaded(model, weight_bytes(model) // 3, policy="stable")
    s.run(None, {"x": x})
    ledger = s.device.ledger
    # The KV cache grows and borrows every resident weight's budget...
    kv = ledger.headroom("kv") + ledger.snapshot().zones["weights"].committed.current
    assert ledger.make_room("kv", kv)
    ledger.charge("kv", kv, outside=True)
    # ...and prefetches in flight hold the transient headroom: nothing is left to lend.
    free = ledger.headroom("transient")
    ledger.charge("transient", free, outside=True)
    with pytest.raises(BudgetExceeded) as e:
        s.run(None, {"x": x})
    assert e.value.zone == "transient"
    check_invariants(s)
    assert all(slot.state != "pinned" for slot in s.residency.slots.values())
    ledger.refund("transient", free, outside=True)
    ledger.refund("kv", kv, outside=True)
    np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)
    final = s.close()
    assert final.committed == 0


def test_kv_growth_borrows_from_resident_weights():
    model = mlp_stack(layers=12, hidden=256, batch=2)
    x = np.ones((2, 256), np.float32)
    with offloaded(model, weight_bytes(model) // 2, policy="planned") as s:
        s.run(None, {"x": x})
        ledger = s.device.ledger
        before = ledger.snapshot().zones["weights"].committed.current
        want = ledger.headroom("kv") + 4 * G
        assert ledger.make_room("kv", want)  # the residency manager gives up weights
        ledger.charge("kv", want, outside=True)
        after = ledger.snapshot().zones["weights"]
        assert after.committed.current < before and after.lent > 0
        np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)
        ledger.refund("kv", want, outside=True)
        check_invariants(s)


def test_a_server_loop_of_many_input_shapes_keeps_running_in_a_small_budget():
    """Each input shape gets fixed boundary buffers for the steps to come; when the
    scratch budget cannot hold them beside the older shapes', the older shapes give
    theirs back (or the shape runs without), and the step still answers, as ORT would."""
    model = mlp_stack(layers=4, hidden=512, batch=None)
    ref = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    rng = np.random.default_rng(0)
    with offloaded(model, "2MiB") as s:
        assert len(s.segments) >= 2
        for b in list(range(1, 41)) + [3, 40, 1]:
            x = rng.standard_normal((b, 512)).astype(np.float32)
            # Unpacked weights (prepacking is off for weights in slots) sum in another order.
            np.testing.assert_allclose(s.run(None, {"x": x})[0], ref.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
        check_invariants(s)
        final = s.close()
    assert final.committed == 0
