"""The engine's scenarios of the reliability bench: soak (arena and session), fault
injection in page-ins and steps, threads sharing a session, Ctrl-C at random points of a
step, a fork with a live session, and bad inputs.

Each is a child of ``python -m onnx_offload.tools.reliability`` returning the counts of
``reliability_rig.result``: a wrong output, a leak, a clear (typed) error.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable, List, Tuple

import numpy as np

from .reliability_rig import (Churn, closing_leaks, correct, feed, host_rig, make_slot, mlp_model, mlp_session,
                              reads_back, reference, result, soak_sizes)

POLICIES = ("planned", "stable", "lru", "mru")


def soak_arena(cycles: str = "10000") -> dict:
    from ..stats import invariant_violations
    fds = len(os.listdir("/proc/self/fd"))
    backend, ledger, arena, stream = host_rig(8 * (64 << 10))
    keep = {}
    slots = [make_slot(arena, f"w{i}", n, i, keep) for i, n in enumerate(soak_sizes(backend.granularity))]
    tally = {"wrong": 0, "leaks": 0}

    def check(_, s):
        tally["wrong"] += not reads_back(backend, stream, s, keep)
        st = arena.stats()
        tally["leaks"] += int(st.handles_created - st.handles_released != st.live_handles)

    churn = Churn(slots, stream)
    churn.run(int(cycles), check)
    churn.evict_all()
    done, wrong, leaks = churn.page_ins, tally["wrong"], tally["leaks"]
    del slots, churn
    arena.close()
    st = arena.stats()
    leaks += int(ledger.committed != 0) + int(st.live_handles != 0) + len(invariant_violations(st))
    del arena, backend, stream
    __import__("gc").collect()
    leaks += int(len(os.listdir("/proc/self/fd")) != fds)
    return result(done, 0, wrong, leaks)


def soak_session(vmm: str = "1", steps: str = "200") -> dict:
    fds = len(os.listdir("/proc/self/fd"))
    s = mlp_session(True, vmm == "1", "lru")
    wrong = sum(not correct(s.run(None, feed(i % 5)), i % 5) for i in range(int(steps)))
    return result(int(steps), 0, wrong, closing_leaks(s, fds))


def faults() -> dict:
    """A create, map or set_access failure at every position of a page-in of four slots,
    then the same at the session level."""
    from .._core import WeightSlot
    from ..errors import OffloadError
    from ..stats import invariant_violations
    attempts = clear = wrong = leaks = 0
    for op in ("create", "map", "set_access"):
        for after in range(1, 100):
            backend, ledger, arena, stream = host_rig(64 * (64 << 10))
            keep, g = {}, backend.granularity
            slots = [make_slot(arena, k, n, i, keep) for i, (k, n) in enumerate(
                [("a", 3 * g + 5), ("b", g), ("c", 2 * g - 100), ("d", 700)])]
            before = ledger.committed
            backend.inject_failure(op, after)
            attempts += 1
            try:
                WeightSlot.page_in(slots, "weights", stream).synchronize()
            except OffloadError:
                clear += 1
                leaks += int(ledger.committed != before) + len(invariant_violations(arena.stats()))
                backend.inject_failure(op, 1 << 60)
                WeightSlot.page_in(slots, "weights", stream).synchronize()
                done = False
            else:
                backend.inject_failure(op, 1 << 60)
                done = True
            wrong += sum(not reads_back(backend, stream, s, keep) for s in slots)
            del slots
            arena.close()
            leaks += int(ledger.committed != 0)
            if done:
                break
    for vmm, ops in ((True, ("map", "set_access")), (False, ("plain_alloc",))):
        s = mlp_session(True, vmm, "lru")
        backend = s.device.backend
        for op in ops:
            for after in range(1, 8):
                attempts += 1
                backend.inject_failure(op, after)
                try:
                    wrong += not correct(s.run(None, feed(after)), after)
                except OffloadError:
                    clear += 1
                finally:
                    backend.inject_failure(op, 1 << 60)
                wrong += not correct(s.run(None, feed(50 + after)), 50 + after)
        leaks += closing_leaks(s)
    return result(attempts, clear, wrong, leaks)


def threads(split: str = "1", n: str = "8", steps: str = "20") -> dict:
    import threading

    from ..errors import OffloadError
    s = mlp_session(split == "1", True, "planned")
    counts = dict(wrong=0, clear=0)
    for t in range(int(n)):
        reference(100 + t)

    def worker(t: int):
        for _ in range(int(steps)):
            try:
                counts["wrong"] += not correct(s.run(None, feed(100 + t)), 100 + t)
            except OffloadError:
                counts["clear"] += 1
            except Exception:  # noqa: BLE001 - an untyped error is a wrong outcome
                counts["wrong"] += 1

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(int(n))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return result(int(n) * int(steps), counts["clear"], counts["wrong"], closing_leaks(s))


def interrupts(policy: str, vmm: str, count: str = "10") -> dict:
    import _thread
    import random
    import threading

    from ..errors import OffloadError
    rng = random.Random(0)
    s = mlp_session(True, vmm == "1", policy)
    t0 = time.perf_counter()
    s.run(None, feed(0))
    step = time.perf_counter() - t0
    clear = wrong = leaks = 0
    for _ in range(int(count)):
        timer = threading.Timer(rng.uniform(0, 3 * step), _thread.interrupt_main)
        try:
            timer.start()
            while True:
                s.run(None, feed(0))
        except KeyboardInterrupt:
            pass
        except Exception:  # noqa: BLE001 - an uninterrupted step failed
            wrong += 1
        timer.join()
        try:
            wrong += not correct(s.run(None, feed(1)), 1)
        except OffloadError as e:
            clear += 1
            leaks += "while evicted" in str(e)
        except Exception:  # noqa: BLE001 - an untyped error
            wrong += 1
    return result(int(count), clear, wrong, leaks + closing_leaks(s))


def fork() -> dict:
    from ..errors import StateError
    s = mlp_session(True, True, "lru")
    s.run(None, feed(0))
    reference(5)
    pid = os.fork()
    if pid == 0:  # 0: worked, 1: a clear StateError, 2: wrong, 3: another error
        code = 0
        for fn in (lambda: correct(s.run(None, feed(5)), 5), lambda: getattr(s.close(), "committed", 0) == 0):
            try:
                code = max(code, 0 if fn() else 2)
            except StateError as e:
                code = max(code, 1 if "fork" in str(e).lower() else 3)
            except BaseException:  # noqa: BLE001
                code = 3
        os._exit(code)
    deadline, status = time.monotonic() + 20, None
    while time.monotonic() < deadline and status is None:
        done, st = os.waitpid(pid, os.WNOHANG)
        status = st if done else None
        time.sleep(0.02)
    hung = status is None
    if hung:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    code = os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else 3
    wrong = int(code in (2, 3) and not hung) + sum(not correct(s.run(None, feed(i)), i) for i in (5, 6))
    return result(3, int(code == 1), wrong, closing_leaks(s), child_hung=hung)


def bad_inputs() -> dict:
    from ..errors import BudgetExceeded, CorruptModel, OffloadError, StateError
    from ..session import OffloadSession
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument
    typed = (InvalidArgument, ValueError, TypeError, OffloadError)
    x = feed(3)["x"]
    s = mlp_session(True)
    data = mlp_model()[0]
    cases: List[Tuple[Callable, tuple]] = [
        (lambda: s.run(None, {"nope": x}), typed), (lambda: s.run(None, {}), typed),
        (lambda: s.run(["nope"], {"x": x}), typed), (lambda: s.run(None, {"x": x.astype(np.float64)}), typed),
        (lambda: s.run(None, {"x": x[None]}), typed),
        (lambda: OffloadSession(data, providers=["CPUExecutionProvider"], vram_limit="2MiB"), (BudgetExceeded,)),
        (lambda: OffloadSession(b"garbage" * 9, providers=["CPUExecutionProvider"]), (CorruptModel,)),
    ]
    clear = wrong = 0
    for fn, want in cases:
        try:
            fn()
        except want as e:
            plain_runtime = isinstance(e, RuntimeError) and not isinstance(e, OffloadError)
            clear += not plain_runtime
            wrong += plain_runtime
        except Exception:  # noqa: BLE001 - the wrong type
            wrong += 1
        else:
            wrong += 1
        wrong += not correct(s.run(None, feed(4)), 4)
    os.environ["ONNX_GENAI_WEIGHT_OFFLOAD"] = "maybe"
    try:
        OffloadSession(data, providers=["CPUExecutionProvider"])
        wrong += 1
    except ValueError:
        clear += 1
    finally:
        del os.environ["ONNX_GENAI_WEIGHT_OFFLOAD"]
    leaks = closing_leaks(s)
    try:
        s.get_inputs()
        wrong += 1
    except StateError:
        clear += 1
    return result(len(cases) + 2, clear, wrong, leaks)


CHILDREN: List[Callable[..., dict]] = [soak_arena, soak_session, faults, threads, interrupts, fork, bad_inputs]

# (row label, child, its arguments, timeout in seconds)
SCENARIOS = [
    ("soak: arena, 10000 cycles", "soak_arena", ("10000",), 120),
    ("soak: session lru, vmm", "soak_session", ("1",), 60),
    ("soak: session lru, plain", "soak_session", ("0",), 60),
    ("faults: page-in + step", "faults", (), 60),
    ("threads: 8 x 20, split", "threads", ("1",), 60),
    ("threads: 8 x 20, whole", "threads", ("0",), 60),
    *[(f"interrupts: {p}, {'vmm' if v == '1' else 'plain'}", "interrupts", (p, v), 60)
      for p in POLICIES for v in ("1", "0")],
    ("fork: child run + close", "fork", (), 60),
    ("bad inputs", "bad_inputs", (), 60),
]
