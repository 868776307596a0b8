"""Residency policies on synthetic cyclic traces, through the real residency manager
and the host backend: one weight per segment, walked in a cycle like a decode step."""
import numpy as np
import pytest

from onnx_offload import OffloadConfig
from onnx_offload.memory.device import Device
from onnx_offload.memory.host_store import HostStore, read_bytes
from onnx_offload.loading.weights import WeightInfo
from onnx_offload.memory.residency import ResidencyManager
from onnx_offload.stats import invariant_violations

G = 64 << 10


def build(sizes_in_granules, allowance_granules, policy):
    cfg = OffloadConfig(vram_limit=(allowance_granules + max(sizes_in_granules) + 8) * G,
                        weight_bytes=allowance_granules * G, host_granularity=G, scratch_bytes=0)
    dev = Device("host", cfg)
    weights = [WeightInfo(f"w{i}", np.dtype(np.uint8), (n * G,), n * G, 0, i) for i, n in enumerate(sizes_in_granules)]
    store = HostStore(dev.backend, weights)
    for i, w in enumerate(weights):
        store.view(w.name)[:] = i + 1
    dev.ledger.set_zone("transient", allowance=dev.budget, reserve=max(sizes_in_granules) * G)
    mgr = ResidencyManager(dev, store, weights, [[w.name] for w in weights], policy, vmm=True)
    return dev, store, mgr


def walk(dev, mgr, steps, check_data=True):
    per_step = []
    for _ in range(steps):
        hits = mgr.counters.hits
        for k in range(len(mgr.segments)):
            ready = mgr.acquire(k)
            if ready is not None:
                ready.synchronize()
            if check_data:
                name = mgr.segments[k][0]
                slot = mgr.slots[name]
                got = read_bytes(dev.backend, dev.copy_stream, slot.va, 64)
                assert np.all(got == int(name[1:]) + 1)
            ev = dev.backend.create_event()
            ev.record(dev.compute_stream)
            mgr.release(k, ev)
        mgr.end_step()
        per_step.append(mgr.counters.hits - hits)
    return per_step


def finish(dev, store, mgr):
    mgr.close()
    snap = dev.close()
    store.close()
    assert snap.committed == 0
    return snap


def test_lru_gets_no_hits_below_the_full_set():
    dev, store, mgr = build([2] * 8, 14, "lru")  # room for 7 of 8
    hits = walk(dev, mgr, 4)
    assert hits[1:] == [0, 0, 0]
    c = mgr.counters
    assert c.page_ins + c.hits == c.accesses and c.evictions > 0
    finish(dev, store, mgr)


def test_stable_holds_floor_of_budget_over_weight():
    dev, store, mgr = build([2] * 8, 7, "stable")  # floor(7 / 2) = 3 resident
    hits = walk(dev, mgr, 4)
    assert hits[1:] == [3, 3, 3]
    assert mgr.counters.evictions == 0
    assert mgr.counters.bypassed == 5 * 4
    finish(dev, store, mgr)


def test_planned_beats_first_fit_in_resident_bytes():
    sizes = [4, 3, 3, 1]
    results = {}
    for policy in ("stable", "planned"):
        dev, store, mgr = build(sizes, 6, policy)
        walk(dev, mgr, 3)
        results[policy] = mgr.counters
        finish(dev, store, mgr)
    stable, planned = results["stable"], results["planned"]
    assert planned.hit_bytes >= stable.hit_bytes
    assert planned.hit_bytes > stable.hit_bytes  # 3+3 resident beats first-fit's 4+1
    assert planned.evictions == 0


@pytest.mark.parametrize("policy", ["stable", "planned", "lru", "mru"])
def test_counters_add_up_and_invariants_hold(policy):
    dev, store, mgr = build([1, 2, 3, 2, 1, 5, 2], 9, policy)
    walk(dev, mgr, 5)
    c = mgr.counters
    assert c.page_ins + c.hits == c.accesses == 7 * 5
    assert c.hit_bytes <= c.access_bytes and 0 <= c.byte_hit_rate <= 1
    assert invariant_violations(dev.arena.stats()) == {}
    snap = dev.ledger.snapshot()
    assert snap.zones["weights"].committed.peak <= 9 * G
    finish(dev, store, mgr)


def test_mru_keeps_part_of_a_cycle():
    dev, store, mgr = build([2] * 8, 14, "mru")
    hits = walk(dev, mgr, 4)
    assert all(h > 0 for h in hits[1:])
    finish(dev, store, mgr)
