"""The route for Optimum users: Optimum's ORTModelForCausalLM over an OffloadSession.

    from onnx_offload.optimum_model import causal_lm
    model = causal_lm("llm-folder", providers=["CUDAExecutionProvider"], offload=True, vmm=True)
    tokens = model.generate(input_ids, max_new_tokens=32)  # transformers' generate(), as with Optimum

Optimum's model runs the session it is given through ``session.run`` when IO binding is
off. With IO binding on, it binds ORT's own session directly (``ort.IOBinding``), which
would go around the package's runner: its segments and its streamed weights. So the
model ``causal_lm`` makes keeps IO binding off, and refuses to turn it on. Without IO
binding Optimum feeds the KV cache from the host and takes it back every step;
``OffloadSession.generate`` keeps it on the device.
"""
from __future__ import annotations

import errno
import os
import tempfile
from typing import Optional


class _SessionForOptimum:
    """The OffloadSession as Optimum's model reads a session: its members, and the two
    private ones Optimum reads of an InferenceSession (the model's path, and the C session
    that it makes an IOBinding of, which this route never runs)."""

    def __init__(self, session, path: str):
        self._offload = session
        self._model_path = path

    @property
    def _sess(self):
        from .devices import StagedSession
        # A session split across devices: its first stage's (Optimum only reads it).
        session = self._offload.stages[0] if isinstance(self._offload, StagedSession) else self._offload
        return session._live_runner().single._sess

    def __getattr__(self, name):
        return getattr(self._offload, name)


def _offloaded(base: type) -> type:
    class OffloadedCausalLM(base):
        """Optimum's ORTModelForCausalLM whose session is an OffloadSession."""

        @property
        def use_io_binding(self) -> bool:
            return False

        @use_io_binding.setter
        def use_io_binding(self, value: bool) -> None:
            if value:
                raise ValueError("IO binding would bind ONNX Runtime's own session and go around the OffloadSession "
                                 "(its segments and streamed weights): this model runs through session.run; "
                                 "OffloadSession.generate keeps the KV cache on the device")

        @property
        def offload_session(self):
            """The OffloadSession underneath: its stats(), close()."""
            return self.session._offload

    OffloadedCausalLM.__name__ = OffloadedCausalLM.__qualname__ = "OffloadedCausalLM"
    return OffloadedCausalLM


# The files of the folder that transformers reads to configure the model.
HF_CONFIG_FILES = ("config.json", "generation_config.json")


def _checked_copies(folder: str, into: str) -> None:
    """Copies into `into` those of the folder's HF_CONFIG_FILES that are there, each read
    as a regular file of bounded size (files.read_config): transformers reads the copies,
    so a FIFO cannot hold it and /dev/zero cannot fill memory, and a file swapped after
    the check is not what it reads. UnsupportedModel names a file that cannot be read so,
    FileNotFoundError a missing config.json."""
    from .errors import UnsupportedModel
    from .loading import config_problem, read_config
    for name in HF_CONFIG_FILES:
        path = os.path.join(folder, name)
        if not os.path.lexists(path):
            if name == "config.json":  # named here: transformers would name the copies' folder
                raise FileNotFoundError(errno.ENOENT, "the model's folder has no config.json, which transformers "
                                                      "reads to configure the model (Optimum's export writes one)",
                                        path)
            continue
        try:
            data = read_config(path)
        except (OSError, ValueError) as e:
            raise UnsupportedModel(config_problem(path, e)) from None
        with open(os.path.join(into, name), "wb") as f:
            f.write(data)


def causal_lm(model, providers=None, provider_options=None, sess_options=None, **offload):
    """Optimum's ORTModelForCausalLM for the model at `model` (an Optimum export's folder,
    or its ONNX file), its session an OffloadSession made with `providers`,
    `provider_options`, `sess_options` and the configuration keywords in `offload`
    (offload=True, vram_limit=..., ...). The folder's config.json and
    generation_config.json configure it, as Optimum's from_pretrained would; each is
    checked to be a regular file first (UnsupportedModel where it is not)."""
    from .loading import model_file
    from .session import OffloadSession
    path = os.path.abspath(model_file(os.fspath(model)))
    folder = os.path.dirname(path)
    with tempfile.TemporaryDirectory(prefix="onnx-offload-hf-config-") as local:
        _checked_copies(folder, local)
        try:
            from optimum.onnxruntime import ORTModelForCausalLM
            from transformers import AutoConfig, GenerationConfig
        except ImportError as e:
            raise ImportError(f"causal_lm needs Optimum's ONNX Runtime models and transformers ({e}): pip install "
                              f"'optimum-onnx[onnxruntime]' (or [onnxruntime-gpu])") from e
        config = AutoConfig.from_pretrained(local)
        generation: Optional[GenerationConfig]
        try:
            generation = GenerationConfig.from_pretrained(local)
        except OSError:  # no generation_config.json: the model config's defaults, as Optimum takes them
            generation = GenerationConfig.from_model_config(config)
    config.name_or_path = folder  # as from_pretrained(folder) names it, not by the copies' folder
    session = OffloadSession(path, sess_options, providers, provider_options, **offload)
    try:
        return _offloaded(ORTModelForCausalLM)(config=config, session=_SessionForOptimum(session, path),
                                               use_io_binding=False, generation_config=generation)
    except BaseException:
        session.close()
        raise
