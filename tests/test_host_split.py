"""The split of a decode step's non-resident weights between the link and the host's cores:
the planner against the step model it states, max(streamed / link, GPU + host seconds),
and against the best subset found by trying them all."""
import itertools
import random

import pytest

from onnx_offload.memory import HostSplit, StepWeight, host_rate, plan_host_split
from onnx_offload.memory.host_split import FRONT, step_timeline

GB = 1e9
MB = 10 ** 6
LAYER = [("q", 32), ("k", 8), ("v", 8), ("o", 32), ("gate", 112), ("up", 112), ("down", 112)]


def llm_weights(layers=32, kind="float16", unit=MB):
    """A Llama-shaped step's weights in read order: per layer q, k, v, o, gate, up, down,
    an RMSNorm weight the host does not compute, and the LM head at the end."""
    ws = []
    for layer in range(layers):
        ws.append(StepWeight(f"{layer}.norm", 8192))
        ws.extend(StepWeight(f"{layer}.{n}", b * unit, kind, f"{layer}.{n}/MatMul") for n, b in LAYER)
    ws.append(StepWeight("lm_head", 1000 * unit, kind, "lm_head/MatMul"))
    return ws


def step(ws, hosts, link, rates, gpu, tokens, cost):
    """The step model, by hand: (stream seconds, compute seconds) of host set `hosts`."""
    host_b = sum(w.nbytes for w in ws if w.matmul in hosts)
    host_s = sum(sum(w.nbytes for w in ws if w.matmul == m) / host_rate(rates, kind, tokens) + cost
                 for m, kind in {(w.matmul, w.kind) for w in ws if w.matmul in hosts})
    return (sum(w.nbytes for w in ws) - host_b) / link, gpu + host_s


def brute_force(ws, link, rates, gpu, tokens, cost):
    """(least step, the most host bytes among the subsets that reach it) over every subset."""
    names = sorted({w.matmul for w in ws if w.matmul and host_rate(rates, w.kind, tokens) > 0})
    best = None
    for r in range(len(names) + 1):
        for sub in itertools.combinations(names, r):
            t = max(step(ws, set(sub), link, rates, gpu, tokens, cost))
            b = sum(w.nbytes for w in ws if w.matmul in sub)
            if best is None or t < best[0] * (1 - 1e-12) or (t <= best[0] * (1 + 1e-12) and b > best[1]):
                best = (min(t, best[0]) if best else t, b)
    return best


def brute_force_ordered(ws, link, rates, gpu, tokens, cost):
    """As brute_force, for max(stream + tail, compute): the tail is the host MatMuls read
    after the last streamed weight."""
    names = sorted({w.matmul for w in ws if w.matmul and host_rate(rates, w.kind, tokens) > 0})
    best = None
    for r in range(len(names) + 1):
        for sub in itertools.combinations(names, r):
            stream_s, compute_s = step(ws, set(sub), link, rates, gpu, tokens, cost)
            streamed = [i for i, w in enumerate(ws) if w.matmul not in sub]
            after = {w.matmul for w in ws[(streamed[-1] if streamed else -1) + 1:]} & set(sub)
            tail = step(ws, after, link, rates, 0, tokens, cost)[1]
            t = max(stream_s + tail, compute_s)
            b = sum(w.nbytes for w in ws if w.matmul in sub)
            if best is None or t < best[0] * (1 - 1e-12) or (t <= best[0] * (1 + 1e-12) and b > best[1]):
                best = (min(t, best[0]) if best else t, b)
    return best


def random_case(rng, matmuls):
    kinds = ["float16", "bfloat16", "int4"]
    ws = [StepWeight(f"w{i}", rng.choice([rng.randint(1, 100), 50, 50]) * MB, rng.choice(kinds), f"m{i}")
          for i in range(matmuls)]
    if rng.random() < 0.5:  # an int4 MatMul's scales: a second weight of the same MatMul, read beside its B
        ws.insert(1, StepWeight("scales", rng.randint(1, 5) * MB, ws[0].kind, ws[0].matmul))
    ws.insert(rng.randint(0, len(ws)), StepWeight("embed", rng.randint(0, 50) * MB))
    rates = {k: {1: rng.uniform(1, 100) * GB, 4: rng.uniform(1, 50) * GB} for k in kinds}
    return ws, rng.uniform(10, 60) * GB, rates, rng.uniform(0, 0.01), rng.choice([1, 3, 4]), rng.choice([0, 30e-6, 1e-3])


def check_consistent(plan: HostSplit, ws, link, rates, gpu, tokens, cost):
    """The plan's sets partition the weights, MatMuls whole, and its seconds are the model's."""
    assert set(plan.host_weights) | set(plan.streamed) == {w.name for w in ws}
    assert not set(plan.host_weights) & set(plan.streamed)
    assert plan.streamed == tuple(w.name for w in ws if w.name in set(plan.streamed))  # read order
    assert {w.matmul for w in ws if w.name in plan.host_weights} == set(plan.host)
    assert all(w.name in plan.host_weights for w in ws if w.matmul in plan.host)
    assert plan.host_bytes + plan.streamed_bytes == sum(w.nbytes for w in ws)
    stream_s, compute_s = step(ws, set(plan.host), link, rates, gpu, tokens, cost)
    assert plan.stream_seconds == pytest.approx(stream_s, rel=1e-12)
    assert plan.compute_seconds == pytest.approx(compute_s, rel=1e-12, abs=1e-15)
    streamed_at = [i for i, w in enumerate(ws) if w.name in set(plan.streamed)]
    after = {w.matmul for w in ws[(streamed_at[-1] if streamed_at else -1) + 1:]}
    tail = sum(step(ws, {m}, link, rates, 0, tokens, cost)[1] for m in set(plan.host) & after)
    assert plan.tail_seconds == pytest.approx(tail, rel=1e-12, abs=1e-15)
    assert plan.predicted_seconds == max(plan.stream_seconds + plan.tail_seconds, plan.compute_seconds)


def test_equal_rates_split_equal_weights_in_half_and_both_sides_finish_together():
    ws = [StepWeight(f"w{i}", 100 * MB, "float16", f"m{i}") for i in range(64)]
    plan = plan_host_split(ws, 50 * GB, {"float16": {1: 50 * GB}}, gpu_seconds=0, tokens=1, node_seconds=0)
    assert len(plan.host) == 32 and plan.host_bytes == plan.streamed_bytes == 3200 * MB
    assert plan.stream_seconds == pytest.approx(plan.compute_seconds) == pytest.approx(0.064)


@pytest.mark.parametrize("tokens", [1, 4])
def test_a_llm_step_balances_within_one_matmul(tokens):
    ws = llm_weights()
    link, rates, gpu = 55 * GB, {"float16": {1: 70 * GB, 4: 39 * GB}}, 3e-3
    plan = plan_host_split(ws, link, rates, gpu, tokens)
    check_consistent(plan, ws, link, rates, gpu, tokens, 30e-6)
    rate = host_rate(rates, "float16", tokens)
    one = max(max(w.nbytes / link, w.nbytes / rate + 30e-6) for w in ws if w.matmul)
    assert abs(plan.stream_seconds - plan.compute_seconds) <= one
    # The host's rate adds to the link's: the step is near (bytes + gpu * rate) / (link + rate).
    total = sum(w.nbytes for w in ws)
    ideal = (total + gpu * rate) / (link + rate)
    assert ideal <= plan.predicted_seconds <= ideal + one
    assert plan.predicted_seconds < 0.6 * total / link


def test_host_matmuls_are_spread_through_the_step():
    ws = [StepWeight(f"w{i}", 100 * MB, "float16", f"m{i}") for i in range(40)]
    plan = plan_host_split(ws, 30 * GB, {"float16": {1: 10 * GB}}, gpu_seconds=0, tokens=1, node_seconds=0)
    taken = sorted(int(m[1:]) for m in plan.host)
    assert len(taken) == 10  # 10 of 40: host 1 GB at 10 GB/s = stream 3 GB at 30 GB/s
    assert taken[0] <= 2 and {b - a for a, b in zip(taken, taken[1:])} <= {3, 4, 5} and taken[-1] < 39
    # In a Llama-shaped step, every stretch of a quarter of the step carries its share of host bytes.
    ws = llm_weights()
    plan = plan_host_split(ws, 55 * GB, {"float16": {1: 30 * GB}}, gpu_seconds=0, tokens=1)
    host = set(plan.host_weights)
    layers = [[w for w in ws if w.name.split(".")[0] == str(i)] for i in range(32)]
    share = plan.host_bytes / sum(w.nbytes for w in ws)
    for q in range(4):
        part = [w for layer in layers[8 * q:8 * q + 8] for w in layer]
        part_share = sum(w.nbytes for w in part if w.name in host) / sum(w.nbytes for w in part)
        assert abs(part_share - share) < 0.1, (q, part_share, share)


def test_prefers_the_kind_the_host_runs_fastest_per_byte():
    ws = [StepWeight(f"f{i}", 100 * MB, "float16", f"f{i}") for i in range(10)] + \
         [StepWeight(f"q{i}", 100 * MB, "int4", f"q{i}") for i in range(10)]
    rates = {"float16": {1: 10 * GB}, "int4": {1: 40 * GB}}
    plan = plan_host_split(ws, 50 * GB, rates, gpu_seconds=0, tokens=1, node_seconds=0)
    assert plan.host and all(m.startswith("q") for m in plan.host)
    # With the rates swapped, the other kind.
    plan = plan_host_split(ws, 50 * GB, {"float16": {1: 40 * GB}, "int4": {1: 10 * GB}}, 0, 1, node_seconds=0)
    assert plan.host and all(m.startswith("f") for m in plan.host)


def test_a_fixed_cost_per_node_favours_large_matmuls():
    ws = [StepWeight("big", 100 * MB, "float16", "big")] + [StepWeight(f"s{i}", 1 * MB, "float16", f"s{i}") for i in range(100)]
    plan = plan_host_split(ws, 50 * GB, {"float16": {1: 50 * GB}}, gpu_seconds=0, tokens=1, node_seconds=1e-3)
    assert plan.host == ("big",)


def test_all_host_when_the_host_costs_nothing():
    ws = llm_weights(layers=2)
    plan = plan_host_split(ws, 55 * GB, {"float16": {1: 1e18}}, gpu_seconds=0, tokens=1, node_seconds=0)
    assert set(plan.streamed) == {"0.norm", "1.norm"}  # what the host cannot compute streams
    assert len(plan.host) == 2 * 7 + 1


@pytest.mark.parametrize("case", ["no rate", "rate 0", "other kind", "prompt", "gpu-bound", "batch unmeasured"])
def test_no_host(case):
    ws = llm_weights(layers=2)
    rates, gpu, tokens, kw = {"float16": {1: 70 * GB, 8: 20 * GB}}, 1e-3, 1, {}
    if case == "no rate":
        rates = {}
    elif case == "rate 0":
        rates = {"float16": {1: 0.0}}
    elif case == "other kind":
        rates = {"int4": {1: 70 * GB}}
    elif case == "prompt":
        tokens = 9
    elif case == "gpu-bound":
        gpu = 1.0  # the link is idle already: host work would only lengthen the step
    elif case == "batch unmeasured":
        tokens, kw = 12, {"prefill_tokens": 16}
    plan = plan_host_split(ws, 55 * GB, rates, gpu, tokens, **kw)
    assert plan.host == () and plan.host_bytes == 0
    assert plan.streamed == tuple(w.name for w in ws)
    assert plan.compute_seconds == gpu


def test_the_prompt_threshold_is_a_parameter():
    ws, rates = llm_weights(layers=2), {"float16": {16: 20 * GB}}
    assert plan_host_split(ws, 55 * GB, rates, 0, 12).host == ()
    assert plan_host_split(ws, 55 * GB, rates, 0, 12, prefill_tokens=16).host


def test_the_rate_of_the_smallest_measured_batch_that_holds_the_step():
    rates = {"float16": {1: 70.0, 4: 39.0, 8: 20.0}}
    assert [host_rate(rates, "float16", t) for t in (1, 2, 4, 5, 8, 9)] == [70, 39, 39, 20, 20, 0]
    assert host_rate(rates, "int4", 1) == 0


def test_the_best_subset_on_small_cases():
    """Without order, the plan is the best subset of the step model; with it (the default),
    the best subset of the model with the tail counted, and no worse than the first."""
    rng = random.Random(7)
    for _ in range(300):
        ws, link, rates, gpu, tokens, cost = random_case(rng, rng.randint(1, 8))
        plan = plan_host_split(ws, link, rates, gpu, tokens, node_seconds=cost, order_aware=False)
        check_consistent(plan, ws, link, rates, gpu, tokens, cost)
        best, most_bytes = brute_force(ws, link, rates, gpu, tokens, cost)
        assert max(plan.stream_seconds, plan.compute_seconds) == pytest.approx(best, rel=1e-12)
        assert plan.host_bytes == most_bytes
        ordered = plan_host_split(ws, link, rates, gpu, tokens, node_seconds=cost)
        check_consistent(ordered, ws, link, rates, gpu, tokens, cost)
        assert ordered.predicted_seconds <= plan.predicted_seconds
        best, most_bytes = brute_force_ordered(ws, link, rates, gpu, tokens, cost)
        assert ordered.predicted_seconds == pytest.approx(best, rel=1e-12)
        assert ordered.host_bytes == most_bytes


def test_a_faster_host_never_takes_fewer_bytes():
    """In the step model (order aside), a faster host takes no fewer bytes and the step is no
    longer. With the tail counted (the default), the step is no longer either, but the
    bytes may drop: a faster host can let a MatMul at the end stream for others earlier."""
    rng = random.Random(11)
    for _ in range(300):
        ws, link, rates, gpu, tokens, cost = random_case(rng, rng.randint(1, 12))
        before = plan_host_split(ws, link, rates, gpu, tokens, node_seconds=cost, order_aware=False)
        ordered_before = plan_host_split(ws, link, rates, gpu, tokens, node_seconds=cost)
        for factor in (1.1, 2.0, 10.0):
            faster = {k: {b: r * factor for b, r in by.items()} for k, by in rates.items()}
            after = plan_host_split(ws, link, faster, gpu, tokens, node_seconds=cost, order_aware=False)
            assert after.host_bytes >= before.host_bytes
            assert max(after.stream_seconds, after.compute_seconds) <= \
                max(before.stream_seconds, before.compute_seconds) * (1 + 1e-12)
            ordered = plan_host_split(ws, link, faster, gpu, tokens, node_seconds=cost)
            assert ordered.predicted_seconds <= ordered_before.predicted_seconds * (1 + 1e-12)
            before, ordered_before = after, ordered
    # A Llama-shaped step, its host's rate rising step by step: more bytes either way.
    ws = llm_weights(layers=4)
    for order_aware in (False, True):
        taken = [plan_host_split(ws, 55 * GB, {"float16": {1: r * GB}}, 2e-3, 1, order_aware=order_aware).host_bytes
                 for r in range(1, 200, 7)]
        assert taken == sorted(taken) and taken[0] < taken[-1]


def test_the_lm_head_read_last_streams():
    """An LM head on the host at the end of the step would run after the link went idle."""
    ws = llm_weights()
    link, rates, gpu = 55 * GB, {"float16": {1: 40 * GB}}, 3e-3
    unordered = plan_host_split(ws, link, rates, gpu, 1, order_aware=False)
    assert "lm_head/MatMul" in unordered.host and unordered.tail_seconds > 0
    plan = plan_host_split(ws, link, rates, gpu, 1)
    assert "lm_head/MatMul" not in plan.host and plan.tail_seconds == 0
    assert plan.predicted_seconds < unordered.predicted_seconds
    assert step_timeline(ws, plan.host, link, rates, gpu, 1) < step_timeline(ws, unordered.host, link, rates, gpu, 1)


def test_many_unlike_matmuls_stay_within_the_front_s_resolution():
    """Past FRONT points the search keeps one per 1/FRONT of the bytes: the step stays within
    that many bytes of link time (plus one MatMul's rounding) of the fractional optimum, a
    lower bound of every subset."""
    rng = random.Random(3)
    ws = [StepWeight(f"w{i}", rng.randint(1, 10 ** 4) * 997, rng.choice(["float16", "int4"]), f"m{i}") for i in range(300)]
    link, rates, gpu = 50 * GB, {"float16": {1: 30 * GB}, "int4": {1: 80 * GB}}, 1e-4
    plan = plan_host_split(ws, link, rates, gpu, 1, node_seconds=5e-6, order_aware=False)
    check_consistent(plan, ws, link, rates, gpu, 1, 5e-6)
    # The fractional optimum: MatMuls by host seconds per byte, the last one in part.
    items = sorted(((w.nbytes / host_rate(rates, w.kind, 1) + 5e-6) / w.nbytes, w.nbytes) for w in ws)
    stream, compute = sum(w.nbytes for w in ws) / link, gpu
    for per_byte, b in items:
        s, h = b / link, per_byte * b
        if compute + h >= stream - s:
            f = (stream - compute) / (s + h)
            stream -= f * s
            break
        stream, compute = stream - s, compute + h
    lower = stream
    total = sum(w.nbytes for w in ws)
    balanced = max(plan.stream_seconds, plan.compute_seconds)
    assert lower * (1 - 1e-12) <= balanced <= lower + total / FRONT / link + max(w.nbytes for w in ws) / link


@pytest.mark.parametrize("bad", ["link", "tokens", "resident", "cost", "bytes", "kinds"])
def test_bad_input_is_refused(bad):
    ws, args, kw = [StepWeight("w", 10, "float16", "m")], [1e9, {"float16": {1: 1e9}}, 0.0, 1], {}
    if bad == "link":
        args[0] = 0
    elif bad == "tokens":
        args[3] = 0
    elif bad == "resident":
        args[2] = -1.0
    elif bad == "cost":
        kw["node_seconds"] = -1.0
    elif bad == "bytes":
        ws = [StepWeight("w", -1, "float16", "m")]
    else:
        ws = [StepWeight("b", 10, "int4", "m"), StepWeight("s", 10, "float16", "m")]
    with pytest.raises(ValueError):
        plan_host_split(ws, *args, **kw)


def test_spread_host_matmuls_keep_the_link_busy_where_a_cluster_would_not():
    """With order taken into account, the plan's evenly spread host set runs near its
    prediction; the same number of host MatMuls bunched at the end of the step does not."""
    ws = llm_weights()
    link, rates, gpu = 55 * GB, {"float16": {1: 40 * GB}}, 3e-3
    plan = plan_host_split(ws, link, rates, gpu, 1)
    spread = step_timeline(ws, plan.host, link, rates, gpu, 1)
    alike = [w.matmul for w in ws if w.name.endswith(("gate", "up", "down"))]
    taken = [m for m in plan.host if m in alike]
    bunched = [m for m in plan.host if m not in alike] + alike[-len(taken):]
    at_end = step_timeline(ws, bunched, link, rates, gpu, 1)
    assert plan.predicted_seconds <= spread <= plan.predicted_seconds * 1.05
    assert at_end > spread * 1.2
