"""What the CLI prints, read as a terminal shows it: stdout and stderr in one stream, in
the order they came."""
import os
import subprocess
import sys

import pytest

from onnx_offload.models.decoder import decoder_lm, save_decoder
from onnx_offload.tools.cli import main


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """A small decoder's folder (vocabulary 97)."""
    return save_decoder(decoder_lm("gqa", max_length=256), str(tmp_path_factory.mktemp("llm") / "llm"))


def test_a_prompt_id_outside_the_vocabulary_is_said_before_any_output(llm, tmp_path):
    """Both streams into one pipe, as a terminal takes them: the error is the first line."""
    proc = subprocess.run([sys.executable, "-m", "onnx_offload", "generate", llm, "--prompt-ids", "1,2,40000",
                           "--cpu", "--cache-dir", "off"], cwd=str(tmp_path), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.startswith("onnx-offload: ValueError: token ids must lie in [0, 97)"), proc.stdout
    assert "tokens:" not in proc.stdout


def test_an_error_part_way_through_the_tokens_goes_on_a_line_of_its_own(llm, capsys, monkeypatch):
    """The tokens that came end their line before the error is printed."""
    from onnx_offload.engines.runner import SegmentRunner
    calls = []
    original = SegmentRunner.run_bound

    def fails_on_the_third_step(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a step failed")
        return original(*a, **kw)
    monkeypatch.setattr(SegmentRunner, "run_bound", fails_on_the_third_step)
    rc = main(["generate", llm, "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--cpu", "--cache-dir", "off"])
    out, err = capsys.readouterr()
    assert rc == 2 and "a step failed" in err, err
    assert out.startswith("tokens: ") and out.endswith("\n") and out.count(",") >= 1, out
