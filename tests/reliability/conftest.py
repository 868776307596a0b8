"""Helpers of the reliability suite: models and their reference outputs, a small arena
rig, leak probes, and a runner for the scenarios that may crash or hang (run as child
processes of the test file itself, which print one JSON line of results).

The test files reach these through fixtures. A child process imports this module as
plain ``conftest``: its script's folder comes first on ``sys.path``.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from typing import Optional

import numpy as np
import pytest

MiB = 1 << 20
RTOL, ATOL = 1e-5, 1e-6
BATCH, HIDDEN = 4, 512


# ---------------------------------------------------------------- models and references

@functools.lru_cache(maxsize=None)
def model_bytes() -> bytes:
    """An 8-layer MLP, 8 MiB of weights."""
    from onnx_offload.models import mlp_stack
    return mlp_stack(layers=8, hidden=HIDDEN, batch=BATCH).SerializeToString()


@functools.lru_cache(maxsize=None)
def weights_total() -> int:
    import onnx

    from onnx_offload.models import weight_bytes
    return weight_bytes(onnx.load_from_string(model_bytes()))


@functools.lru_cache(maxsize=None)
def reference_session():
    import onnxruntime as ort
    return ort.InferenceSession(model_bytes(), providers=["CPUExecutionProvider"])


def feed(seed: int) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((BATCH, HIDDEN)).astype(np.float32)}


@functools.lru_cache(maxsize=None)
def _reference(seed: int):
    return reference_session().run(None, feed(seed))


def reference(seed: int):
    return _reference(seed)


def outputs_match(got, seed: int) -> bool:
    want = reference(seed)
    return len(got) == len(want) and all(
        g.shape == w.shape and np.allclose(g, w, rtol=RTOL, atol=ATOL) for g, w in zip(got, want))


def open_session(split: bool = True, *, vmm: bool = True, policy: str = "planned", **kw):
    """A session of the MLP: split into several segments (weights stream under a third of
    their size) or whole."""
    from onnx_offload import OffloadSession
    if split:
        kw.setdefault("weight_bytes", weights_total() // 3)
    s = OffloadSession(model_bytes(), providers=["CPUExecutionProvider"], offload=True, vmm=vmm,
                       vram_limit="256MiB", policy=policy, **kw)
    assert (len(s.segments) > 1) == split, f"expected a {'split' if split else 'whole'} session: {len(s.segments)}"
    return s


# ---------------------------------------------------------------- leak probes

def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def handle_leak(arena_stats) -> Optional[str]:
    """Why the arena's handle counts disagree, or None."""
    a = arena_stats
    if a.handles_created - a.handles_released != a.live_handles:
        return (f"handles_created {a.handles_created} - handles_released {a.handles_released} "
                f"!= live_handles {a.live_handles}")
    return None


# ---------------------------------------------------------------- an arena rig

class Rig:
    """A host backend, a ledger and an arena, as one device would have them."""

    def __init__(self, budget: int, granularity: int = 64 << 10, **arena_kw):
        from onnx_offload import _core
        self.backend = _core.make_host_backend(granularity)
        self.g = self.backend.granularity
        self.ledger = _core.BudgetOwner(budget)
        self.arena = _core.Arena(self.backend, self.ledger, zone_va_bytes=1 << 36, **arena_kw)
        self.stream = self.backend.create_stream()
        self.sources = {}

    def slot(self, key: str, nbytes: int, seed: int):
        """A slot with a host source of random bytes (kept alive as long as the rig)."""
        from onnx_offload import WeightSlot
        s = WeightSlot(self.arena, key, nbytes)
        data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        s.set_source(data.ctypes.data, data.nbytes)
        self.sources[key] = data
        return s

    def page_in(self, slots):
        from onnx_offload import WeightSlot
        ev = WeightSlot.page_in(slots, "weights", self.stream)
        if ev is not None:
            ev.synchronize()

    def reads_back(self, slot) -> bool:
        from onnx_offload.memory.host_store import read_bytes
        return bool(np.array_equal(read_bytes(self.backend, self.stream, slot.va, slot.length),
                                   self.sources[slot.key]))

    def invariants(self) -> dict:
        from onnx_offload.stats import invariant_violations
        return invariant_violations(self.arena.stats())


# ---------------------------------------------------------------- child processes

class ChildResult:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.rc = proc.returncode
        self.stdout, self.stderr = proc.stdout, proc.stderr
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        self.data = json.loads(lines[-1]) if lines else None


def run_child(script: str, *args: str, timeout: float = 60) -> ChildResult:
    """Runs `python script args...`; fails the test on a hang (timeout), a crash (a
    signal), a non-zero exit or a missing result line. The child imports the package
    from where this process imported it (the source tree, or an installed copy)."""
    import onnx_offload
    cmd = [sys.executable, script, *args]
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(onnx_offload.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{' '.join(args)}: hung (no exit within {timeout} s)\n{err[-3000:]}")
    if proc.returncode < 0:
        pytest.fail(f"{' '.join(args)}: crashed with {signal.Signals(-proc.returncode).name}\n{proc.stderr[-3000:]}")
    res = ChildResult(proc)
    if proc.returncode != 0 or res.data is None:
        pytest.fail(f"{' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return res


def emit(result: dict) -> None:
    """A child's result: the last JSON line of its stdout."""
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------- fixtures

@pytest.fixture
def child():
    return run_child


@pytest.fixture
def rig():
    made = []

    def make(budget: int, **kw) -> Rig:
        r = Rig(budget, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        if not r.arena.closed:
            r.arena.close()


@pytest.fixture
def helpers():
    """This module, for the plain helpers (model, feeds, references, probes)."""
    return _THIS


_THIS = sys.modules[__name__]  # bound at import: pytest imports another module as "conftest" too
