"""The advice of a budget too small for a session, made to hold a generation too.

A session's smallest budget holds its weights. A decoder's generation also needs its KV
cache and its step buffers, whose sizes depend on the batch and the length. The budget
that holds both is found by trying it: a session made at the smallest budget allocates
the generation's cache as its last step holds it (a cache that grows while decoding,
grown as decoding grows it; nothing runs). Where that is short, the shortage's advice
(the budget, KV and scratch reserves that hold both) is the one given, so that one round
of advice runs. The constructor tries the generation the streaming engine plans for
(one sequence of up to DEFAULT_CONTEXT positions); the CLI, which knows its generation,
tries that one.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Callable, Optional

from ..config import fmt_bytes
from ..errors import BudgetExceeded
from .loop import DEFAULT_CONTEXT

_TRYING = threading.local()  # set while a probe (or a caller that probes itself) makes a session


@contextlib.contextmanager
def own_probe():
    """Sessions made inside give their errors as they are: the caller tries its own
    generation (the CLI), or is the probe."""
    was = getattr(_TRYING, "on", False)
    _TRYING.on = True
    try:
        yield
    finally:
        _TRYING.on = was


def default_generation(spec) -> tuple:
    """(batch, prompt, total) of the generation a decoder's session plans for: one
    sequence of up to DEFAULT_CONTEXT positions (or the model's context, if shorter), all
    of them prompt, so that the prompt's chunks and their step buffers are tried too."""
    length = min(spec.max_length or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    return 1, length, length


def with_generation(error: BudgetExceeded, make: Callable[[int], object], batch: int, prompt: int, total: int,
                    what: str, check: Optional[Callable[[object], None]] = None) -> BaseException:
    """`error` (a budget too small for the session, with its smallest budget), or the
    error whose advice also holds a generation of `batch` rows, `prompt` tokens and
    `total` positions: `make(budget)` makes the session at a budget. `check(session)`
    checks the generation's arguments; a ValueError or TypeError of it, which no budget
    mends, is returned instead."""
    least = error.smallest_budget
    if not least or getattr(_TRYING, "on", False):
        return error
    try:
        with own_probe(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the probe's own notes are not the caller's
            with make(least) as probe:
                if check is not None:
                    check(probe)
                gen = probe._new_generation(probe.decoder_spec, batch, prompt, total)
                try:
                    with probe._step():
                        while getattr(gen.cache, "room", total) < total:
                            gen.cache.ensure(gen.cache.room + 1)
                finally:
                    gen.close()
    except BudgetExceeded as short:
        if short.device_full:  # the device, not the budget, was short: nothing to advise beyond the error
            return error
        advised = BudgetExceeded(f"{error.reason} The smallest budget that runs it with this configuration is "
                                 f"{fmt_bytes(least)} ({least} bytes), which leaves {what} short: {short}")
        advised.smallest_budget, advised.reason = least, error.reason
        return advised
    except (ValueError, TypeError) as bad:
        return bad if check is not None else error
    except Exception:  # noqa: BLE001 - the probe says nothing more than the error it was for
        return error
    return error
