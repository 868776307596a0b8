"""Ctrl-C at random points of run(): the next run() is right or says clearly why not.

Each policy and slot kind runs in a child process: an interrupt that corrupts a slot
may crash it."""
import sys

import pytest

from onnx_offload.config import POLICIES

INTERRUPTS = 30


def child_interrupts(h, policy: str, vmm: bool, count: int = INTERRUPTS, seed: int = 0) -> dict:
    import _thread
    import random
    import signal
    import threading
    import time

    from onnx_offload import OffloadError
    from onnx_offload.stats import invariant_violations
    # interrupt_main raises KeyboardInterrupt only where SIGINT has Python's handler: this
    # process inherits SIGINT ignored where the suite was started so (`&`, nohup).
    signal.signal(signal.SIGINT, signal.default_int_handler)
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


def child_generate_interrupts(layout: str, policy: str, count: int = INTERRUPTS, seed: int = 0) -> dict:
    """KeyboardInterrupt raised by a SIGALRM handler (nothing holds it back, unlike
    SIGINT's) at random moments of generations whose weights stream: after each, the
    idle session holds no pin and no transient or KV byte, and the next generation's
    tokens are right (or the session says it is closed)."""
    import random
    import signal
    import time

    import numpy as np

    from onnx_offload import OffloadSession, StateError
    from onnx_offload.models import weight_bytes
    from onnx_offload.models.decoder import decoder_lm
    from onnx_offload.stats import invariant_violations
    rng = random.Random(seed)
    model = decoder_lm(layout, max_length=256)
    s = OffloadSession(model.SerializeToString(), providers=["CPUExecutionProvider"], host_granularity=4096,
                       vram_limit="64MiB", offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3,
                       policy=policy)
    ids = np.random.default_rng(seed).integers(0, 97, (2, 6))
    want = s.generate(ids, 12)
    t0 = time.perf_counter()
    s.generate(ids, 12)
    step_s = time.perf_counter() - t0
    armed = [False]

    def handler(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, handler)
    res = dict(segments=len(s.segments), interrupts=0, correct=0, closed=0, wrong=0, unclear=[], left_idle=[])
    for i in range(count):
        try:
            armed[0] = True
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0, step_s))
            while True:
                s.generate(ids, 12)
        except KeyboardInterrupt:
            res["interrupts"] += 1
        except Exception as e:  # noqa: BLE001 - an error of an uninterrupted generation
            res["unclear"].append(f"uninterrupted generation {i}: {type(e).__name__}: {e}")
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        if not s._closed:
            zones = s.device.ledger.snapshot().zones
            pinned = [n for n, slot in s.residency.slots.items() if slot.state == "pinned"]
            held = {z: zones[z].committed.current for z in ("transient", "kv") if zones[z].committed.current}
            if pinned or held:
                res["left_idle"].append(f"after interrupt {i}: pinned {pinned[:3]}, committed {held}")
        try:
            got = s.generate(ids, 12)
        except StateError as e:
            if "closed" not in str(e):
                res["unclear"].append(f"after interrupt {i}: StateError: {e}")
            res["closed"] += 1
        except Exception as e:  # noqa: BLE001 - reported to the parent
            res["unclear"].append(f"after interrupt {i}: {type(e).__name__}: {e}")
        else:
            res["correct" if np.array_equal(got, want) else "wrong"] += 1
    res["invariants"] = invariant_violations(s.stats().arena)
    res["committed"] = s.close().committed
    return res


@pytest.mark.parametrize("layout", ["gqa", "standard"])
@pytest.mark.parametrize("policy", POLICIES)
def test_interrupts_from_another_signal_leave_a_streaming_generation_usable(child, layout, policy):
    res = child(__file__, "generate", layout, policy, timeout=120).data
    assert res["segments"] > 2
    assert res["unclear"] == [], res["unclear"][:5]
    assert res["interrupts"] == INTERRUPTS
    assert res["left_idle"] == [], res["left_idle"][:5]
    assert res["wrong"] == 0, f"{res['wrong']} wrong generations after an interrupt"
    assert res["correct"] + res["closed"] == INTERRUPTS
    assert res["invariants"] == {}
    assert res["committed"] == 0


if __name__ == "__main__":
    import conftest as h  # this folder's: the script's folder leads sys.path
    if sys.argv[1] == "generate":
        h.emit(child_generate_interrupts(sys.argv[2], sys.argv[3]))
    else:
        h.emit(child_interrupts(h, sys.argv[1], sys.argv[2] == "1"))
