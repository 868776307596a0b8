"""The reliability bench: soak, fault injection, threads, interrupts, fork and bad inputs,
each scenario in a child process so that a crash or a hang is counted, not suffered.

    onnx-offload bench reliability [--json FILE]

A child runs ``python -m onnx_offload.tools.reliability SCENARIO ARGS`` and prints one JSON line
of counts: attempts, clear (typed) errors, wrong outputs and leaks. The parent adds
crashes (a signal, or an exit without a result) and hangs (no exit in time).
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..stats import table
from . import reliability_hostile, reliability_trust

MiB = 1 << 20
RTOL, ATOL = 1e-5, 1e-6
POLICIES = ("planned", "stable", "lru", "mru")
COLUMNS = ("attempts", "clear_errors", "crashes", "wrong_outputs", "leaks", "hangs")


# ---------------------------------------------------------------- shared by the children

@functools.lru_cache(maxsize=None)
def _model() -> Tuple[bytes, int]:
    from ..models import mlp_stack, weight_bytes
    m = mlp_stack(layers=8, hidden=512, batch=4)
    return m.SerializeToString(), weight_bytes(m)


def _feed(seed: int) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((4, 512)).astype(np.float32)}


@functools.lru_cache(maxsize=None)
def _reference(seed: int):
    import onnxruntime as ort
    return ort.InferenceSession(_model()[0], providers=["CPUExecutionProvider"]).run(None, _feed(seed))


def _correct(got, seed: int) -> bool:
    want = _reference(seed)
    return len(got) == len(want) and all(g.shape == w.shape and np.allclose(g, w, rtol=RTOL, atol=ATOL)
                                         for g, w in zip(got, want))


def _session(split: bool = True, vmm: bool = True, policy: str = "planned"):
    from ..session import OffloadSession
    data, weights = _model()
    kw = dict(weight_bytes=weights // 3) if split else {}
    return OffloadSession(data, providers=["CPUExecutionProvider"], offload=True, vmm=vmm, vram_limit="256MiB",
                          policy=policy, **kw)


def _closing_leaks(s, fds: Optional[int] = None) -> int:
    """What closing the session leaves behind: committed bytes, handles, the folder,
    invariant breaks, descriptors."""
    import gc

    from ..stats import invariant_violations
    workdir = s._workdir
    final = s.close()
    arena = s.stats().arena
    leaks = int(final is None or final.committed != 0) + int(arena.live_handles != 0)
    leaks += int(arena.handles_created != arena.handles_released) + len(invariant_violations(arena))
    leaks += int(os.path.exists(workdir))
    if fds is not None:
        gc.collect()
        leaks += int(len(os.listdir("/proc/self/fd")) != fds)
    return leaks


def _result(attempts=0, clear_errors=0, wrong_outputs=0, leaks=0, **notes) -> dict:
    return dict(attempts=attempts, clear_errors=clear_errors, wrong_outputs=wrong_outputs, leaks=leaks, notes=notes)


def _rig(budget: int, granularity: int = 64 << 10):
    from .. import _core
    backend = _core.make_host_backend(granularity)
    ledger = _core.BudgetOwner(budget)
    return backend, ledger, _core.Arena(backend, ledger, zone_va_bytes=1 << 36), backend.create_stream()


def _slot(arena, key: str, n: int, seed: int, keep: dict):
    from .._core import WeightSlot
    s = WeightSlot(arena, key, n)
    keep[key] = data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    s.set_source(data.ctypes.data, n)
    return s


def _reads_back(backend, stream, slot, keep) -> bool:
    from ..memory import read_bytes
    return bool(np.array_equal(read_bytes(backend, stream, slot.va, slot.length), keep[slot.key]))


class Churn:
    """Random evictions and page-ins of a set of slots; when the budget refuses a page-in,
    the oldest resident slot is evicted. Every `every` page-ins, `check(page_ins, slot)`
    runs after the last page-in's copy is done."""

    def __init__(self, slots, stream, seed: int = 1):
        self.slots, self.stream = slots, stream
        self.rng = np.random.default_rng(seed)
        self.resident: list = []  # oldest first
        self.page_ins = self.refusals = 0

    def run(self, cycles: int, check, every: int = 500) -> None:
        from .._core import WeightSlot
        from ..errors import BudgetExceeded
        while self.page_ins < cycles:
            s = self.slots[int(self.rng.integers(len(self.slots)))]
            if s.state != "evicted":
                if self.rng.random() < 0.5:
                    WeightSlot.evict([s])
                    self.resident.remove(s)
                continue
            while True:
                try:
                    ev = WeightSlot.page_in([s], "weights", self.stream)
                    break
                except BudgetExceeded:
                    self.refusals += 1
                    WeightSlot.evict([self.resident.pop(0)])
            self.resident.append(s)
            self.page_ins += 1
            if self.page_ins % every == 0:
                ev.synchronize()
                check(self.page_ins, s)

    def evict_all(self) -> None:
        from .._core import WeightSlot
        WeightSlot.evict(self.resident)
        self.resident = []


def soak_sizes(g: int) -> list:
    """Slot sizes around the granule `g`: below, at, across and many times it."""
    return [100, 4096, g - 1, g, g + 1, 2 * g, 3 * g - 7, 5 * g, 40_000, 2 * g + 256]


# ---------------------------------------------------------------- the scenarios (children)

def soak_arena(cycles: str = "10000") -> dict:
    from ..stats import invariant_violations
    fds = len(os.listdir("/proc/self/fd"))
    backend, ledger, arena, stream = _rig(8 * (64 << 10))
    keep = {}
    slots = [_slot(arena, f"w{i}", n, i, keep) for i, n in enumerate(soak_sizes(backend.granularity))]
    tally = {"wrong": 0, "leaks": 0}

    def check(_, s):
        tally["wrong"] += not _reads_back(backend, stream, s, keep)
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
    return _result(done, 0, wrong, leaks)


def soak_session(vmm: str = "1", steps: str = "200") -> dict:
    fds = len(os.listdir("/proc/self/fd"))
    s = _session(True, vmm == "1", "lru")
    wrong = sum(not _correct(s.run(None, _feed(i % 5)), i % 5) for i in range(int(steps)))
    return _result(int(steps), 0, wrong, _closing_leaks(s, fds))


def faults() -> dict:
    """A create, map or set_access failure at every position of a page-in of four slots,
    then the same at the session level."""
    from .._core import WeightSlot
    from ..errors import OffloadError
    from ..stats import invariant_violations
    attempts = clear = wrong = leaks = 0
    for op in ("create", "map", "set_access"):
        for after in range(1, 100):
            backend, ledger, arena, stream = _rig(64 * (64 << 10))
            keep, g = {}, backend.granularity
            slots = [_slot(arena, k, n, i, keep) for i, (k, n) in enumerate(
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
            wrong += sum(not _reads_back(backend, stream, s, keep) for s in slots)
            del slots
            arena.close()
            leaks += int(ledger.committed != 0)
            if done:
                break
    for vmm, ops in ((True, ("map", "set_access")), (False, ("plain_alloc",))):
        s = _session(True, vmm, "lru")
        backend = s.device.backend
        for op in ops:
            for after in range(1, 8):
                attempts += 1
                backend.inject_failure(op, after)
                try:
                    wrong += not _correct(s.run(None, _feed(after)), after)
                except OffloadError:
                    clear += 1
                finally:
                    backend.inject_failure(op, 1 << 60)
                wrong += not _correct(s.run(None, _feed(50 + after)), 50 + after)
        leaks += _closing_leaks(s)
    return _result(attempts, clear, wrong, leaks)


def threads(split: str = "1", n: str = "8", steps: str = "20") -> dict:
    import threading

    from ..errors import OffloadError
    s = _session(split == "1", True, "planned")
    counts = dict(wrong=0, clear=0)
    for t in range(int(n)):
        _reference(100 + t)

    def worker(t: int):
        for _ in range(int(steps)):
            try:
                counts["wrong"] += not _correct(s.run(None, _feed(100 + t)), 100 + t)
            except OffloadError:
                counts["clear"] += 1
            except Exception:  # noqa: BLE001 - an untyped error is a wrong outcome
                counts["wrong"] += 1

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(int(n))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return _result(int(n) * int(steps), counts["clear"], counts["wrong"], _closing_leaks(s))


def interrupts(policy: str, vmm: str, count: str = "10") -> dict:
    import _thread
    import random
    import threading

    from ..errors import OffloadError
    rng = random.Random(0)
    s = _session(True, vmm == "1", policy)
    t0 = time.perf_counter()
    s.run(None, _feed(0))
    step = time.perf_counter() - t0
    clear = wrong = leaks = 0
    for _ in range(int(count)):
        timer = threading.Timer(rng.uniform(0, 3 * step), _thread.interrupt_main)
        try:
            timer.start()
            while True:
                s.run(None, _feed(0))
        except KeyboardInterrupt:
            pass
        except Exception:  # noqa: BLE001 - an uninterrupted step failed
            wrong += 1
        timer.join()
        try:
            wrong += not _correct(s.run(None, _feed(1)), 1)
        except OffloadError as e:
            clear += 1
            leaks += "while evicted" in str(e)
        except Exception:  # noqa: BLE001 - an untyped error
            wrong += 1
    return _result(int(count), clear, wrong, leaks + _closing_leaks(s))


def fork() -> dict:
    from ..errors import StateError
    s = _session(True, True, "lru")
    s.run(None, _feed(0))
    _reference(5)
    pid = os.fork()
    if pid == 0:  # 0: worked, 1: a clear StateError, 2: wrong, 3: another error
        code = 0
        for fn in (lambda: _correct(s.run(None, _feed(5)), 5), lambda: getattr(s.close(), "committed", 0) == 0):
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
    wrong = int(code in (2, 3) and not hung) + sum(not _correct(s.run(None, _feed(i)), i) for i in (5, 6))
    return _result(3, int(code == 1), wrong, _closing_leaks(s), child_hung=hung)


def bad_inputs() -> dict:
    from ..errors import BudgetExceeded, CorruptModel, OffloadError, StateError
    from ..session import OffloadSession
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument
    typed = (InvalidArgument, ValueError, TypeError, OffloadError)
    x = _feed(3)["x"]
    s = _session(True)
    data = _model()[0]
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
        wrong += not _correct(s.run(None, _feed(4)), 4)
    os.environ["ONNX_GENAI_WEIGHT_OFFLOAD"] = "maybe"
    try:
        OffloadSession(data, providers=["CPUExecutionProvider"])
        wrong += 1
    except ValueError:
        clear += 1
    finally:
        del os.environ["ONNX_GENAI_WEIGHT_OFFLOAD"]
    leaks = _closing_leaks(s)
    try:
        s.get_inputs()
        wrong += 1
    except StateError:
        clear += 1
    return _result(len(cases) + 2, clear, wrong, leaks)


CHILDREN: Dict[str, Callable[..., dict]] = {f.__name__: f for f in
                                            (soak_arena, soak_session, faults, threads, interrupts, fork, bad_inputs,
                                             *reliability_trust.CHILDREN, *reliability_hostile.CHILDREN)}

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
    *reliability_trust.SCENARIOS,
    *reliability_hostile.SCENARIOS,
]


# ---------------------------------------------------------------- the parent

def run_scenario(child: str, args=(), timeout: float = 60) -> dict:
    """One child: its counts, plus crashes and hangs as the parent saw them."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "onnx_offload.tools.reliability", child, *args]
    try:
        # `-m` puts the working folder first on the path: run where this very package lies, so
        # that the child imports it (and not a source tree the parent was started in).
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=here)
    except subprocess.TimeoutExpired:
        return dict(_result(1), crashes=0, hangs=1, seconds=round(time.perf_counter() - t0, 2))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        why = signal.Signals(-proc.returncode).name if proc.returncode < 0 else proc.stderr.strip()[-300:]
        return dict(_result(1, error=why), crashes=1, hangs=0, seconds=round(time.perf_counter() - t0, 2))
    return dict(json.loads(lines[-1]), crashes=0, hangs=0, seconds=round(time.perf_counter() - t0, 2))


def run_all(only: Optional[str] = None) -> dict:
    """Every scenario (or those whose label contains `only`), by row label."""
    return {label: run_scenario(child, args, timeout) for label, child, args, timeout in SCENARIOS
            if only is None or only in label}


def print_table(results: dict) -> str:
    rows = [[label] + [r[c] for c in COLUMNS] + [f"{r['seconds']:.1f}"] for label, r in results.items()]
    totals = ["total"] + [sum(r[c] for r in results.values()) for c in COLUMNS] + [""]
    text = table(rows + [totals], ("scenario", "attempts", "clear errors", "crashes", "wrong outputs", "leaks",
                                   "hangs", "s"))
    bad = [label for label, r in results.items() if r["crashes"] or r["wrong_outputs"] or r["leaks"] or r["hangs"]]
    return text + ("\n\nfailing: " + "; ".join(bad) if bad else "\n\nevery scenario held")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(json.dumps(CHILDREN[argv[0]](*argv[1:])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
