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


# A thread reads the ledger in a loop while make_room calls Python reclaimers. Each round
# first holds the GIL in C past the switch interval (sum over a range), then enters
# make_room with no bytecode between: the reader has asked for the GIL by then, so it is
# running when make_room lets the GIL go, and holds it whenever the core wants it back.
READ_WHILE_MAKING_ROOM = r"""
import faulthandler, functools, json, operator, threading
faulthandler.dump_traceback_later(30, exit=True)
from onnx_offload import BudgetOwner
b = BudgetOwner(1 << 20)
b.charge("weights", 1 << 20)
calls = {"weights": 0, "scratch": 0}
def reclaimer(zone):
    def reclaim(n):
        calls[zone] += 1
        return 0
    return reclaim
b.set_reclaimer("weights", reclaimer("weights"))
b.set_reclaimer("scratch", reclaimer("scratch"))
stop, started, reads = threading.Event(), threading.Event(), [0]
def read():
    started.set()
    while not stop.is_set():
        b.snapshot(), b.committed, b.pooled, b.budget, b.headroom("kv"), b.can_charge("kv", 1)
        reads[0] += 1
reader = threading.Thread(target=read)
reader.start()
started.wait()
hold = functools.partial(sum, range(3_000_000))
room = functools.partial(b.make_room, "kv", 4096)
made = [list(map(operator.call, [hold, room]))[1] for _ in range(20)]
b.set_reclaimer("weights", reclaimer("weights"))  # replaced while the reader runs
stop.set()
reader.join()
print(json.dumps(dict(made=made, calls=calls, reads=reads[0], committed=b.committed)))
"""


def test_make_room_calls_python_reclaimers_while_another_thread_reads_the_ledger():
    import json
    import os
    import subprocess
    import sys

    import onnx_offload
    root = os.path.dirname(os.path.dirname(os.path.abspath(onnx_offload.__file__)))
    try:
        proc = subprocess.run([sys.executable, "-c", READ_WHILE_MAKING_ROOM], capture_output=True, text=True,
                              timeout=60, env=dict(os.environ, PYTHONPATH=root), cwd=os.path.dirname(__file__))
    except subprocess.TimeoutExpired:
        pytest.fail("make_room and a reader of the ledger hung")
    assert proc.returncode == 0, f"exit {proc.returncode} (a deadlock dumps the stacks):\n{proc.stderr[-3000:]}"
    res = json.loads(proc.stdout.splitlines()[-1])
    assert res["made"] == [False] * 20  # nothing could lend: the weights reclaimer frees nothing
    assert res["calls"] == {"weights": 20, "scratch": 20}
    assert res["reads"] > 0 and res["committed"] == 1 << 20
