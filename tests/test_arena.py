"""The arena, slots and scratch allocator: one suite, run on the host backend (CPU, in
CI) and on the CUDA backend (marked gpu)."""
import numpy as np
import pytest

from conftest import MiB, make_slot, page_in
from onnx_offload import BudgetExceeded, OffloadError, ScratchAllocator, StateError, WeightSlot


def test_address_is_stable_and_readback_correct_after_remap(rig_factory):
    rig = rig_factory(budget=8 * (2 << 20))
    g = rig.g
    a_data = np.random.default_rng(0).integers(0, 255, 3 * g, dtype=np.uint8)
    a = make_slot(rig, "a", 3 * g, a_data, align=g)
    b = make_slot(rig, "b", 3 * g, 0xBB, align=g)
    va = a.va
    page_in(rig, [a])
    assert a.state == "resident"
    assert np.array_equal(rig.read(a.va, 3 * g), a_data)
    WeightSlot.evict([a])
    assert a.state == "evicted"
    page_in(rig, [b])  # takes a's pooled handles
    created = rig.backend.counters().creates
    page_in(rig, [a])  # so a is backed by different physical memory now
    assert rig.backend.counters().creates > created
    assert a.va == va
    assert np.array_equal(rig.read(a.va, 3 * g), a_data)
    assert np.all(rig.read(b.va, 3 * g) == 0xBB)
    assert rig.invariants() == {}


def test_committed_bytes_return_to_zero_on_close(rig_factory):
    rig = rig_factory()
    slots = [make_slot(rig, f"w{i}", 1000 + i * 777, i) for i in range(20)]
    page_in(rig, slots[:10])
    page_in(rig, slots[10:], zone="transient")
    assert rig.ledger.committed > 0
    rig.arena.close()
    s = rig.ledger.snapshot()
    assert s.committed == 0 and s.pooled == 0
    assert all(z.content.current == 0 for z in s.zones.values())
    del slots  # slots of a closed arena are inert


def test_shared_granule_is_released_after_both_slots(rig_factory):
    rig = rig_factory()
    a = make_slot(rig, "a", 1000, 1)
    b = make_slot(rig, "b", 1000, 2)
    assert a.va // rig.g == b.va // rig.g
    page_in(rig, [a])
    page_in(rig, [b])
    assert rig.ledger.committed == rig.g  # one granule for both
    WeightSlot.evict([a])
    assert rig.ledger.committed == rig.g
    assert np.all(rig.read(b.va, 1000) == 2)
    WeightSlot.evict([b])
    assert rig.ledger.committed == 0


def test_large_ranges_map_with_large_handles_and_one_access_call(rig_factory):
    rig = rig_factory(budget=600 * (2 << 20))
    g = rig.g
    assert rig.arena.handle_classes == [g, 16 * g, 64 * g, 256 * g]
    va = rig.arena.carve("weights", 300 * g, g)
    before = rig.backend.counters()
    rig.arena.commit("weights", [(va, 300 * g)], 300 * g)
    after = rig.backend.counters()
    assert after.maps - before.maps == 1 + 2 + 12  # 256 + 2 * 16 + 12 * 1 granules
    assert after.set_access - before.set_access == 1
    rig.arena.decommit("weights", [(va, 300 * g)], 300 * g)
    assert rig.backend.counters().unmaps - after.unmaps == 1


def test_steady_state_page_ins_create_and_release_nothing(rig_factory):
    rig = rig_factory(budget=8 * (2 << 20))
    g = rig.g
    slots = [make_slot(rig, f"w{i}", 2 * g, i, align=g) for i in range(4)]
    for step in range(4):
        if step == 1:
            warm = rig.backend.counters()
        for s in slots:
            page_in(rig, [s], zone="transient")
            WeightSlot.evict([s])
    now = rig.backend.counters()
    assert now.creates == warm.creates and now.releases == warm.releases
    assert rig.arena.stats().handles_reused >= 12


@pytest.mark.parametrize("op", ["map", "set_access", "create"])
def test_commit_rolls_back_on_injected_failure(rig_factory, op):
    rig = rig_factory(budget=512 * (2 << 20))
    g = rig.g
    keep = make_slot(rig, "keep", g, 7, align=g)
    page_in(rig, [keep])
    va = rig.arena.carve("weights", 20 * g, g)
    ledger_before = rig.ledger.snapshot()
    mapped_before = rig.arena.stats().mapped_bytes
    rig.backend.inject_failure(op, 2 if op != "set_access" else 1)
    with pytest.raises(OffloadError, match="injected failure"):
        rig.arena.commit("weights", [(va, 20 * g)], 20 * g)
    after = rig.ledger.snapshot()
    assert after.zones["weights"].committed.current == ledger_before.zones["weights"].committed.current
    assert after.zones["weights"].content.current == ledger_before.zones["weights"].content.current
    stats = rig.arena.stats()
    assert stats.mapped_bytes == mapped_before and stats.rollbacks == 1
    assert rig.invariants() == {}
    rig.arena.commit("weights", [(va, 20 * g)], 20 * g)  # and the arena still works
    assert np.all(rig.read(keep.va, g) == 7)


def test_budget_refusal_changes_nothing(rig_factory):
    rig = rig_factory(budget=4 * (2 << 20))
    g = rig.g
    big = make_slot(rig, "big", 4 * (2 << 20) + 1, 1)
    small = make_slot(rig, "small", g, 2, align=g)
    page_in(rig, [small])
    with pytest.raises(BudgetExceeded) as e:
        page_in(rig, [big])
    assert e.value.zone == "weights"
    assert big.state == "evicted" and rig.ledger.committed == g
    assert rig.invariants() == {}


def test_decommit_waits_for_the_last_reader(rig_factory):
    rig = rig_factory(budget=1 << 30)
    n = 64 * MiB
    data = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    slot = make_slot(rig, "w", n, data)
    page_in(rig, [slot])
    reader = rig.backend.create_stream()
    outs = [np.empty(n, dtype=np.uint8) for _ in range(4)]
    for out in outs:  # page-locked, so that CUDA copies them asynchronously too
        rig.backend.host_register(out.ctypes.data, n)
    try:
        rig.backend.enqueue_delay(reader, 200)  # the copies start only after the evict below began
        for out in outs:
            rig.backend.copy_d2h(out.ctypes.data, slot.va, n, reader)
        ev = rig.backend.create_event()
        ev.record(reader)
        slot.mark_read(ev)
        assert not ev.query()  # the reader is busy
        WeightSlot.evict([slot])  # must wait: the copies still read the range
        assert ev.query()
        for out in outs:
            assert np.array_equal(out, data)
    finally:
        reader.synchronize()
        for out in outs:
            rig.backend.host_unregister(out.ctypes.data)
    stats = rig.arena.stats()
    assert stats.reader_waits >= 1
    assert stats.unmaps_before_reader == 0


def test_host_waits_are_counted_with_their_time(rig_factory):
    rig = rig_factory(budget=8 * MiB)
    b = rig.backend
    ev = b.create_event()
    before = b.counters()
    b.enqueue_delay(rig.stream, 30)
    ev.record(rig.stream)
    ev.synchronize()  # waits out the delay
    rig.stream.synchronize()
    assert ev.query()  # no wait
    after = b.counters()
    assert after.host_waits - before.host_waits == 2
    assert after.host_wait_ns - before.host_wait_ns >= 25e6
    other = b.create_stream()
    other.close()
    with pytest.raises(StateError, match="closed"):
        other.synchronize()  # refused: no wait, not counted
    assert b.counters().host_waits == after.host_waits


def test_unmap_before_a_running_reader_is_counted(rig_factory):
    """unmaps_before_reader is a real check: skipping the reader wait (a test hook) makes
    it count. The reader's event only follows a delay, so nothing reads the unmapped memory."""
    rig = rig_factory()
    slot = make_slot(rig, "w", rig.g, 5, align=rig.g)  # one extent
    reader = rig.backend.create_stream()

    def evict_under_a_running_reader(skip_wait: bool):
        page_in(rig, [slot])
        rig.backend.enqueue_delay(reader, 300)
        ev = rig.backend.create_event()
        ev.record(reader)
        slot.mark_read(ev)
        rig.arena.debug_skip_reader_wait(skip_wait)
        try:
            WeightSlot.evict([slot])
            return not ev.query()
        finally:
            rig.arena.debug_skip_reader_wait(False)
            ev.synchronize()

    assert not evict_under_a_running_reader(skip_wait=False)
    assert rig.arena.stats().unmaps_before_reader == 0
    assert evict_under_a_running_reader(skip_wait=True)  # the reader was still running after the unmap
    stats = rig.arena.stats()
    assert stats.unmaps_before_reader == 1
    assert rig.invariants() == {"unmaps_before_reader": 1}


def test_slot_state_machine_rejects_illegal_transitions(rig_factory):
    rig = rig_factory()
    s = make_slot(rig, "layer0.weight", 1000, 1)
    with pytest.raises(StateError, match=r"layer0\.weight.*0x[0-9a-f]+.*evicted"):
        WeightSlot.evict([s])
    with pytest.raises(StateError, match="be pinned"):
        s.pin()
    page_in(rig, [s])
    with pytest.raises(StateError, match="be paged in"):
        page_in(rig, [s])
    s.pin()
    with pytest.raises(StateError, match="pinned"):
        WeightSlot.evict([s])
    s.unpin()
    with pytest.raises(StateError, match="be unpinned"):
        s.unpin()
    WeightSlot.evict([s])
    no_source = WeightSlot(rig.arena, "nosrc", 10)
    with pytest.raises(StateError, match="no host source"):
        page_in(rig, [no_source])


def test_scratch_allocator_caches_and_gives_back(rig_factory):
    rig = rig_factory(budget=64 * (2 << 20))
    rig.ledger.set_zone("scratch", allowance=8 * rig.g)
    sa = ScratchAllocator(rig.arena, "scratch")
    p = sa.allocate(1000)
    q = sa.allocate(3000)
    rig.write(q, np.full(3000, 9, np.uint8))
    sa.deallocate(p)
    assert sa.allocate(900) == p  # same size class, reused from the cache
    assert sa.stats().cache_hits == 1
    with pytest.raises(BudgetExceeded):
        sa.allocate(9 * rig.g)
    assert np.all(rig.read(q, 3000) == 9)
    sa.deallocate(q)
    sa.deallocate(p)
    assert sa.empty_cache() == rig.g
    assert rig.ledger.snapshot().zones["scratch"].committed.current == 0
    with pytest.raises(StateError):
        sa.deallocate(12345)


def test_plain_allocations_free_exactly_what_they_took(rig_factory):
    """A plain allocation is charged in whole granules once it is large; freeing one
    must give back that span and nothing of its neighbour's."""
    rig = rig_factory()
    n = 15 * rig.g + 100  # not a whole number of granules, nor of pages
    upper = rig.arena.plain_alloc("weights", n)
    lower = rig.arena.plain_alloc("weights", n)
    rig.write(upper, np.full(n, 7, np.uint8))
    rig.arena.plain_free(lower)
    np.testing.assert_array_equal(rig.read(upper, n), np.full(n, 7, np.uint8))
    rig.arena.plain_free(upper)
    assert rig.ledger.committed == 0 and not rig.invariants()


def test_host_backend_free_memory_is_what_the_kernel_reports_available():
    """vram_limit="auto" and fractions mean on the CPU what they mean on a GPU: free is
    MemAvailable (the page cache the kernel can reclaim counts), not MemFree + Buffers."""
    from onnx_offload import _core
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    free, total = _core.make_host_backend(2 * MiB).mem_info()
    assert total == pytest.approx(info["MemTotal"], rel=0.01)
    # The two reads are a moment apart: the machine's other processes move the figure a little.
    assert free == pytest.approx(info["MemAvailable"], abs=256 * MiB)
    assert free <= total
