"""User errors: a VRAM limit of a few bytes, and the `onnx-offload` command line's bad
arguments and inputs, each refused with one line on stderr and exit code 2, before any
weight is loaded where the input allows it."""
import pickle

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_offload import BudgetExceeded, CorruptModel, OffloadConfig, OffloadSession
from onnx_offload.tools import cli, cli_bench
from onnx_offload.config import parse_vram_limit
from onnx_offload.models import mlp_stack, save

GRANULE = 2 * 1024 * 1024


# --- ONNX_GENAI_VRAM_LIMIT=1 is one byte, not the whole device -------------------------------

@pytest.mark.parametrize("value,shown", [("1", "'1' is 1 byte"), (1, "=1 is 1 byte"), (" 4096 ", "' 4096 ' is 4096 bytes"),
                                         (GRANULE - 1, f"={GRANULE - 1} is {GRANULE - 1} bytes"),
                                         ("1KiB", "'1KiB' is 1024 bytes"), ("1MB", "'1MB' is 1000000 bytes")])
def test_a_byte_count_below_one_granule_is_refused_showing_both_forms(value, shown):
    with pytest.raises(ValueError) as e:
        parse_vram_limit(value)
    msg = str(e.value)
    assert msg.startswith("ONNX_GENAI_VRAM_LIMIT"), msg
    assert shown in msg and "less than one 2 MiB granule" in msg, msg
    assert "1.0 for the whole device" in msg and "1GiB" in msg, msg


def test_the_message_names_the_variable_and_what_was_written():
    with pytest.raises(ValueError) as e:
        parse_vram_limit("1")
    assert str(e.value) == ("ONNX_GENAI_VRAM_LIMIT='1' is 1 byte, less than one 2 MiB granule: "
                            "write 1.0 for the whole device, or a size such as 1GiB")


def test_the_environment_and_the_keyword_are_refused_alike():
    with pytest.raises(ValueError, match=r"ONNX_GENAI_VRAM_LIMIT='1' is 1 byte.*1\.0.*1GiB"):
        OffloadConfig.from_env({"ONNX_GENAI_VRAM_LIMIT": "1"})
    with pytest.raises(ValueError, match=r"vram_limit=1 is 1 byte.*1\.0.*1GiB"):
        OffloadConfig(vram_limit=1)
    with pytest.raises(ValueError, match=r"vram_limit='1' is 1 byte.*1\.0.*1GiB"):
        OffloadConfig.from_env({}, vram_limit="1")


@pytest.mark.parametrize("value,expected", [("1.0", 1.0), (1.0, 1.0), ("1.", 1.0), (GRANULE, GRANULE),
                                            (str(GRANULE), GRANULE), ("2MiB", GRANULE), ("1GiB", 1 << 30)])
def test_a_granule_or_more_and_the_whole_device_are_accepted(value, expected):
    assert parse_vram_limit(value) == expected


def test_the_floor_is_the_configured_granule_where_the_host_backend_has_a_smaller_one():
    # the host backend's tests run with 64 KiB granules and budgets of a few of them
    assert OffloadConfig(vram_limit=128 << 10, host_granularity=64 << 10).vram_limit == 128 << 10
    assert OffloadConfig.from_env({"ONNX_GENAI_VRAM_LIMIT": "131072"}, host_granularity=64 << 10).vram_limit == 128 << 10
    with pytest.raises(ValueError, match="less than one 64 KiB granule"):
        OffloadConfig(vram_limit=4096, host_granularity=64 << 10)


# --- the command line ------------------------------------------------------------------------

@pytest.fixture
def model_path(tmp_path):
    return save(mlp_stack(layers=4, hidden=1024, batch=4), str(tmp_path / "m.onnx"))


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fails the test if the command creates a session (loads weights)."""
    import onnx_offload.session

    def refuse(*a, **kw):
        raise AssertionError("the session was created (weights loaded) before the error was found")
    monkeypatch.setattr(onnx_offload.session, "OffloadSession", refuse)


def one_line_error(capsys, rc, *words):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "loading weights" not in line]
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("onnx-offload: "), err
    for w in words:
        assert w in lines[0], err
    return lines[0]


@pytest.mark.parametrize("steps", ["0", "-1", "two"])
def test_steps_below_one_are_refused_when_parsing(model_path, steps, capsys, no_weights_loaded):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", model_path, "--cpu", "--steps", steps, "--profile"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "argument --steps" in err, err


@pytest.mark.parametrize("flag,env", [(["--vram-limit", "1"], None), ([], "1"), (["--vram-limit", "1KiB"], "0.5")])
def test_a_vram_limit_of_a_few_bytes_is_refused_before_the_weights_load(model_path, flag, env, capsys, monkeypatch):
    if env is None:
        monkeypatch.delenv("ONNX_GENAI_VRAM_LIMIT", raising=False)
    else:
        monkeypatch.setenv("ONNX_GENAI_VRAM_LIMIT", env)
    rc = cli.main(["run", model_path, "--cpu", "--steps", "1"] + flag)
    out = capsys.readouterr()
    assert "loading weights" not in out.err, out.err
    assert rc == 2 and "Traceback" not in out.err and len(out.err.strip().splitlines()) == 1, out.err
    name = "--vram-limit='" if flag else "ONNX_GENAI_VRAM_LIMIT='1' is 1 byte"
    for w in ("onnx-offload: ValueError: ", name, "less than one 2 MiB granule", "1.0", "1GiB"):
        assert w in out.err, out.err


def test_a_missing_inputs_file_is_reported_before_the_weights_load(model_path, tmp_path, capsys, no_weights_loaded):
    missing = str(tmp_path / "nowhere.npz")
    rc = cli.main(["run", model_path, "--cpu", "--steps", "1", "--inputs", missing])
    one_line_error(capsys, rc, "FileNotFoundError", missing)


@pytest.mark.parametrize("content", [b"x = 1, 2, 3\n", b"", b"PK\x03\x04 not really a zip"])
def test_an_inputs_file_that_is_not_an_npz_is_reported_before_the_weights_load(model_path, tmp_path, capsys,
                                                                                 no_weights_loaded, content):
    bad = tmp_path / "feeds.npz"
    bad.write_bytes(content)
    rc = cli.main(["run", model_path, "--cpu", "--steps", "1", "--inputs", str(bad)])
    one_line_error(capsys, rc, "ValueError", str(bad), ".npz", "zip")


def test_an_npy_file_is_not_an_npz(model_path, tmp_path, capsys, no_weights_loaded):
    npy = str(tmp_path / "x.npy")
    np.save(npy, np.zeros((4, 1024), np.float32))
    rc = cli.main(["run", model_path, "--cpu", "--steps", "1", "--inputs", npy])
    one_line_error(capsys, rc, "ValueError", npy, ".npz")


def test_feeds_whose_names_do_not_match_the_model_inputs(model_path, tmp_path, capsys):
    feeds = str(tmp_path / "feeds.npz")
    np.savez(feeds, y=np.zeros((4, 1024), np.float32))
    rc = cli.main(["run", model_path, "--cpu", "--steps", "1", "--inputs", feeds])
    line = one_line_error(capsys, rc, "ValueError", "'x'", "'y'")
    assert "missing" in line and "unknown" in line, line


def test_feeds_of_the_wrong_dtype_are_refused_not_converted(model_path, tmp_path, capsys):
    feeds = str(tmp_path / "feeds.npz")
    np.savez(feeds, x=np.zeros((4, 1024), np.float64))
    rc = cli.main(["run", model_path, "--cpu", "--steps", "1", "--inputs", feeds])
    one_line_error(capsys, rc, "ValueError", "'x'", "float64", "float32")


def test_feeds_of_the_wrong_shape_are_refused(model_path, tmp_path, capsys):
    feeds = str(tmp_path / "feeds.npz")
    np.savez(feeds, x=np.zeros((4, 512), np.float32))
    rc = cli.main(["run", model_path, "--cpu", "--steps", "1", "--inputs", feeds])
    one_line_error(capsys, rc, "ValueError", "'x'", "(4, 512)")


def test_good_feeds_still_run(model_path, tmp_path, capsys):
    feeds = str(tmp_path / "feeds.npz")
    np.savez(feeds, x=np.zeros((4, 1024), np.float32))
    rc = cli.main(["run", model_path, "--cpu", "--steps", "2", "--profile", "--inputs", feeds])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "over 2 steps" in out.out


def test_bench_out_on_a_path_that_cannot_be_a_folder(tmp_path, capsys):
    afile = tmp_path / "a-file"
    afile.write_text("")
    rc = cli.main(["bench", "arena", "--cpu", "--out", str(afile / "sub")])
    one_line_error(capsys, rc, "NotADirectoryError")


def test_bench_out_without_permission(capsys, monkeypatch):
    def denied(path, *a, **kw):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(cli_bench.os, "makedirs", denied)
    rc = cli.main(["bench", "arena", "--cpu", "--out", "/proc/forbidden"])
    one_line_error(capsys, rc, "PermissionError", "/proc/forbidden")


@pytest.mark.parametrize("cls", [ort.InferenceSession, OffloadSession])
def test_loading_errors_are_of_the_types_ort_raises(cls, tmp_path):
    """Code written for InferenceSession catches OffloadSession's loading errors: a
    missing file is NoSuchFile, bytes that are not a model InvalidProtobuf, a model ORT's
    loader refuses the type it raised (and the package's own types still hold)."""
    errors = ort.capi.onnxruntime_pybind11_state
    with pytest.raises(errors.NoSuchFile) as e:
        cls(str(tmp_path / "missing.onnx"), providers=["CPUExecutionProvider"])
    assert cls is ort.InferenceSession or isinstance(e.value, FileNotFoundError)
    with pytest.raises(errors.InvalidProtobuf) as e:
        cls(b"these bytes are no model", providers=["CPUExecutionProvider"])
    assert cls is ort.InferenceSession or isinstance(e.value, CorruptModel)
    back = pickle.loads(pickle.dumps(e.value))  # as multiprocessing sends it
    assert isinstance(back, errors.InvalidProtobuf) and str(back) == str(e.value)
    assert cls is ort.InferenceSession or isinstance(back, CorruptModel)
    g = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    bad = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    try:
        ort.InferenceSession(bad, providers=["CPUExecutionProvider"])
    except Exception as ort_error:  # noqa: BLE001 - whatever ORT raises is what is expected
        expected = type(ort_error)
    with pytest.raises(expected) as e:
        cls(bad, providers=["CPUExecutionProvider"])
    assert cls is ort.InferenceSession or isinstance(e.value, CorruptModel)


@pytest.mark.parametrize("kw", [dict(vram_limit="9" * 400), dict(weight_bytes="9" * 400), dict(kv_bytes="9" * 400),
                                dict(weight_bytes=2**70), dict(kv_bytes=2**70), dict(host_granularity=2**70),
                                dict(zone_va_bytes=2**70), dict(vram_limit="9" * 30 + "GiB"),
                                dict(weight_bytes=str(2**63))])
def test_sizes_past_64_bits_are_a_value_error(kw):
    with pytest.raises(ValueError, match="more than 9223372036854775807 bytes|is not valid"):
        OffloadConfig(**kw)


def test_the_largest_64_bit_size_is_a_size():
    from onnx_offload.config import parse_bytes
    assert parse_bytes(str(2**63 - 1)) == 2**63 - 1 and parse_bytes("0.5KiB") == 512


def test_an_eos_past_64_bits_is_refused_at_the_call():
    from onnx_offload.models.decoder import decoder_lm
    with OffloadSession(decoder_lm("gqa", max_length=64).SerializeToString(), providers=["CPUExecutionProvider"],
                        vram_limit="64MiB", host_granularity=4096) as s:
        with pytest.raises(ValueError, match="eos_token_id"):
            s.generate_iter(np.arange(4)[None], 3, eos_token_id=2**63)
        assert s.generate(np.arange(4)[None], 3, eos_token_id=[5, 2**63 - 1]).shape == (1, 7)


@pytest.mark.parametrize("key", ["kv_bytes", "scratch_bytes"])
def test_a_reserve_larger_than_the_device_is_named_as_what_limits(key):
    from onnx_offload.models import mlp_stack
    m = mlp_stack(layers=3, hidden=256, batch=4).SerializeToString()
    with pytest.raises(BudgetExceeded) as e:
        OffloadSession(m, providers=["CPUExecutionProvider"], offload=True, vmm=True, vram_limit="64MiB",
                       **{key: 10**15})
    assert f"lower {key}" in str(e.value) and "weight_bytes" not in str(e.value)
    with OffloadSession(m, providers=["CPUExecutionProvider"], offload=True, vmm=True, vram_limit="64MiB",
                        **{key: "1MiB"}) as s:  # the advice followed, on the same budget
        s.run(None, {"x": np.ones((4, 256), np.float32)})
