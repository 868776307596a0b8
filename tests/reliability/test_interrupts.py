"""Ctrl-C at random points of run(): the next run() is right or says clearly why not.

Each policy and slot kind runs in a child process: an interrupt that corrupts a slot
may crash it."""
import sys

import pytest

from onnx_offload.policies import NAMES as POLICIES

INTERRUPTS = 30


def child_interrupts(h, policy: str, vmm: bool, count: int = INTERRUPTS, seed: int = 0) -> dict:
    import _thread
    import random
    import threading
    import time

    from onnx_offload import OffloadError
    from onnx_offload.stats import invariant_violations
    rng = random.Random(seed)
    s = h.open_session(split=True, vmm=vmm, policy=policy)
    h.reference(0), h.reference(1)
    t0 = time.perf_counter()
    s.run(None, h.feed(0))
    step_s = time.perf_counter() - t0
    res = dict(interrupts=0, outside_run=0, correct=0, clear_errors=0, wrong=0, unclear=[], evicted_twice=[])
    for i in range(count):
        delay = rng.uniform(0, 3 * step_s)
        timer = threading.Timer(delay, _thread.interrupt_main)
        in_run = False
        try:
            timer.start()
            while True:
                in_run = True
                s.run(None, h.feed(0))
                in_run = False
        except KeyboardInterrupt:
            res["interrupts"] += 1
            res["outside_run"] += not in_run
        except Exception as e:  # noqa: BLE001 - an error of an uninterrupted run
            res["unclear"].append(f"uninterrupted run {i}: {type(e).__name__}: {e}")
        timer.join()
        try:
            got = s.run(None, h.feed(1))
        except OffloadError as e:
            res["clear_errors"] += 1
            if "while evicted" in str(e):
                res["evicted_twice"].append(str(e))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            res["unclear"].append(f"after interrupt {i}: {type(e).__name__}: {e}")
        else:
            if h.outputs_match(got, 1):
                res["correct"] += 1
            else:
                res["wrong"] += 1
    res["invariants"] = invariant_violations(s.stats().arena)
    res["committed"] = s.close().committed
    return res


@pytest.mark.parametrize("vmm", [True, False], ids=["vmm", "plain"])
@pytest.mark.parametrize("policy", POLICIES)
def test_interrupted_runs_leave_a_usable_session(child, policy, vmm):
    res = child(__file__, policy, str(int(vmm)), timeout=60).data
    assert res["interrupts"] == INTERRUPTS
    assert res["unclear"] == [], res["unclear"][:5]
    assert res["evicted_twice"] == [], res["evicted_twice"][:3]
    assert res["wrong"] == 0, f"{res['wrong']} wrong outputs after an interrupt"
    assert res["correct"] + res["clear_errors"] == INTERRUPTS
    assert res["invariants"] == {}
    assert res["committed"] == 0


if __name__ == "__main__":
    import conftest as h  # this folder's: the script's folder leads sys.path
    h.emit(child_interrupts(h, sys.argv[1], sys.argv[2] == "1"))
