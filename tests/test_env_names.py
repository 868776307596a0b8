"""The environment variables as a user mistypes them: an unknown name of the package's is
warned about with the closest known one, and a cache folder the variable names is made
only where its parent exists, and said where it resolved when relative."""
import os
import warnings

import numpy as np
import pytest

from onnx_offload import OffloadSession, OffloadWarning, env_names
from onnx_offload.models import mlp_stack

CPU = ["CPUExecutionProvider"]


@pytest.fixture
def fresh_names(monkeypatch):
    """Each unknown name is warned about once a process: these tests start afresh."""
    monkeypatch.setattr(env_names, "_WARNED_NAMES", set())


@pytest.fixture(scope="module")
def model():
    return mlp_stack(layers=2, hidden=64, batch=2).SerializeToString()


def run_once(model) -> None:
    with OffloadSession(model, providers=CPU, host_granularity=4096) as s:
        s.run(None, {s.get_inputs()[0].name: np.ones(s.get_inputs()[0].shape, np.float32)})


@pytest.mark.parametrize("name,closest", [("ONNX_GENAI_VRAM_LIMT", "ONNX_GENAI_VRAM_LIMIT"),
                                          ("ONNX_OFFLOAD_VRAM_LIMIT", "ONNX_GENAI_VRAM_LIMIT"),
                                          ("ONNX_OFFLOAD_CACHEDIR", "ONNX_OFFLOAD_CACHE_DIR")])
def test_a_mistyped_name_is_warned_about_with_the_closest_known_one(name, closest, monkeypatch, fresh_names, model):
    monkeypatch.setenv(name, "64MiB")
    with pytest.warns(OffloadWarning, match=f"{name} is not a variable onnx-offload reads, and is ignored: "
                                            f"did you mean {closest}\\?"):
        run_once(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_once(model)  # once a process


def test_a_name_like_none_lists_the_names_read(monkeypatch, fresh_names, model):
    monkeypatch.setenv("ONNX_OFFLOAD_FOO", "1")
    with pytest.warns(OffloadWarning, match="ONNX_OFFLOAD_FOO .*the variables it reads are ONNX_GENAI_WEIGHT_OFFLOAD,"):
        run_once(model)


def test_a_relative_cache_folder_is_made_with_a_warning_saying_where(tmp_path, monkeypatch, model):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ONNX_OFFLOAD_CACHE_DIR", "of")
    with pytest.warns(OffloadWarning, match=f"ONNX_OFFLOAD_CACHE_DIR='of', relative to the working folder, is "
                                            f"{tmp_path}/of: the cache folder is made there"):
        run_once(model)
    assert os.listdir(tmp_path / "of")  # the cache holds the model's entry
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_once(model)  # the folder is there: nothing to say


def test_a_cache_folder_whose_parent_is_missing_is_not_made(tmp_path, monkeypatch, model):
    named = tmp_path / "typo" / "cache"
    monkeypatch.setenv("ONNX_OFFLOAD_CACHE_DIR", str(named))
    with pytest.warns(OffloadWarning, match=f"whose parent folder {tmp_path}/typo does not exist: the cache is not "
                                            f"used and nothing is made"):
        run_once(model)
    assert not (tmp_path / "typo").exists()
    # An absolute name whose parent exists is made without a word.
    monkeypatch.setenv("ONNX_OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_once(model)
    assert os.listdir(tmp_path / "cache")
