"""Files beside a model that the package hands to another library (tokenizers,
transformers, numpy) are checked as regular files of bounded size first: a FIFO or a
device gives a clear error that names the file, never a hang or a read without end.

Each case runs in a child process under a timeout, so that a hang fails the test instead
of holding the run."""
import os
import subprocess
import sys
import textwrap

import pytest

from onnx_offload.models.decoder import decoder_lm, save_decoder
from conftest import CHILD_CWD, child_env

TIMEOUT_S = 60


def child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=child_env(), cwd=CHILD_CWD, stdin=subprocess.DEVNULL)


def spoil(path: str, how: str) -> str:
    """Puts a FIFO, or a link to /dev/zero, at `path`; what the error should say of it."""
    if how == "fifo":
        os.mkfifo(path)
        return "not a regular file but a FIFO"
    os.symlink("/dev/zero", path)
    return "not a regular file but a character device"


@pytest.fixture
def llm(tmp_path):
    return save_decoder(decoder_lm("gqa", layers=1, hidden=32, heads=2, kv_heads=1, vocab=17),
                        str(tmp_path / "llm"))


@pytest.mark.parametrize("how", ["fifo", "dev_zero"])
def test_generate_refuses_a_tokenizer_json_that_is_no_regular_file(llm, how):
    pytest.importorskip("tokenizers", reason="--prompt needs the 'tokenizers' package")
    tokenizer = os.path.join(os.path.dirname(llm), "tokenizer.json")
    says = spoil(tokenizer, how)
    r = child("import sys; from onnx_offload.tools.cli import main; sys.exit(main(sys.argv[1:]))",
              "generate", os.path.dirname(llm), "--prompt", "hi", "--cpu")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "UnsupportedModel" in r.stderr and tokenizer in r.stderr and says in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["generation_config.json", "config.json"])
@pytest.mark.parametrize("how", ["fifo", "dev_zero"])
def test_the_optimum_route_refuses_a_config_file_that_is_no_regular_file(llm, name, how):
    """Checked before transformers (or Optimum) is imported or reads the folder."""
    path = os.path.join(os.path.dirname(llm), name)
    if name != "config.json":
        with open(os.path.join(os.path.dirname(llm), "config.json"), "w") as f:
            f.write('{"model_type": "llama"}')
    says = spoil(path, how)
    r = child("""
        import sys
        from onnx_offload.errors import UnsupportedModel
        from onnx_offload.optimum_model import causal_lm
        try:
            causal_lm(sys.argv[1], providers=["CPUExecutionProvider"], cache_dir="off")
        except UnsupportedModel as e:
            print(e)
        """, os.path.dirname(llm))
    assert r.returncode == 0, r.stderr
    assert path in r.stdout and says in r.stdout, (r.stdout, r.stderr)


@pytest.mark.parametrize("how", ["fifo", "dev_zero"])
def test_run_refuses_inputs_that_are_no_regular_file(llm, tmp_path, how):
    feeds = str(tmp_path / "feeds.npz")
    says = spoil(feeds, how)
    r = child("import sys; from onnx_offload.tools.cli import main; sys.exit(main(sys.argv[1:]))",
              "run", llm, "--cpu", "--inputs", feeds)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert feeds in r.stderr and says in r.stderr, r.stderr


@pytest.mark.parametrize("how", ["fifo", "dev_zero"])
def test_a_model_path_that_is_no_regular_file_is_refused(tmp_path, how):
    """Plain ORT waits on a FIFO for ever: the session refuses it (CorruptModel, also ORT's
    Fail) before onnx or ORT opens it."""
    path = str(tmp_path / "model.onnx")
    says = spoil(path, how)
    r = child("""
        import sys
        from onnxruntime.capi.onnxruntime_pybind11_state import Fail
        from onnx_offload import CorruptModel, OffloadSession
        try:
            OffloadSession(sys.argv[1], providers=["CPUExecutionProvider"])
        except CorruptModel as e:
            print(isinstance(e, Fail), e)
        """, path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("True") and path in r.stdout and says in r.stdout, (r.stdout, r.stderr)


def test_the_optimum_route_names_a_missing_config_json_in_the_model_s_folder(llm):
    r = child("""
        import sys
        from onnx_offload.optimum_model import causal_lm
        try:
            causal_lm(sys.argv[1], providers=["CPUExecutionProvider"], cache_dir="off")
        except FileNotFoundError as e:
            print(e)
        """, os.path.dirname(llm))
    assert r.returncode == 0, r.stderr
    assert os.path.join(os.path.dirname(llm), "config.json") in r.stdout and "no config.json" in r.stdout, r.stdout
