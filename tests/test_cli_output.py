"""What the CLI prints, read as a terminal shows it: stdout and stderr in one stream, in
the order they came."""
import os
import subprocess
import sys

import pytest

from onnx_offload.models.decoder import decoder_lm, save_decoder
from onnx_offload.tools.cli import main
from conftest import child_env


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """A small decoder's folder (vocabulary 97)."""
    return save_decoder(decoder_lm("gqa", max_length=256), str(tmp_path_factory.mktemp("llm") / "llm"))


def test_a_prompt_id_outside_the_vocabulary_is_said_before_any_output(llm, tmp_path):
    """Both streams into one pipe, as a terminal takes them: the error is the first line."""
    proc = subprocess.run([sys.executable, "-m", "onnx_offload", "generate", llm, "--prompt-ids", "1,2,40000",
                           "--cpu", "--cache-dir", "off"], cwd=str(tmp_path), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120,
                          env=child_env())
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


def test_generate_says_what_it_measured(llm, capsys):
    """On the CPU, weights streamed: the budget, that nothing is saved in RAM, a decode
    step against the bound of its streamed bytes at the measured link, what to try."""
    import re
    rc = main(["generate", llm, "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--cpu", "--cache-dir", "off",
               "--vram-limit", "8MiB", "--weight-bytes", "64KiB"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert re.search(r"^budget: 8.00 MiB; .* for the model's [0-9.]+ KiB of weights$", out, re.M), out
    assert "\nsaved: no RAM: on the CPU the host backend plays the GPU" in out, out
    step, bound, ratio, link = re.search(r"^a decode step: ([0-9.]+) ms against its bound of ([0-9.]+) ms "
                                         r"\(([0-9.]+)x\): [0-9.]+ KiB over the link at [0-9.]+ GB/s \(measured\) "
                                         r"take ([0-9.]+) ms$", out, re.M).groups()
    # Each figure is printed rounded to its last digit: the ratio lies within what the
    # rounded step and bound allow.
    half = 0.005
    low, high = (float(step) - half) / (float(bound) + half), (float(step) + half) / max(float(bound) - half, 1e-9)
    assert bound == link and low * 0.99 - 0.06 <= float(ratio) <= high * 1.01 + 0.06, (step, bound, ratio)
    assert "\nnext: on the CPU the host backend plays a GPU" in out, out


@pytest.mark.gpu
def test_the_demo_on_the_gpu_says_what_the_budget_saved_and_how_near_its_bound_the_step_ran(capsys):
    import re
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    saved = re.search(r"saved: ([0-9.]+) MiB of GPU memory that plain ORT's weights would take", out)
    assert saved and float(saved.group(1)) > 32, out
    assert re.search(r"a step: [0-9.]+ ms against its bound of [0-9.]+ ms \([0-9.]+x\)", out), out
    assert re.search(r"^  next: the step runs (at|above) its bound", out, re.M), out
