"""Fault injection: a failed driver call at any point of a page-in rolls all of it back."""
import pytest

from onnx_offload import OffloadError, WeightSlot

DISARM = 1 << 60  # re-targets the injection at a call that never comes


def _group(r):
    """Slots of mixed sizes, paged in together: many creates, maps and set_access calls."""
    g = r.g
    return [r.slot("a", 3 * g + 5, 1), r.slot("b", g, 2), r.slot("c", 2 * g - 100, 3), r.slot("d", 700, 4)]


@pytest.mark.parametrize("op", ["create", "map", "set_access"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "with-resident"])
def test_a_failure_at_every_position_of_a_page_in_rolls_back(rig, helpers, op, warm):
    failures = 0
    for after in range(1, 200):
        r = rig(budget=64 * (64 << 10))
        if warm:  # a resident slot the failed page-in must leave alone
            keep = r.slot("keep", r.g + 9, 99)
            r.page_in([keep])
        slots = _group(r)
        committed = r.ledger.snapshot().committed
        weights = r.ledger.snapshot().zones["weights"].committed.current
        r.backend.inject_failure(op, after)
        try:
            r.page_in(slots)
        except OffloadError as e:
            failures += 1
            assert "injected failure" in str(e), f"{op} #{after}: {e}"
        else:
            r.backend.inject_failure(op, DISARM)
            assert all(r.reads_back(s) for s in slots)
            break
        where = f"{op} failing at call {after}"
        snap = r.ledger.snapshot()
        assert snap.committed == committed, where
        assert snap.zones["weights"].committed.current == weights, where
        assert r.invariants() == {}, where
        assert helpers.handle_leak(r.arena.stats()) is None, where
        assert [s.state for s in slots] == ["evicted"] * len(slots), where
        if warm:
            assert keep.state != "evicted" and r.reads_back(keep), where
        r.backend.inject_failure(op, DISARM)
        r.page_in(slots)  # the retry without the fault
        assert all(r.reads_back(s) for s in slots), where
        assert r.invariants() == {}, where
        WeightSlot.evict(slots)
        assert r.ledger.snapshot().committed == committed, where
        del slots
        r.arena.close()
        assert r.ledger.snapshot().committed == 0, where
    else:
        pytest.fail(f"a page-in never succeeded with {op} failing")
    assert failures >= 1, f"no {op} call in a page-in"


@pytest.mark.parametrize("vmm,ops", [(True, ["map", "set_access", "create"]), (False, ["plain_alloc"])],
                         ids=["vmm", "plain"])
def test_a_fault_during_a_step_raises_and_the_next_step_is_correct(helpers, vmm, ops):
    s = helpers.open_session(split=True, vmm=vmm, policy="lru")
    backend = s.device.backend
    assert helpers.outputs_match(s.run(None, helpers.feed(0)), 0)
    failures = 0
    for op in ops:
        for after in range(1, 12):
            backend.inject_failure(op, after)
            try:
                got = s.run(None, helpers.feed(after))
            except OffloadError as e:
                failures += 1
                assert "injected failure" in str(e), f"{op} #{after}: {type(e).__name__}: {e}"
            else:
                assert helpers.outputs_match(got, after), f"{op} #{after}: wrong output"
            finally:
                backend.inject_failure(op, DISARM)
            where = f"the step after {op} failing at call {after}"
            assert helpers.outputs_match(s.run(None, helpers.feed(100 + after)), 100 + after), where
            st = s.stats()
            from onnx_offload.stats import invariant_violations
            assert invariant_violations(st.arena) == {}, where
            assert helpers.handle_leak(st.arena) is None, where
            assert st.ledger.committed <= st.ledger.budget, where
    assert failures > 0, "no fault fired during a step"
    assert s.close().committed == 0
