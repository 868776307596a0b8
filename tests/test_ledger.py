"""The budget owner on its own: zones, allowances, reserves, lending, refusals."""
import pytest

from onnx_offload import BudgetExceeded, BudgetOwner, StateError

MiB = 1 << 20


def test_charge_refund_and_counters():
    b = BudgetOwner(100 * MiB)
    b.charge("weights", 30 * MiB)
    b.charge("weights", 10 * MiB)
    b.refund("weights", 25 * MiB)
    w = b.snapshot().zones["weights"].committed
    assert (w.current, w.peak, w.total) == (15 * MiB, 40 * MiB, 40 * MiB)
    with pytest.raises(StateError):
        b.refund("weights", 16 * MiB)


def test_refusal_names_request_and_every_zone():
    b = BudgetOwner(64 * MiB)
    b.set_zone("weights", allowance=32 * MiB, priority=0)
    b.charge("weights", 30 * MiB)
    with pytest.raises(BudgetExceeded) as e:
        b.charge("weights", 4 * MiB)
    err = e.value
    assert isinstance(err, MemoryError)
    assert err.zone == "weights" and err.requested == 4 * MiB
    for text in ("4194304", "weights 31457280/33554432", "kv 0/", "scratch 0/", "transient 0/"):
        assert text in str(err)
    assert b.snapshot().refusals == 1
    assert b.committed == 30 * MiB  # the refusal changed nothing


def test_reserves_are_kept_for_their_zone():
    b = BudgetOwner(100 * MiB)
    b.set_zone("transient", allowance=100 * MiB, reserve=20 * MiB, priority=3)
    b.charge("weights", 80 * MiB)
    with pytest.raises(BudgetExceeded, match="reserves"):
        b.charge("weights", 1)
    b.charge("transient", 20 * MiB)  # the reserve is there for transient
    with pytest.raises(ValueError, match="exceed"):
        b.set_zone("kv", allowance=100 * MiB, reserve=90 * MiB, priority=2)


def test_growth_lends_from_lower_priority_zones():
    b = BudgetOwner(100 * MiB)
    b.charge("weights", 90 * MiB)
    asked = []

    def reclaim(n):
        asked.append(n)
        b.refund("weights", 20 * MiB)
        return 20 * MiB

    b.set_reclaimer("weights", reclaim)
    assert b.make_room("kv", 25 * MiB)
    b.charge("kv", 25 * MiB)
    assert asked == [15 * MiB]
    s = b.snapshot()
    assert s.zones["weights"].lent == 20 * MiB and s.reclaims == 1
    b.clear_reclaimer("weights")


def test_no_lending_upwards_and_refusal_when_lenders_are_empty():
    b = BudgetOwner(100 * MiB)
    b.charge("kv", 90 * MiB)
    called = []
    b.set_reclaimer("kv", lambda n: called.append(n) or 0)
    # Weights are the lowest priority: they never take from KV.
    assert not b.make_room("weights", 20 * MiB)
    assert called == []
    b.set_reclaimer("weights", lambda n: 0)
    assert not b.make_room("transient", 20 * MiB)
    with pytest.raises(BudgetExceeded):
        b.charge("transient", 20 * MiB)
    b.clear_reclaimer("kv")
    b.clear_reclaimer("weights")


def test_outside_bytes_are_tracked_separately():
    b = BudgetOwner(100 * MiB)
    b.charge("scratch", 8 * MiB, outside=True)
    assert b.snapshot().zones["scratch"].outside == 8 * MiB
    with pytest.raises(StateError):
        b.refund("scratch", 9 * MiB, outside=True)
    b.refund("scratch", 8 * MiB, outside=True)
    assert b.committed == 0


def test_unknown_zone_is_a_value_error():
    b = BudgetOwner(MiB)
    with pytest.raises(ValueError, match="unknown zone"):
        b.charge("activations", 1)
