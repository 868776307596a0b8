"""The budget plan: how one device budget is split, as a pure function (no device)."""
import pytest

from onnx_offload import BudgetExceeded, OffloadConfig
from onnx_offload.memory.budget import plan_budget

MiB = 1 << 20
GiB = 1 << 30
G = 2 * MiB


def plan(sizes, segments=None, free=80 * GiB, total=80 * GiB, margin=0, reserves=None, **cfg):
    """A plan for weights of these sizes (each costs whole granules on its own, and a
    set costs the sum); `segments` maps a target to the weights of each segment."""
    config = OffloadConfig(**cfg)
    costs = {n: -(-s // G) * G for n, s in sizes.items()}
    asked = []

    def plan_segments(target):
        asked.append(target)
        return segments(target) if segments else [list(sizes)]

    p = plan_budget(config, free=free, total=total, granularity=G, weight_costs=costs,
                    cost=lambda names: sum(costs[n] for n in names), plan_segments=plan_segments,
                    margin=margin, reserves=reserves)
    return p, asked


def zones(p):
    return {z: (v.allowance, v.reserve) for z, v in p.zones.items()}


@pytest.mark.parametrize("cfg, budget, scratch, kv", [
    (dict(vram_limit=GiB), GiB, 128 * MiB, 0),                                # an eighth of the budget
    (dict(vram_limit=4 * GiB), 4 * GiB, 256 * MiB, 0),                        # capped at 256 MiB
    (dict(vram_limit=GiB, scratch_bytes=0), GiB, 0, 0),                       # none asked
    (dict(vram_limit=GiB, scratch_bytes=1), GiB, G, 0),                       # whole granules
    (dict(vram_limit=GiB, kv_bytes=512 * MiB), GiB, 64 * MiB, 512 * MiB),     # an eighth of what KV leaves
    (dict(vram_limit=0.5), 40 * GiB, 256 * MiB, 0),                           # a fraction of the device
])
def test_reserves_of_an_unsplit_model(cfg, budget, scratch, kv):
    p, asked = plan({"a": 10 * MiB, "b": 10 * MiB}, **cfg)
    assert not p.streaming and asked == [] and p.segment_target == 0
    assert p.budget == budget
    assert zones(p) == {"weights": (budget, 0), "kv": (budget, kv), "scratch": (budget, scratch),
                        "transient": (budget, 0)}
    # ORT may take what the weights and the other reserves leave.
    assert p.ort_memory_cap == budget - 20 * MiB - kv


def test_a_request_above_the_free_memory_is_cut_to_it_with_a_note():
    p, _ = plan({"a": MiB}, free=GiB, total=80 * GiB, vram_limit=2 * GiB)
    assert p.budget == GiB and "exceeds" in p.note
    p, _ = plan({"a": MiB}, free=10 * GiB, total=80 * GiB, margin=256 * MiB)  # auto: the free memory less the margin
    assert p.budget == 10 * GiB - 256 * MiB and p.note == ""


def test_weights_over_their_allowance_without_offload_are_refused():
    with pytest.raises(BudgetExceeded, match="ONNX_GENAI_WEIGHT_OFFLOAD=1"):
        plan({"a": 10 * MiB, "b": 10 * MiB}, vram_limit=GiB, weight_bytes=12 * MiB)


def test_the_largest_weight_must_fit_the_usable_budget():
    with pytest.raises(BudgetExceeded, match="largest weight 'big'"):
        plan({"big": 200 * MiB, "small": MiB}, vram_limit=192 * MiB, scratch_bytes=0, offload=True, vmm=True)


@pytest.mark.parametrize("cfg, target, transient, weights", [
    # a quarter of the allowance per segment; the transient zone holds the largest segment
    # (3 x 32 MiB) plus a granule; the weights zone keeps the allowance
    (dict(weight_bytes=256 * MiB), 64 * MiB, 96 * MiB + G, 256 * MiB),
    # an allowance above the usable budget (768 MiB) is cut to what the transient zone leaves
    (dict(weight_bytes=GiB), 192 * MiB, 96 * MiB + G, 768 * MiB - 96 * MiB - G),
    # an explicit segment size wins
    (dict(weight_bytes=256 * MiB, segment_bytes=32 * MiB), 32 * MiB, 96 * MiB + G, 256 * MiB),
    # without stable addresses a segment starts on its own allocations: no granule more
    (dict(weight_bytes=256 * MiB, vmm=False), 64 * MiB, 96 * MiB, 256 * MiB),
])
def test_streaming_splits_the_weights_budget(cfg, target, transient, weights):
    sizes = {f"w{i}": 32 * MiB for i in range(30)}  # 960 MiB
    segs = lambda t: [[f"w{i}" for i in range(j, min(j + 3, 30))] for j in range(0, 30, 3)]  # noqa: E731
    base = dict(vram_limit=GiB, scratch_bytes=256 * MiB, offload=True, vmm=True)
    base.update(cfg)
    p, asked = plan(sizes, segs, **base)
    assert p.streaming and asked == [target] and len(p.segments) == 10
    assert (p.segment_target, p.zones["transient"].reserve, p.zones["weights"].allowance) == (target, transient, weights)
    assert p.zones["scratch"].reserve == 256 * MiB
    assert p.ort_memory_cap == GiB - weights - transient
    # The weights allowance and every reserve together stay within the budget.
    assert p.zones["weights"].allowance + sum(z.reserve for z in p.zones.values()) <= p.budget


def test_one_segment_over_the_allowance_streams():
    # Both weights plan into one segment: it still streams, through the transient zone.
    p, asked = plan({"a": 10 * MiB, "b": 10 * MiB}, vram_limit=GiB, weight_bytes=12 * MiB, offload=True, vmm=True)
    assert asked and p.streaming and len(p.segments) == 1
    assert p.zones["transient"].reserve == 20 * MiB + G and p.zones["weights"].allowance == 12 * MiB


def test_a_segment_larger_than_the_usable_budget_is_refused():
    sizes = {f"w{i}": 16 * MiB for i in range(8)}
    with pytest.raises(BudgetExceeded, match="a segment needs"):
        plan(sizes, lambda t: [list(sizes)[:6], list(sizes)[6:]], vram_limit=64 * MiB, scratch_bytes=0,
             weight_bytes=32 * MiB, offload=True, vmm=True)


def test_no_weights_plan_unsplit():
    p, _ = plan({}, vram_limit=GiB)
    assert not p.streaming and p.segments == [[]]


def test_the_models_default_reserves_apply_where_the_configuration_gives_none():
    sizes = {"a": 10 * MiB, "b": 10 * MiB}
    # A decoder's first generation: its cache and its step, in whole granules, not an
    # eighth of the budget.
    p, _ = plan(sizes, vram_limit=GiB, reserves={"kv": 3 * MiB, "scratch": 5 * MiB})
    assert zones(p)["kv"] == (GiB, 4 * MiB) and zones(p)["scratch"] == (GiB, 6 * MiB)
    # What the configuration gives wins.
    p, _ = plan(sizes, vram_limit=GiB, kv_bytes=8 * MiB, scratch_bytes=16 * MiB,
                reserves={"kv": 3 * MiB, "scratch": 5 * MiB})
    assert zones(p)["kv"] == (GiB, 8 * MiB) and zones(p)["scratch"] == (GiB, 16 * MiB)
    # Reserves sized so leave more to the weights: 60 MiB of weights resident in a budget
    # of 64 MiB, where an eighth of it set aside for scratch would make them stream.
    sizes = {f"w{i}": 10 * MiB for i in range(6)}
    one_each = lambda target: [[n] for n in sizes]  # noqa: E731
    assert plan(sizes, one_each, vram_limit=64 * MiB, offload=True)[0].streaming
    assert not plan(sizes, one_each, vram_limit=64 * MiB, offload=True,
                    reserves={"kv": MiB, "scratch": MiB})[0].streaming
