"""Graph capture against the arena: no map inside a captured region, and a replay
after a remap reads the new contents. The host backend captures its streams into
host graphs; the CUDA backend is driven through cuda-python."""
import numpy as np
import pytest

from conftest import MiB, Rig, make_slot, page_in
from onnx_offload import StateError, WeightSlot, _core


@pytest.fixture
def host_rig():
    rig = Rig("host", 256 * MiB)
    yield rig
    rig.arena.close()


@pytest.fixture
def cuda_rig():
    rig = Rig("cuda", 256 * MiB)
    yield rig
    rig.arena.close()


def test_host_map_inside_capture_is_refused(host_rig):
    rig = host_rig
    rig.arena.guard_capture(rig.stream)
    s = make_slot(rig, "w", 1000, 3)
    _core.host_begin_capture(rig.stream)
    with pytest.raises(StateError, match="capturing"):
        WeightSlot.page_in([s], "weights", rig.stream)
    _core.host_end_capture(rig.stream)
    assert s.state == "evicted" and rig.ledger.committed == 0
    assert rig.arena.stats().capture_refusals == 1
    page_in(rig, [s])  # outside the captured region it maps


def test_host_replay_reads_new_contents_after_remap(host_rig):
    rig = host_rig
    g = rig.g
    a = make_slot(rig, "a", 2 * g, 0x11, align=g)
    b = make_slot(rig, "b", 2 * g, 0x22, align=g)
    page_in(rig, [a])
    out = np.zeros(2 * g, dtype=np.uint8)
    _core.host_begin_capture(rig.stream)
    rig.backend.copy_d2h(out.ctypes.data, a.va, 2 * g, rig.stream)
    graph = _core.host_end_capture(rig.stream)
    assert graph.size == 1 and not out.any()  # captured, not run
    WeightSlot.evict([a])
    page_in(rig, [b])  # b takes a's physical pages
    new = np.full(2 * g, 0x77, dtype=np.uint8)
    a.set_source(new.ctypes.data, new.nbytes)
    page_in(rig, [a])  # a comes back on other physical memory, same address
    graph.launch(rig.stream)
    rig.stream.synchronize()
    assert np.all(out == 0x77)


def _cu():
    from cuda.bindings import driver as cu
    return cu


def _check(result):
    """cuda-python returns (CUresult, values...): assert success, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    assert int(err) == 0, f"CUDA driver error {err}"
    return values[0] if len(values) == 1 else (tuple(values) or None)


@pytest.mark.gpu
def test_cuda_map_inside_capture_is_refused(cuda_rig):
    rig = cuda_rig
    cu = _cu()
    rig.arena.guard_capture(rig.stream)
    s = make_slot(rig, "w", 4096, 3)
    stream = cu.CUstream(rig.stream.native)
    _check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
    with pytest.raises(StateError, match="capturing"):
        WeightSlot.page_in([s], "weights", rig.stream)
    graph = _check(cu.cuStreamEndCapture(stream))
    _check(cu.cuGraphDestroy(graph))
    assert rig.arena.stats().capture_refusals == 1 and rig.ledger.committed == 0
    page_in(rig, [s])


@pytest.mark.gpu
def test_cuda_graph_replay_reads_new_contents_after_remap(cuda_rig):
    rig = cuda_rig
    cu = _cu()
    g = rig.g
    a = make_slot(rig, "a", 2 * g, 0x11, align=g)
    b = make_slot(rig, "b", 2 * g, 0x22, align=g)
    page_in(rig, [a])
    handle_before = _check(cu.cuMemRetainAllocationHandle(a.va))
    out = rig.arena.plain_alloc("scratch", 2 * g)
    stream = cu.CUstream(rig.stream.native)
    _check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
    _check(cu.cuMemcpyDtoDAsync(out, a.va, 2 * g, stream))
    graph = _check(cu.cuStreamEndCapture(stream))
    exe = _check(cu.cuGraphInstantiate(graph, 0))
    WeightSlot.evict([a])
    page_in(rig, [b])
    new = np.full(2 * g, 0x77, dtype=np.uint8)
    a.set_source(new.ctypes.data, new.nbytes)
    page_in(rig, [a])
    handle_after = _check(cu.cuMemRetainAllocationHandle(a.va))
    assert int(handle_after) != int(handle_before)  # other physical memory, same address
    _check(cu.cuGraphLaunch(exe, stream))
    rig.stream.synchronize()
    assert np.all(rig.read(out, 2 * g) == 0x77)
    for h in (handle_before, handle_after):
        _check(cu.cuMemRelease(h))  # the retains above
    _check(cu.cuGraphExecDestroy(exe))
    _check(cu.cuGraphDestroy(graph))
    rig.arena.plain_free(out)


@pytest.mark.gpu
def test_cuda_steady_state_creates_nothing_cross_checked_by_the_driver():
    cu = _cu()
    rig = Rig("cuda", 64 * MiB)
    try:
        g = rig.g
        slots = [make_slot(rig, f"w{i}", 8 * g, i, align=g) for i in range(6)]
        for s in slots:  # warm-up: the pool fills
            page_in(rig, [s], "transient")
            WeightSlot.evict([s])
        free_before, _ = _check(cu.cuMemGetInfo())
        counters = rig.backend.counters()
        for _ in range(3):
            for s in slots:
                page_in(rig, [s], "transient")
                assert np.all(rig.read(s.va, 16) == slots.index(s))
                WeightSlot.evict([s])
        free_after, _ = _check(cu.cuMemGetInfo())
        now = rig.backend.counters()
        assert now.creates == counters.creates and now.releases == counters.releases
        assert int(free_after) == int(free_before)  # the driver saw no new physical memory either
    finally:
        rig.arena.close()
