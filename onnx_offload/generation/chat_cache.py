"""chat()'s KV cache, kept across turns.

After a reply the session keeps the reply's generation (batch 1) and the ids its cache
holds: the rendered conversation and the reply's tokens, all but the last, which was
never fed. The next chat() renders the whole conversation again; the longest common
prefix of its ids and the cached ones stays in the cache (a template may render earlier
turns otherwise than the model wrote them: the cache is cut back where they part), and
only the rest is fed, in chunks, as a prompt continued (PromptSteps.extend). The tokens
are those of recomputing the conversation from scratch.

The conversation runs from scratch instead (the session's ``last_chat`` says why) for a
model split across devices, a graph that chooses its kernels by the sequence's length,
window-sized caches (they evict positions), the exact layout where the cache must be cut
back, and a conversation that outgrows the cache it was planned with (a new one, twice
as long, is planned). Ctrl-C or a caller that stops early keeps what the steps fed; an
error gives the cache back. Memory running short, a new plan, free_generation_cache()
and close() give it back too (``release_kept``).
"""
from __future__ import annotations

from typing import Iterator, NamedTuple, Optional

import numpy as np

from ..errors import OffloadError
from ..interrupts import deferred_interrupts
from .loop import FIRST_CONTEXT, generate_tokens
from .sampling import MAX_POSITIONS, Sampling


class ChatTurn(NamedTuple):
    """What the last chat() fed: `reused` positions kept in the cache, `fed` prompt
    tokens run, and `note`: why the conversation ran from scratch, else None."""
    reused: int
    fed: int
    note: Optional[str]


class ChatCache:
    """A kept chat generation and the ids of the positions its cache holds."""

    def __init__(self, gen, total: int):
        self.gen, self.total = gen, total
        self.ids: list = []

    def close(self) -> None:
        self.gen.close()


def refusal(session, spec) -> Optional[str]:
    """Why a chat's cache cannot be continued on this session's model, else None."""
    if getattr(session, "_chat_refused", None):
        return session._chat_refused
    if spec.window_caches:
        return "its window-sized caches evict positions"
    if spec.length_thresholds != ():
        return "its graph chooses its kernels by the sequence's length"
    return None


def _common(a: list, b: list) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def release_chat(session) -> bool:
    """Gives the kept chat cache back; whether there was one. The caller holds the lock."""
    state, session._chat = getattr(session, "_chat", None), None
    if state is None:
        return False
    state.close()
    return True


def _take(session, spec, ids: list, needed: int) -> tuple:
    """(the kept chat cache or None, the positions of it to keep, why not kept or None)."""
    with session._lock, deferred_interrupts():
        state, session._chat = getattr(session, "_chat", None), None
    if state is None:
        return None, 0, None
    reused = min(_common(state.ids, ids), len(ids) - 1)  # a token at least is fed, for its logits
    why = None
    if state.gen._closed or state.gen.spec != spec:
        why = "the model's layout changed"
    elif needed > state.total:
        why = (f"the conversation needs {needed} positions, more than the {state.total} its cache was planned "
               f"with; it runs again in a cache planned for more")
    elif not state.ids:
        why = ""  # nothing cached: no reason to tell
    elif reused == 0:
        why = "the conversation does not start as the cached one did"
    elif spec.layout == "exact" and reused < len(state.ids):
        why = ("the chat template renders the earlier turns otherwise than the model wrote them, and the exact "
               "layout's cache cannot be cut back")
    if why is not None:
        state.close()
        return None, 0, why or None
    return state, reused, None


def _give(session, state: ChatCache) -> None:
    """Keeps `state` for the next chat() (the one kept meanwhile goes back)."""
    with session._lock, deferred_interrupts():
        if session._closed or session._closing or state.gen._closed:
            state.close()
            return
        release_chat(session)
        session._chat = state


def _fresh(session, spec, prompt: int, needed: int) -> ChatCache:
    """A new chat cache for a conversation of `needed` positions: twice as many (at least
    FIRST_CONTEXT), as far as the model holds."""
    limit = spec.max_length or MAX_POSITIONS
    total = max(needed, min(limit, max(2 * needed, FIRST_CONTEXT)))
    chunk = session.config.prefill_chunk
    # planned as a prompt in chunks: the standard layout's present then holds a chunk's
    # positions, which a later turn's tokens fill
    return ChatCache(session._new_generation(spec, 1, min(max(prompt, chunk + 1), total), total), total)


def chat_tokens(session, ids: list, new: int, sampling: Sampling, seed: Optional[int],
                eos: tuple) -> Iterator[np.ndarray]:
    """Each step's new token [1] of a chat whose rendered conversation is `ids`, through
    the kept cache where it continues (module docstring). Sets session.last_chat."""
    spec = session.decoder_spec
    why = refusal(session, spec)
    if why is not None:
        session.last_chat = ChatTurn(0, len(ids), f"each turn runs the whole conversation again: {why}")
        yield from generate_tokens(session, np.array([ids], np.int64), new, sampling, seed, eos)
        return
    if new == 0:
        return
    needed = len(ids) + new - 1
    state, reused, why = _take(session, spec, ids, needed)
    seq = list(ids)
    held = state.ids if state is not None else []  # the ids whose first positions the cache holds
    kept = False
    try:
        logits = None
        if state is not None:
            with deferred_interrupts():  # the positions after `reused` are dropped, and the ids say so
                state.gen.rewind(reused)
                held = seq
            try:
                logits = state.gen.extend(ids[reused:], reused)
            except RuntimeError as e:
                if isinstance(e, OffloadError):
                    raise
                # ORT refused the past beside new tokens (as a model that slices a table by
                # the past's length may): the conversation runs from its start
                why = f"ONNX Runtime failed on the cached past beside the new tokens ({str(e).strip()[:200]})"
                state.close()
                state, reused = None, 0
        if state is None:
            state = _fresh(session, spec, len(ids), needed)
            with deferred_interrupts():  # (kept buffers may count an earlier generation's positions)
                state.gen.rewind(0)
                held = seq
            logits = state.gen.prompt(np.array([ids], np.int64), None)
        gen = state.gen
        session.last_chat = ChatTurn(reused, len(ids) - reused,
                                     why and f"this turn ran the whole conversation again: {why}")
        rng = np.random.default_rng(seed)
        eos_ids = set(int(e) for e in eos)
        for step in range(new):
            tokens = sampling.pick(logits, rng)
            seq.append(int(tokens[0]))
            if int(tokens[0]) in eos_ids or step + 1 == new:
                state.ids = seq[:-1]  # the last token is never fed
                _give(session, state)
                kept = True
                yield tokens
                return
            yield tokens
            logits, _ = gen.decode(tokens, len(ids) + step + 1)
    except (KeyboardInterrupt, GeneratorExit):
        # Each step changes the cache whole (Ctrl-C waits for its end): it holds the
        # positions the generation counts.
        if not kept and state is not None:
            state.ids = held[:int(state.gen._tokens[0])]
            _give(session, state)
            kept = True
        raise
    finally:
        if not kept and state is not None:  # an error: the cache's state is unknown
            state.close()
