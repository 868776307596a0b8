"""generate() on the CPU host backend: the tokens of a plain-ORT greedy loop over the same
model, for both export layouts, all resident and streamed; the KV cache in the kv zone,
lent by the weights; clear errors that lose nothing."""
import os
import re
import warnings

import numpy as np
import onnxruntime as ort
import pytest

from onnx_offload import BudgetExceeded, OffloadSession, OffloadWarning
from onnx_offload.tools.cli import main
from onnx_offload.errors import UnsupportedModel
from onnx_offload.engines.graph_capture import resolve_graph_capture_enabled
from onnx_offload.models import mlp_stack, weight_bytes
from onnx_offload.models.decoder import decoder_lm, genai_config, save_decoder

from conftest import reference_greedy

CPU = ["CPUExecutionProvider"]
# "exact": the standard layout without position_ids; positions count from the past's length.
LAYOUTS = ("gqa", "standard", "exact")


_MODELS = {}


def make_decoder(layout, **kw):
    if layout == "exact":
        return decoder_lm("standard", position_ids=False, **kw)
    return decoder_lm(layout, **kw)


def model_of(layout):
    if layout not in _MODELS:
        _MODELS[layout] = make_decoder(layout, max_length=256)
    return _MODELS[layout]


def session(model, path=None, **kw):
    """A session of `model` given as bytes, or of the model at `path` (a file or a folder)."""
    kw.setdefault("host_granularity", 4096)
    kw.setdefault("vram_limit", "64MiB")
    return OffloadSession(path if path is not None else model.SerializeToString(), providers=CPU, **kw)


def prompt(batch, length=6, seed=0):
    return np.random.default_rng(seed).integers(0, 97, (batch, length))


def kv_committed(s):
    """The KV bytes committed once the cache the session keeps for its next generation of
    the same shape is given back: what a generation left behind."""
    s.free_generation_cache()
    return s.device.ledger.snapshot().zones["kv"].committed.current


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weights", ["resident", "a third"])
@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_tokens_equal_a_plain_ort_loop(layout, weights, batch):
    model = model_of(layout)
    ids = prompt(batch)
    want = reference_greedy(model, ids, 24)
    kw = {} if weights == "resident" else dict(offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3)
    with session(model, **kw) as s:
        assert s.decoder_spec.layout == layout
        assert (len(s.segments) > 1) == (weights != "resident")
        got = s.generate(ids, 24)
        assert got.dtype == np.int64 and got.shape == (batch, 6 + 24)
        np.testing.assert_array_equal(got, want)
        if weights != "resident":
            assert s.stats().counters.page_ins > 0
        assert kv_committed(s) == 0  # the cache went back with the generation
        np.testing.assert_array_equal(s.generate(ids, 24), want)  # and a second one is the same
        final = s.close()
    assert final.committed == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_step_wise_form_yields_each_token(layout):
    model = model_of(layout)
    ids = prompt(2)
    with session(model) as s:
        steps = list(s.generate_iter(ids, 10))
        assert len(steps) == 10 and all(t.shape == (2,) for t in steps)
        np.testing.assert_array_equal(np.stack(steps, 1), s.generate(ids, 10)[:, 6:])


def test_sampling_with_a_seed_is_reproducible():
    model = model_of("gqa")
    ids = prompt(2)
    with session(model) as s:
        a = s.generate(ids, 20, do_sample=True, temperature=2.0, seed=7)
        b = s.generate(ids, 20, do_sample=True, temperature=2.0, seed=7)
        c = s.generate(ids, 20, do_sample=True, temperature=2.0, seed=8)
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)
        # top_k=1 leaves one candidate, and top_p near 0 the likeliest: both are greedy.
        greedy = s.generate(ids, 20)
        np.testing.assert_array_equal(s.generate(ids, 20, do_sample=True, top_k=1, seed=3), greedy)
        np.testing.assert_array_equal(s.generate(ids, 20, do_sample=True, top_p=1e-6, seed=3), greedy)
        assert kv_committed(s) == 0


@pytest.mark.parametrize("kwargs,error", [
    (dict(temperature=0.0), ValueError), (dict(top_p=0.0), ValueError), (dict(top_k=-1), ValueError),
    (dict(max_new_tokens=-1), ValueError)])
def test_bad_sampling_arguments_are_refused(kwargs, error):
    with session(model_of("gqa")) as s:
        with pytest.raises(error):
            s.generate(prompt(1), **{"max_new_tokens": 4, **kwargs})
        assert kv_committed(s) == 0


@pytest.mark.parametrize("ids,error", [(np.zeros((1, 0), np.int64), ValueError),
                                       (np.zeros((1, 3), np.float32), TypeError),
                                       (np.zeros((1, 2, 3), np.int64), ValueError)])
def test_bad_input_ids_are_refused(ids, error):
    with session(model_of("gqa")) as s:
        with pytest.raises(error):
            s.generate(ids, 4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eos_stops_every_row(layout):
    model = model_of(layout)
    ids = prompt(2)
    want = reference_greedy(model, ids, 12)
    eos = int(want[0, 6 + 2])  # row 0 produces it as its third new token
    with session(model) as s:
        got = s.generate(ids, 12, eos_token_id=eos)
    row1_stops = [i for i in range(12) if want[1, 6 + i] == eos]
    stop = max(2, row1_stops[0] if row1_stops else 11)
    assert got.shape == (2, 6 + stop + 1)
    np.testing.assert_array_equal(got[0, :9], want[0, :9])
    assert (got[0, 9:] == eos).all()  # a finished row repeats its EOS
    np.testing.assert_array_equal(got[1], want[1, :got.shape[1]])


def test_a_finished_row_repeats_the_eos_it_produced():
    model = model_of("gqa")
    ids = prompt(2)
    want = reference_greedy(model, ids, 12)
    eos = int(want[0, 6 + 2])
    never = next(t for t in range(97) if t not in want)  # listed first, produced by no row
    with session(model) as s:
        got = s.generate(ids, 12, eos_token_id=[never, eos])
    assert (got[0, 9:] == eos).all(), got[0]


def test_genai_config_beside_the_model_gives_the_eos_and_head_counts(tmp_path):
    model = model_of("gqa")
    ids = prompt(1)
    want = reference_greedy(model, ids, 8)
    eos = int(want[0, 6 + 3])
    cfg = genai_config(layers=2, hidden=64, heads=4, kv_heads=2, vocab=97, max_length=256, eos_token_id=eos)
    path = save_decoder(model, str(tmp_path / "llm"), config=cfg)
    with OffloadSession(path, providers=CPU, vram_limit="64MiB", host_granularity=4096) as s:
        assert s.decoder_spec.eos_token_id == (eos,)
        got = s.generate(ids, 8)
    np.testing.assert_array_equal(got, want[:, :6 + 4])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_kv_zone_follows_the_cache(layout):
    model = model_of(layout)
    with session(model) as s:
        seen = []
        it = s.generate_iter(prompt(1), 40)
        for _ in it:
            seen.append(kv_committed(s))
        # The last token comes after the cache went back: a caller that takes exactly
        # what it asked for never resumes the generator.
        assert seen[-1] == 0
        seen = seen[:-1]
        assert min(seen) > 0
        if layout == "gqa":
            # One buffer per layer of the whole length, allocated once: 2 x 2 x [1, 2, 46, 16] fp32.
            assert len(set(seen)) == 1 and seen[0] >= 4 * 46 * 2 * 16 * 4
        else:
            assert seen[-1] > seen[0]  # the bucket grew (16 -> 32 -> 64 positions)
        assert kv_committed(s) == 0


@pytest.mark.parametrize("weights", ["resident", "a third"])
@pytest.mark.parametrize("length", [6, 20])
def test_layers_with_a_window_sized_cache_give_plain_orts_tokens_past_the_window(weights, length):
    # The builder's sliding-window layers (gpt-oss, Gemma): GroupQueryAttention with
    # sliding_window_cache=1 keeps local_window_size positions and evicts from them itself.
    # Prompts shorter and longer than the window, and 24 tokens past it.
    model = decoder_lm("gqa", max_length=256, window_cache=8)
    ids = prompt(2, length)
    want = reference_greedy(model, ids, 24)
    assert not np.array_equal(want, reference_greedy(model_of("gqa"), ids, 24))  # the window changes the tokens
    kw = {} if weights == "resident" else dict(offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3)
    with session(model, **kw) as s:
        assert s.decoder_spec.window_caches == ((0, 8),)
        seen = []
        for _ in s.generate_iter(ids, 24):
            seen.append(s.device.ledger.snapshot().zones["kv"].committed.current)
        np.testing.assert_array_equal(s.generate(ids, 24), want)
        # Layer 0's cache holds its window, layer 1's the whole length (the prompt and 23
        # positions): less than both of the whole length. A position is 2 rows x 2 KV heads x
        # 16 floats, key and value.
        row, total = 2 * 2 * 16 * 4 * 2, length + 23
        assert row * (total + 8) <= max(seen) < row * 2 * total
    assert s.close().committed == 0


def test_the_kv_cache_borrows_from_the_weights_zone():
    model = model_of("gqa")
    ids = prompt(1)
    want = reference_greedy(model, ids, 40)
    W = weight_bytes(model)
    with session(model, offload=True, vmm=True, vram_limit=int(W * 0.9), scratch_bytes=64 << 10) as s:
        assert len(s.segments) > 1
        s.generate(ids, 1)  # a step without a cache to speak of: the weights settle
        before = s.device.ledger.snapshot().zones["weights"]
        got = []
        for step in s.generate_iter(ids, 40):
            got.append(step)
            if len(got) == 2:
                snap = s.device.ledger.snapshot().zones
                assert snap["kv"].committed.current > 0
                assert snap["weights"].committed.current < before.committed.current
                assert snap["weights"].lent > before.lent  # the ledger asked the weights to give way
        np.testing.assert_array_equal(np.concatenate([ids, np.stack(got, 1)], 1), want)
        assert kv_committed(s) == 0


def test_a_real_shortage_raises_before_the_step_and_loses_nothing():
    model = model_of("gqa")
    ids = prompt(1)
    with session(model, vram_limit="2MiB", scratch_bytes=64 << 10) as s:
        before = s.device.ledger.snapshot()
        with pytest.raises(BudgetExceeded, match=r"kv zone.*weights .* committed"):
            s.generate(np.zeros((64, 6), np.int64), 200)
        after = s.device.ledger.snapshot()
        assert after.zones["kv"].committed.current == 0
        assert after.zones["weights"].committed.current == before.zones["weights"].committed.current
        np.testing.assert_array_equal(s.generate(ids, 8), reference_greedy(model, ids, 8))


@pytest.mark.parametrize("layout", ["standard", "exact"])
def test_a_growing_cache_the_budget_cannot_hold_is_refused_before_the_first_token(layout):
    """A short prompt's bucketed cache grows as it decodes, and its last growth holds the
    old bucket and the new one at once: a budget that holds the prompt's bucket but not
    that is refused at the call, not after the tokens before the growth were made and lost.
    A budget that holds it runs the whole generation."""
    model = model_of(layout)
    with session(model, vram_limit="3MiB", scratch_bytes=64 << 10) as s:
        before = s.device.ledger.snapshot().zones
        it = s.generate_iter(prompt(8), 240)
        with pytest.raises(BudgetExceeded, match=r"KV cache at its largest \(245 positions, batch 8, while it grows\)"):
            next(it)
        after = s.device.ledger.snapshot().zones
        assert after["kv"].committed.current == 0
        assert after["weights"].committed.current == before["weights"].committed.current
    with session(model, vram_limit="4MiB", scratch_bytes=64 << 10) as s:
        assert s.generate(prompt(8), 240).shape == (8, 246)


def test_an_abandoned_or_interrupted_generation_gives_its_cache_back():
    model = model_of("standard")
    ids = prompt(1)
    want = reference_greedy(model, ids, 20)
    with session(model, offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3) as s:
        it = s.generate_iter(ids, 20)
        next(it), next(it), next(it)
        assert kv_committed(s) > 0
        it.close()  # the caller stopped iterating
        assert kv_committed(s) == 0
        with pytest.raises(KeyboardInterrupt):
            for i, _ in enumerate(s.generate_iter(ids, 20)):
                if i == 4:
                    raise KeyboardInterrupt
        assert kv_committed(s) == 0
        np.testing.assert_array_equal(s.generate(ids, 20), want)


def test_a_model_without_a_kv_cache_is_refused_by_name():
    with session(mlp_stack(layers=2, hidden=64, batch=2)) as s:
        with pytest.raises(UnsupportedModel, match="input_ids.*past_key_values"):
            s.generate(np.zeros((1, 3), np.int64), 4)


def test_decoders_capture_decode_steps_only():
    d = resolve_graph_capture_enabled(on_cuda=True, offload=True, stable_addresses=True, decoder=True)
    assert d.enabled and d.decode_only and "generate()" in d.reason
    assert not resolve_graph_capture_enabled(on_cuda=True, offload=True, stable_addresses=True, decoder=False).enabled
    assert not resolve_graph_capture_enabled(on_cuda=True, offload=False, stable_addresses=True, decoder=True,
                                             env_value=False).enabled
    assert not resolve_graph_capture_enabled(on_cuda=False, offload=False, stable_addresses=True, decoder=True).enabled


def test_cli_generate_prints_the_tokens_of_generate(tmp_path, capsys):
    model = model_of("standard")
    path = save_decoder(model, str(tmp_path / "llm"))
    rc = main(["generate", path, "--prompt-ids", "5,6,7;8,9,10", "--max-new-tokens", "6", "--cpu",
               "--vram-limit", "64MiB"])
    out = capsys.readouterr().out
    assert rc == 0
    want = reference_greedy(model, np.array([[5, 6, 7], [8, 9, 10]]), 6)[:, 3:]
    rows = [line.split(": ")[1] for line in out.splitlines() if line.startswith("tokens: ")]
    assert rows == [",".join(map(str, r)) for r in want]
    assert "tokens/s" in out


@pytest.mark.parametrize("argv,needle", [
    (["--prompt-ids", "1,x"], "expected integers"),
    (["--prompt-ids", "1,2;3"], "same number"),
    (["--prompt-ids", "1,,2"], "expected integers"),
    (["--prompt-ids", "99999999999999999999999,2"], "64-bit"),
    (["--prompt-ids", "1,2", "--temperature", "nan", "--do-sample"], "--temperature: must be a finite number"),
    (["--prompt-ids", "1,2", "--seed", "-5"], "--seed: must be at least 0"),
    (["--prompt-ids", "1,2", "--top-k", "-1"], "--top-k: must be at least 0"),
    (["--prompt-ids", "1,2", "--top-p", "2"], "--top-p: must be a number above 0 and at most 1"),
    (["--prompt-ids", "1,2", "--eos-token-id", "-1"], "--eos-token-id '-1': expected token ids"),
    (["--prompt-ids", "1,2", "--eos-token-id", "1180591620717411303424"], "--eos-token-id"),
    (["--prompt", "hello"], "tokenizer.json"),
])
def test_cli_generate_refuses_bad_prompts_before_loading(tmp_path, capsys, argv, needle):
    path = save_decoder(model_of("gqa"), str(tmp_path / "llm"))
    try:
        rc = main(["generate", path, "--cpu"] + argv)
    except SystemExit as e:  # refused by the argument parser
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and "loading weights" not in err


def test_cli_generate_names_what_a_model_lacks(tmp_path, capsys):
    from onnx_offload.models import save
    path = save(mlp_stack(layers=2, hidden=64, batch=2), os.path.join(tmp_path, "mlp.onnx"))
    assert main(["generate", path, "--prompt-ids", "1,2", "--cpu"]) == 2
    assert "UnsupportedModel" in capsys.readouterr().err


def test_split_decoders_recompute_mask_values_instead_of_passing_them():
    # seqlens_k and total_sequence_length live on the CPU in ORT: between segments they
    # would cross device memory inside a step, which a captured graph cannot do.
    model = model_of("gqa")
    with session(model, offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3) as s:
        graph_inputs = {i.name for i in s.get_inputs()}
        crossing = [(seg.index, vi.name) for seg in s.segments for vi in seg.model.graph.input
                    if vi.name not in graph_inputs and vi.name in seg.inputs
                    and vi.type.tensor_type.elem_type not in (1, 10, 16)]  # float, float16, bfloat16
        assert len(s.segments) > 2 and crossing == []


def test_the_model_script_writes_an_llm_folder_that_generate_runs(tmp_path, capsys):
    import runpy
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "models", "make_model.py")
    folder = str(tmp_path / "llm")
    argv = sys.argv
    sys.argv = [script, "llm-standard", folder, "--layers", "2", "--hidden", "64", "--vocab", "97", "--ffn", "128"]
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = argv
    assert e.value.code == 0
    files = ["genai_config.json", "model.onnx", "model.onnx.data"]
    try:
        import tokenizers  # noqa: F401 - the script writes a tokenizer.json where it is installed
        files += ["chat_template.jinja", "tokenizer.json"]
    except ImportError:
        pass
    assert sorted(os.listdir(folder)) == sorted(files)
    with OffloadSession(os.path.join(folder, "model.onnx"), providers=CPU, vram_limit="64MiB") as s:
        assert s.decoder_spec.layout == "standard" and s.decoder_spec.position_ids
        ids = prompt(1)
        got = s.generate(ids, 5, eos_token_id=[])
    import onnx
    np.testing.assert_array_equal(got, reference_greedy(onnx.load(os.path.join(folder, "model.onnx")), ids, 5))


def test_cli_generate_takes_text_through_the_tokenizer_beside_the_model(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers", reason="--prompt needs the 'tokenizers' package")
    vocab = {f"w{i}": i for i in range(97)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    model = model_of("gqa")
    path = save_decoder(model, str(tmp_path / "llm"))
    tok.save(str(tmp_path / "llm" / "tokenizer.json"))
    assert main(["generate", path, "--prompt", "w5 w6 w7", "--max-new-tokens", "4", "--cpu"]) == 0
    want = reference_greedy(model, np.array([[5, 6, 7]]), 4)[0, 3:]
    out = capsys.readouterr().out
    assert f"tokens: {','.join(map(str, want))}" in out
    assert tok.decode([int(t) for t in want]) in out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_concurrent_generations_on_one_session_are_each_right(layout):
    import threading
    model = model_of(layout)
    prompts = [prompt(1, seed=i) for i in range(4)]
    want = [reference_greedy(model, p, 16) for p in prompts]
    W = weight_bytes(model)
    with session(model, offload=True, vmm=True, vram_limit=int(W * 0.9), scratch_bytes=64 << 10) as s:
        got, errors = [None] * 4, []

        def work(i):
            try:
                got[i] = s.generate(prompts[i], 16)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        # Two iterators advanced in turn on one thread: each keeps its own cache.
        a, b = s.generate_iter(prompts[0], 16), s.generate_iter(prompts[1], 16)
        steps = [(next(a), next(b)) for _ in range(16)]
        np.testing.assert_array_equal(np.stack([x for x, _ in steps], 1), want[0][:, 6:])
        np.testing.assert_array_equal(np.stack([y for _, y in steps], 1), want[1][:, 6:])
        assert kv_committed(s) == 0


def _raise_sigint_after(obj, name, monkeypatch):
    import signal
    original = getattr(obj, name)

    def patched(*a, **kw):
        out = original(*a, **kw)
        signal.raise_signal(signal.SIGINT)  # held back by the step; raised when it ends
        return out
    monkeypatch.setattr(obj, name, patched)


def test_the_next_generation_of_a_shape_runs_on_the_kept_buffers():
    """The builder layout's buffers (its cache, the step buffers and the plans on them) are
    kept after a generation: the next one of the same batch, length and chunking takes them
    and gives its own tokens (nothing of the last one's shows); another shape gives them
    back first; close gives back everything."""
    model = model_of("gqa")
    ids, other = prompt(2, 40), prompt(2, 40, seed=3)
    with session(model, prefill_chunk=16) as s:
        np.testing.assert_array_equal(s.generate(ids, 10), reference_greedy(model, ids, 10))
        kept = s._parked
        held = s.device.ledger.snapshot().zones
        assert kept is not None and held["kv"].committed.current > 0
        for x in (other, ids):
            np.testing.assert_array_equal(s.generate(x, 10), reference_greedy(model, x, 10))
            now = s.device.ledger.snapshot().zones
            assert s._parked is kept
            assert now["kv"].committed.current == held["kv"].committed.current
            assert now["scratch"].committed.current == held["scratch"].committed.current
        one = prompt(1, 9)
        np.testing.assert_array_equal(s.generate(one, 4), reference_greedy(model, one, 4))
        assert s._parked is not kept and s._parked is not None
        assert kv_committed(s) == 0
    assert s.close().committed == 0


@pytest.mark.usefixtures("ctrl_c")
def test_a_generation_cut_short_leaves_nothing_kept(monkeypatch):
    """Ctrl-C in a step of a generation on the kept buffers, and a caller that stops
    early: the buffers go back, and the next generation runs on new ones, right."""
    from onnx_offload.engines.runner import SegmentRunner
    model = model_of("gqa")
    ids = prompt(1)
    want = reference_greedy(model, ids, 8)
    with session(model) as s:
        s.generate(ids, 8)
        kept = s._parked
        with monkeypatch.context() as m:
            _raise_sigint_after(SegmentRunner, "run_bound", m)
            with pytest.raises(KeyboardInterrupt):
                s.generate(ids, 8)
        assert s._parked is None and s.device.ledger.snapshot().zones["kv"].committed.current == 0
        np.testing.assert_array_equal(s.generate(ids, 8), want)
        assert s._parked is not kept
        it = s.generate_iter(ids, 8)
        next(it)
        it.close()  # stopped after one token
        assert s._parked is None and s.device.ledger.snapshot().zones["kv"].committed.current == 0
        np.testing.assert_array_equal(s.generate(ids, 8), want)


@pytest.mark.parametrize("where", ["allocating the cache", "dropping the plans"])
@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_while_the_cache_is_made_or_given_back_leaks_nothing(where, monkeypatch):
    from onnx_offload.generation.buffers import DeviceBuffers
    from onnx_offload.engines.runner import SegmentRunner
    model = model_of("gqa")
    ids = prompt(1)
    with session(model) as s:
        want = s.generate(ids, 8)
        with monkeypatch.context() as m:
            if where == "allocating the cache":
                s.free_generation_cache()  # else the next generation takes the kept buffers
                _raise_sigint_after(DeviceBuffers, "new", m)
            else:  # the kept buffers given back, by the next generation of another shape
                _raise_sigint_after(SegmentRunner, "drop_plans", m)
            with pytest.raises(KeyboardInterrupt):
                s.generate(ids if where == "allocating the cache" else prompt(2), 8)
        assert kv_committed(s) == 0
        assert s.device.ledger.snapshot().zones["scratch"].content.current == 0
        np.testing.assert_array_equal(s.generate(ids, 8), want)


def test_an_interrupt_between_an_allocation_and_its_bookkeeping_loses_nothing(monkeypatch):
    """A KeyboardInterrupt that no SIGINT raised (so nothing holds it back) lands right
    after a cache buffer is allocated, before the generation has noted it: the buffer
    still goes back, since the generation's allocator gives back all it holds."""
    from onnx_offload.generation import kv_cache
    model = model_of("exact")
    ids = prompt(2)
    calls = []

    class Interrupted(kv_cache._core.ScratchAllocator):
        def allocate(self, nbytes):
            ptr = super().allocate(nbytes)
            calls.append(nbytes)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return ptr
    with session(model) as s:
        want = s.generate(ids, 8)
        with monkeypatch.context() as m:
            m.setattr(kv_cache._core, "ScratchAllocator", Interrupted)
            with pytest.raises(KeyboardInterrupt):
                s.generate(ids, 8)
        assert len(calls) == 3
        zones = s.device.ledger.snapshot().zones
        assert zones["kv"].committed.current == 0 and zones["scratch"].content.current == 0
        np.testing.assert_array_equal(s.generate(ids, 8), want)


def test_interrupts_from_another_signal_at_any_moment_leak_nothing():
    """A SIGALRM handler that raises KeyboardInterrupt, at random moments of many
    generations: the idle session holds no cache byte afterwards, and generates right."""
    import gc
    import signal
    model = model_of("exact")
    ids = prompt(2, 15)
    armed = [False]

    def handler(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
    previous = signal.signal(signal.SIGALRM, handler)
    rng = np.random.default_rng(7)
    try:
        with session(model) as s:
            want = s.generate(ids, 20)
            for _ in range(500):
                try:
                    armed[0] = True
                    signal.setitimer(signal.ITIMER_REAL, float(rng.uniform(0, 0.01)))
                    s.generate(ids, 20)
                except KeyboardInterrupt:
                    pass
                finally:
                    armed[0] = False
                    signal.setitimer(signal.ITIMER_REAL, 0)
            gc.collect()
            zones = s.device.ledger.snapshot().zones
            assert zones["kv"].committed.current == 0 and zones["scratch"].content.current == 0
            np.testing.assert_array_equal(s.generate(ids, 20), want)
        assert s.stats().ledger.committed == 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("batch", [10000, 20000])
def test_a_batch_whose_cache_cannot_fit_is_refused_and_the_session_runs_on(batch):
    """The cache's first buffers fit, a later one does not: those allocated are given back
    once the stream has run their zero fills (never unmapped under them), and the error is
    the budget's."""
    model = model_of("standard")
    with session(model) as s:
        with pytest.raises(BudgetExceeded, match="KV cache"):
            s.generate(np.ones((batch, 3), np.int64), 2)
        assert kv_committed(s) == 0
        np.testing.assert_array_equal(s.generate(prompt(2), 6), reference_greedy(model, prompt(2), 6))
    assert s.stats().ledger.committed == 0


def test_an_interrupt_right_after_a_page_in_leaves_nothing_pinned(monkeypatch):
    """An exception between a segment's page-in and the code that releases it (a signal's
    handler may raise anywhere): the step gives back what it acquired, the transient zone
    is empty when the session is idle, and later generations are right."""
    from onnx_offload.memory import residency
    model = model_of("standard")
    ids = prompt(2)
    want = reference_greedy(model, ids, 12)
    real, calls = residency.ResidencyManager.acquire, []

    def acquire(self, k):
        ready = real(self, k)
        calls.append(k)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return ready
    with session(model, offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3) as s:
        assert len(s.segments) > 2
        with monkeypatch.context() as m:
            m.setattr(residency.ResidencyManager, "acquire", acquire)
            with pytest.raises(KeyboardInterrupt):
                s.generate(ids, 12)
        zones = s.device.ledger.snapshot().zones
        assert zones["transient"].committed.current == 0 and kv_committed(s) == 0
        np.testing.assert_array_equal(s.generate(ids, 12), want)
    assert s.stats().ledger.committed == 0


@pytest.mark.parametrize("nth", [1, 2, 3, 5, 8, 13])
def test_an_interrupt_right_after_a_weight_is_pinned_leaves_it_unpinned(nth):
    """A signal's handler runs as soon as a call into the core returns, so its
    KeyboardInterrupt can land between a weight's pin() and the code that records it:
    the weight must not stay pinned (it could never be evicted, and its transient bytes
    would stay charged)."""
    import sys
    from onnx_offload.memory import residency
    model = model_of("gqa")
    ids = prompt(2)
    want = reference_greedy(model, ids, 8)
    with session(model, offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3) as s:
        seen = []

        def hook(frame, event, arg):
            if event == "c_return" and getattr(arg, "__name__", "") == "pin" \
                    and frame.f_code.co_filename == residency.__file__:
                seen.append(1)
                if len(seen) == nth:
                    raise KeyboardInterrupt
        sys.setprofile(hook)
        try:
            with pytest.raises(KeyboardInterrupt):
                s.generate(ids, 8)
        finally:
            sys.setprofile(None)
        assert len(seen) >= nth
        assert [n for n, slot in s.residency.slots.items() if slot.state == "pinned"] == []
        assert s.device.ledger.snapshot().zones["transient"].committed.current == 0
        np.testing.assert_array_equal(s.generate(ids, 8), want)
        final = s.close()
    assert final.committed == 0 and s.stats().arena.refcount_underflows == 0


def _interrupt_before_line(code, call: int, line: int) -> dict:
    """A tracer that raises KeyboardInterrupt before the `line`-th line that the `call`-th
    call of `code` runs (as a signal's handler may, between any two lines); `line` 0
    raises nowhere and counts the lines that call runs."""
    state = dict(calls=0, lines=0, fired=False)

    def local(frame, event, arg):
        if event == "line":
            state["lines"] += 1
            if state["lines"] == line and not state["fired"]:
                state["fired"] = True
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None
        state["calls"] += 1
        return local if state["calls"] == call else None
    state["tracer"] = tracer
    return state


@pytest.mark.parametrize("method", ["acquire", "release"])
def test_an_interrupt_before_any_line_of_a_segments_acquire_or_release_leaves_the_session_whole(method):
    """Under lru (misses evict other weights) a KeyboardInterrupt before each line, in
    turn, of one segment's acquire() or release(): the idle session holds no pin and no
    transient byte, the policy tracks exactly the weights resident in the weights zone,
    and the next generation's tokens are right."""
    import sys
    from onnx_offload.memory import residency
    model = model_of("standard")
    ids = prompt(2)
    want = reference_greedy(model, ids, 4)
    code = getattr(residency.ResidencyManager, method).__code__
    with session(model, offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3, policy="lru") as s:
        assert len(s.segments) > 6
        counting = _interrupt_before_line(code, 6, 0)
        sys.settrace(counting["tracer"])
        try:
            s.generate(ids, 4)
        finally:
            sys.settrace(None)
        assert counting["lines"] > 10
        for line in range(1, counting["lines"] + 1):
            trace = _interrupt_before_line(code, 6, line)
            sys.settrace(trace["tracer"])
            try:
                s.generate(ids, 4)
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            res = s.residency
            assert [n for n, slot in res.slots.items() if slot.state == "pinned"] == [], line
            assert s.device.ledger.snapshot().zones["transient"].committed.current == 0, line
            held = {n for n, slot in res.slots.items() if slot.state != "evicted" and slot.charged_zone == "weights"}
            assert set(res.policy._recent) == held, line
            np.testing.assert_array_equal(s.generate(ids, 4), want)
            assert trace["fired"], f"the call ran {trace['lines']} lines, not {line}"
        final = s.close()
    assert final.committed == 0 and s.stats().arena.refcount_underflows == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_generation_longer_than_the_model_is_refused_before_it_runs(layout, tmp_path):
    model = model_of(layout)
    cfg = genai_config(layers=2, hidden=64, heads=4, kv_heads=2, vocab=97, max_length=64, layout=layout)
    path = save_decoder(model, str(tmp_path / "llm"), config=cfg)
    with OffloadSession(path, providers=CPU, vram_limit="64MiB", host_granularity=4096) as s:
        with pytest.raises(ValueError, match="need 69 positions; the model holds 64"):
            s.generate_iter(prompt(1, 60), 10)  # refused at the call, not at the first next()
        assert s.generate(prompt(1, 60), 5).shape == (1, 65)  # 64 positions: the last token is not fed back


def test_without_a_config_the_rotary_table_bounds_the_length():
    with session(model_of("gqa")) as s:  # decoder_lm(max_length=256): a 256-row cos_cache
        assert s.decoder_spec.max_length == 256
        with pytest.raises(ValueError, match="the model holds 256"):
            s.generate(prompt(1), 10 ** 12)


@pytest.mark.parametrize("config", ['{"model": {"eos_token_id": null}}', '{"search": {"max_length": "abc"}}',
                                    '{"model": {"decoder": []}}', "{not json", '{"model": {"eos_token_id": [[2, 3]]}}',
                                    '{"model": {"eos_token_id": 18446744073709551616}}'])
def test_a_bad_genai_config_still_runs_and_generate_says_what_is_wrong(config, tmp_path):
    model = model_of("gqa")
    path = save_decoder(model, str(tmp_path / "llm"))
    with open(tmp_path / "llm" / "genai_config.json", "w") as f:
        f.write(config)
    with OffloadSession(path, providers=CPU, vram_limit="64MiB", host_granularity=4096) as s:
        with pytest.raises(UnsupportedModel, match="genai_config.json cannot be used"):
            s.generate(prompt(1), 4)


@pytest.mark.parametrize("config,reason", [('{"model": "x"}', "'model' must be an object, got str 'x'"),
                                           ('{"search": 5}', "'search' must be an object, got int 5"),
                                           ('{"model": {"decoder": 3}}', "'model.decoder' must be an object")])
def test_a_genai_config_whose_sections_are_no_objects_names_the_section(config, reason, tmp_path):
    path = save_decoder(model_of("gqa"), str(tmp_path / "llm"))
    with open(tmp_path / "llm" / "genai_config.json", "w") as f:
        f.write(config)
    with OffloadSession(path, providers=CPU, vram_limit="64MiB", host_granularity=4096) as s:
        with pytest.raises(UnsupportedModel, match=re.escape(reason)):
            s.generate(prompt(1), 4)


@pytest.mark.parametrize("name", ["genai_config.json", "config.json"])
def test_a_deeply_nested_config_beside_the_model_leaves_the_session_and_run_working(name, tmp_path):
    """A config 100,000 levels deep (more than Python's recursion limit): the session is
    made and run() runs; an unusable genai_config.json makes generate() raise
    UnsupportedModel, and a config.json that is no model's gives no sliding window."""
    model = model_of("standard")  # the sliding window is read for standard attention
    path = save_decoder(model, str(tmp_path / "llm"))
    with open(tmp_path / "llm" / name, "w") as f:
        f.write('{"model": ' * 100000 + "1" + "}" * 100000)
    ids = prompt(1)
    with OffloadSession(path, providers=CPU, vram_limit="64MiB", host_granularity=4096) as s:
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(6)[None]}
        for i in s.get_inputs():
            if i.name.startswith("past_key_values"):
                feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
        assert s.run(["logits"], feeds)[0].shape[:2] == (1, 6)
        if name == "genai_config.json":
            with pytest.raises(UnsupportedModel, match="genai_config.json cannot be used: .*nested"):
                s.generate(ids, 4)
        else:
            np.testing.assert_array_equal(s.generate(ids, 4), reference_greedy(model, ids, 4))


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "nested", "a list", "top_p 5"])
def test_a_config_in_the_model_folder_that_cannot_be_used_is_named_and_the_folder_still_runs(kind, tmp_path):
    """The model given as its folder, whose genai_config.json is a FIFO (which would hold
    the open), a link to /dev/zero (which would fill memory), nested past the parser's
    depth, no object, or a sampling value no sampling takes: the session is made from the
    folder, run() runs, and generate() raises UnsupportedModel naming the file, at once."""
    import json
    import signal
    model = model_of("standard")
    folder = tmp_path / "llm"
    save_decoder(model, str(folder))
    config = folder / "genai_config.json"
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "/dev/zero":
        os.symlink("/dev/zero", config)
    else:
        config.write_text({"nested": '{"model": ' * 100000 + "1" + "}" * 100000, "a list": "[1, 2]",
                           "top_p 5": json.dumps({"search": {"top_p": 5}})}[kind])

    def hung(*_):
        raise TimeoutError("reading the folder's config hung")
    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        ids = prompt(1)
        with OffloadSession(str(folder), providers=CPU, vram_limit="64MiB", host_granularity=4096) as s:
            feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(6)[None]}
            for i in s.get_inputs():
                if i.name.startswith("past_key_values"):
                    feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
            assert s.run(["logits"], feeds)[0].shape[:2] == (1, 6)
            with pytest.raises(UnsupportedModel, match="genai_config.json cannot be used"):
                s.generate(ids, 4)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def test_a_temperature_of_0_in_the_model_s_config_decodes_greedily(tmp_path):
    """As the CLI's --temperature 0, and as Hugging Face and llama.cpp users mean it."""
    import json
    model = model_of("gqa")
    ids = prompt(1)
    path = save_decoder(model, str(tmp_path / "llm"))
    (tmp_path / "llm" / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0}))
    with session(None, path=path) as s:
        np.testing.assert_array_equal(s.generate(ids, 8, seed=3), reference_greedy(model, ids, 8))


def test_a_decoder_whose_logits_are_the_last_position_only_generates_the_same_tokens():
    from onnx import TensorProto, helper

    def last_only(m):  # logits [batch, vocab]: the last position's, as some exports return
        for node in m.graph.node:
            node.output[:] = ["full_logits" if o == "logits" else o for o in node.output]
        m.graph.initializer.append(helper.make_tensor("last", TensorProto.INT64, [], [-1]))
        m.graph.node.append(helper.make_node("Gather", ["full_logits", "last"], ["logits"], axis=1))
        out = next(o for o in m.graph.output if o.name == "logits")
        out.CopyFrom(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", 97]))
    ids = prompt(2)
    for layout in ("gqa", "exact"):
        with session(model_of(layout)) as s:
            want = s.generate(ids, 10)
        with session(_with_inputs(model_of(layout), last_only)) as s:
            np.testing.assert_array_equal(s.generate(ids, 10), want)


@pytest.mark.parametrize("layer1_value", [
    ("float", 2, 8),  # a value head size that is not the key's (MLA-style)
    ("float", 1, 16),  # fewer KV heads in one layer (OpenELM-style)
    ("float16", 2, 16),
])
def test_kv_shapes_that_differ_between_layers_are_refused_by_name(layer1_value):
    from onnx import TensorProto, helper
    from onnx_offload.loading.decoder import decoder_spec
    from onnx_offload.engines.ortvalues import IOInfo

    def vi(name, elem, heads, size):
        t = {"float": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[elem]
        return IOInfo(helper.make_tensor_value_info(name, t, ["b", heads, "t", size]))
    ids = [IOInfo(helper.make_tensor_value_info(n, TensorProto.INT64, ["b", "s"]))
           for n in ("input_ids", "attention_mask")]
    pasts = [vi(f"past_key_values.{i}.{kv}", *(layer1_value if (i, kv) == (1, "value") else ("float", 2, 16)))
             for i in range(2) for kv in ("key", "value")]
    outs = [IOInfo(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 97]))]
    outs += [vi(f"present.{i}.{kv}", "float", 2, 16) for i in range(2) for kv in ("key", "value")]
    with pytest.raises(UnsupportedModel, match="one KV shape and type for every layer") as e:
        decoder_spec(ids + pasts, outs, set(), None)
    assert "past_key_values.1.value" in str(e.value)
    assert decoder_spec(ids + pasts[:3] + [vi("past_key_values.1.value", "float", 2, 16)], outs, set(),
                        None).layout == "exact"


def test_a_past_fed_at_its_length_makes_positions_right_without_position_ids():
    """A model without position_ids that counts positions from the past's length (as a
    torch.onnx export of HF code given none does): a padded past would shift them."""
    model = model_of("exact")
    assert "position_ids" not in {i.name for i in model.graph.input}
    ids = prompt(2, 20)  # past the first 16-position room: the cache grows once
    want = reference_greedy(model, ids, 30)
    with session(model, offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3) as s:
        assert s.decoder_spec.layout == "exact" and len(s.segments) > 1
        np.testing.assert_array_equal(s.generate(ids, 30), want)
        assert kv_committed(s) == 0


@pytest.mark.parametrize("layout", ["standard", "exact"])
@pytest.mark.parametrize("weights", ["resident", "a third"])
def test_left_padded_prompts_of_different_lengths_generate_as_a_plain_ort_loop(layout, weights):
    """A batch of prompts of different lengths, left-padded with their attention mask as
    a tokenizer gives it: the tokens of a plain-ORT loop fed the same mask and positions;
    with position_ids, each row's as if it ran alone (its positions count its tokens)."""
    model = model_of(layout)
    lengths = [9, 4, 1, 17]  # the longest crosses the first bucket of 16
    rng = np.random.default_rng(7)
    rows = [rng.integers(0, 97, n) for n in lengths]
    p = max(lengths)
    ids = np.zeros((len(rows), p), np.int64)
    mask = np.zeros((len(rows), p), np.int64)
    for r, row in enumerate(rows):
        ids[r, p - len(row):], mask[r, p - len(row):] = row, 1
    want = reference_greedy(model, ids, 20, attention_mask=mask)
    kw = {} if weights == "resident" else dict(offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3)
    with session(model, **kw) as s:
        got = s.generate(ids, 20, attention_mask=mask)
        np.testing.assert_array_equal(got, want)
        assert [t.shape for t in s.generate_iter(ids, 3, attention_mask=mask.astype(bool))] == [(4,)] * 3
        if layout == "standard":
            for r, row in enumerate(rows):
                np.testing.assert_array_equal(s.generate(row[None], 20)[0, len(row):], got[r, p:])
        assert kv_committed(s) == 0


@pytest.mark.parametrize("mask,error,needle", [
    (np.ones((2, 5)), ValueError, "shape of input_ids"),
    (np.full((2, 6), 2), ValueError, "0 .padding. and 1"),
    (np.full((2, 6), 0.5), ValueError, "0 .padding. and 1"),
    (np.array([[0] * 6, [1] * 6]), ValueError, "at least one token"),
    (np.array([[1] * 5 + [0], [1] * 6]), ValueError, "attention_mask .* left padding"),
    (np.array([[0, 1, 1, 0, 1, 1], [1] * 6]), ValueError, "attention_mask .* left padding"),
])
def test_a_bad_attention_mask_is_refused_at_the_call(mask, error, needle):
    with session(model_of("standard")) as s:
        with pytest.raises(error, match=needle):
            s.generate_iter(prompt(2), 4, attention_mask=mask)
        assert kv_committed(s) == 0


@pytest.mark.parametrize("weights", ["resident", "a third"])
def test_a_left_padded_batch_on_the_shared_cache_runs_each_row_as_plain_ort_runs_it(weights):
    """GroupQueryAttention (the builder's layout) with a left-padded batch: each row's tokens
    are a plain-ORT loop's on that row alone, without its padding; a row that reached EOS
    before the others repeats it; all ones is no padding."""
    model = model_of("gqa")
    lengths = [9, 4, 1, 17]
    rng = np.random.default_rng(7)
    rows = [rng.integers(0, 97, n) for n in lengths]
    p = max(lengths)
    ids = np.zeros((len(rows), p), np.int64)
    mask = np.zeros((len(rows), p), np.int64)
    for r, row in enumerate(rows):
        ids[r, p - len(row):], mask[r, p - len(row):] = row, 1
    wants = [reference_greedy(model, row[None], 12)[0, len(row):] for row in rows]
    kw = {} if weights == "resident" else dict(offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3)
    with session(model, **kw) as s:
        got = s.generate(ids, 12, attention_mask=mask)
        np.testing.assert_array_equal(got[:, :p], ids)
        for r, want in enumerate(wants):
            np.testing.assert_array_equal(got[r, p:], want)
        eos = int(wants[1][3])  # row 1 ends at its 4th token; the others go on where it is not theirs
        ended = s.generate(ids, 12, attention_mask=mask, eos_token_id=eos)
        assert list(ended[1, p + 3:]) == [eos] * (ended.shape[1] - p - 3)
        steps = list(s.generate_iter(ids, 3, attention_mask=mask.astype(bool)))
        assert [t.shape for t in steps] == [(4,)] * 3
        np.testing.assert_array_equal(np.stack(steps, axis=1), got[:, p:p + 3])
        same = prompt(2)
        np.testing.assert_array_equal(s.generate(same, 6, attention_mask=np.ones_like(same)), s.generate(same, 6))
        assert kv_committed(s) == 0


def _causal_mask_from_a_table(m, rows):
    """The causal mask sliced from a fixed [rows, rows] table by the key length (past +
    sequence), as HF's GPT-2 takes it from its `bias` buffer."""
    from onnx import helper, numpy_helper
    le = next(n for n in m.graph.node if n.op_type == "LessOrEqual")
    at = list(m.graph.node).index(le)
    m.graph.node.remove(le)
    for name, value in (("tbl", np.tril(np.ones((rows, rows), bool))), ("tbl_2", np.array([2])),
                        ("tbl_1", np.array([1])), ("tbl_axes", np.array([0, 1])), ("tbl_0", np.array([0]))):
        m.graph.initializer.append(numpy_helper.from_array(value, name))
    nodes = [helper.make_node("Shape", ["past_key_values.0.key"], ["tbl_ps"]),
             helper.make_node("Gather", ["tbl_ps", "tbl_2"], ["tbl_past"]),
             helper.make_node("Shape", ["input_ids"], ["tbl_is"]),
             helper.make_node("Gather", ["tbl_is", "tbl_1"], ["tbl_seq"]),
             helper.make_node("Add", ["tbl_past", "tbl_seq"], ["tbl_key"]),
             helper.make_node("Concat", ["tbl_past", "tbl_0"], ["tbl_starts"], axis=0),
             helper.make_node("Concat", ["tbl_key", "tbl_key"], ["tbl_ends"], axis=0),
             helper.make_node("Slice", ["tbl", "tbl_starts", "tbl_ends", "tbl_axes"], [le.output[0]])]
    for node in reversed(nodes):
        m.graph.node.insert(at, node)


def test_a_model_that_refuses_a_padded_past_gets_it_at_its_exact_length():
    """A past padded to its bucket (64 positions) is longer than the 64-row table this
    model slices its causal mask from, though the sequence (49) is not: ORT fails on the
    padded step, which runs again with the past at its exact length, and so does every
    later generation, with a warning that says so."""
    model = _with_inputs(decoder_lm("standard", max_length=256), lambda m: _causal_mask_from_a_table(m, 64))
    ids = prompt(2, 10)
    want = reference_greedy(model, ids, 40)
    with session(model, offload=True, vmm=True, weight_bytes=weight_bytes(model) // 3) as s:
        assert s.decoder_spec.layout == "standard" and len(s.segments) > 1
        with pytest.warns(OffloadWarning, match="exact length from now on"):
            np.testing.assert_array_equal(s.generate(ids, 40), want)
        assert s.decoder_spec.layout == "exact" and kv_committed(s) == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error", OffloadWarning)
            np.testing.assert_array_equal(s.generate(ids, 40), want)
        assert any("padded" in n for n in s.stats().notes)
    assert s.stats().ledger.committed == 0


def test_a_failure_of_the_moment_in_a_padded_step_changes_no_layout(monkeypatch):
    """ORT failing once on a padded step (memory short for a moment) is not the padding's
    doing: the step runs again as it was, and the layout stays."""
    from onnx_offload import OffloadSession as S
    model = model_of("standard")
    ids = prompt(2)
    want = reference_greedy(model, ids, 12)
    real, calls = S._run_bound, []

    def flaky(self, feeds, outputs, *, fixed, key=None):
        calls.append(fixed)
        if fixed and calls.count(True) == 3:
            raise RuntimeError("Failed to allocate memory for requested buffer of size 4096")
        return real(self, feeds, outputs, fixed=fixed, key=key)
    with session(model) as s:
        monkeypatch.setattr(S, "_run_bound", flaky)
        with warnings.catch_warnings():
            warnings.simplefilter("error", OffloadWarning)
            np.testing.assert_array_equal(s.generate(ids, 12), want)
        assert s.decoder_spec.layout == "standard" and calls.count(True) >= 4


def _with_inputs(model, change):
    import onnx
    m = onnx.ModelProto()
    m.CopyFrom(model)
    change(m)
    return m


def test_a_decoder_that_needs_another_input_is_refused_by_name():
    from onnx import TensorProto, helper

    def add_input(m):
        m.graph.input.append(helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["b", "s"]))
        m.graph.node.append(helper.make_node("Identity", ["token_type_ids"], ["tt"]))
        m.graph.output.append(helper.make_tensor_value_info("tt", TensorProto.INT64, ["b", "s"]))
    with session(_with_inputs(model_of("gqa"), add_input)) as s:
        with pytest.raises(UnsupportedModel, match="also requires token_type_ids"):
            s.generate(prompt(1), 4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_int32_token_ids_and_positions_are_fed_as_the_model_declares(layout):
    from onnx import TensorProto

    def to_int32(m):  # both only index a Gather, which takes int32 indices
        for vi in m.graph.input:
            if vi.name in ("input_ids", "position_ids"):
                vi.type.tensor_type.elem_type = TensorProto.INT32
    ids = prompt(2)
    with session(model_of(layout)) as s:
        want = s.generate(ids, 12)
    m = _with_inputs(model_of(layout), to_int32)
    with session(m) as s:
        assert s.decoder_spec.ids_dtype == np.int32
        np.testing.assert_array_equal(s.generate(ids, 12), want)


@pytest.mark.parametrize("kwargs,error,needle", [
    (dict(eos_token_id=np.array([2, 5])), None, None),
    (dict(eos_token_id=[[2, 3]]), TypeError, "eos_token_id"),
    (dict(do_sample=True, temperature=float("nan")), ValueError, "finite"),
    (dict(do_sample=True, temperature=float("inf")), ValueError, "finite"),
    (dict(do_sample=True, temperature=1e-310, seed=1), None, None),
    (dict(top_k=2.5), TypeError, None),
    (dict(max_new_tokens=2.5), TypeError, None),
    (dict(max_new_tokens="3"), TypeError, None),
    (dict(input_ids=np.array([[-1, 3]])), ValueError, r"token ids must lie in \[0, 97\)"),
    (dict(input_ids=np.array([[97, 3]])), ValueError, r"\[0, 97\)"),
    (dict(max_new_tokens=2**60), ValueError, "holds at most 2147483647"),
    (dict(seed=-5), ValueError, "seed must be"),
    (dict(seed=1.5), TypeError, None),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an integer"),
    (dict(do_sample="no"), TypeError, "do_sample must be a bool"),
    (dict(do_sample=1), TypeError, "do_sample must be a bool"),
    (dict(top_k=True), TypeError, "top_k must be a number"),
])
def test_generate_arguments_are_checked_at_the_call(kwargs, error, needle):
    args = {"input_ids": prompt(1), "max_new_tokens": 4, **kwargs}
    with session(model_of("exact")) as s:  # no length bound from the model (no position table read)
        if error is None:
            assert s.generate(**args).shape[1] <= 10
        else:
            with pytest.raises(error, match=needle):
                s.generate_iter(**args)  # no next() needed
        assert kv_committed(s) == 0


def _least_budget(make, start=4096, **kw):
    """The smallest budget a too-small one's error names."""
    with pytest.raises(BudgetExceeded) as e:
        make(vram_limit=start, **kw)
    m = re.search(r"The smallest budget that runs it with this configuration is [^(]+\((\d+) bytes\)", str(e.value))
    assert m, str(e.value)
    return int(m.group(1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_smallest_budget_named_runs_a_model_whose_weights_several_segments_read(layout):
    """The rotary tables are read by every layer: each segment that reads them pays for
    the granules they lie in, and the transient zone's reserve, so the budget named in
    the error, accounts for it (2 MiB granules, a segment's weights in about one)."""
    model = make_decoder(layout, layers=4, hidden=256, heads=8, kv_heads=4, intermediate=512, vocab=1000,
                         max_length=256)
    ids = prompt(1)
    g = 2 << 20

    def make(**kw):
        return session(model, offload=True, vmm=True, host_granularity=g, **kw)

    least = _least_budget(make, start=g)
    with make(vram_limit=least) as s:
        assert len(s.segments) > 1
        res = s._residency  # nothing is resident yet: each segment's cost is all of its granules
        assert max(res._group_cost(seg) for seg in res.segments) == \
            s.device.ledger.snapshot().zones["transient"].reserve
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for i in s.get_inputs():
            if i.name.startswith("past_key_values"):
                feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
            elif i.name == "position_ids":
                feeds[i.name] = np.arange(ids.shape[1])[None]
        so = ort.SessionOptions()
        so.add_session_config_entry("session.disable_prepacking", "1")  # ORT reads the weights where they lie
        want = ort.InferenceSession(model.SerializeToString(), so, providers=CPU).run(None, feeds)
        for got, ref in zip(s.run(None, feeds), want):
            np.testing.assert_array_equal(got, ref)
        with pytest.raises(BudgetExceeded, match="smallest budget that holds the weights and this cache") as e:
            s.generate(ids, 8)  # no room left for a KV cache: the error names a budget with room ...
    m = re.search(r"pass vram_limit=(\d+), kv_bytes=(\d+), scratch_bytes=(\d+)", str(e.value))
    limit, kv, scratch = map(int, m.groups())
    with make(vram_limit=limit, kv_bytes=kv, scratch_bytes=scratch) as s:  # ... and it generates there
        np.testing.assert_array_equal(s.generate(ids, 8), reference_greedy(model, ids, 8))
    with pytest.raises(BudgetExceeded):
        make(vram_limit=least - g)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weights_resident_for_the_session_give_way_to_the_kv_cache(layout):
    """At a budget that holds every weight and no KV cache, generate() works: the weights
    start streaming, with a warning that says how to keep them resident. Before, a larger
    budget failed where a smaller one (already streaming) worked."""
    model = model_of(layout)
    ids = prompt(2)
    least = _least_budget(lambda **kw: session(model, **kw), offload=False)  # every weight resident
    want = reference_greedy(model, ids, 24)
    with session(model, offload=True, vmm=True, vram_limit=least) as s:
        assert len(s.segments) == 1
        with pytest.warns(OffloadWarning, match="the weights now stream in"):
            got = s.generate(ids, 24)
        np.testing.assert_array_equal(got, want)
        assert len(s.segments) > 1 and kv_committed(s) == 0
        np.testing.assert_array_equal(s.generate(ids, 24), want)  # and again, already streaming
        assert any("kv_bytes=" in n for n in s.stats().notes)
    assert s.stats().ledger.committed == 0


@pytest.mark.parametrize("layout", ["standard", "exact"])
def test_a_longer_generation_after_a_shorter_one_runs_where_a_new_session_runs_it(layout):
    """The plan made for a short generation's cache is made again for a longer one's: what
    a session can generate does not depend on what it generated before."""
    model = make_decoder(layout, layers=3, hidden=128, heads=4, kv_heads=4, max_length=1024, dtype=np.float16)
    ids = np.random.default_rng(33).integers(0, 97, (1, 33))

    def make():
        return session(model, offload=True, vmm=True, vram_limit=weight_bytes(model) + (2 << 20))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        with make() as s:
            want = s.generate(ids, 300)
        with make() as s:
            s.generate(ids, 100)
            shorter = len(s.segments)
            np.testing.assert_array_equal(s.generate(ids, 300), want)
            assert len(s.segments) > shorter  # planned again, for the longer cache
        assert s.stats().ledger.committed == 0


def test_weights_that_cannot_start_streaming_stay_resident_and_the_session_runs_on(monkeypatch):
    """When the segments cannot be made (here ORT fails to create one, after the resident
    runner was let go), the weights come back resident, the error is raised, nothing
    leaks, and the session runs on."""
    from onnx_offload.engines.ort_sessions import SessionFactory
    model = model_of("gqa")
    ids = prompt(1)
    least = _least_budget(lambda **kw: session(model, **kw), offload=False)
    want = reference_greedy(model, ids, 8)
    real = SessionFactory.create
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second segment's session
            raise RuntimeError("ORT could not create the session")
        return real(self, *args, **kwargs)

    with session(model, offload=True, vmm=True, vram_limit=least) as s:
        resident = s.device.ledger.snapshot().zones["weights"].committed.current
        monkeypatch.setattr(SessionFactory, "create", failing)
        with pytest.raises(RuntimeError, match="ORT could not create the session"):
            s.generate(ids, 8)
        monkeypatch.setattr(SessionFactory, "create", real)
        assert len(calls) >= 2
        zones = s.device.ledger.snapshot().zones
        assert len(s.segments) == 1 and kv_committed(s) == 0 and zones["weights"].committed.current == resident
        with pytest.warns(OffloadWarning, match="the weights now stream in"):
            np.testing.assert_array_equal(s.generate(ids, 8), want)
    assert s.stats().ledger.committed == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_larger_budget_generates_where_a_smaller_one_does(layout):
    """Above the smallest budget that holds every weight, a budget that generates is
    followed by larger ones that generate too, with the same tokens."""
    model = model_of(layout)
    ids = prompt(3)
    least = _least_budget(lambda **kw: session(model, **kw), offload=False)
    want = reference_greedy(model, ids, 40)
    outcomes = []
    for k in range(0, 64, 6):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadWarning)  # the weights may start streaming
            with session(model, offload=True, vmm=True, vram_limit=least + k * 4096) as s:
                try:
                    np.testing.assert_array_equal(s.generate(ids, 40), want)
                    outcomes.append(True)
                except BudgetExceeded:
                    outcomes.append(False)
    assert outcomes == sorted(outcomes) and outcomes[-1], outcomes


def test_a_sliding_window_from_config_json_generates_as_a_plain_ort_loop(tmp_path):
    """A Mistral-style window placed by the past's length: a past padded to a bucket would
    move it (the tokens differ from the 2nd on here), so config.json's window makes the
    past go in at its exact length."""
    import json
    model = decoder_lm("standard", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=97,
                       max_length=128, sliding_window=4)
    path = save_decoder(model, str(tmp_path / "m"))
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump({"model_type": "mistral", "sliding_window": 4, "use_sliding_window": True}, f)
    ids = np.random.default_rng(5).integers(0, 97, (2, 9))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    for kw in (dict(), dict(offload=True, weight_bytes=weight_bytes(model) // 3, host_granularity=64 << 10)):
        with OffloadSession(path, providers=CPU, **kw) as s:
            assert s.decoder_spec.layout == "exact" and s.decoder_spec.sliding_window == 4
            assert any("sliding window of 4" in n for n in s.stats().notes)
            np.testing.assert_array_equal(s.generate(ids, 20), reference_greedy(model, ids, 20))
            np.testing.assert_array_equal(s.generate(ids, 20, attention_mask=mask),
                                          reference_greedy(model, ids, 20, attention_mask=mask))
            assert s.close().committed == 0


def test_cli_generate_streams_one_row_and_takes_temperature_0_and_eos_ids(tmp_path, capsys):
    model = model_of("gqa")
    path = save_decoder(model, str(tmp_path / "llm"))
    want = reference_greedy(model, np.array([[5, 6, 7]]), 6)[0, 3:]
    argv = ["generate", path, "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--cpu", "--vram-limit", "64MiB"]
    # --temperature 0 is greedy, as llama.cpp and HF users mean it, even with --do-sample.
    assert main(argv + ["--temperature", "0", "--do-sample"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("tokens: ")] == \
        ["tokens: " + ",".join(map(str, want))]
    # A row ends at its first EOS id (the rest repeat it).
    assert main(argv + ["--eos-token-id", f"{want[1]},99999"]) == 0
    out = capsys.readouterr().out
    assert "tokens: " + ",".join(map(str, want[:2])) in out


@pytest.mark.usefixtures("ctrl_c")
def test_cli_generate_ends_a_ctrl_c_with_130_and_the_tokens_so_far(tmp_path):
    import signal
    import subprocess
    import sys
    path = save_decoder(decoder_lm("gqa", max_length=4096), str(tmp_path / "llm"),
                        config=genai_config(2, 64, 4, 2, 97, 4096, eos_token_id=-1))
    child = subprocess.Popen([sys.executable, "-m", "onnx_offload", "generate", path, "--prompt-ids", "5,6,7",
                              "--max-new-tokens", "4000", "--cpu", "--cache-dir", "off"], cwd=str(tmp_path),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = child.stdout.read(len("tokens: ") + 3)  # the first tokens came
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    assert "Traceback" not in err and "interrupted after" in err, err
    assert (seen + out).startswith("tokens: ") and len((seen + out).strip().split(",")) > 1


def test_cli_generate_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """`onnx-offload generate ... | head -c 20`: the reader goes away; the command ends
    as one killed by SIGPIPE would (141), saying nothing."""
    import subprocess
    import sys
    path = save_decoder(decoder_lm("gqa", max_length=4096), str(tmp_path / "llm"),
                        config=genai_config(2, 64, 4, 2, 97, 4096, eos_token_id=-1))
    child = subprocess.Popen([sys.executable, "-m", "onnx_offload", "generate", path, "--prompt-ids", "5,6,7",
                              "--max-new-tokens", "4000", "--cpu", "--cache-dir", "off"], cwd=str(tmp_path),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.read(len("tokens: ") + 3)
    child.stdout.close()
    with child.stderr:
        err = child.stderr.read()
    assert child.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


def test_cli_run_on_a_decoder_without_feeds_says_to_generate(tmp_path, capsys):
    path = save_decoder(model_of("gqa"), str(tmp_path / "llm"))
    assert main(["run", path, "--cpu", "--vram-limit", "64MiB"]) == 2
    err = capsys.readouterr().err
    assert "decoder with a KV cache" in err and "onnx-offload generate" in err and "--inputs" in err


@pytest.mark.parametrize("source", ["generation_config.json", "config.json", "folder"])
def test_eos_comes_from_hugging_face_s_files_and_a_folder_is_a_model(tmp_path, source):
    """As Optimum and HF's generate() stop: generation_config.json's eos_token_id, else
    config.json's; and the model is taken as the folder the ecosystem hands over."""
    import json
    model = model_of("standard")
    ids = prompt(1)
    want = reference_greedy(model, ids, 8)[0, 6:]
    folder = tmp_path / "llm"
    path = save_decoder(model, str(folder))
    name = "config.json" if source == "config.json" else "generation_config.json"
    (folder / name).write_text(json.dumps({"eos_token_id": [int(want[2]), 99999]}))
    with session(model if source != "folder" else None, path=str(folder) if source == "folder" else path) as s:
        got = s.generate(ids, 8)[0, 6:]
    np.testing.assert_array_equal(got[:3], want[:3])
    assert (got[3:] == want[2]).all()  # the row stopped at its EOS, which repeats


def test_a_folder_with_several_models_and_none_named_says_so(tmp_path):
    from onnx_offload import ModelNotFound
    from onnx_offload.models import save
    for name in ("a.onnx", "b.onnx"):
        save(mlp_stack(layers=1, hidden=64, batch=2), str(tmp_path / name))
    with pytest.raises(ModelNotFound, match="several ONNX models"):
        OffloadSession(str(tmp_path), providers=CPU)


def test_sampling_defaults_come_from_the_model_s_generation_config(tmp_path):
    """As HF's generate() and onnxruntime-genai read them: arguments left unset take the
    model's generation_config.json (here do_sample with top_k 1, which is greedy)."""
    import json
    model = model_of("gqa")
    ids = prompt(1)
    want = reference_greedy(model, ids, 8)
    path = save_decoder(model, str(tmp_path / "llm"))
    with session(None, path=path) as s:
        sampled = s.generate(ids, 8, do_sample=True, seed=3)
    assert not np.array_equal(sampled, want)  # this model samples other tokens than its greedy ones
    (tmp_path / "llm" / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 1}))
    with session(None, path=path) as s:
        np.testing.assert_array_equal(s.generate(ids, 8, seed=3), want)  # top_k 1: the greedy tokens
        assert not np.array_equal(s.generate(ids, 8, seed=3, top_k=0), want)  # an argument wins


def test_each_chunk_of_a_bucketed_prompt_waits_for_the_copy_of_the_one_before():
    """The standard layout copies a chunk's present into the bucketed past on the device's
    stream (on the CPU a thread of its own); the next chunk, which the CPU EP runs on the
    caller's thread, reads it only once the copy is done."""
    model = make_decoder("standard", layers=4, max_length=64)
    with session(model, prefill_chunk=8) as s:
        for seed in range(12):
            ids = prompt(1, 20, seed=seed)
            np.testing.assert_array_equal(s.generate(ids, 2), reference_greedy(model, ids, 2))
