"""Pure bookkeeping: carving, granule refcounts, handle classes. No device involved."""
import math
import random

import pytest

from onnx_offload import StateError, Zone, _core

G = 2 << 20


def test_carve_zero_size_is_rejected():
    a = _core.SpanAllocator(1 << 20)
    with pytest.raises(ValueError, match="zero-size"):
        a.carve(0, 1)


def test_carve_exact_fit_and_exhaustion():
    a = _core.SpanAllocator(4 * G)
    assert a.carve(4 * G, G) == 0
    assert a.free_bytes == 0
    assert a.carve(1, 1) is None
    a.release(0)
    assert a.free_bytes == 4 * G and a.free_blocks == 1


def test_carve_misaligned_tails_and_alignment():
    a = _core.SpanAllocator(1 << 20)
    first = a.carve(100, 1)
    second = a.carve(1000, 256)
    assert first == 0 and second == 256
    third = a.carve(10, 4096)
    assert third == 4096
    with pytest.raises(ValueError, match="power of two"):
        a.carve(10, 3)


def test_carve_overflow_and_oversize():
    a = _core.SpanAllocator(1 << 30)
    assert a.carve((1 << 30) + 1, 1) is None
    with pytest.raises(OverflowError):
        _core.round_up(2**64 - 5, 4096)


def test_release_coalesces_neighbours():
    a = _core.SpanAllocator(1 << 20)
    offs = [a.carve(1000, 1) for _ in range(10)]
    for o in offs[::2]:
        a.release(o)
    assert a.free_blocks == 6  # five holes plus the tail
    for o in offs[1::2]:
        a.release(o)
    assert a.free_blocks == 1 and a.free_bytes == 1 << 20
    with pytest.raises(StateError):
        a.release(offs[0])


def test_granule_shared_by_two_spans_released_after_both():
    m = _core.GranuleMap(G)
    a, b = (0, G + 100), (G + 100, 500)  # both touch granule 1
    assert m.incremental_commit_bytes([a, b]) == 2 * G
    for first, count in m.uncovered_runs([a, b]):
        m.add_extent(first, count, 7, Zone.WEIGHTS)
    m.acquire(Zone.WEIGHTS, [a])
    m.acquire(Zone.WEIGHTS, [b])
    assert m.refs(1) == 2
    assert m.release(Zone.WEIGHTS, [a]) == []  # the extent still backs b
    assert m.refs(1) == 1 and m.mapped_granules == 2
    assert m.release(Zone.WEIGHTS, [b]) == [(0, 2)]
    assert m.mapped_granules == 0


def test_refcount_underflow_is_an_error_and_changes_nothing():
    m = _core.GranuleMap(G)
    m.add_extent(0, 1, 1, Zone.WEIGHTS)
    m.acquire(Zone.WEIGHTS, [(0, 10)])
    with pytest.raises(StateError, match="underflow"):
        m.release(Zone.WEIGHTS, [(0, 10), (0, 10)])
    assert m.underflows == 1 and m.refs(0) == 1


def test_packing_1000_random_slots_commits_at_most_one_extra_granule():
    rng = random.Random(5)
    a = _core.SpanAllocator(1 << 40)
    m = _core.GranuleMap(G)
    ranges, total = [], 0
    for _ in range(1000):
        n = rng.randint(1, 3 * G)
        off = a.carve(n, 256)
        ranges.append((off, n))
        total += n
    committed = m.incremental_commit_bytes(ranges)
    # 256-byte alignment padding is at most 255 bytes a slot.
    assert committed <= (math.ceil((total + 1000 * 255) / G) + 1) * G
