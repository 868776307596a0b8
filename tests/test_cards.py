"""A card smaller than the model, on the CPU host backend: a long prompt in chunks with its
scratch bounded by the chunk, every budget from the smallest the package names up to the
whole model giving plain ORT's tokens, and every piece of advice the package gives,
followed, running."""
import re
import shlex
import subprocess
import sys
import warnings

import numpy as np
import pytest

from onnx_offload import BudgetExceeded, OffloadSession, OffloadWarning
from onnx_offload.generation.steps import CHUNK_NOTE
from onnx_offload.models import weight_bytes
from onnx_offload.models.decoder import decoder_lm, genai_config, save_decoder

from conftest import reference_greedy

CPU = ["CPUExecutionProvider"]
G = 4096  # host granule: small, so that budgets of a few hundred KiB are meaningful
_MODELS = {}


def model_of(layout):
    if layout not in _MODELS:
        _MODELS[layout] = decoder_lm(layout, hidden=128, intermediate=384, vocab=512, max_length=4096)
    return _MODELS[layout]


def session(model, **kw):
    kw.setdefault("host_granularity", G)
    return OffloadSession(model.SerializeToString(), providers=CPU, offload=True, vmm=True, **kw)


def prompt(batch, length, seed=0):
    return np.random.default_rng(seed).integers(0, 512, (batch, length))


ADVICE = re.compile(r"pass ((?:\w+=\d+(?:, )?)+)")


def advice_of(error: BaseException) -> dict:
    """The keywords an error tells the caller to pass."""
    m = ADVICE.search(str(error))
    assert m, f"no advice in: {error}"
    return {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).rstrip(", ").split(", "))}


@pytest.mark.parametrize("layout", ["gqa", "standard"])
def test_a_long_prompt_runs_in_chunks_with_its_scratch_bounded_by_the_chunk(layout):
    model = model_of(layout)
    peaks = {}
    for length in (256, 2048):
        ids = prompt(1, length)
        want = reference_greedy(model, ids, 6)
        with session(model, vram_limit="64MiB", weight_bytes=weight_bytes(model) // 2, prefill_chunk=128) as s:
            steps = []
            run_bound = s._run_bound

            def counted(feeds, outputs, **kw):
                steps.append(feeds["input_ids"].shape()[1])
                return run_bound(feeds, outputs, **kw)
            s._run_bound = counted
            np.testing.assert_array_equal(s.generate(ids, 6), want)
            assert len(s.segments) > 1  # the weights streamed
            assert max(steps) == 128 and sum(steps) == length + 5  # the prompt in chunks, then 5 decode steps
            peaks[length] = s.device.ledger.snapshot().zones["scratch"].committed.peak
            # The CPU EP's chunks give one step's tokens (above): no note of rounding.
            assert CHUNK_NOTE not in s.stats().notes
            assert s.close().committed == 0
    if layout == "gqa":
        # What the steps hold in scratch depends on the chunk, not on the prompt: eight
        # times the prompt adds only the mask's bytes.
        assert peaks[2048] <= peaks[256] + (64 << 10), peaks
    else:
        # Standard attention's values between segments hold a chunk's scores against the
        # whole past: chunk x length, linear in the prompt (one step would be quadratic).
        assert peaks[2048] <= 2048 / 256 * peaks[256], peaks


@pytest.mark.parametrize("layout", ["gqa", "standard"])
def test_each_chunk_layout_gives_the_tokens_of_one_step(layout):
    """Prompts around the chunk's length, a batch, and (standard) left padding."""
    model = model_of(layout)
    for length, batch in ((64, 1), (65, 2), (200, 2)):
        ids = prompt(batch, length, seed=length)
        mask = None
        if layout == "standard" and batch > 1:
            mask = np.ones((batch, length), np.int64)
            mask[1, :9] = 0
        want = reference_greedy(model, ids, 5, attention_mask=mask)
        with session(model, vram_limit="64MiB", weight_bytes=weight_bytes(model) // 2, prefill_chunk=64) as s:
            np.testing.assert_array_equal(s.generate(ids, 5, attention_mask=mask), want)


def test_every_budget_from_the_smallest_named_up_to_the_whole_model_gives_ort_s_tokens():
    model = model_of("gqa")
    ids = prompt(2, 300)
    want = reference_greedy(model, ids, 6)
    with pytest.raises(BudgetExceeded) as e:
        session(model, vram_limit=G, prefill_chunk=64)
    least = e.value.smallest_budget  # the session's; the advice holds a sequence of the model's context too
    assert 0 < least < advice_of(e.value)["vram_limit"] and e.value.reason and "pass" not in e.value.reason
    whole = weight_bytes(model) + (8 << 20)
    budgets = [least] + [int(least + (whole - least) * k / 5) // G * G for k in range(1, 6)]
    for budget in budgets:
        with session(model, vram_limit=budget, prefill_chunk=64) as s:
            try:
                got = s.generate(ids, 6)
            except BudgetExceeded as short:  # the cache does not fit this budget: the advice runs
                kw = advice_of(short)
                with session(model, **{"prefill_chunk": 64, **kw}) as t:  # the advice may name a smaller chunk
                    got = t.generate(ids, 6)
            np.testing.assert_array_equal(got, want, err_msg=f"budget {budget}")
            assert s.close().committed == 0


@pytest.mark.parametrize("layout", ["gqa", "standard"])
def test_the_advice_of_a_budget_too_small_for_the_session_holds_a_sequence_of_its_context(layout):
    """One round: the session's advice names the budget and reserves that also hold a
    generation of one sequence up to the context the session plans for (its prompt in
    chunks, or decoding to that length), and following it, such generations run."""
    model = model_of(layout)
    with pytest.raises(BudgetExceeded, match="one sequence of up to 4096 positions") as e:
        session(model, vram_limit=64 << 10, prefill_chunk=256)
    kw = advice_of(e.value)
    assert set(kw) - {"prefill_chunk"} == {"vram_limit", "kv_bytes", "scratch_bytes"}
    assert kw["vram_limit"] > e.value.smallest_budget
    for ids, new in ((prompt(1, 3000), 8), (prompt(1, 600), 8), (prompt(1, 8), 300)):
        with session(model, **{"prefill_chunk": 256, **kw}) as s:  # the advice may name a smaller chunk
            np.testing.assert_array_equal(s.generate(ids, new), reference_greedy(model, ids, new))
            assert s.close().committed == 0


def test_the_advice_is_tried_with_what_ort_takes_at_session_creation(monkeypatch):
    """On a GPU, ORT takes memory of its own when its sessions are made, which no plan
    counts before ORT takes it (on the host backend ORT's memory is the process's own):
    here ORT is made to take 1 MiB more than a budget has room for, as the meter would
    say it. The advice is the budget raised by that much and tried: followed, it runs."""
    from onnx_offload.engines import Engines
    from onnx_offload.memory import StepMemoryShort
    model = model_of("gqa")
    with pytest.raises(BudgetExceeded) as e:
        session(model, vram_limit=64 << 10)
    least = e.value.smallest_budget
    ort_takes, took = 1 << 20, []
    start = Engines.start

    def taking(self, *a, **kw):
        if self.device.budget < least + ort_takes:
            took.append(self.device.budget)
            raise StepMemoryShort(f"ORT took {ort_takes} bytes of device memory for its own use (its arena, "
                                  f"workspaces), which the scratch zone has no room for: ...", ort_takes)
        return start(self, *a, **kw)
    monkeypatch.setattr(Engines, "start", taking)
    with pytest.raises(BudgetExceeded) as e:
        session(model, vram_limit=64 << 10)
    kw = advice_of(e.value)
    # tried at the smallest budget, where ORT's memory was short, then with it added
    assert took == [least] and kw["vram_limit"] >= least + ort_takes and e.value.smallest_budget == least
    ids = prompt(1, 600)
    with session(model, **kw) as s:
        np.testing.assert_array_equal(s.generate(ids, 4), reference_greedy(model, ids, 4))


def test_the_advice_for_a_cache_that_does_not_fit_runs_when_followed():
    model = model_of("standard")
    ids = prompt(4, 600)
    with session(model, vram_limit=weight_bytes(model) // 3, prefill_chunk=128) as s:
        with pytest.raises(BudgetExceeded) as e:
            s.generate(ids, 4)
        assert s.device.ledger.snapshot().zones["kv"].committed.current == 0  # nothing left behind
        np.testing.assert_array_equal(s.generate(ids[:1, :8], 4), reference_greedy(model, ids[:1, :8], 4))
    kw = advice_of(e.value)
    with session(model, **{"prefill_chunk": 128, **kw}) as s:  # the advice may name a smaller chunk
        np.testing.assert_array_equal(s.generate(ids, 4), reference_greedy(model, ids, 4))


@pytest.mark.parametrize("layout", ["gqa", "standard"])
def test_a_cache_buffer_over_the_whole_budget_names_a_budget_that_runs(layout):
    """The smallest budget that holds the session holds its weights; a generation whose
    one cache buffer is larger than that whole budget says the budget that holds the
    weights and the cache, and that budget runs it."""
    model = model_of(layout)
    ids = prompt(8, 600)
    with pytest.raises(BudgetExceeded) as first:
        session(model, vram_limit=64 << 10)
    least = first.value.smallest_budget
    with session(model, vram_limit=least) as s:
        with pytest.raises(BudgetExceeded, match="more than the whole budget") as second:
            s.generate(ids, 100)
        assert s.device.ledger.snapshot().zones["kv"].committed.current == 0
    kw = advice_of(second.value)
    assert kw["vram_limit"] > least and "kv_bytes" in kw
    with session(model, **kw) as s:
        np.testing.assert_array_equal(s.generate(ids, 100), reference_greedy(model, ids, 100))


def _saved(layout, tmp_path) -> str:
    return save_decoder(model_of(layout), str(tmp_path / "llm"),
                        config=genai_config(2, 128, 4, 2, 512, 4096, eos_token_id=-1))


def _generate(path, ids, *flags, cwd):
    """`onnx-offload generate` on the CPU; `ids`: one row or a batch, as --prompt-ids takes them."""
    if not isinstance(ids, str):
        ids = ";".join(",".join(str(t) for t in row) for row in ids)
    return subprocess.run([sys.executable, "-m", "onnx_offload", "generate", path, "--cpu", "--prompt-ids", ids,
                           "--cache-dir", "off", *flags], capture_output=True, text=True, cwd=str(cwd), env=_env())


def _one_advice(run) -> list:
    """The flags of the one piece of advice a failed command gave, on its one line of
    stderr (what the probe session says is not the command's)."""
    assert run.returncode == 2 and "BudgetExceeded" in run.stderr, run.stderr
    advice = re.findall(r"pass ((?:--[\w-]+ \d+(?: |$))+)", run.stderr.strip())
    assert len(advice) == 1 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    return advice[0].split()


def test_the_cli_gives_its_own_flags_as_advice_and_they_run(tmp_path):
    path = _saved("gqa", tmp_path)
    base = ["--max-new-tokens", "4", "--prefill-chunk", "64"]
    # A budget too small for the session, and one that holds the session and not the
    # generation's cache: the command knows the generation, so one piece of advice, in
    # its own flags, covers both, and following it runs.
    for flags in (["--vram-limit", "2MiB"], ["--vram-limit", "6MiB"]):
        run = _generate(path, prompt(1, 300), *base, *flags, cwd=tmp_path)
        assert "vram_limit=" not in run.stderr, run.stderr
        flags = _one_advice(run)
        assert "--kv-bytes" in flags, run.stderr
        run = _generate(path, prompt(1, 300), *base, *flags, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert "tokens: " in run.stdout


@pytest.mark.parametrize("devices", [None, "0,1"])
def test_the_cli_s_advice_pastes_into_a_shell_as_given(tmp_path, devices):
    """The flags after "pass" are a shell line: pasted after the command, as given, they run."""
    path = _saved("gqa", tmp_path)
    ids = ",".join(str(t) for t in prompt(1, 300)[0])
    base = ["--max-new-tokens", "4", "--prefill-chunk", "64"] + (["--devices", devices] if devices else [])
    run = _generate(path, ids, *base, "--vram-limit", "2MiB", cwd=tmp_path)
    assert run.returncode == 2 and "BudgetExceeded" in run.stderr and len(run.stderr.strip().splitlines()) == 1, \
        run.stderr
    said = run.stderr.strip().split(" pass ")[-1]
    assert said.startswith("--") and ", " not in said, run.stderr
    line = " ".join(shlex.quote(w) for w in [sys.executable, "-m", "onnx_offload", "generate", path, "--cpu",
                                                "--prompt-ids", ids, "--cache-dir", "off", *base]) + " " + said
    pasted = subprocess.run(["sh", "-c", line], capture_output=True, text=True, cwd=str(tmp_path), env=_env())
    assert pasted.returncode == 0, (said, pasted.stderr)
    assert "tokens: " in pasted.stdout


def test_the_cli_s_advice_across_devices_names_one_value_per_device_and_runs_in_one_round(tmp_path):
    path = _saved("gqa", tmp_path)
    ids, base = prompt(1, 300), ["--max-new-tokens", "4", "--prefill-chunk", "64"]
    alone = _generate(path, ids, *base, cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    # Too small for either device's stage and for the caches: one piece of advice, each
    # budget flag a list in the order of --devices, every device's shortage tried in it.
    run = _generate(path, ids, *base, "--devices", "0,1", "--vram-limit", "2MiB", cwd=tmp_path)
    assert run.returncode == 2 and "BudgetExceeded" in run.stderr and len(run.stderr.strip().splitlines()) == 1, \
        run.stderr
    assert "vram_limit=" not in run.stderr and "its entry in a list" not in run.stderr, run.stderr
    advice = re.findall(r"(--[\w-]+) ((?:\d+|auto),(?:\d+|auto))\b", run.stderr.split(" pass ")[-1])
    assert advice and {flag for flag, _ in advice} >= {"--vram-limit", "--kv-bytes"}, run.stderr
    flags = [w for pair in advice for w in pair]
    run = _generate(path, ids, *base, "--devices", "0,1", *flags, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[0] == alone.stdout.split("\n")[0]  # the tokens' line


def test_the_cli_s_advice_across_devices_holds_a_cache_that_grows_while_decoding(tmp_path):
    # Standard attention's caches grow as the generation decodes: the advice holds their
    # last size on every device, and --devices 0 (one session) is advised as one session.
    path = _saved("standard", tmp_path)
    # (6 MiB holds the session and the caches at the prompt's size, not at 2000 positions.)
    ids, base = prompt(1, 3), ["--max-new-tokens", "2000"]
    for devices, budget in (("0,1", "6MiB"), ("0", "2MiB")):
        run = _generate(path, ids, *base, "--devices", devices, "--vram-limit", budget, cwd=tmp_path)
        assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
        said = run.stderr.split(" pass ")[-1]
        flags = [w for pair in re.findall(r"(--[\w-]+) ((?:\d+|auto)(?:,(?:\d+|auto))*)\b", said) for w in pair]
        assert "--vram-limit" in flags, run.stderr
        run = _generate(path, ids, *base, "--devices", devices, *flags, cwd=tmp_path)
        assert run.returncode == 0, run.stderr


def test_the_cli_s_advice_across_devices_holds_the_past_moved_to_a_stage_with_no_layer(tmp_path):
    # Standard attention, split where the first stage holds no layer but reads the first
    # layer's past for its shape: that past is moved into its scratch each step, as long
    # as the cache. The advice holds its last size on that device too.
    model = decoder_lm("standard", layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512,
                       max_length=4096)
    path = save_decoder(model, str(tmp_path / "split"), config=genai_config(2, 128, 4, 2, 512, 4096, eos_token_id=-1))
    ids, base = prompt(8, 3), ["--max-new-tokens", "1500", "--devices", "0,1"]
    run = _generate(path, ids, *base, "--vram-limit", "2MiB", cwd=tmp_path)
    said = run.stderr.split(" pass ")[-1]
    advice = dict(re.findall(r"(--[\w-]+) ((?:\d+|auto),(?:\d+|auto))\b", said))
    assert run.returncode == 2 and advice.get("--scratch-bytes", "auto,").split(",")[0] != "auto", run.stderr
    run = _generate(path, ids, *base, *[w for kv in advice.items() for w in kv], cwd=tmp_path)
    assert run.returncode == 0, run.stderr


def test_the_cli_s_budget_lists_need_devices_and_one_value_for_each(tmp_path):
    path = _saved("gqa", tmp_path)
    for flags, says in ((["--vram-limit", "8MiB,8MiB"], "needs --devices"),
                        (["--devices", "0,1", "--kv-bytes", "1MiB,1MiB,1MiB"], "gives 3 values for the 2 devices"),
                        (["--devices", "0,1", "--scratch-bytes", "1MiB,lots"], "--scratch-bytes")):
        run = _generate(path, prompt(1, 8), "--max-new-tokens", "1", *flags, cwd=tmp_path)
        assert run.returncode == 2 and "ValueError" in run.stderr and says in run.stderr, run.stderr


def test_the_cli_s_advice_holds_a_cache_that_grows_while_decoding(tmp_path):
    # Standard attention's cache doubles as the generation decodes: the advice for a budget
    # too small for the session holds its last size, so one round runs.
    path = _saved("standard", tmp_path)
    run = _generate(path, prompt(8, 60), "--max-new-tokens", "200", "--vram-limit", "2MiB", "--kv-bytes", "2MiB",
                    cwd=tmp_path)
    run = _generate(path, prompt(8, 60), "--max-new-tokens", "200", *_one_advice(run), cwd=tmp_path)
    assert run.returncode == 0, run.stderr


def test_the_cli_s_advice_holds_a_cache_buffer_larger_than_the_session_s_whole_budget(tmp_path):
    # 48 rows of 620 positions: one layer's key buffer (7.6 MB) is over the whole smallest
    # budget that holds the session (6 MiB), so no plan there holds it; the advice names the
    # budget that does, in one round.
    path = _saved("gqa", tmp_path)
    args = ["--max-new-tokens", "20"]
    run = _generate(path, prompt(48, 600), *args, "--vram-limit", "2MiB", cwd=tmp_path)
    assert "more than the whole budget" in run.stderr, run.stderr
    run = _generate(path, prompt(48, 600), *args, *_one_advice(run), cwd=tmp_path)
    assert run.returncode == 0, run.stderr


def test_the_cli_names_arguments_no_budget_runs_before_advising_a_budget(tmp_path):
    path = _saved("gqa", tmp_path)
    for ids, says in ((",".join(["1"] * 4097), "the model holds 4096"), ("1,2,9999", "token ids must lie in")):
        run = _generate(path, ids, "--max-new-tokens", "1", "--vram-limit", "2MiB", cwd=tmp_path)
        assert run.returncode == 2 and "ValueError" in run.stderr and says in run.stderr, run.stderr


def test_the_cli_s_warnings_give_its_own_flags_on_one_line(tmp_path):
    # A cache larger than the room the resident weights leave: the weights stream instead,
    # with a warning whose advice is a flag, then a budget too small for the cache's growth.
    path = _saved("standard", tmp_path)
    # (One row: the cache's peak, 4 MiB, and a streamed segment fit the budget. Two rows'
    # peak, 6 MiB, is the whole budget, which no plan of it holds: that is an error with
    # its advice, and no warning.)
    run = _generate(path, prompt(1, 300), "--max-new-tokens", "8", "--vram-limit", "6MiB", cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert any(line.startswith("onnx-offload: OffloadWarning: ") and "--kv-bytes" in line for line in lines), run.stderr
    assert all(line.startswith("onnx-offload: ") for line in lines), run.stderr
    assert "kv_bytes=" not in run.stderr, run.stderr


def _env():
    import os
    env = dict(os.environ)
    env.pop("ONNX_GENAI_VRAM_LIMIT", None)
    return env


def test_a_model_that_the_cuda_pass_cannot_hold_runs_as_exported(tmp_path):
    """The fallback of ORT's CUDA optimization pass on a card smaller than the model: the
    graph unchanged (no CPU pass, whose inserted float32 casts the CUDA provider would run),
    the weights in the data file, and ORT's outputs those of the model as given."""
    from onnx_offload.loading.optimize import OPTIMIZED, OPTIMIZED_DATA, _as_exported
    model = model_of("gqa")
    src = save_decoder(model, str(tmp_path / "src"))
    out = str(tmp_path / "opt" / OPTIMIZED)
    (tmp_path / "opt").mkdir()
    _as_exported(src, out, 4096)
    import onnx
    saved = onnx.load(out, load_external_data=False)
    assert [n.op_type for n in saved.graph.node] == [n.op_type for n in model.graph.node]
    assert (tmp_path / "opt" / OPTIMIZED_DATA).stat().st_size > weight_bytes(model) // 2
    ids = prompt(1, 9)
    np.testing.assert_array_equal(reference_greedy(onnx.load(out), ids, 4), reference_greedy(model, ids, 4))


def test_ort_running_out_of_memory_in_a_step_is_budget_exceeded_and_the_session_stays_usable():
    """A real out-of-memory of ORT's (a 256 GiB Expand): BudgetExceeded naming the zones,
    also ORT's own Fail, as code written for InferenceSession catches it; then the next
    call runs, and every byte is where it was."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["h"]),
                           helper.make_node("Expand", ["h", "shape"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
                           helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    x = np.ones((1, 64), np.float32)
    with OffloadSession(model.SerializeToString(), providers=CPU, host_granularity=G, cache_dir="off") as s:
        before = s.device.ledger.snapshot().committed
        with pytest.raises(BudgetExceeded, match="ran out of memory.*budget") as e:
            s.run(None, {"x": x, "shape": np.array([1 << 36, 64], np.int64)})
        assert isinstance(e.value, Fail)
        assert s.device.ledger.snapshot().committed == before
        assert s.run(None, {"x": x, "shape": np.array([2, 64], np.int64)})[0].shape == (2, 64)


def test_the_device_running_out_in_a_step_is_a_budget_shortage_and_loses_nothing(monkeypatch):
    """A driver call that finds the device full (memory outside the ledger took what the
    plan counted on: another process, the kernels ORT loads) is a BudgetExceeded naming
    the zones, not the driver's error; the kept generation's buffers go back first, and
    the session runs afterwards."""
    from onnx_offload.errors import CudaDriverError
    from onnx_offload.engines.runner import SegmentRunner
    model = model_of("gqa")
    ids = prompt(1, 12)
    want = reference_greedy(model, ids, 4)
    calls = []

    def full(*a, **kw):
        calls.append(1)
        e = CudaDriverError("DRV(cuMemCreate) failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)")
        e.error_name = "CUDA_ERROR_OUT_OF_MEMORY"
        raise e
    with session(model) as s:
        np.testing.assert_array_equal(s.generate(ids, 4), want)
        with monkeypatch.context() as m:
            m.setattr(SegmentRunner, "run_bound", full)
            with pytest.raises(BudgetExceeded, match=r"ran out of memory in a step.*weights \d+ committed") as e:
                s.generate(ids, 4)  # on the kept buffers
        assert not isinstance(e.value, CudaDriverError) and len(calls) == 1
        assert s._parked is None and s.device.ledger.snapshot().zones["kv"].committed.current == 0
        np.testing.assert_array_equal(s.generate(ids, 4), want)
        # A step beside kept buffers (a run() of the session's): they go back, and the
        # step runs again before the shortage is the caller's.
        assert s._parked is not None
        calls.clear()
        with s._lock, pytest.raises(BudgetExceeded):
            s._with_fallback(full)
        assert len(calls) == 2 and s._parked is None
        np.testing.assert_array_equal(s.generate(ids, 4), want)
    assert s.close().committed == 0


def test_a_full_device_under_a_budget_with_room_is_a_typed_shortage_and_loses_nothing():
    """The device refusing physical memory the budget has room for (the driver's out of
    memory, injected into the host backend's creates) is a BudgetExceeded marked
    device_full, from the arena up through generate(), with every byte accounted and the
    session running afterwards."""
    from onnx_offload.errors import CudaDriverError
    model = model_of("gqa")
    ids = prompt(1, 12)
    want = reference_greedy(model, ids, 4)
    with session(model) as s:
        before = s.device.ledger.snapshot()
        s.device.backend.inject_failure("create", 1, out_of_memory=True, times=4)
        with pytest.raises(BudgetExceeded, match="the device cannot give them although the budget has room") as e:
            s.generate(prompt(2, 12), 4)
        assert e.value.device_full and not isinstance(e.value, CudaDriverError)
        s.device.backend.inject_failure("create", 1 << 60)  # disarmed
        after = s.device.ledger.snapshot()
        assert after.zones["kv"].committed.current == 0 and after.committed == before.committed
        assert s.device.arena.stats().unaccounted_bytes == 0
        np.testing.assert_array_equal(s.generate(ids, 4), want)
    assert s.close().committed == 0


def test_the_advice_for_a_cache_that_doubles_while_decoding_runs_in_one_round():
    """Standard attention's cache doubles as it decodes, each bucket's buffers held beside
    the next one's: the advice sizes the KV reserve from that peak, which the cache's
    buffers commit no more than, and following it runs the generation."""
    model = model_of("standard")
    ids = prompt(2, 5)
    with session(model, vram_limit="1MiB") as s:
        with pytest.raises(BudgetExceeded) as e:
            s.generate(ids, 1000)
    kw = advice_of(e.value)
    with session(model, **kw) as s:
        np.testing.assert_array_equal(s.generate(ids, 1000), reference_greedy(model, ids, 1000))
        assert s.device.ledger.snapshot().zones["kv"].committed.peak <= kw["kv_bytes"]


_LLAMA = {}


def builder_llama():
    """A builder-layout Llama of about 74 MB of weights, most of them the embedding and the
    head of a 32000-token vocabulary: a prompt chunk's logits (512 x 32000 floats, 62.5
    MiB) outweigh its KV cache, as a small real model's do."""
    if not _LLAMA:
        _LLAMA["m"] = decoder_lm("gqa", layers=2, hidden=256, heads=8, kv_heads=4, intermediate=1024, vocab=32000,
                                 max_length=4096)
    return _LLAMA["m"]


def llama_session(**kw):
    """builder_llama()'s session at the host backend's own granule, as a user makes it;
    the notes of weights that stream are not the test's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        return OffloadSession(builder_llama().SerializeToString(), providers=CPU, offload=True, vmm=True, **kw)


def test_the_advice_for_a_long_prompt_names_the_prompt_chunk_that_runs_it_within_the_budget():
    """A 1500-token prompt at 64 MiB: its chunk's logits drive the scratch reserve, so the
    advice says so, names the smallest budget with the configured chunk, and offers the
    chunk that runs it at this budget; followed, it runs."""
    model = builder_llama()
    ids = np.random.default_rng(0).integers(0, 32000, (1, 1500))
    with llama_session(vram_limit="64MiB") as s:
        with pytest.raises(BudgetExceeded) as e, warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadWarning)
            s.generate(ids, 3)
    said = str(e.value)
    assert "the scratch reserve the most of it: a prompt chunk's step of 512 tokens" in said, said
    kw = advice_of(e.value)
    assert kw["prefill_chunk"] < 512 and kw["vram_limit"] <= 64 << 20, said
    with llama_session(**kw) as s:
        np.testing.assert_array_equal(s.generate(ids, 3), reference_greedy(model, ids, 3))


def test_the_advice_of_a_budget_below_the_weights_names_what_drives_it_and_runs():
    """At 32 MiB the session's advice holds a sequence of the model's context: the prompt
    chunk's step drives its scratch, and a smaller chunk lowers the budget to within
    the weights and the cache, not 2.4 times the weights; followed, it runs."""
    model = builder_llama()
    with pytest.raises(BudgetExceeded) as e:
        llama_session(vram_limit="32MiB")
    said = str(e.value)
    assert "the scratch reserve the most of it" in said and "A smaller prompt chunk lowers it" in said, said
    kw = advice_of(e.value)
    assert kw["vram_limit"] < 1.25 * weight_bytes(model) + kw["kv_bytes"], said
    for ids, new in ((prompt(1, 8), 4), (np.random.default_rng(1).integers(0, 32000, (1, 700)), 3)):
        with llama_session(**kw) as s:
            np.testing.assert_array_equal(s.generate(ids, new), reference_greedy(model, ids, new))
