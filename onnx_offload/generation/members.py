"""generate() and generate_iter(), as members of OffloadSession.

The members check their arguments when called (not at the first next()), read the
model's sampling defaults, and run the generation loop (``loop.py``) over the session's
engine; the buffers a generation ends with are kept for the next of its shape
(``kept.py``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import UnsupportedModel
from ..loading import SAMPLING_DEFAULTS
from .loop import generate_tokens
from .sampling import Sampling, check_generate_args
from .chat_cache import chat_tokens
from .kept import new_generation, park, release_kept
from .text_steps import chat_prompt, encode_rows, is_text, text_model as _text_model, text_pieces


def sampling_sources(model: dict, given: dict) -> dict:
    """{key: (value, source)} of do_sample, temperature, top_k and top_p: the value `given`
    (source "given"), else the model's (`model`, its files' settings: "model"), else the
    package's default ("default"). A call that asks to sample (do_sample=True given) does
    not take the model's top_k of 1 ("model top_k 1 dropped"): onnxruntime-genai's builder
    writes top_k 1 beside do_sample false, and with it every sample is the greedy token."""
    out = {}
    for key, default in SAMPLING_DEFAULTS.items():
        if given.get(key) is not None:
            out[key] = (given[key], "given")
        elif key in model:
            out[key] = (model[key], "model")
        else:
            out[key] = (default, "default")
    if given.get("do_sample") and out["top_k"] == (1, "model"):
        out["top_k"] = (SAMPLING_DEFAULTS["top_k"], "model top_k 1 dropped")
    return out


class GenerationMembers:
    """Mixed into OffloadSession; uses its _check_open(), _step() and _decoder_spec."""

    # What the last chat() fed (chat_cache.ChatTurn: positions reused from the cache, prompt
    # tokens fed, why the conversation ran whole); None before the first.
    last_chat = None

    def generate(self, input_ids, max_new_tokens: int = 32, *, attention_mask=None, do_sample: Optional[bool] = None,
                 temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 seed: Optional[int] = None, eos_token_id=None):
        """Token ids [batch, prompt + new] (int64): greedy unless `do_sample`. Sampling
        arguments left as None take the model's own (genai_config.json's search section,
        else generation_config.json), else greedy, temperature 1, no top-k, top-p 1.
        Generation stops at `max_new_tokens`, or when every row has produced an EOS id
        (from `eos_token_id`, else the model's files); finished rows repeat their EOS.
        `attention_mask` [batch, prompt]: 0 where a prompt is padded (left padding, as a
        tokenizer gives for prompts of different lengths), else 1.

        Text in, text out: a str prompt gives the new text (a str), a list of them a list,
        each row's text up to its first EOS. The prompts are encoded by the model folder's
        tokenizer.json (the [llm] extra), a batch left-padded."""
        if is_text(input_ids):
            pieces = self.generate_iter(input_ids, max_new_tokens, do_sample=do_sample, temperature=temperature,
                                        top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id)
            rows = ["".join(p) for p in zip(*([q] if isinstance(q, str) else q for q in pieces))]
            if not rows:  # max_new_tokens == 0
                rows = [""] * (1 if isinstance(input_ids, str) else len(input_ids))
            return rows[0] if isinstance(input_ids, str) else rows
        ids, steps, _ = self._generation(input_ids, max_new_tokens, attention_mask, do_sample, temperature, top_k,
                                         top_p, seed, eos_token_id)
        return np.concatenate([ids] + [t[:, None] for t in steps], axis=1)

    def generate_iter(self, input_ids, max_new_tokens: int = 32, *, attention_mask=None,
                      do_sample: Optional[bool] = None, temperature: Optional[float] = None,
                      top_k: Optional[int] = None, top_p: Optional[float] = None, seed: Optional[int] = None,
                      eos_token_id=None):
        """The step-wise form of generate(): yields each step's new tokens [batch]; for a str
        prompt each step's new text (a str, '' while a character's bytes are still coming
        or once the reply has ended), for a list of them a list of such texts."""
        if not is_text(input_ids):
            return self._generation(input_ids, max_new_tokens, attention_mask, do_sample, temperature, top_k, top_p,
                                    seed, eos_token_id)[1]
        if attention_mask is not None:
            raise ValueError("attention_mask goes with token ids; text prompts are padded by the tokenizer")
        tm = _text_model(self)
        ids, mask = encode_rows(tm, [input_ids] if isinstance(input_ids, str) else list(input_ids))
        _, steps, eos = self._generation(ids, max_new_tokens, mask, do_sample, temperature, top_k, top_p, seed,
                                         eos_token_id)
        pieces = text_pieces(tm, steps, len(ids), eos)
        return (p[0] for p in pieces) if isinstance(input_ids, str) else pieces

    def chat(self, messages, max_new_tokens: int = 256, **sampling) -> str:
        """The assistant's reply to chat `messages` ([{"role": "user", "content": ...}, ...]),
        through the model's chat template; the keywords are generate()'s."""
        return "".join(self.chat_iter(messages, max_new_tokens, **sampling))

    def chat_iter(self, messages, max_new_tokens: int = 256, *, do_sample: Optional[bool] = None,
                  temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                  seed: Optional[int] = None, eos_token_id=None):
        """The step-wise form of chat(): yields the reply's text as it decodes. The KV cache
        of the reply stays with the session: a next call whose messages continue these
        feeds only the tokens its rendering adds (last_chat says how many; see
        generation.chat_cache for where the whole conversation runs again)."""
        ids = chat_prompt(self, messages)
        self._check_open()
        sampling = self._sampling(do_sample, temperature, top_k, top_p)
        ids, new, eos, _ = check_generate_args(self, ids, max_new_tokens, eos_token_id, None, seed)
        steps = chat_tokens(self, [int(t) for t in ids[0]], new, sampling, seed, eos)
        return (p[0] for p in text_pieces(_text_model(self), steps, 1, eos))

    def _sampling(self, do_sample, temperature, top_k, top_p) -> Sampling:
        """The arguments given, else the model's sampling defaults, else the package's."""
        given = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        model = dict(self.decoder_spec.sampling)  # UnsupportedModel for a model generate() cannot run
        return Sampling(**{k: v for k, (v, _) in sampling_sources(model, given).items()})

    def _generation(self, input_ids, max_new_tokens, attention_mask, do_sample, temperature, top_k, top_p, seed,
                    eos_token_id):
        """(the checked prompt ids, the generator of new tokens, the EOS ids); the arguments
        are checked now, not at the first next()."""
        self._check_open()
        sampling = self._sampling(do_sample, temperature, top_k, top_p)
        ids, new, eos, mask = check_generate_args(self, input_ids, max_new_tokens, eos_token_id, attention_mask, seed)
        return ids, generate_tokens(self, ids, new, sampling, seed, eos, mask), eos

    @property
    def text_model(self):
        """The model folder's tokenizer and chat template (generation.TextModel), read at
        first use; the [llm] extra."""
        return _text_model(self)

    @property
    def model_folder(self) -> Optional[str]:
        """The folder of the model's file (its tokenizer and configuration files), None for
        a model given as bytes."""
        prepared = getattr(self, "_prepared", None)
        return getattr(prepared, "model_dir", None) or getattr(self, "_model_folder", None)

    @property
    def decoder_spec(self):
        """The decoder layout generate() runs; raises UnsupportedModel for other models."""
        if isinstance(self._decoder_spec, Exception):
            raise UnsupportedModel(str(self._decoder_spec))
        return self._decoder_spec

    def _new_generation(self, spec, batch: int, prompt: int, total: int):
        return new_generation(self, spec, batch, prompt, total)

    def _park(self, gen) -> None:
        park(self, gen)

    def free_generation_cache(self) -> None:
        """Gives back the KV cache and step buffers that the session keeps after a
        generation for the next one of the same batch and length (which then replays the
        graphs captured on them). The session does so itself when memory runs short."""
        with self._step():
            release_kept(self)
