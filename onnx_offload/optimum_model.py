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

import os
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


def causal_lm(model, providers=None, provider_options=None, sess_options=None, **offload):
    """Optimum's ORTModelForCausalLM for the model at `model` (an Optimum export's folder,
    or its ONNX file), its session an OffloadSession made with `providers`,
    `provider_options`, `sess_options` and the configuration keywords in `offload`
    (offload=True, vram_limit=..., ...). The folder's config.json and
    generation_config.json configure it, as Optimum's from_pretrained would."""
    try:
        from optimum.onnxruntime import ORTModelForCausalLM
        from transformers import AutoConfig, GenerationConfig
    except ImportError as e:
        raise ImportError(f"causal_lm needs Optimum's ONNX Runtime models and transformers ({e}): pip install "
                          f"'optimum-onnx[onnxruntime]' (or [onnxruntime-gpu])") from e
    from .loading import model_file
    from .session import OffloadSession
    path = os.path.abspath(model_file(os.fspath(model)))
    folder = os.path.dirname(path)
    config = AutoConfig.from_pretrained(folder)
    generation: Optional[GenerationConfig]
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json: the model config's defaults, as Optimum takes them
        generation = GenerationConfig.from_model_config(config)
    session = OffloadSession(path, sess_options, providers, provider_options, **offload)
    try:
        return _offloaded(ORTModelForCausalLM)(config=config, session=_SessionForOptimum(session, path),
                                               use_io_binding=False, generation_config=generation)
    except BaseException:
        session.close()
        raise
