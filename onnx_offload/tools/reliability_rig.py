"""What the reliability bench's children share: the small MLP they run and its reference
outputs, a session of it under a budget, the leaks a closed session leaves, the counts a
child returns, and an arena on the host backend with slots that churn under its budget.
"""
from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import numpy as np

RTOL, ATOL = 1e-5, 1e-6


def package_parent() -> str:
    """The folder that holds this onnx_offload package: a child started there (``-m`` or
    ``-c`` put the working folder first on the path) imports this very package, not a source
    tree or an installed copy the parent's folder would give it."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=None)
def mlp_model() -> Tuple[bytes, int]:
    """The bench's 8-layer MLP, serialized, and its weight bytes."""
    from ..models import mlp_stack, weight_bytes
    m = mlp_stack(layers=8, hidden=512, batch=4)
    return m.SerializeToString(), weight_bytes(m)


def feed(seed: int) -> dict:
    """The MLP's input for `seed`."""
    return {"x": np.random.default_rng(seed).standard_normal((4, 512)).astype(np.float32)}


@functools.lru_cache(maxsize=None)
def reference(seed: int):
    """Plain ORT's outputs for feed(seed), computed once."""
    import onnxruntime as ort
    return ort.InferenceSession(mlp_model()[0], providers=["CPUExecutionProvider"]).run(None, feed(seed))


def correct(got, seed: int) -> bool:
    """Whether `got` are plain ORT's outputs for feed(seed)."""
    want = reference(seed)
    return len(got) == len(want) and all(g.shape == w.shape and np.allclose(g, w, rtol=RTOL, atol=ATOL)
                                         for g, w in zip(got, want))


def mlp_session(split: bool = True, vmm: bool = True, policy: str = "planned"):
    """A session of the MLP on the host backend; `split`: a third of its weights fit at once."""
    from ..session import OffloadSession
    data, weights = mlp_model()
    kw = dict(weight_bytes=weights // 3) if split else {}
    return OffloadSession(data, providers=["CPUExecutionProvider"], offload=True, vmm=vmm, vram_limit="256MiB",
                          policy=policy, **kw)


def closing_leaks(s, fds: Optional[int] = None) -> int:
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


def result(attempts=0, clear_errors=0, wrong_outputs=0, leaks=0, **notes) -> dict:
    """The counts a child prints; the parent adds crashes and hangs."""
    return dict(attempts=attempts, clear_errors=clear_errors, wrong_outputs=wrong_outputs, leaks=leaks, notes=notes)


def host_rig(budget: int, granularity: int = 64 << 10):
    """(backend, ledger, arena, stream) on the host backend, under `budget` bytes."""
    from .. import _core
    backend = _core.make_host_backend(granularity)
    ledger = _core.BudgetOwner(budget)
    return backend, ledger, _core.Arena(backend, ledger, zone_va_bytes=1 << 36), backend.create_stream()


def make_slot(arena, key: str, n: int, seed: int, keep: dict):
    """A slot of `n` random bytes, its source kept in `keep` under `key`."""
    from .._core import WeightSlot
    s = WeightSlot(arena, key, n)
    keep[key] = data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    s.set_source(data.ctypes.data, n)
    return s


def reads_back(backend, stream, slot, keep) -> bool:
    """Whether the resident slot holds its source's bytes."""
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
