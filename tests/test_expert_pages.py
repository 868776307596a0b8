"""Experts read in place with the hot ones on device pages (memory.expert_pages), on the host
backend: the host store's paged region, a stack's stable address mapping host pages and
device pages granule by granule, the ledger's account of them, the picks counted and the
rebalance between steps, faults mid-way, and a session whose stacks are paged."""
import ctypes

import numpy as np
import onnx
import pytest

from onnx_offload import OffloadConfig, OffloadSession
from onnx_offload.errors import CudaDriverError, OffloadError
from onnx_offload.loading import WeightInfo
from onnx_offload.memory import Device, ExpertPages, HostStore, InPlaceNode, ZonePlan
from onnx_offload.models import gpt_oss, weight_bytes

from conftest import reference_greedy

G = 4096
E = 8
ROWS = 3 * G + 1000  # an expert's rows: not whole granules, so neighbours share one


def _bytes_at(va, n):
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(va)).copy()


@pytest.fixture
def rig():
    dev = Device("host", OffloadConfig(vram_limit=64 * G, host_granularity=G))
    dev.set_zones({"weights": ZonePlan(16 * G, 0), "kv": ZonePlan(64 * G, 0), "scratch": ZonePlan(64 * G, 0),
                   "transient": ZonePlan(64 * G, 0)})
    stack = WeightInfo("layer.fc1", np.dtype(np.uint8), (E, ROWS), E * ROWS, 0, 0)
    small = WeightInfo("layer.norm", np.dtype(np.uint8), (64,), 64, 0, 0)
    store = HostStore(dev.backend, [small, stack], paged=["layer.fc1"])
    data = np.random.default_rng(0).integers(0, 256, E * ROWS, dtype=np.uint8)
    store.view("layer.fc1")[:] = data
    store.view("layer.norm")[:] = 7
    pages = ExpertPages(dev, store, [InPlaceNode("router", 2, E, ("layer.fc1",))])
    yield dev, store, pages, data
    pages.close()
    store.close()
    final = dev.close()
    assert final.committed == 0


def _zone(dev):
    return dev.ledger.snapshot().zones["weights"]


def test_the_paged_region_holds_the_stack_apart_and_the_store_reads_it_at_one_address(rig):
    dev, store, pages, data = rig
    assert "layer.fc1" in store.pages.offsets and "layer.norm" not in store.pages.offsets
    assert store.ptr("layer.fc1") == store.device_address("layer.fc1") == store.pages.address("layer.fc1")
    assert store.ptr("layer.fc1") % G == 0
    np.testing.assert_array_equal(_bytes_at(store.ptr("layer.fc1"), E * ROWS), data)
    assert len(store.pages.granules("layer.fc1")) == -(-E * ROWS // G)
    assert (store.view("layer.norm") == 7).all()


def test_the_stack_s_address_reads_its_bytes_whichever_experts_are_on_device_pages(rig):
    dev, store, pages, data = rig
    va = pages.address["layer.fc1"]
    assert va != store.ptr("layer.fc1")
    np.testing.assert_array_equal(_bytes_at(va, E * ROWS), data)  # all host pages
    assert pages.promote((0, 1)) and pages.promote((0, 2))
    dev.compute_stream.synchronize()
    np.testing.assert_array_equal(_bytes_at(va, E * ROWS), data)
    # Experts 1 and 2 share a granule: it is committed once.
    spans = {e: set(range(e * ROWS // G, -(-(e + 1) * ROWS // G))) for e in (1, 2)}
    assert spans[1] & spans[2]
    assert pages.committed == len(spans[1] | spans[2]) * G
    assert _zone(dev).committed.current == pages.committed == _zone(dev).outside
    # A device page is not the host page: writing the host copy leaves expert 1's bytes.
    host = store.view("layer.fc1")
    host[ROWS + 5] ^= 0xFF
    assert _bytes_at(va + ROWS + 5, 1)[0] == data[ROWS + 5]
    host[ROWS + 5] ^= 0xFF
    pages.demote((0, 1))
    assert pages.committed == len(spans[2]) * G  # the shared granule stays for expert 2
    pages.demote((0, 2))
    assert pages.committed == 0 and _zone(dev).committed.current == 0
    np.testing.assert_array_equal(_bytes_at(va, E * ROWS), data)


def test_experts_take_the_zone_s_room_the_most_picked_first_and_no_more(rig):
    dev, store, pages, data = rig
    pages.counts[(0, 5)] = 9
    pages.counts[(0, 3)] = 4
    pages.place()
    assert (0, 5) in pages.resident and (0, 3) in pages.resident
    assert _zone(dev).committed.current <= 16 * G
    assert not pages.promote(next(k for k in pages.counts if k not in pages.resident))  # no room: nothing changes
    assert _zone(dev).committed.current == pages.committed
    dev.compute_stream.synchronize()
    np.testing.assert_array_equal(_bytes_at(pages.address["layer.fc1"], E * ROWS), data)


def test_a_step_s_picks_are_counted_and_the_most_picked_take_the_place_of_colder_ones(rig):
    dev, store, pages, data = rig
    pages.place()
    resident = set(pages.resident)
    cold = sorted({e for _, e in pages.counts} - {e for _, e in resident})
    assert cold, "the zone holds every expert: the rig must leave some out"
    logits = np.full((1, E), -5.0, np.float32)
    logits[0, cold[0]] = logits[0, cold[-1]] = 5.0
    hits, misses, read = pages.count({"router": logits})
    assert (hits, misses) == (0, 2) and read == 2 * ROWS
    r = sorted(resident)[0][1]
    both = logits.copy()
    both[0, r] = 6.0
    both[0, cold[-1]] = -5.0
    hits, misses, read = pages.count({"router": both})
    assert (hits, misses) == (1, 1) and read == ROWS
    for _ in range(3):
        pages.count({"router": logits})
    moved = pages.rebalance()
    assert moved >= 1 and (0, cold[0]) in pages.resident
    assert _zone(dev).committed.current == pages.committed <= 16 * G
    dev.compute_stream.synchronize()
    np.testing.assert_array_equal(_bytes_at(pages.address["layer.fc1"], E * ROWS), data)


@pytest.mark.parametrize("op", ["create", "map", "set_access"])
def test_a_fault_while_an_expert_moves_in_leaves_the_ledger_and_the_bytes_whole(rig, op):
    dev, store, pages, data = rig
    assert pages.promote((0, 0))
    before = (set(pages.resident), pages.committed, _zone(dev).committed.current)
    dev.backend.inject_failure(op, after=2 if op == "create" else 1)
    with pytest.raises((CudaDriverError, OffloadError, OSError)):
        pages.promote((0, 4))
    assert (set(pages.resident), pages.committed, _zone(dev).committed.current) == before
    dev.compute_stream.synchronize()
    np.testing.assert_array_equal(_bytes_at(pages.address["layer.fc1"], E * ROWS), data)
    assert pages.promote((0, 4))  # and it works once the fault is gone
    dev.compute_stream.synchronize()
    np.testing.assert_array_equal(_bytes_at(pages.address["layer.fc1"], E * ROWS), data)


def test_close_gives_every_page_and_handle_back(rig):
    dev, store, pages, data = rig
    pages.place()
    pages.close()
    assert _zone(dev).committed.current == 0 and pages.committed == 0
    store.close()
    c = dev.backend.counters()
    assert c.creates == c.releases and c.maps == c.unmaps


def test_a_cpu_session_whose_stacks_are_paged_gives_plain_ort_s_tokens():
    """experts="in_place" on the CPU: the stacks are held in the paged region, which the
    segments copy from (the streaming engine that reads them in place is CUDA's)."""
    model = gpt_oss(max_length=64)
    ids = np.random.default_rng(0).integers(0, 97, (1, 6))
    want = reference_greedy(model, ids, 6)
    with OffloadSession(model.SerializeToString(), providers=["CPUExecutionProvider"], host_granularity=4096,
                        vram_limit="64MiB", offload=True, vmm=True, weight_bytes=int(weight_bytes(model) * 0.3),
                        experts="in_place") as s:
        assert s._store.pages.offsets, "no stack was paged"
        np.testing.assert_array_equal(s.generate(ids, 6), want)
        final = s.close()
    assert final.committed == 0


@pytest.mark.parametrize("quant", [None, "int4"])
def test_the_routers_as_extra_outputs_leave_the_tokens_and_have_the_node_s_type(quant):
    """The streaming engine adds each MoE (or QMoE, int4) node's router values to the
    graph's outputs, to count the picks: the copy runs in plain ORT with the same tokens,
    and each router output is [tokens, experts] of the node's float type."""
    import onnxruntime as ort
    from onnx_offload.engines.in_place import in_place_nodes, with_router_outputs
    model = gpt_oss(max_length=64, hidden=128, heads=8, expert_intermediate=128,
                    **({"quant": quant} if quant else {}))
    infos = []
    for i, t in enumerate(model.graph.initializer):
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
        infos.append(WeightInfo(t.name, dtype, tuple(t.dims), int(np.prod(t.dims)) * dtype.itemsize, 0, i))
    stacks = [w.name for w in infos if w.name.endswith((".fc1", ".fc2"))]
    assert stacks

    class Paged:  # what in_place_nodes reads of the store's paged region
        offsets = dict.fromkeys(stacks, 0)
    nodes = in_place_nodes(model, infos, stacks, Paged)
    assert len(nodes) == 2 and all(set(n.stacks) <= set(stacks) for n in nodes)
    copy = with_router_outputs(model, nodes, infos)
    assert len(model.graph.output) + 2 == len(copy.graph.output)
    ids = np.random.default_rng(3).integers(0, 97, (2, 5))
    np.testing.assert_array_equal(reference_greedy(copy, ids, 5), reference_greedy(model, ids, 5))
    s = ort.InferenceSession(copy.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = {o.name: o for o in s.get_outputs()}
    for n in nodes:
        assert outs[n.router].type == "tensor(float)"


@pytest.mark.parametrize("op, after", [("create", 3), ("map", 2), ("set_access", 1)])
def test_a_fault_while_the_paged_region_is_made_leaves_nothing_mapped_or_held(op, after):
    dev = Device("host", OffloadConfig(vram_limit=64 * G, host_granularity=G))
    stack = WeightInfo("layer.fc1", np.dtype(np.uint8), (E, ROWS), E * ROWS, 0, 0)
    dev.backend.inject_failure(op, after=after)
    with pytest.raises((CudaDriverError, OffloadError, OSError)):
        HostStore(dev.backend, [stack], paged=["layer.fc1"])
    c = dev.backend.counters()
    assert c.creates == c.releases and c.maps == c.unmaps
    dev.close()
