"""The streaming engine on the H200: one ORT session captured into a graph with the
page-ins in it. Tokens equal plain ORT's at every budget, a decode step makes no
driver call, the weights budget holds, and two sessions share the device."""
import threading

import numpy as np
import pytest

from onnx_offload import OffloadSession
from onnx_offload.models import weight_bytes
from onnx_offload.models.decoder import decoder_lm

from conftest import reference_greedy

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
_MODEL = []
STEADY = ("creates", "releases", "maps", "unmaps", "set_access", "plain_allocs", "plain_frees")


def model():
    # Large enough that the weights span many granules: units, a ring that wraps, and
    # a resident set the planner has to choose.
    if not _MODEL:
        _MODEL.append(decoder_lm("gqa", layers=4, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=8000,
                                 max_length=256, dtype=np.float16))
    return _MODEL[0]


def session(fraction, **kw):
    m = model()
    return OffloadSession(m.SerializeToString(), providers=[CUDA], vram_limit="2GiB", offload=True, vmm=True,
                          weight_bytes=int(weight_bytes(m) * fraction), **kw)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_tokens_equal_plain_ort_and_steps_make_no_driver_call(fraction):
    ids = np.random.default_rng(3).integers(0, 8000, (1, 12))
    want = reference_greedy(model(), ids, 32, providers=[CUDA])
    with session(fraction) as s:
        assert s.engine == "graph", s.graph_capture
        assert len(s.segments) == 1
        # The embedding, which only a Gather reads, is read in place from host memory.
        assert s._runner.plan.in_host == ["embed_tokens"]
        assert any("a table only Gathers read, a row a token" in n for n in s.stats().notes), s.stats().notes
        gen = s.generate_iter(ids, 32)
        got = [next(gen) for _ in range(4)]  # the prompt graph and the decode graph are built
        before = s.stats().driver.as_dict()
        steps = s.stats().graph_steps
        got += [next(gen) for _ in range(27)]  # not the last: the cache is given back before it
        after = s.stats().driver.as_dict()
        assert {k: after[k] - before[k] for k in STEADY} == {k: 0 for k in STEADY}
        assert s.stats().graph_steps - steps == 27
        got += list(gen)
        np.testing.assert_array_equal(np.concatenate([ids] + [t[:, None] for t in got], axis=1), want)
        last = s.stats().last_step
        assert last.page_ins > 0 and last.hits > 0
        snap = s.device.ledger.snapshot()
        weights_budget = snap.zones["weights"].allowance + snap.zones["transient"].reserve
        assert weights_budget <= int(weight_bytes(model()) * fraction)
        assert snap.zones["weights"].committed.peak + snap.zones["transient"].committed.peak <= weights_budget
        final = s.close()
    assert final.committed == 0
    assert s.stats().arena.refcount_underflows == 0 and s.stats().arena.unaccounted_bytes == 0


def test_engine_equals_segments_with_capture_off():
    """The same prompt through run(): the graph engine's logits are bitwise the
    segment runner's, uncaptured."""
    ids = np.random.default_rng(4).integers(0, 8000, (2, 9))
    feeds = {"input_ids": ids, "attention_mask": np.ones((2, 9), np.int64)}
    for i in range(4):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((2, 4, 0, 64), np.float16)
    with session(0.3) as g, session(0.3, cuda_graph=False) as seg:
        assert g.engine == "graph" and seg.engine == "segments"
        a = g.run(None, feeds)
        a2 = g.run(None, feeds)  # a replay of the graph built by the first call
        b = seg.run(None, feeds)
        for x, x2, y in zip(a, a2, b):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(x2, y)


def test_two_sessions_at_once_each_with_its_budget():
    ids = np.random.default_rng(5).integers(0, 8000, (1, 10))
    want = reference_greedy(model(), ids, 24, providers=[CUDA])
    results, errors = {}, []
    with session(0.25) as a, session(0.5) as b:
        def work(name, s):
            try:
                for _ in range(3):
                    results[name] = s.generate(ids, 24)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=work, args=(n, s)) for n, s in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for name in ("a", "b"):
            np.testing.assert_array_equal(results[name], want)


@pytest.mark.parametrize("policy", ["stable", "lru", "mru"])
def test_other_policies_keep_working(policy):
    ids = np.random.default_rng(6).integers(0, 8000, (1, 8))
    want = reference_greedy(model(), ids, 12, providers=[CUDA])
    with session(0.4, policy=policy) as s:
        assert s.engine == ("graph" if policy == "stable" else "segments")
        np.testing.assert_array_equal(s.generate(ids, 12), want)


def test_each_streamed_weight_has_readers_that_hold_its_address():
    """The scan's readers are the captured nodes whose parameters hold a weight's
    address, at 8-aligned places (cuBLASLt's packed parameter buffers included), and
    every streamed weight has one: a page-in is never left unordered."""
    ids = np.random.default_rng(5).integers(0, 8000, (1, 10))
    with session(0.25) as s:
        assert s.engine == "graph", s.graph_capture
        s.generate(ids, 3)
        engine = s._runner
        names = engine.plan.streamed
        assert names
        ranges = [(engine.address[n], engine.address[n] + engine.info[n].nbytes) for n in names]
        for g in engine._graphs.values():
            graph = g.graph
            for name, (lo, hi), readers in zip(names, ranges, graph.readers(ranges)):
                assert readers, name
                for r in readers:
                    where = graph.address_in_params(r, lo, hi)
                    if graph.kernel_name(r).startswith("(node type"):
                        continue  # a copy or a set node: its address is a field of its own
                    assert where, (name, r, graph.kernel_name(r))
                    assert all(off % 8 == 0 for _, _, off in where), where
                    assert any(len(b) > 0 for b in graph.param_bytes(r))


def test_an_output_listed_twice_is_returned_twice_by_the_engine():
    """ORT binds a name once: the engine's buffers follow the names it bound."""
    import onnx
    import onnxruntime as ort
    m = onnx.ModelProto()
    m.CopyFrom(model())
    m.graph.output.insert(1, m.graph.output[0])  # logits, logits, present.0.key, ...
    ids = np.random.default_rng(7).integers(0, 8000, (2, 9))
    feeds = {"input_ids": ids, "attention_mask": np.ones((2, 9), np.int64)}
    for i in range(4):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((2, 4, 0, 64), np.float16)
    m.graph.ClearField("value_info")
    want = ort.InferenceSession(m.SerializeToString(), providers=[CUDA]).run(None, feeds)
    with OffloadSession(m.SerializeToString(), providers=[CUDA], vram_limit="2GiB", offload=True, vmm=True,
                        weight_bytes=int(weight_bytes(m) * 0.3)) as s:
        assert s.engine == "graph", s.graph_capture
        for _ in range(2):
            got = s.run(None, feeds)
            assert len(got) == len(want)
            np.testing.assert_array_equal(got[0], got[1])
            np.testing.assert_allclose(got[0].astype(np.float32), want[0].astype(np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])  # the embedding table (fp16) is read from the host
def test_int4_weights_stream_with_their_scales_and_give_plain_ort_s_tokens(fraction):
    # Each MatMulNBits reads its packed weight and its scales: they stream as one unit,
    # one copy per run, and the graph's tokens are plain ORT's.
    from onnx_offload.models import int4
    m = int4(model())
    ids = np.random.default_rng(5).integers(0, 8000, (1, 12))
    want = reference_greedy(m, ids, 24, providers=[CUDA])
    with OffloadSession(m.SerializeToString(), providers=[CUDA], vram_limit="2GiB", offload=True, vmm=True,
                        weight_bytes=int(weight_bytes(m) * fraction)) as s:
        assert s.engine == "graph", s.graph_capture
        assert s._runner.plan.in_host == ["embed_tokens"]
        units = s._runner.plan.units
        # At 75% every weight but the embedding table (a third of this model) stays resident.
        assert bool(units) == (fraction < 0.75)
        assert all(len(u.names) == 2 for u in units if u.names[0].endswith("_Q4")), [u.names for u in units]
        got = np.concatenate([ids] + [t[:, None] for t in s.generate_iter(ids, 24)], axis=1)
        np.testing.assert_array_equal(got, want)
        assert (s.stats().last_step.page_ins > 0) == bool(units)
        final = s.close()
    assert final.committed == 0
