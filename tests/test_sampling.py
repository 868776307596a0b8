"""The greedy pick reads float16 logits without casting them, and must give numpy's
argmax of their float32 values in every case: ties, both zeros, infinities and NaNs of
either sign, rows of negative values only."""
import numpy as np
import pytest

from onnx_offload.generation.sampling import Sampling, greedy

EVERY_FLOAT16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, 65504, -65504, 6e-8, -6e-8], np.float16)
NEGATIVE_NANS = np.array([0xFC01, 0xFE00, 0xFFFF], np.uint16).view(np.float16)


def expected(logits):
    return logits.astype(np.float32).argmax(axis=-1)


def test_every_float16_value_as_the_largest_of_a_row_and_tied_with_itself():
    # Row i holds value i twice among a background of the values around it, so each of
    # the 65536 values is once the maximum, once tied, and beside both zeros.
    rng = np.random.default_rng(0)
    n = EVERY_FLOAT16.size
    rows = np.empty((n, 12), np.float16)
    rows[:, :8] = EVERY_FLOAT16[(np.arange(n)[:, None] + rng.integers(-3, 4, (n, 8))) % n]
    rows[:, 8:10] = np.float16(0.0), np.float16(-0.0)
    rows[:, 10:] = EVERY_FLOAT16[:, None]
    for perm in (np.arange(12), rng.permutation(12), rng.permutation(12)):
        r = np.ascontiguousarray(rows[:, perm])
        assert np.array_equal(greedy(r), expected(r))


@pytest.mark.parametrize("kind", ["any", "negative", "with specials", "with negative NaNs"])
def test_random_rows_of_few_values_with_many_ties(kind):
    rng = np.random.default_rng({"any": 1, "negative": 2, "with specials": 3, "with negative NaNs": 4}[kind])
    for _ in range(3000):
        pool = rng.choice(EVERY_FLOAT16, size=rng.integers(1, 6))
        if kind == "negative":
            pool = -np.abs(pool)
        elif kind == "with specials":
            pool = np.concatenate([pool, SPECIALS])
        elif kind == "with negative NaNs":
            pool = np.concatenate([pool[~np.isnan(pool)], SPECIALS, NEGATIVE_NANS])
        rows = rng.choice(pool, size=(int(rng.integers(1, 5)), int(rng.integers(1, 40)))).astype(np.float16)
        assert np.array_equal(greedy(rows), expected(rows)), rows.view(np.uint16)


def test_a_vocabulary_row_and_other_float_types():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 128256)).astype(np.float16)
    x[1] -= 40  # every logit negative
    x[2, 7] = np.nan
    x[3, 100:] = 0.0
    x[3, 50] = -0.0
    x[3, :50] = -1.0
    for logits in (x, x.astype(np.float32), x.astype(np.float64)):
        got = greedy(logits)
        assert got.dtype == np.int64
        assert np.array_equal(got, expected(x))
    assert np.array_equal(Sampling().pick(x, np.random.default_rng(0)), expected(x))


@pytest.mark.parametrize("dtype", ["<f8", ">f8", "longdouble", "int32", "int64", ">f2"])
def test_logits_of_numpy_s_own_types_are_picked_by_their_own_values(dtype):
    # values that float32 would make equal (or infinite)
    rows = {"<f8": [1.0, 1.0 + 1e-12, 1.0], ">f8": [1e300, 2e300, 0.0], "longdouble": [1.0, 1.0 + 1e-12, 1.0],
            "int32": [16777216, 16777217, 0], "int64": [2**40, 2**40 + 1, 0], ">f2": [0.5, 2.0, 1.0]}[dtype]
    assert greedy(np.array([rows], dtype=dtype)).tolist() == [1]


def test_bfloat16_logits_are_picked_by_their_float32_values():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.array([[1.0, 3.0, np.nan, 3.0], [-1.0, -0.5, -2.0, -0.5]], np.float32)
    assert greedy(x.astype(ml_dtypes.bfloat16)).tolist() == [2, 1]


def test_logits_other_than_batch_by_vocabulary_are_refused():
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        greedy(np.zeros((2, 3, 10), np.float16))


def test_sampling_reads_float16_logits_as_their_float32_values():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 1000)).astype(np.float16)
    s = Sampling(do_sample=True, temperature=0.7, top_k=50, top_p=0.9)
    assert np.array_equal(s.pick(x, np.random.default_rng(1)), s.pick(x.astype(np.float32), np.random.default_rng(1)))


def test_a_call_that_asks_to_sample_leaves_out_the_model_s_top_k_of_1(tmp_path):
    """onnxruntime-genai's builder writes top_k 1 beside do_sample false: a call (or a
    server request) that asks to sample samples, not the greedy token every time."""
    from onnx_offload import OffloadSession
    from onnx_offload.models.decoder import decoder_lm, genai_config, save_decoder
    model = decoder_lm("gqa", max_length=64)
    folder = str(tmp_path / "llm")
    save_decoder(model, folder, genai_config(layers=2, hidden=64, heads=4, kv_heads=2, vocab=97, max_length=64))
    ids = np.random.default_rng(0).integers(0, 97, (1, 6))
    with OffloadSession(folder, providers=["CPUExecutionProvider"], vram_limit="64MiB") as s:
        assert dict(s.decoder_spec.sampling)["top_k"] == 1
        greedy_ids = s.generate(ids, 12)[0, 6:]
        sampled = [s.generate(ids, 12, do_sample=True, temperature=2.0, seed=seed)[0, 6:] for seed in range(3)]
        assert any(not np.array_equal(x, greedy_ids) for x in sampled)
        # top_k given by the call is the call's
        np.testing.assert_array_equal(s.generate(ids, 12, do_sample=True, top_k=1, seed=5)[0, 6:], greedy_ids)
    from onnx_offload.generation import sampling_sources
    assert sampling_sources({"do_sample": False, "top_k": 1}, {"do_sample": True})["top_k"] == (
        0, "model top_k 1 dropped")
    assert sampling_sources({"do_sample": False, "top_k": 1}, {})["top_k"] == (1, "model")
    assert sampling_sources({"top_k": 40}, {"do_sample": True})["top_k"] == (40, "model")


def test_cli_sampling_flags_without_do_sample_sample_as_a_server_request_does(tmp_path, capsys):
    """--temperature, --top-k or --top-p alone samples (llama.cpp's users mean it so, and a
    request to the server that sets them samples); --temperature 0 decodes greedily."""
    from onnx_offload.tools.cli import main
    from onnx_offload.models.decoder import decoder_lm, genai_config, save_decoder
    folder = str(tmp_path / "llm")
    save_decoder(decoder_lm("gqa", max_length=64), folder,
                 genai_config(layers=2, hidden=64, heads=4, kv_heads=2, vocab=97, max_length=64))

    def tokens(*flags):
        assert main(["generate", folder, "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--cpu", *flags]) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tokens: "))
    greedy = tokens()
    assert tokens("--temperature", "0", "--seed", "1") == greedy
    for flags in (["--temperature", "2"], ["--top-p", "0.99"], ["--top-k", "50"]):
        assert any(tokens(*flags, "--seed", str(seed)) != greedy for seed in range(3)), flags
