"""A model split across devices: on the CPU every device is a host backend of its own,
with its own ledger, so the split, the boundary moves and the per-device ledgers run
here the code they run on GPUs."""
import json
import os
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_offload import OffloadSession, StateError, UnsupportedModel
from onnx_offload.config import OffloadConfig
from onnx_offload.devices import DeviceShare, StagedSession, split_stages
from onnx_offload.devices.moves import StepMoves
from onnx_offload.devices.stages import tensor_bytes
from onnx_offload.models import gpt2_lm, mlp_stack
from onnx_offload.models.decoder import decoder_lm

from conftest import reference_greedy

CPU = ["CPUExecutionProvider"]


def staged(model, devices=(0, 1), **kw):
    kw.setdefault("host_granularity", 4096)
    kw.setdefault("vram_limit", "64MiB")
    return OffloadSession(model.SerializeToString(), providers=CPU, devices=list(devices), **kw)


def weights_of(model, least=4096):
    return {t.name: n for t in model.graph.initializer if (n := tensor_bytes(t)) >= least}


def plain(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)


# ---------------------------------------------------------------------- the split

def test_equal_devices_take_equal_weights_and_cut_between_layers():
    m = decoder_lm("gqa", layers=4, max_length=64)
    w = weights_of(m)
    cut = split_stages(m, w, [DeviceShare(10 << 20)] * 2)
    assert abs(cut.weight_bytes[0] - cut.weight_bytes[1]) <= max(w.values())
    # Between layers two values cross (SkipSimplifiedLayerNormalization adds the residual
    # inside the next layer's norm: the residual and the last projection's output); the
    # attention mask's derived values are computed again by each stage. Inside a layer
    # more values live, and eight stages must cut there.
    assert cut.crossings == [2]
    assert max(split_stages(m, w, [DeviceShare(10 << 20)] * 8).crossings) > 2
    assert sum(map(len, cut.groups)) == len(m.graph.node)
    assert [g[0] for g in cut.groups] == sorted(g[0] for g in cut.groups)


def test_a_device_with_a_larger_allowance_takes_more_and_the_streamed_bytes_balance():
    m = mlp_stack(layers=8, hidden=128)
    w = weights_of(m)
    total = sum(w.values())
    even = split_stages(m, w, [DeviceShare(total // 4), DeviceShare(total // 4)])
    uneven = split_stages(m, w, [DeviceShare(total // 2), DeviceShare(total // 8)])
    assert uneven.weight_bytes[0] > even.weight_bytes[0] > uneven.weight_bytes[1] - 1
    # No other cut gives a smaller largest stage time (each device streams what its bytes
    # exceed its allowance by).
    shares = [DeviceShare(total // 2), DeviceShare(total // 8)]
    layer = 128 * 128 * 4  # (a bias of 512 bytes is no weight: it stays in the model)
    best = min(max(shares[0].step_time(k * layer), shares[1].step_time((8 - k) * layer)) for k in range(1, 8))
    assert max(uneven.times) == pytest.approx(best)


def test_the_split_minimizes_the_largest_stage_time():
    m = mlp_stack(layers=6, hidden=64)
    w = weights_of(m)
    shares = [DeviceShare(0), DeviceShare(0), DeviceShare(0)]
    cut = split_stages(m, w, shares)
    # Six equal layers over three devices streaming everything: two layers each.
    assert cut.weight_bytes[0] == cut.weight_bytes[1] == cut.weight_bytes[2]


def test_more_devices_than_places_to_cut_is_refused():
    m = mlp_stack(layers=2, hidden=64)
    with pytest.raises(UnsupportedModel, match="cannot be split over 4 devices"):
        split_stages(m, weights_of(m), [DeviceShare(0)] * 4)


# ---------------------------------------------------------------------- running

def test_run_gives_plain_ort_s_outputs_over_three_devices():
    m = mlp_stack(layers=6, hidden=64, batch=3)
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    with staged(m, devices=(0, 1, 2)) as s:
        assert isinstance(s, StagedSession) and len(s.stages) == 3
        assert [i.name for i in s.get_inputs()] == ["x"] and [o.name for o in s.get_outputs()] == ["y"]
        (y,) = s.run(None, {"x": x})
        np.testing.assert_array_equal(y, plain(m, {"x": x})[0])
        (v,) = s.run_with_ort_values(["y"], {"x": ort.OrtValue.ortvalue_from_numpy(x)})
        np.testing.assert_array_equal(v.numpy(), y)
        assert s.moved_bytes == 2 * 2 * x.nbytes  # two boundaries, two runs


def test_each_device_has_its_own_ledger_and_every_byte_returns_on_close():
    m = mlp_stack(layers=6, hidden=64, batch=3)
    x = np.ones((3, 64), np.float32)
    s = staged(m, weight_bytes=[40000, 20000], offload=True, vmm=True)
    ledgers = [st.device.ledger for st in s.stages]
    assert ledgers[0] is not ledgers[1]
    s.run(None, {"x": x})
    st = s.stats()
    assert [d.weight_bytes for d in st.stages] == s.split.weight_bytes
    # The moves of a step are given back after it: a second step commits nothing more.
    scratch = [z.ledger.zones["scratch"].committed.current for z in st.stages]
    s.run(None, {"x": x})
    assert [z.device.ledger.snapshot().zones["scratch"].committed.current for z in s.stages] == scratch
    assert st.counters.htod_bytes == sum(d.counters.htod_bytes for d in st.stages) > 0
    assert "total" in st.table() and st.as_dict()["moved_bytes"] == s.moved_bytes // 2 == 3 * 64 * 4
    workdir = s._workdir
    finals = s.close()
    assert [f.committed for f in finals] == [0, 0]
    assert all(stage.stats().arena.refcount_underflows == 0 for stage in s.stages)
    assert not os.path.exists(workdir)
    with pytest.raises(StateError):
        s.run(None, {"x": x})


def test_a_move_lands_in_the_reading_device_s_ledger_and_leaves_with_the_step():
    m = mlp_stack(layers=4, hidden=64, batch=3)
    with staged(m) as s:
        src, dst = s.stages[0].device, s.stages[1].device
        value = ort.OrtValue.ortvalue_from_numpy(np.arange(3 * 512, dtype=np.float32).reshape(3, 512))

        def scratch(dev):
            return dev.ledger.snapshot().zones["scratch"].content.current
        before = scratch(dst), scratch(src)
        moves = StepMoves(dst)
        moved = moves.move(src, value)
        assert moved.data_ptr() != value.data_ptr()
        np.testing.assert_array_equal(moved.numpy(), value.numpy())
        assert scratch(dst) == before[0] + 3 * 512 * 4 and scratch(src) == before[1]
        moves.close()
        assert (scratch(dst), scratch(src)) == before
        assert moves.bytes == 3 * 512 * 4


def test_a_bad_feed_is_refused_as_ort_refuses_it():
    m = mlp_stack(layers=4, hidden=64, batch=3)
    with staged(m) as s:
        with pytest.raises(Exception, match="Invalid input name"):
            s.run(None, {"x": np.ones((3, 64), np.float32), "z": np.ones((3, 64), np.float32)})
        with pytest.raises(ValueError, match="Required inputs"):
            s.run(None, {"z": np.ones((3, 64), np.float32)})
        with pytest.raises(Exception, match="Unexpected input data type"):
            s.run(None, {"x": np.ones((3, 64), np.float64)})


@pytest.mark.parametrize("devices, error", [([0, 0], ValueError), ("01", TypeError), ([], ValueError),
                                            ([0, -1], ValueError), ([0, True], TypeError),
                                            ([0, 2**31], ValueError), ([0, 2**15], ValueError)])
def test_bad_devices_are_refused(devices, error):
    with pytest.raises(error):
        staged(mlp_stack(layers=4, hidden=64), devices=devices)


@pytest.mark.parametrize("kw", [dict(device_id=2**31), dict(devices=[2**31]), dict(devices=[0, 2**31])])
def test_a_device_id_onnxruntime_cannot_hold_is_refused_before_it_reaches_onnxruntime(kw):
    with pytest.raises(ValueError, match="ONNX Runtime takes device ids up to 32767"):
        OffloadSession(mlp_stack(layers=2, hidden=64).SerializeToString(), providers=CPU, **kw)


@pytest.mark.parametrize("value", ["\u0663", "\uff11", "1.0", "-1"])
def test_a_device_id_given_as_text_takes_ascii_digits_only(value):
    # ORT reads a provider option's digits as ASCII; other scripts' digits are refused here.
    with pytest.raises(ValueError, match="device_id=.*non-negative integer"):
        OffloadConfig(device_id=value)


def test_per_device_values_must_name_each_device():
    with pytest.raises(ValueError, match="2 values for 3 devices"):
        staged(mlp_stack(layers=6, hidden=64), devices=(0, 1, 2), vram_limit=["64MiB", "64MiB"])


def test_one_device_is_a_plain_session_on_that_device():
    s = staged(mlp_stack(layers=4, hidden=64), devices=(3,))
    try:
        assert type(s) is OffloadSession and s.config.device_id == 3
    finally:
        s.close()


def test_a_model_file_s_data_is_read_from_a_copy_and_stays_the_caller_s_to_load(tmp_path):
    m = mlp_stack(layers=4, hidden=128)
    path = str(tmp_path / "m.onnx")
    onnx.save(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location="m.data",
              size_threshold=0)
    x = np.ones((8, 128), np.float32)
    with OffloadSession(path, providers=CPU, devices=[0, 1], host_granularity=4096, vram_limit="64MiB") as s:
        # The stages read the optimized model's data file, written in the session's folder.
        folder = os.path.join(s._workdir, "stages")
        assert "optimized.onnx.data" in os.listdir(folder)
        theirs = os.stat(tmp_path / "m.data").st_ino
        assert all(os.stat(os.path.join(folder, f)).st_ino != theirs for f in os.listdir(folder))
        assert os.stat(tmp_path / "m.data").st_nlink == 1
        # onnx.load refuses a data file with several hard links; the caller's has one.
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], plain(onnx.load(path), {"x": x})[0])


def test_concurrent_runs_give_right_answers():
    m = mlp_stack(layers=6, hidden=64, batch=3)
    xs = [np.random.default_rng(i).standard_normal((3, 64)).astype(np.float32) for i in range(4)]
    want = [plain(m, {"x": x})[0] for x in xs]
    bad = []
    with staged(m) as s:
        def work(k):
            for _ in range(5):
                if not np.array_equal(s.run(None, {"x": xs[k]})[0], want[k]):
                    bad.append(k)
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    assert not bad


def test_an_interrupt_between_stages_leaves_a_usable_session(monkeypatch):
    m = mlp_stack(layers=6, hidden=64, batch=3)
    x = np.ones((3, 64), np.float32)
    with staged(m) as s:
        moved = StepMoves.move

        def interrupted(self, source, value):
            moved(self, source, value)  # the buffer is taken, then Ctrl-C
            raise KeyboardInterrupt
        monkeypatch.setattr(StepMoves, "move", interrupted)
        with pytest.raises(KeyboardInterrupt):
            s.run(None, {"x": x})
        monkeypatch.setattr(StepMoves, "move", moved)
        assert s.stages[1].device.ledger.snapshot().zones["scratch"].committed.current == 0
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], plain(m, {"x": x})[0])


# ---------------------------------------------------------------------- generation

@pytest.mark.parametrize("layout", ["gqa", "standard", "exact"])
@pytest.mark.parametrize("budget", ["resident", "streaming"])
def test_generate_across_devices_gives_plain_ort_s_tokens(layout, budget):
    m = decoder_lm("standard", position_ids=False, layers=4, max_length=128) if layout == "exact" else \
        decoder_lm(layout, layers=4, max_length=128)
    ids = np.random.default_rng(1).integers(0, 97, (2, 7))
    kw = dict(weight_bytes=[150000, 120000], offload=True, vmm=True) if budget == "streaming" else {}
    with staged(m, **kw) as s:
        out = s.generate(ids, 6)
        np.testing.assert_array_equal(out, reference_greedy(m, ids, 6))
        if budget == "streaming":
            assert all(st.counters.htod_bytes > 0 for st in s.stats().stages)
        # each layer's past stays with its stage: the later stage reads its own layers, and
        # in the builder's layout only those
        later = set(s._model.segments[1].inputs)
        assert "past_key_values.3.key" in later and "past_key_values.3.key" not in s._model.segments[0].inputs
        assert layout != "gqa" or "past_key_values.0.key" not in later
        if layout == "gqa":
            return  # left padding needs standard attention (check_prompt_mask)
        padded = np.array([[0, 0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7]])
        mask = np.array([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
        np.testing.assert_array_equal(s.generate(padded, 4, attention_mask=mask),
                                      reference_greedy(m, padded, 4, attention_mask=mask))


@pytest.mark.parametrize("budget", ["resident", "streaming"])
def test_a_gpt2_mask_that_crosses_the_cut_takes_each_step_s_size(budget):
    """GPT-2 as torch.onnx exports it: its [batch, 1, seq, total] mask crosses the cut, and
    the later stage, a session of its own, takes it at the prompt's size and every decode
    step's."""
    m = gpt2_lm(layers=4, heads=4)
    kw = dict(weight_bytes=[60000, 60000], offload=True, vmm=True) if budget == "streaming" else {}
    with staged(m, **kw) as s:
        assert any(n.startswith("/transformer/Where") for n in s._model.segments[1].inputs)
        if budget == "streaming":
            assert all(stage._runner.streaming and len(stage.segments) > 1 for stage in s.stages)
        for ids in (np.array([[5, 6, 7, 8]]), np.random.default_rng(4).integers(0, 97, (2, 6))):
            np.testing.assert_array_equal(s.generate(ids, 4), reference_greedy(m, ids, 4))
        b, p = 2, 6
        feeds = {"input_ids": np.random.default_rng(5).integers(0, 97, (b, p)),
                 "attention_mask": np.ones((b, p), np.int64), "position_ids": np.tile(np.arange(p), (b, 1))}
        feeds.update({i.name: np.zeros((b, 4, 0, 16), np.float32) for i in s.get_inputs() if "past" in i.name})
        for got, want in zip(s.run(None, feeds), plain(m, feeds)):
            np.testing.assert_array_equal(got, want)


def test_generate_stops_at_eos_and_an_interrupted_generation_leaves_a_usable_session():
    m = decoder_lm("gqa", layers=4, max_length=128)
    ids = np.random.default_rng(2).integers(0, 97, (1, 5))
    ref = reference_greedy(m, ids, 6)
    with staged(m) as s:
        new = list(ref[0, 5:])
        eos = int(new[2])
        assert s.generate(ids, 6, eos_token_id=eos).shape[1] == 5 + new.index(eos) + 1 < 11
        for taken in (1, 4):  # before the decode steps' fixed buffers exist, and after
            it = s.generate_iter(ids, 6)
            for _ in range(taken):
                next(it)
            it.close()
            zones = [stage.device.ledger.snapshot().zones for stage in s.stages]
            assert [z["kv"].committed.current for z in zones] == [0, 0]
            assert [stage._runner.plan_count for stage in s.stages] == [0, 0]
        np.testing.assert_array_equal(s.generate(ids, 6), ref)


@pytest.mark.parametrize("layout", ["gqa", "standard"])
def test_each_stage_keeps_its_layers_cache_in_its_own_device_s_kv_zone(layout):
    m = decoder_lm(layout, layers=4, max_length=128)
    ids = np.random.default_rng(3).integers(0, 97, (2, 9))
    with staged(m) as s:
        def kv(stage):
            return stage.device.ledger.snapshot().zones["kv"].content.current
        it = s.generate_iter(ids, 5)
        next(it)
        moved = s.moved_bytes
        next(it)  # a decode step
        step = s.moved_bytes - moved
        held = [kv(stage) for stage in s.stages]
        # Two layers each, keys and values, float32, [batch 2, 2 heads, positions, 16]: the
        # builder's layout holds the whole length (9 + 5 - 1) in one buffer; the standard
        # layout a past and a present with room for 16 positions.
        each = 2 * 2 * (2 * 2 * 13 * 16 * 4) if layout == "gqa" else 2 * 2 * 2 * (2 * 2 * 16 * 16 * 4)
        assert held == [each] * 2
        next(it)  # the decode steps from here run at fixed addresses (builder layout)
        plans = [stage._runner.plan_count for stage in s.stages]
        assert plans == [int(layout == "gqa")] * 2
        list(it)
        assert [kv(stage) for stage in s.stages] == [0, 0]
        # The builder layout's decode steps run at fixed addresses, a plan kept per stage for
        # the generation (a captured graph where the engine captures), dropped at its end.
        assert [stage._runner.plan_count for stage in s.stages] == [0, 0]
        # A decode step moves the values crossing the cut and no past: a later stage of a
        # standard export reads the first layer's past for its length only, and is fed its
        # own. (The builder's two crossing values are [batch, 1, hidden] each.)
        assert 0 < step < 2 * 2 * 9 * 16 * 4  # one layer's key at the prompt's length
        assert layout != "gqa" or step == s.split.crossings[0] * 2 * 1 * 64 * 4


# ---------------------------------------------------------------------- the command line

def test_the_command_line_splits_a_model_across_devices(tmp_path, capsys):
    from onnx_offload.models.decoder import genai_config, save_decoder
    from onnx_offload.tools.cli import main
    m = decoder_lm("gqa", layers=4, max_length=128)
    save_decoder(m, str(tmp_path), config=genai_config(4, 64, 4, 2, 97, 128, eos_token_id=-1))
    ids = np.array([[5, 6, 7, 8]])
    want = reference_greedy(m, ids, 5)[0, 4:]
    rc = main(["generate", str(tmp_path), "--cpu", "--devices", "0,1", "--prompt-ids", "5,6,7,8",
               "--max-new-tokens", "5", "--vram-limit", "64MiB"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "tokens: " + ",".join(map(str, want)) in out.out
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(tmp_path / "model.onnx"), "--cpu", "--devices", "0,0"])
    assert exit_.value.code == 2 and "distinct device ids" in capsys.readouterr().err


def test_bench_compare_over_devices_runs_each_row_and_gives_the_anchor_s_tokens(tmp_path):
    from onnx_offload.tools.bench_devices import bench_devices, print_devices
    res = bench_devices("host", str(tmp_path), [0, 1], prompt=16, new=8)
    assert not res["failures"]
    (model,) = res["models"]  # the 8B shape's rows run on CUDA only
    assert [r["devices"] for r in model["rows"]] == [[0], [0, 1]]
    assert all(r["tokens_equal"] for r in model["rows"])
    two = model["rows"][1]
    assert len(two["stage_weights"]) == 2 and all(s > 0 for s in two["streamed_per_step"])
    assert "vs one device" in print_devices(res)


def test_session_keywords_reach_every_stage_and_device_id_is_refused():
    m = mlp_stack(layers=4, hidden=64, batch=3)
    with staged(m, record_timeline=True, disabled_optimizers=["ConstantFolding"]) as s:
        s.run(None, {"x": np.ones((3, 64), np.float32)})
        assert all(stage._disabled_optimizers == ["ConstantFolding"] for stage in s.stages)
    with pytest.raises(TypeError, match="devices="):
        staged(m, device_id=1)


def test_no_stage_is_left_without_weights():
    """Nodes before the first weight (a Shape of the input) join the first stage: alone they
    would make a stage with nothing to compute that a later stage does not compute again."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Shape", ["x"], ["shape"])]
    for i in range(3):
        nodes.append(helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"], [f"h{i}"]))
    nodes.append(helper.make_node("Reshape", ["h2", "shape"], ["y"]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 64])],
                          [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w{i}")
                           for i in range(3)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.ones((2, 64), np.float32)
    with staged(m, devices=(0, 1, 2)) as s:
        assert all(seg.weights and seg.outputs for seg in s._model.segments)
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], plain(m, {"x": x})[0])
    with pytest.raises(UnsupportedModel, match="cannot be split over 4 devices"):
        staged(m, devices=(0, 1, 2, 3))


def test_the_drop_in_members_answer_as_ort_does():
    m = mlp_stack(layers=4, hidden=64, batch=3)
    with pytest.raises(TypeError, match="not both"):
        OffloadSession(m.SerializeToString(), providers=CPU, devices=[0, 1], config=OffloadConfig(), vram_limit="1MiB")
    x = ort.OrtValue.ortvalue_from_numpy(np.ones((3, 64), np.float32))
    with staged(m) as s:
        boundary = s._model.segments[0].outputs[0]
        for names in (["bogus"], [boundary]):  # a value between stages is no output of the model
            with pytest.raises(Exception, match="Invalid output name"):
                s.run_with_ort_values(names, {"x": x})
        with pytest.raises(NotImplementedError, match="run_with_ort_values"):
            s.io_binding()
        done = threading.Event()
        got = []
        s.run_async(None, {"x": x.numpy()}, lambda out, data, err: (got.append((out, data, err)), done.set()), 7)
        assert done.wait(60)
        (out, data, err), = got
        assert err == "" and data == 7
        np.testing.assert_array_equal(out[0], plain(m, {"x": x.numpy()})[0])


def test_an_input_no_node_reads_is_listed_as_ort_lists_it():
    from onnx import TensorProto, helper
    m = mlp_stack(layers=4, hidden=64, batch=3)
    m.graph.input.append(helper.make_tensor_value_info("unused", TensorProto.FLOAT, [1]))
    with staged(m) as s:
        want = [i.name for i in ort.InferenceSession(m.SerializeToString(), providers=CPU).get_inputs()]
        assert [i.name for i in s.get_inputs()] == want == ["x", "unused"]


def _list_advice(error) -> dict:
    """The budget keywords a staged session's error tells the caller to pass, each a list
    of one value per device."""
    import ast
    import re
    said = str(error).split(" pass ")[-1]
    advice = {k: ast.literal_eval(v) for k, v in re.findall(r"\b(\w+)=(\[[^\]]*\])", said)}
    assert advice, str(error)
    return advice


def test_a_shortage_names_its_device_and_the_advice_runs():
    from onnx_offload import BudgetExceeded
    m = mlp_stack(layers=6, hidden=128, batch=3)
    with pytest.raises(BudgetExceeded, match=r"^device 7 \(stage 2 of 2\): ") as e:
        staged(m, devices=(3, 7), vram_limit=["360KiB", "140KiB"])
    with staged(m, devices=(3, 7), **_list_advice(e.value)) as s:
        x = np.ones((3, 128), np.float32)
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], plain(m, {"x": x})[0])


@pytest.mark.parametrize("layout", ["gqa", "standard"])
def test_a_staged_session_s_advice_holds_a_generation_in_one_round(layout):
    """Following one device's entry moves more of the model onto that device (the split
    balances by allowance): the advice is tried with the split it causes, every device's
    entries at once, with the caches of a sequence of the model's context and a prompt
    chunk's step, so that following it once runs."""
    from onnx_offload import BudgetExceeded
    m = decoder_lm(layout, layers=4, hidden=128, intermediate=384, vocab=512, max_length=512)
    ids = np.random.default_rng(0).integers(0, 512, (1, 300))
    kw = dict(offload=True, vmm=True, prefill_chunk=128)
    with pytest.raises(BudgetExceeded, match="on every device, these hold it") as e:
        staged(m, vram_limit=[300000, 300000], **kw)
    advice = _list_advice(e.value)
    assert set(advice) >= {"vram_limit", "kv_bytes"} and all(len(v) == 2 for v in advice.values())
    with staged(m, **advice, **kw) as s:
        np.testing.assert_array_equal(s.generate(ids, 4), reference_greedy(m, ids, 4))
        np.testing.assert_array_equal(s.generate(ids[:, :8], 300), reference_greedy(m, ids[:, :8], 300))


@pytest.mark.parametrize("layout", ["gqa", "standard"])
def test_a_stage_per_layer_gives_plain_ort_s_tokens(layout):
    """Six stages, each a layer: the builder layout's caches are zeroed on each device's
    stream before the prompt writes them (a race there shows with many stages)."""
    m = decoder_lm(layout, layers=6, max_length=128)
    ids = np.random.default_rng(1).integers(0, 97, (4, 7))
    want = reference_greedy(m, ids, 6)
    for _ in range(3):
        with staged(m, devices=range(6)) as s:
            np.testing.assert_array_equal(s.generate(ids, 6), want)


def test_a_cache_short_of_room_makes_its_device_s_weights_stream_and_the_advice_runs():
    import re
    import warnings
    m = decoder_lm("gqa", layers=4, max_length=512)
    ids = np.random.default_rng(0).integers(0, 97, (4, 100))
    want = reference_greedy(m, ids, 8)
    kw = dict(vram_limit="600KiB", offload=True, vmm=True, scratch_bytes=65536)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with staged(m, **kw) as s:
            np.testing.assert_array_equal(s.generate(ids, 8), want)
            assert all(st.counters.htod_bytes > 0 for st in s.stats().stages)
    advice = [str(w.message) for w in seen if "kv_bytes=" in str(w.message)]
    assert advice, [str(w.message) for w in seen]
    kv = int(re.search(r"kv_bytes=(\d+)", advice[0]).group(1))
    with staged(m, kv_bytes=kv, **kw) as s:
        np.testing.assert_array_equal(s.generate(ids, 8), want)


@pytest.mark.parametrize("layout", ["gqa", "standard", "exact"])
def test_a_long_prompt_runs_in_chunks_across_devices_and_gives_plain_ort_s_tokens(layout, monkeypatch):
    m = decoder_lm("standard", position_ids=False, layers=4, max_length=128) if layout == "exact" else \
        decoder_lm(layout, layers=4, max_length=128)
    ids = np.random.default_rng(4).integers(0, 97, (2, 40))
    want = reference_greedy(m, ids, 5)
    shapes = []
    move_into = StepMoves.move_into

    def seen(self, source, value, dst):
        shapes.append(list(value.shape()))
        return move_into(self, source, value, dst)
    monkeypatch.setattr(StepMoves, "move_into", seen)
    with staged(m, prefill_chunk=16) as s:
        np.testing.assert_array_equal(s.generate(ids, 5), want)
    # What crossed between the devices came in chunks of at most 16 positions (8, 16, 16),
    # each row on its own in the builder's layout; unchunked, a value of 40 would cross.
    hidden = [sh for sh in shapes if len(sh) == 3 and sh[-1] == 64]
    assert hidden and max(sh[1] for sh in hidden) == 16
    assert {sh[0] for sh in hidden if sh[1] > 1} == ({1} if layout == "gqa" else {2})


def test_an_interrupt_while_a_generation_closes_leaves_no_stage_s_plan_behind(monkeypatch):
    m = decoder_lm("gqa", layers=4, max_length=128)
    ids = np.random.default_rng(5).integers(0, 97, (1, 6))
    with staged(m) as s:
        it = s.generate_iter(ids, 6)
        for _ in range(4):  # each stage's decode plan exists from here
            next(it)
        assert [st._runner.plan_count for st in s.stages] == [1, 1]
        first = s.stages[0]._runner
        drop = type(first).drop_plans

        def interrupted(self, keys):
            drop(self, keys)
            if self is first:
                raise KeyboardInterrupt
        monkeypatch.setattr(type(first), "drop_plans", interrupted)
        with pytest.raises(KeyboardInterrupt):
            it.close()
        monkeypatch.setattr(type(first), "drop_plans", drop)
        assert [st._runner.plan_count for st in s.stages] == [0, 0]
        assert [st.device.ledger.snapshot().zones["kv"].committed.current for st in s.stages] == [0, 0]
        np.testing.assert_array_equal(s.generate(ids, 6), reference_greedy(m, ids, 6))


# ---------------------------------------------------------------------- as InferenceSession

def test_every_public_member_of_inference_session_is_on_both_kinds_of_session():
    m = mlp_stack(layers=4, hidden=64, batch=3)
    members = [n for n in dir(ort.InferenceSession) if not n.startswith("_")]
    with staged(m) as split, OffloadSession(m.SerializeToString(), providers=CPU) as one:
        for session in (split, one):
            assert [n for n in members if not hasattr(session, n)] == [], type(session).__name__


def test_a_staged_session_answers_what_inference_session_answers(tmp_path, monkeypatch):
    from onnx import TensorProto, helper
    monkeypatch.chdir(tmp_path)
    m = mlp_stack(layers=4, hidden=64, batch=3)
    m.graph.input.append(helper.make_tensor_value_info("b0", TensorProto.FLOAT, [64]))  # overridable
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = "split"
    x = np.ones((3, 64), np.float32)
    plain_session = ort.InferenceSession(m.SerializeToString(), providers=CPU)
    with OffloadSession(m.SerializeToString(), so, providers=CPU, devices=[0, 1], host_granularity=4096,
                        vram_limit="64MiB") as s:
        assert s.get_session_options() is so
        assert [i.name for i in s.get_overridable_initializers()] == \
            [i.name for i in plain_session.get_overridable_initializers()] == ["b0"]
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], plain_session.run(None, {"x": x})[0])
        s.disable_fallback()
        s.enable_fallback()
        with pytest.raises(StateError, match="providers fixed"):
            s.set_providers(CPU)
        for member in ("get_input_memory_infos", "get_output_memory_infos"):
            with pytest.raises(StateError, match="stages on devices"):
                getattr(s, member)()
        with pytest.raises(StateError, match="run_with_ort_values"):
            s.run_with_ortvaluevector(None, [], [], [], [], [])
        assert isinstance(s.get_tuning_results(), list)
        assert s.create_ortvalue_from_shape_and_type([2, 3], np.float32, "cpu").shape() == [2, 3]
        start = s.get_profiling_start_time_ns()
        assert start == min(stage.get_profiling_start_time_ns() for stage in s.stages) > 0
        with open(s.end_profiling()) as f:
            events = json.load(f)
    # One file holds both stages' kernels; no stage's own file is left beside it.
    assert {e["args"]["offload_stage"] for e in events if e.get("cat") == "Node"} == {0, 1}
    assert [p.name.endswith("_merged.json") for p in tmp_path.glob("split*.json")] == [True]


def test_the_optimum_route_reads_the_c_session_of_a_staged_session():
    from onnx_offload.optimum_model import _SessionForOptimum
    m = mlp_stack(layers=4, hidden=64, batch=3)
    with staged(m) as s:
        wrapped = _SessionForOptimum(s, "model.onnx")
        assert type(wrapped._sess).__name__ == "InferenceSession"  # ORT's C session, as Optimum reads it
        assert [i.name for i in wrapped.get_inputs()] == ["x"]


# ---------------------------------------------------------------------- the optimized model

def decoder_feeds(model, b=2, p=5):
    """A prompt's feeds for a decoder made by the models package: an empty past."""
    names = {i.name: i for i in ort.InferenceSession(model.SerializeToString(), providers=CPU).get_inputs()}
    feeds = {"input_ids": np.random.default_rng(6).integers(0, 97, (b, p)), "attention_mask": np.ones((b, p), np.int64)}
    if "position_ids" in names:
        feeds["position_ids"] = np.tile(np.arange(p), (b, 1))
    feeds.update({n: np.zeros((b, i.shape[1], 0, i.shape[3]), np.float32) for n, i in names.items() if "past" in n})
    return feeds


@pytest.mark.parametrize("model", ["gpt2", "standard", "gqa"])
def test_the_whole_optimized_model_is_written_and_the_stages_run_its_kernels(model, tmp_path):
    """optimized_model_filepath gets the whole model as ORT optimizes it (what a session on
    one device writes), not a stage's part of it; the stages run that optimized graph, so
    their outputs are plain ORT's to the bit."""
    m = gpt2_lm() if model == "gpt2" else decoder_lm(model, layers=4)
    feeds = decoder_feeds(m)
    want = plain(m, feeds)
    options = {}
    for kind in ("split", "one"):
        options[kind] = so = ort.SessionOptions()
        so.optimized_model_filepath = str(tmp_path / f"{kind}.onnx")
    with OffloadSession(m.SerializeToString(), options["split"], providers=CPU, devices=[0, 1],
                        host_granularity=4096, vram_limit="64MiB") as s:
        assert len({tuple(seg.inputs) for seg in s._model.segments}) == 2
        got = s.run(None, feeds)
    OffloadSession(m.SerializeToString(), options["one"], providers=CPU).close()
    assert sorted(os.listdir(tmp_path)) == ["one.onnx", "split.onnx"]  # no stage wrote a file of its own
    written, one = onnx.load(str(tmp_path / "split.onnx")), onnx.load(str(tmp_path / "one.onnx"))
    assert [i.name for i in written.graph.input] == [i.name for i in m.graph.input]
    assert [o.name for o in written.graph.output] == [o.name for o in m.graph.output]
    assert [n.op_type for n in written.graph.node] == [n.op_type for n in one.graph.node]
    again = ort.InferenceSession(str(tmp_path / "split.onnx"), providers=CPU).run(None, feeds)
    for name, g, a, w in zip([o.name for o in m.graph.output], got, again, want):
        np.testing.assert_array_equal(g, w, err_msg=name)
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("whole", [True, False])
def test_a_cut_through_a_pattern_ort_fuses_keeps_plain_ort_s_outputs(whole, monkeypatch):
    """Over three devices GPT-2's cut falls inside the tanh GELU that ORT fuses (FastGelu):
    the whole model's optimized graph, cut, runs plain ORT's fused kernel, to the bit;
    stages that optimize their own parts cannot fuse across the cut and run the GELU
    unfused, within float32 rounding of it."""
    from onnx_offload.devices import stages
    if not whole:
        monkeypatch.setattr(stages, "optimize_whole", lambda src, folder, pass_: "each stage optimizes its part")
    m = gpt2_lm()
    feeds = decoder_feeds(m)
    with staged(m, devices=(0, 1, 2)) as s:
        got = s.run(None, feeds)
    for name, g, w in zip([o.name for o in m.graph.output], got, plain(m, feeds)):
        if whole:
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)


def test_where_the_whole_model_cannot_be_optimized_the_stages_optimize_their_parts(monkeypatch, tmp_path):
    """The CUDA pass holds every weight on one device: where that does not fit, the model is
    cut as exported and each stage optimizes its part; no optimized model of the whole
    exists then, and asking for one is refused with the reason."""
    from onnx_offload.devices import stages
    why = "ORT's optimization pass of the whole model did not fit device 0's free memory (out of memory)"
    monkeypatch.setattr(stages, "optimize_whole", lambda src, folder, whole: why)
    m = gpt2_lm()
    feeds = decoder_feeds(m)
    with staged(m) as s:
        assert s._model.optimized is None
        assert all(why in stage.stats().notes for stage in s.stages)
        for got, want in zip(s.run(None, feeds), plain(m, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "split.onnx")
    with pytest.raises(UnsupportedModel, match="no optimized model of the whole exists to write"):
        OffloadSession(m.SerializeToString(), so, providers=CPU, devices=[0, 1], host_granularity=4096,
                       vram_limit="64MiB")
    assert os.listdir(tmp_path) == []
