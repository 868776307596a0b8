"""The arena's pool (handles it unmapped and keeps for reuse) counts as taken: memory charged
from outside the arena (ORT's own, the streaming ring's, an expert's pages) gives the pool
back first, so the device never holds more than its budget."""
import pytest

from onnx_offload.config import OffloadConfig
from onnx_offload.errors import BudgetExceeded
from onnx_offload.memory import Device, OrtMemoryMeter

G = 64 * 1024


def _device_with_a_full_pool():
    dev = Device("host", OffloadConfig(vram_limit=16 * G, host_granularity=G))
    dev.ledger.set_zone("weights", allowance=16 * G, reserve=0)
    dev.ledger.set_zone("scratch", allowance=16 * G, reserve=0)
    va = dev.arena.carve("weights", 12 * G)
    dev.arena.commit("weights", [(va, 12 * G)], 12 * G)
    dev.arena.decommit("weights", [(va, 12 * G)], 12 * G)
    assert dev.ledger.snapshot().pooled == 12 * G  # idle, kept for reuse
    return dev, va


def test_ort_memory_charged_beside_the_arenas_pool_keeps_the_device_within_its_budget():
    dev, va = _device_with_a_full_pool()
    try:
        free, _ = dev.mem_info()
        taken = [0]
        dev.free_memory_hook = lambda: free - taken[0]  # plays ORT taking device memory
        meter = OrtMemoryMeter(dev)
        mark = meter.mark()
        taken[0] = 8 * G
        assert meter.charge_since(mark, creating=True) >= 8 * G
        snap = dev.ledger.snapshot()
        assert snap.committed + snap.pooled <= snap.budget
        assert snap.peak_committed <= snap.budget
        dev.free_memory_hook = None
        meter.refund()
        assert dev.ledger.snapshot().committed == 0
        dev.arena.release(va)
    finally:
        dev.close()


def test_a_charge_beyond_the_budget_is_refused_as_before_and_keeps_the_ledger():
    dev, va = _device_with_a_full_pool()
    try:
        dev.charge_outside("scratch", 8 * G)
        with pytest.raises(BudgetExceeded):
            dev.charge_outside("scratch", 9 * G)
        snap = dev.ledger.snapshot()
        assert snap.committed == 8 * G and snap.peak_committed <= snap.budget
        dev.ledger.refund("scratch", 8 * G, True)
        dev.arena.release(va)
    finally:
        dev.close()
