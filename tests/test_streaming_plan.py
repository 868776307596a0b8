"""The streaming engine's layout (a pure function) and when the engine runs: on CUDA,
with stable addresses, graphs on and a fixed resident set; the CPU execution provider
runs segments, and asking it for the engine is a clear error."""
import dataclasses

import numpy as np
import pytest

from onnx_offload import OffloadConfig, OffloadSession
from onnx_offload.engines.graph_capture import GraphCaptureDecision
from onnx_offload.loading.weights import WeightInfo
from onnx_offload.models import mlp_stack, weight_bytes
from onnx_offload.memory.slots import slot_kind
import onnx_offload.engines.stream_plan as stream_plan
from onnx_offload.engines.stream_plan import (RING_FRACTION, RING_SLACK, StreamingUnavailable, choose_engine,
                                              leading_copies, plan_copies, plan_stream, ring_by_reads)

MiB = 1 << 20
G = 2 * MiB


def tinyllama_weights():
    """The weights of a TinyLlama-shape decoder (fp16) in the order the model reads them."""
    sizes = [("embed", 32000 * 2048 * 2)]
    for i in range(22):
        sizes += [(f"l{i}.q", 2048 * 2048 * 2), (f"l{i}.k", 2048 * 256 * 2), (f"l{i}.v", 2048 * 256 * 2),
                  (f"l{i}.o", 2048 * 2048 * 2), (f"l{i}.gate", 2048 * 5632 * 2), (f"l{i}.up", 2048 * 5632 * 2),
                  (f"l{i}.down", 5632 * 2048 * 2)]
    sizes += [("rotary", 2048 * 32 * 2), ("lm_head", 32000 * 2048 * 2)]
    return [WeightInfo(n, np.dtype(np.float16), (b // 2,), b, 0, i) for i, (n, b) in enumerate(sizes)]


def cost(weights):
    size = {w.name: w.nbytes for w in weights}
    return lambda names: slot_kind(True).packed_cost([size[n] for n in names], G)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("policy", ["planned", "stable"])
def test_layout_fills_the_budget_with_a_small_ring(fraction, policy):
    weights = tinyllama_weights()
    total = sum(w.nbytes for w in weights)
    allowance = int(total * fraction)
    plan = plan_stream(weights, allowance, G, cost(weights), policy, shared=["rotary"])
    size = {w.name: w.nbytes for w in weights}
    resident = sum(size[n] for n in plan.resident)
    assert "rotary" in plan.resident
    assert cost(weights)(plan.resident) + plan.ring_bytes <= allowance
    # Every unit is one weight, at most a layer; the ring holds the largest streamed one
    # and RING_SLACK spare granules.
    assert all(len(u.names) == 1 for u in plan.units)
    largest = max(size[n] for n in plan.streamed)
    assert plan.ring_bytes >= largest + RING_SLACK * G and plan.ring_bytes % G == 0
    assert plan.ring_bytes <= max(-(-largest // G) * G + RING_SLACK * G, -(-int(allowance * RING_FRACTION) // G) * G)
    assert set(plan.resident) | set(plan.streamed) == set(size) and not set(plan.resident) & set(plan.streamed)
    if policy == "planned":
        # The byte hit rate against what the weights budget allows: the ring holds one MLP
        # weight and a spare granule (24 MiB, under 5% of the budget at 25%); the fill
        # leaves room only where more bytes would cost more copies than they save.
        assert resident / total >= 0.95 * allowance / total, (resident / total, fraction)
        assert "lm_head" in plan.resident and "embed" in plan.resident  # the largest first
    else:
        assert "embed" in plan.resident  # the model's first weights


@pytest.mark.parametrize("fraction", [0.5, 0.75, 0.9])
def test_planned_streams_weights_spread_over_the_step(fraction):
    # Copies overlap compute only where there is compute left to overlap: the streamed
    # weights of each size are spread over the read order, not bunched at its end.
    weights = tinyllama_weights()
    allowance = int(sum(w.nbytes for w in weights) * fraction)
    plan = plan_stream(weights, allowance, G, cost(weights), "planned", shared=["rotary"])
    mlp = sorted(int(n[1:n.index(".")]) for n in plan.streamed if n.endswith((".gate", ".up", ".down")))
    assert mlp, plan.streamed
    layers = sorted(set(mlp))
    # The streamed MLP weights reach from the first third of the layers to the last.
    assert layers[0] < 22 // 3 and layers[-1] >= 2 * 22 // 3, layers
    if len(layers) > 2:
        gaps = np.diff(layers)
        assert gaps.max() <= 2 * 22 / len(layers) + 1, layers


@pytest.mark.parametrize("shared", [["rotary"], []])
def test_the_fill_packs_the_budget_where_the_first_pass_leaves_room(monkeypatch, shared):
    """The first pass stops at the first weight that does not fit; the fill chooses how
    many weights of each size stay resident, so that the budget is used to within about
    a granule, and never holds fewer bytes than the first pass."""
    weights = tinyllama_weights()
    size = {w.name: w.nbytes for w in weights}
    total, packed = sum(size.values()), cost(weights)
    gained = 0
    for pct in range(15, 100):
        allowance = total * pct // 100
        plan = plan_stream(weights, allowance, G, packed, "planned", shared=shared)
        with monkeypatch.context() as m:
            m.setattr(stream_plan, "_fill", lambda order, resident, *rest: resident)
            first = plan_stream(weights, allowance, G, packed, "planned", shared=shared)
        hit, first_hit = (sum(size[n] for n in p.resident) for p in (plan, first))
        assert packed(plan.resident) + plan.ring_bytes <= allowance
        assert hit >= first_hit, pct
        assert allowance - plan.ring_bytes - packed(plan.resident) < 2 * G + allowance % G, pct
        gained += hit > first_hit
    assert gained >= 40  # the fill changed most of these budgets


@pytest.mark.parametrize("policy", ["planned", "stable"])
def test_an_empty_weight_never_streams(policy):
    # It costs no bytes; as a unit of no granules it would have nothing in the ring.
    weights = [WeightInfo("empty", np.dtype(np.float32), (0,), 0, 0, 0),
               WeightInfo("w", np.dtype(np.float32), ((G + 4) // 4,), G + 4, 0, 1)]
    for allowance in (3 * MiB, 4 * MiB, 7830323):
        try:
            plan = plan_stream(weights, allowance, G, cost(weights), policy)
        except StreamingUnavailable:
            continue
        assert "empty" in plan.resident and all(u.granules > 0 for u in plan.units)


def _copy_plan(fraction: float, slack_granules: int = RING_SLACK):
    """The copies of one step of a TinyLlama at `fraction`, each unit read by one node in
    the model's order, with the ring placed by those reads."""
    weights = tinyllama_weights()
    size = {w.name: w.nbytes for w in weights}
    plan = plan_stream(weights, int(sum(size.values()) * fraction), G, cost(weights), "planned", shared=["rotary"])
    units = plan.units
    readers = [[10 * i + 5] for i in range(len(units))]
    copied = list(range(len(units)))
    first_from = {i: readers[i][0] for i in copied}
    ring = plan.ring_bytes // G - RING_SLACK + slack_granules
    for u, r in zip(units, ring_by_reads(units, ring, copied, readers, first_from)):
        u.ring = r
    address, va = {}, 1 << 40
    for u in units:
        address[u.names[0]] = va
        va += (u.granules + 1) * G
    source = {n: (1 << 30) + 7 * i for i, n in enumerate(plan.streamed)}
    reads = {u.names[0]: readers[i] for i, u in enumerate(units)}
    return units, readers, plan_copies(units, readers, copied, first_from, G, address, size, source, reads), \
        address, source, size


def _unit_at(units, address, dst: int) -> int:
    """The unit whose addresses hold `dst`."""
    return max(range(len(units)), key=lambda i: (address[units[i].names[0]] <= dst, address[units[i].names[0]]))


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_the_copies_cover_every_streamed_byte_once_and_wait_for_the_last_reader(fraction):
    units, readers, copies, address, source, size = _copy_plan(fraction)
    by_weight = {}
    for dst, src, n, after, before in copies:
        i = _unit_at(units, address, dst)
        name = units[i].names[0]
        assert src - source[name] == dst - address[name]  # the same offset in the host store
        assert before == readers[i]
        by_weight.setdefault(name, []).append((dst - address[name], n))
    for u in units:
        runs = sorted(by_weight[u.names[0]])
        assert runs[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(runs, runs[1:]))
        assert runs[-1][0] + runs[-1][1] == size[u.names[0]]
    # Before a copy writes a ring granule, every reader of what that granule held has
    # finished: the copy itself waits for them (its own `after`), not through the copies
    # before it, since several may be in flight at once (COPIES_IN_FLIGHT).
    holder = {}
    g_of = {}
    for i, u in enumerate(units):
        for k, gr in enumerate(u.ring):
            g_of[(address[u.names[0]] + k * G)] = (i, gr)
    for dst, src, n, after, before in copies:
        first = dst - dst % G
        for va in range(first, dst + n, G):
            i, gr = g_of[va]
            if gr in holder and holder[gr] != i:
                assert set(readers[holder[gr]]) <= set(after)
        for va in range(first, dst + n, G):
            holder[g_of[va][1]] = g_of[va][0]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_each_copy_starts_in_spare_granules_without_waiting_for_the_weight_before(fraction):
    """With spare granules, the first part of each weight's copy lands where the weight
    copied before it does not lie, so it runs while that weight is read."""
    units, readers, copies, address, _, _ = _copy_plan(fraction)
    starts = {}
    for c in copies:
        starts.setdefault(_unit_at(units, address, c[0]), c)
    for i in range(1, len(units)):
        assert not set(readers[i - 1]) & set(starts[i][3]), (i, starts[i][3])
    # The lead, issued before the step starts: the first weight whole and the start of
    # the second, in the spare granules; no more than the ring holds.
    lead = leading_copies(copies)
    assert not any(c[3] for c in lead) and copies[len(lead)][3]
    first, second = units[0].names[0], units[1].names[0]
    assert sum(c[2] for c in lead if c[0] < address[first] + units[0].granules * G) == units[0].nbytes
    assert 0 < sum(c[2] for c in lead if c[0] >= address[second]) <= RING_SLACK * G
    # Without them, a weight as large as the one before it waits for that one's reader.
    units, readers, copies, address, _, _ = _copy_plan(fraction, slack_granules=0)
    waits = 0
    for c in copies:
        i = _unit_at(units, address, c[0])
        waits += i > 0 and bool(set(readers[i - 1]) & set(c[3]))
    assert waits > 0


@pytest.mark.parametrize("slack", [1, 2])
def test_the_part_of_a_copy_in_spare_granules_is_whole_granules_when_the_last_is_partly_filled(slack):
    """An int4 weight with its scales fills 3 granules and a tenth of a fourth: the part
    of its copy that runs while the weight before it is read is whole granules (the
    unit's first), not the partly filled last one."""
    from onnx_offload.engines.stream_plan import Unit
    size = 3 * G + G // 10
    units = [Unit([f"w{i}"], [0], size, 4) for i in range(8)]
    readers = [[10 * i + 5] for i in range(len(units))]
    copied = list(range(len(units)))
    first_from = {i: readers[i][0] for i in copied}
    for u, r in zip(units, ring_by_reads(units, 4 + slack, copied, readers, first_from)):
        u.ring = r
    address = {u.names[0]: (1 << 40) + 5 * G * i for i, u in enumerate(units)}
    nbytes = {u.names[0]: size for u in units}
    source = {u.names[0]: (1 << 30) + 4 * G * i for i, u in enumerate(units)}
    reads = {u.names[0]: readers[i] for i, u in enumerate(units)}
    copies = plan_copies(units, readers, copied, first_from, G, address, nbytes, source, reads)
    for i in range(1, len(units)):
        base = address[units[i].names[0]]
        mine = [c for c in copies if base <= c[0] < base + 4 * G]
        free = sum(c[2] for c in mine if not set(readers[i - 1]) & set(c[3]))
        assert free == slack * G, (i, [(c[0] - base, c[2], c[3]) for c in mine])
        # and they come first: the copy engine runs them while the weight before is read
        assert not set(readers[i - 1]) & set(mine[0][3])


def test_a_read_order_the_ring_cannot_follow_is_a_clear_error():
    from onnx_offload.engines.stream_plan import Unit
    units = [Unit(["a"], [0], 11 * G, 11), Unit(["b"], [0], 11 * G, 11)]
    readers = [[1, 10], [5]]  # "a" is still read after "b" is first read
    with pytest.raises(StreamingUnavailable, match="too small"):
        ring_by_reads(units, 13, [0, 1], readers, {0: 1, 1: 5})
    units[0].ring, units[1].ring = list(range(11)), list(range(11))
    with pytest.raises(StreamingUnavailable, match="too small"):
        plan_copies(units, readers, [0, 1], {0: 1, 1: 5}, G, {"a": 0, "b": 12 * G}, {"a": 11 * G, "b": 11 * G},
                    {"a": 0, "b": 0}, {"a": [1, 10], "b": [5]})


def test_shared_weights_that_do_not_fit_are_a_clear_error():
    weights = tinyllama_weights()
    with pytest.raises(StreamingUnavailable, match="read by several nodes"):
        plan_stream(weights, 100 * MiB, G, cost(weights), "planned", shared=["embed"])


def test_a_budget_below_the_ring_is_a_clear_error():
    weights = tinyllama_weights()
    with pytest.raises(StreamingUnavailable, match="cannot hold a ring"):
        plan_stream(weights, 10 * MiB, G, cost(weights), "planned")


@pytest.mark.parametrize("policy", ["lru", "mru"])
def test_policies_that_move_the_resident_set_are_refused_by_the_layout(policy):
    weights = tinyllama_weights()
    with pytest.raises(StreamingUnavailable, match=policy):
        plan_stream(weights, 600 * MiB, G, cost(weights), policy)


ON = GraphCaptureDecision(True, "on")


@pytest.mark.parametrize("engine,on_cuda,streaming,stable,capture,policy,want", [
    ("auto", True, True, True, ON, "planned", "graph"),
    ("auto", True, True, True, ON, "stable", "graph"),
    ("auto", True, True, True, ON, "lru", "segments"),
    ("auto", False, True, True, ON, "planned", "segments"),
    ("auto", True, True, False, ON, "planned", "segments"),
    ("auto", True, True, True, GraphCaptureDecision(False, "off"), "planned", "segments"),
    ("auto", True, False, True, ON, "planned", "segments"),
    ("segments", True, True, True, ON, "planned", "segments"),
    ("graph", True, True, True, ON, "planned", "graph"),
])
def test_choose_engine(engine, on_cuda, streaming, stable, capture, policy, want):
    cfg = OffloadConfig(engine=engine, policy=policy)
    assert choose_engine(cfg, on_cuda, streaming, stable, capture) == want


def test_a_decoder_whose_steps_grow_runs_in_segments_unless_the_engine_is_asked_for():
    notes = []
    assert choose_engine(OffloadConfig(), True, True, True, ON, growing_steps=True, notes=notes) == "segments"
    assert len(notes) == 1 and "segments" in notes[0] and "exact length" in notes[0], notes
    with pytest.raises(StreamingUnavailable, match="exact length"):
        choose_engine(OffloadConfig(engine="graph"), True, True, True, ON, growing_steps=True)


def test_engine_from_the_environment_and_bad_values():
    assert OffloadConfig.from_env({"ONNX_OFFLOAD_ENGINE": "segments"}).engine == "segments"
    assert OffloadConfig.from_env({}).engine == "auto"
    with pytest.raises(ValueError, match="ONNX_OFFLOAD_ENGINE"):
        OffloadConfig.from_env({"ONNX_OFFLOAD_ENGINE": "fast"})


def test_asking_the_cpu_for_the_graph_engine_is_a_clear_error():
    m = mlp_stack(layers=4, hidden=256, batch=2)
    with pytest.raises(StreamingUnavailable, match="CPU execution provider runs segments"):
        OffloadSession(m.SerializeToString(), offload=True, vmm=True, weight_bytes=weight_bytes(m) // 2,
                       engine="graph")
    with OffloadSession(m.SerializeToString(), offload=True, vmm=True, weight_bytes=weight_bytes(m) // 2) as s:
        assert s.engine == "segments"


@pytest.mark.parametrize("call", ["run", "generate", "iobinding"])
def test_a_model_the_engine_cannot_capture_moves_to_segments_and_says_so(monkeypatch, call):
    """The engine is built (ring, addresses, one ORT session); when its first step
    cannot be captured (here: the host backend has no device graphs) the session moves
    to segments with a warning, gives back everything the engine held, and answers."""
    import onnx_offload.session as session_module
    from onnx_offload.errors import OffloadWarning
    from onnx_offload.models.decoder import decoder_lm
    from conftest import reference_greedy
    monkeypatch.setattr(session_module, "choose_engine", lambda *a, **kw: "graph")
    model = decoder_lm("gqa", layers=2, hidden=64, max_length=64)
    ids = np.random.default_rng(0).integers(0, 97, (1, 5))
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, 5), np.int64)}
    for i in range(2):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, 2, 0, 16), np.float32)
    import onnxruntime as ort
    want_run = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    with OffloadSession(model.SerializeToString(), offload=True, vmm=True, host_granularity=4096,
                        vram_limit="64MiB", weight_bytes=weight_bytes(model) // 2) as s:
        assert s.engine == "graph"
        with pytest.warns(OffloadWarning, match="run in segments"):
            if call == "run":
                got = s.run(None, feeds)
                for a, b in zip(got, want_run):
                    np.testing.assert_array_equal(a, b)
            elif call == "generate":
                np.testing.assert_array_equal(s.generate(ids, 6), reference_greedy(model, ids, 6))
            else:
                io = s.io_binding()
                for k, v in feeds.items():
                    io.bind_cpu_input(k, v)
                io.bind_output("logits")
                s.run_with_iobinding(io)
                np.testing.assert_array_equal(io.copy_outputs_to_cpu()[0], want_run[0])
        assert s.engine == "segments" and any("run in segments" in n for n in s.stats().notes)
        assert s.stats().ledger.zones["transient"].outside == 0  # the ring went back
        final = s.close()
    assert final.committed == 0


@pytest.mark.parametrize("op,after", [("create", 2), ("map", 3), ("set_access", 2)])
def test_an_engine_that_fails_half_way_gives_everything_back(monkeypatch, op, after):
    """A driver call that fails while the engine maps its ring: the session raises, and
    every physical handle it made is given back."""
    import onnx_offload.memory.device as device_module
    import onnx_offload.session as session_module
    from onnx_offload import OffloadError, _core
    from onnx_offload.models.decoder import decoder_lm
    monkeypatch.setattr(session_module, "choose_engine", lambda *a, **kw: "graph")
    made = []

    def backend(kind, config):
        b = _core.make_host_backend(config.host_granularity)
        made.append(b)
        return b

    monkeypatch.setattr(device_module, "make_backend", backend)
    model = decoder_lm("gqa", layers=2, hidden=64, max_length=64)
    from onnx_offload.engines.stream_ring import Ring
    real_map_ring = Ring.map

    def failing_map_ring(self):
        self.device.backend.inject_failure(op, after)
        real_map_ring(self)

    monkeypatch.setattr(Ring, "map", failing_map_ring)
    with pytest.raises(OffloadError, match="injected failure"):
        OffloadSession(model.SerializeToString(), offload=True, vmm=True, host_granularity=4096,
                       vram_limit="64MiB", weight_bytes=weight_bytes(model) // 2)
    c = made[0].counters()
    assert c.creates == c.releases, c.as_dict()  # the ring's handles and the arena's, all given back


def int4_weights():
    """An int4 TinyLlama-shape decoder as the builder writes it: each MatMulNBits reads
    its packed weight and its scales (one node, one first use), in the host store's order."""
    sizes = [("embed", 32000 * 2048 * 2, 0)]
    node = 1
    for i in range(22):
        for proj, (k, n) in (("q", (2048, 2048)), ("k", (2048, 256)), ("v", (2048, 256)), ("o", (2048, 2048)),
                             ("gate", (2048, 5632)), ("up", (2048, 5632)), ("down", (5632, 2048))):
            sizes += [(f"l{i}.{proj}.B", n * k // 2, node), (f"l{i}.{proj}.scales", n * k // 32 * 2, node)]
            node += 1
    sizes += [("lm_head.B", 32000 * 2048 // 2, node), ("lm_head.scales", 32000 * 2048 // 32 * 2, node)]
    return [WeightInfo(n, np.dtype(np.uint8), (b,), b, 0, use) for n, b, use in sizes]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_the_weights_one_node_reads_stay_or_stream_together_as_the_store_lays_them_out(fraction):
    from onnx_offload.memory.host_store import ALIGN
    weights = int4_weights()
    size = {w.name: w.nbytes for w in weights}
    plan = plan_stream(weights, int(sum(size.values()) * fraction), G, cost(weights), "planned")
    node = {w.name: w.first_use for w in weights}
    resident = set(plan.resident)
    for w in weights:  # a node's weights are all resident or all streamed
        assert all((v.name in resident) == (w.name in resident) for v in weights if v.first_use == w.first_use)
    assert plan.units
    for u in plan.units:
        assert len({node[n] for n in u.names}) == 1 and len(u.names) == 2  # the packed weight and its scales
        assert u.offsets[0] == 0 and u.offsets[1] == -(-size[u.names[0]] // ALIGN) * ALIGN
        assert u.nbytes == u.offsets[1] + size[u.names[1]]
        assert u.granules == -(-u.nbytes // G)
    # The ring holds the largest unit, both of its weights at once, and the spare granules.
    assert plan.ring_bytes == max(u.granules for u in plan.units) * G + RING_SLACK * G
    assert cost(weights)(plan.resident) + plan.ring_bytes <= int(sum(size.values()) * fraction)


def test_a_unit_laid_out_as_the_store_copies_each_run_once():
    weights = int4_weights()
    size = {w.name: w.nbytes for w in weights}
    plan = plan_stream(weights, int(sum(size.values()) * 0.5), G, cost(weights), "planned")
    units = plan.units
    readers = [[10 * i + 5, 10 * i + 6] for i in range(len(units))]
    copied = list(range(len(units)))
    first_from = {i: readers[i][0] for i in copied}
    for u, r in zip(units, ring_by_reads(units, plan.ring_bytes // G, copied, readers, first_from)):
        u.ring = r
    address, va = {}, 1 << 40
    for u in units:
        for n, off in zip(u.names, u.offsets):
            address[n] = va + off
        va += (u.granules + 1) * G
    # Each weight of a unit read by a node of its own (scan hits), so a run's copy waits
    # for them both; the host store as plan_stream laid the units out.
    reads = {n: [readers[i][k]] for i, u in enumerate(units) for k, n in enumerate(u.names)}
    source, at = {}, 1 << 30
    for u in units:
        for n, off in zip(u.names, u.offsets):
            source[n] = at + off
        at += -(-u.nbytes // 4096) * 4096
    copies = plan_copies(units, readers, copied, first_from, G, address, size, source, reads)
    covered = {i: 0 for i in copied}
    for dst, src, n, after, before in copies:
        i = next(i for i, u in enumerate(units) if address[u.names[0]] <= dst < address[u.names[0]] + u.granules * G)
        u = units[i]
        assert src - source[u.names[0]] == dst - address[u.names[0]]
        spanned = [k for k, (name, off) in enumerate(zip(u.names, u.offsets))
                   if off < dst - address[u.names[0]] + n and off + size[name] > dst - address[u.names[0]]]
        assert before == sorted(readers[i][k] for k in spanned)
        covered[i] += n
    assert all(covered[i] == units[i].nbytes for i in copied)  # the gap between the weights included
    assert len(copies) < sum(len(u.names) for u in units)  # fewer copies than weights
    # A store laid out otherwise: a copy per weight and run, as before.
    u = units[0]
    moved = dict(source, **{u.names[1]: source[u.names[1]] + 4096})
    apart = [c for c in plan_copies(units, readers, copied, first_from, G, address, size, moved, reads)
             if address[u.names[0]] <= c[0] < address[u.names[0]] + u.granules * G]
    assert sum(c[2] for c in apart) == size[u.names[0]] + size[u.names[1]]
    assert all(any(moved[n] <= src and src + n_ <= moved[n] + size[n] for n in u.names)
               for _, src, n_, _, _ in apart)
    # Laid out otherwise, a run becomes a copy per weight, and each of them waits itself
    # for the readers of what its ring granules held (copies may be in flight together).
    apart_all = dict(source, **{v.names[1]: source[v.names[1]] + 4096 for v in units if len(v.names) > 1})
    held = {}
    for dst, src, n, after, before in plan_copies(units, readers, copied, first_from, G, address, size, apart_all,
                                                  reads):
        i = next(i for i, v in enumerate(units) if address[v.names[0]] <= dst < address[v.names[0]] + v.granules * G)
        base = address[units[i].names[0]]
        for k in range((dst - base) // G, (dst + n - 1 - base) // G + 1):
            gr = units[i].ring[k]
            if gr in held and held[gr] != i:
                assert set(readers[held[gr]]) <= set(after), (i, k)
        for k in range((dst - base) // G, (dst + n - 1 - base) // G + 1):
            held[units[i].ring[k]] = i


def test_tables_that_only_gathers_read_are_found_and_no_other_weight():
    """The streaming engine reads an embedding in place from host memory: a weight that
    only Gathers of the main graph read, as their table (input 0, axis 0). Not a tied
    embedding that a MatMul reads too, a Gather along another axis, a weight used as the
    indices, one a subgraph reads, or a graph output."""
    from onnx import TensorProto, helper
    from onnx_offload.loading import read_as_tables
    from onnx_offload.models.decoder import decoder_lm
    m = decoder_lm("gqa", max_length=64)
    assert read_as_tables(m, {t.name for t in m.graph.initializer}) == ["embed_tokens"]

    def init(name, shape):
        return helper.make_tensor(name, TensorProto.FLOAT, shape, np.zeros(int(np.prod(shape)), np.float32))

    then = helper.make_graph([helper.make_node("Gather", ["sub_table", "ids"], ["s"])], "then", [],
                             [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 4])])
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["a"]),
        helper.make_node("Gather", ["table", "ids2"], ["a2"]),  # two Gathers: still only rows
        helper.make_node("Gather", ["tied", "ids"], ["b"]),
        helper.make_node("MatMul", ["x", "tied"], ["c"]),
        helper.make_node("Gather", ["columns", "ids"], ["d"], axis=1),
        helper.make_node("Gather", ["x", "index_weight"], ["e"]),
        helper.make_node("If", ["cond"], ["s"], then_branch=then, else_branch=then),
        helper.make_node("Gather", ["sub_table", "ids"], ["f"]),
        helper.make_node("Gather", ["out_table", "ids"], ["g"]),
    ]
    inits = [init("table", [8, 4]), init("tied", [4, 4]), init("columns", [4, 8]), init("sub_table", [8, 4]),
             init("out_table", [8, 4]), helper.make_tensor("index_weight", TensorProto.INT64, [1], [0])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in
                                           [("ids", TensorProto.INT64, [2]), ("ids2", TensorProto.INT64, [2]),
                                            ("x", TensorProto.FLOAT, [2, 4]), ("cond", TensorProto.BOOL, [])]],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                               for n in ("a", "a2", "b", "c", "d", "e", "s", "f", "g", "out_table")], inits)
    model = helper.make_model(graph)
    assert read_as_tables(model, {t.name for t in inits}) == ["table"]


def test_a_table_stays_in_host_memory_only_once_the_weights_stream():
    """The streaming engine's plan reads the embedding in place once other weights stream,
    also where the table alone is over the budget; not where everything else fits beside
    it, not off CUDA, and not a table under one granule."""
    import types
    from onnx_offload.engines.switch import stream_layout
    # An int4 model's shape: the LM head a quarter of the fp16 embedding table.
    weights = [dataclasses.replace(w, nbytes=w.nbytes // 4) if w.name == "lm_head" else w
               for w in tinyllama_weights()]
    total = sum(w.nbytes for w in weights)
    run = types.SimpleNamespace(weights=weights, tables=["embed"], stacks=[], shared=["rotary"])
    at = {f: stream_layout(run, int(total * f), G, cost(weights), "planned", True) for f in (0.03, 0.25, 0.75)}
    for f, layout in at.items():
        assert layout.in_host == ["embed"] and "embed" not in layout.resident + layout.streamed, f
        assert layout.units
    # The table alone (131 MB) is over a budget of 3%: without it in place, no plan.
    assert 0.03 * total < 131 << 20
    with pytest.raises(StreamingUnavailable):
        stream_layout(run, int(total * 0.03), G, cost(weights), "planned", False)
    # Everything fits: nothing streams, and the table stays with the other weights.
    whole = stream_layout(run, 2 * total, G, cost(weights), "planned", True)
    assert whole.in_host == [] and not whole.units and "embed" in whole.resident
    small = [dataclasses.replace(weights[0], nbytes=200)] + weights[1:]
    run_small = types.SimpleNamespace(weights=small, tables=["embed"], stacks=[], shared=["rotary"])
    assert stream_layout(run_small, int(total * 0.25), G, cost(small), "planned", True).in_host == []
    assert stream_layout(run, int(total * 0.25), G, cost(weights), "planned", False).in_host == []


def moe_weights(layers=12, experts=32):
    """A gpt-oss-shape decoder's weights (fp16, hidden 1024, 32 experts) in reading order:
    each layer's attention, router, and one MoE node reading its fc1 and fc2 stacks and
    their biases first (the same first use)."""
    sizes, use = [("embed", 8000 * 1024 * 2, 0)], 1
    for i in range(layers):
        for n, b in ((f"l{i}.qkv", 1024 * 1536 * 2), (f"l{i}.o", 1024 * 1024 * 2), (f"l{i}.router", 1024 * experts * 2)):
            sizes.append((n, b, use))
            use += 1
        sizes += [(f"l{i}.fc1", experts * 2048 * 1024 * 2, use), (f"l{i}.fc1_bias", experts * 2048 * 2, use),
                  (f"l{i}.fc2", experts * 1024 * 1024 * 2, use), (f"l{i}.fc2_bias", experts * 1024 * 2, use)]
        use += 1
    sizes += [("lm_head", 8000 * 1024 * 2, use)]
    return [WeightInfo(n, np.dtype(np.float16), (b // 2,), b, 0, u) for n, b, u in sizes]


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.9])
def test_stacks_of_experts_read_in_place_leave_the_budget_to_the_other_weights_first(fraction):
    """experts="in_place": once the weights stream, each stack of experts stays in host
    memory, read in place, or is resident whole; it never streams. A stack comes back to the
    device only where the budget holds it beside every weight it held without it."""
    import types
    from onnx_offload.engines.switch import stream_layout
    weights = moe_weights()
    size = {w.name: w.nbytes for w in weights}
    total = sum(size.values())
    stacks = [w.name for w in weights if w.name.endswith((".fc1", ".fc2"))]
    run = types.SimpleNamespace(weights=weights, tables=["embed"], stacks=stacks, shared=[])
    allowance = int(total * fraction)
    layout = stream_layout(run, allowance, G, cost(weights), "planned", True)
    away = types.SimpleNamespace(weights=weights, tables=["embed"] + stacks, stacks=[], shared=[])
    all_away = stream_layout(away, allowance, G, cost(weights), "planned", True)
    assert set(all_away.in_host) == {"embed"} | set(stacks)
    assert not set(stacks) & set(layout.streamed)
    assert set(layout.in_host) | set(layout.resident) >= set(stacks)
    assert set(layout.streamed) <= set(all_away.streamed)  # no other weight gave way to a stack
    assert cost(weights)(layout.resident) + layout.ring_bytes <= allowance
    back = [n for n in stacks if n in layout.resident]
    dense = total - sum(size[n] for n in stacks) - size["embed"]
    if fraction >= 0.25:  # the other weights fit with room for stacks
        assert dense < allowance and not layout.streamed and back
    if fraction == 0.9:
        assert len(back) > len(stacks) // 2
    # The stacks' bytes resident or in host; what is left in host does not fit beside.
    left = [n for n in stacks if n in layout.in_host]
    assert all(cost(weights)(layout.resident + [n]) + layout.ring_bytes > allowance for n in left) or layout.streamed
    # Not on the CPU.
    assert stream_layout(run, allowance, G, cost(weights), "planned", False).in_host == []
    everything = stream_layout(run, 2 * total, G, cost(weights), "planned", True)
    assert everything.in_host == [] and not everything.units


def test_a_stack_of_experts_under_a_granule_is_read_in_place_too_never_streamed():
    """experts="in_place": a stack under a granule (a small model's, 2 MiB granules) never
    streams either: streamed, it copies all its experts every step where read in place the
    kernel reads the picked ones; it stays resident where the budget holds it beside every
    weight it held without it, else in host memory. A stack not among the weights, or
    listed twice, changes nothing; an empty one stays resident (it parts the weights around
    it into items of their own, see plan_stream)."""
    import types
    from onnx_offload.engines.switch import stream_layout
    weights = [dataclasses.replace(w, nbytes=w.nbytes // 16) if w.name.endswith((".fc1", ".fc2")) else w
               for w in moe_weights(layers=6, experts=4)]
    stacks = [w.name for w in weights if w.name.endswith((".fc1", ".fc2"))]
    assert all(w.nbytes < G for w in weights if w.name in stacks)
    total = sum(w.nbytes for w in weights)
    run = types.SimpleNamespace(weights=weights, tables=["embed"], stacks=stacks, shared=[])
    hostile = types.SimpleNamespace(weights=weights, tables=["embed"], stacks=stacks + stacks[:2] + ["nowhere"],
                                    shared=[])
    others = [w for w in weights if w.name not in stacks and w.name != "embed"]
    for step in range(26, 100, 2):  # from the ring the largest weight needs
        allowance = total * step // 100
        layout = stream_layout(run, allowance, G, cost(weights), "planned", True)
        assert not set(stacks) & set(layout.streamed), step
        assert set(layout.in_host) | set(layout.resident) >= set(stacks), step
        assert set(layout.streamed) <= set(plan_stream(others, allowance, G, cost(weights), "planned").streamed)
        assert cost(weights)(layout.resident) + layout.ring_bytes <= allowance
        again = stream_layout(hostile, allowance, G, cost(weights), "planned", True)
        assert (again.resident, again.streamed, again.in_host) == (layout.resident, layout.streamed, layout.in_host)
    use = next(w.first_use for w in weights if w.name == "l2.fc1")
    empty = weights + [WeightInfo("l2.fc1_empty", np.dtype(np.float16), (0,), 0, 0, use)]
    layout = stream_layout(types.SimpleNamespace(weights=empty, tables=["embed"], stacks=stacks + ["l2.fc1_empty"],
                                                 shared=[]), total // 2, G, cost(empty), "planned", True)
    assert "l2.fc1_empty" in layout.resident and not set(stacks) & set(layout.streamed)


@pytest.mark.parametrize("fraction", [0.02, 0.1, 0.5, 0.9])
def test_stacks_read_in_place_are_planned_in_two_passes_of_plan_stream(fraction, monkeypatch):
    """experts="in_place" at gpt-oss scale (48 stacks): stream_layout plans the weights
    twice, with every stack and with none, not once a stack more. plan_stream takes
    O(weights^2) (the greedy costs each trial set whole): once a stack, the plan took 1.3
    to 1.8 s at gpt-oss-20b's 555 weights, at every engine build and replan. A stack whose
    bytes do not fit beside the weights the plan without it keeps resident cannot come
    back, and beside weights that are all resident it comes back where its bytes fit."""
    import types
    from onnx_offload.engines import in_place
    weights = moe_weights(layers=24)
    stacks = [w.name for w in weights if w.name.endswith((".fc1", ".fc2"))]
    calls = []
    monkeypatch.setattr(in_place, "plan_stream", lambda *a, **k: calls.append(1) or plan_stream(*a, **k))
    allowance = int(sum(w.nbytes for w in weights) * fraction)
    run = types.SimpleNamespace(weights=weights, tables=["embed"], stacks=stacks, shared=[])
    layout = in_place.stream_layout(run, allowance, G, cost(weights), "planned", True)
    assert len(calls) == 2
    assert not set(stacks) & set(layout.streamed) and set(layout.in_host) | set(layout.resident) >= set(stacks)
    assert cost(weights)(layout.resident) + layout.ring_bytes <= allowance
    if not layout.units:
        assert all(cost(weights)(layout.resident + [n]) > allowance for n in layout.in_host if n in stacks)


def test_weights_read_in_place_never_make_a_step_copy_more():
    """Taking the tables and stacks out moves plan_stream's other choices (the weights it
    keeps first depend on the sizes it is given): where the plan with them in host memory
    would copy as many bytes a step as the plan without, or more, the plan without runs."""
    import types
    from onnx_offload.engines.switch import stream_layout
    rng = np.random.default_rng(7)
    worse = 0
    for model in range(300):
        n = int(rng.integers(2, 12))
        sizes = [int(rng.choice([1, 3, 10, 20, 60, 150])) * MiB + int(rng.integers(0, 4096)) for _ in range(n)]
        weights = [WeightInfo(f"w{i}", np.dtype(np.float16), (b // 2,), b, 0, i) for i, b in enumerate(sizes)]
        picks = rng.random(n)
        run = types.SimpleNamespace(weights=weights, tables=[], shared=[],
                                    stacks=[w.name for w, p in zip(weights, picks) if p < 0.4])
        plain = types.SimpleNamespace(weights=weights, tables=[], stacks=[], shared=[])
        total = sum(sizes)
        for allowance in np.linspace(G, total, 12).astype(int):
            try:
                before = stream_layout(plain, int(allowance), G, cost(weights), "planned", True)
            except StreamingUnavailable:
                continue
            layout = stream_layout(run, int(allowance), G, cost(weights), "planned", True)
            copied = sum(w.nbytes for w in weights if w.name in layout.streamed)
            assert not layout.in_host or copied < sum(w.nbytes for w in weights if w.name in before.streamed), \
                (model, int(allowance))
            worse += 1
    assert worse > 100  # budgets where the weights stream, checked
