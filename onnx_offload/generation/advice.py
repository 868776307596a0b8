"""The advice of a budget too small for a session, made to hold a generation too.

A session's smallest budget holds its weights. A decoder's generation also needs its KV
cache and its step buffers, whose sizes depend on the batch and the length. The budget
that holds both is found by trying it: a session made at the smallest budget allocates
the generation's cache as its last step holds it (a cache that grows while decoding,
grown as decoding grows it; nothing runs). Where that is short, the shortage's advice
(the budget, KV and scratch reserves that hold both) is tried in turn, as is a budget
raised by what ORT took at session creation, and only advice that ran is given, so that
one round of advice runs. The constructor tries the generation the streaming engine
plans for (one sequence of up to DEFAULT_CONTEXT positions); the CLI, which knows its
generation, tries that one.
"""
from __future__ import annotations

import contextlib
import re
import threading
import warnings
from typing import Callable, Optional

from ..config import fmt_bytes
from ..errors import BudgetExceeded
from ..memory import StepMemoryShort
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


def probing() -> bool:
    """Whether sessions made now give their errors as they are (own_probe)."""
    return getattr(_TRYING, "on", False)


def hold_growth(session, batch: int, total: int) -> None:
    """Grows a bucketed cache (the standard and exact layouts) from a one-token prompt to
    `total` positions, as a short prompt's decoding grows it, and gives it back: its last
    growth holds the old bucket and the new one at once, more than a prompt of `total`
    tokens allocates. The shared (gqa) cache holds its whole length from the start."""
    spec = session.decoder_spec
    if spec.layout == "gqa" or total <= 1:
        return
    gen = session._new_generation(spec, batch, 1, total)
    try:
        gen.hold(total)
    finally:
        gen.close()


def default_generation(spec) -> tuple:
    """(batch, prompt, total) of the generation a decoder's session plans for: one
    sequence of up to DEFAULT_CONTEXT positions (or the model's context, if shorter), all
    of them prompt, so that the prompt's chunks and their step buffers are tried too."""
    length = min(spec.max_length or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    return 1, length, length


# The advice a shortage gives, as the package words it: "pass vram_limit=N, kv_bytes=M".
_ADVICE = re.compile(r"pass ((?:(?:prefill_chunk|vram_limit|kv_bytes|scratch_bytes)=\d+(?:, )?)+)")
TRIES = 4
# A shortage's account of its figure (engines.replan.kv_short): the smallest budget, and
# the reserve that is the most of it, before the advice.
_DRIVES = re.compile(r"raise the budget: (the smallest budget that holds .*?, the \w+ reserve the most of it.*?)"
                     r"(?:: pass |$)")


def advised(error: BaseException) -> dict:
    """The budget keywords an error's advice names ({} for none)."""
    m = _ADVICE.search(str(error))
    if not m:
        return {}
    return {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).rstrip(", ").split(", "))}


def with_generation(error: BudgetExceeded, make: Callable[..., object], batch: int, prompt: int, total: int,
                    what: str, check: Optional[Callable[[object], None]] = None) -> BaseException:
    """`error` (a budget too small for the session, with its smallest budget), or the
    error whose advice holds the session and a generation of `batch` rows, `prompt`
    tokens and `total` positions: `make(**keywords)` makes the session with budget
    keywords. The smallest budget is tried first; a shortage there (the generation's, or
    ORT's own memory, which the plan cannot know before ORT takes it) names what to try
    next, and only advice that was tried is given. `check(session)` checks the
    generation's arguments; a ValueError or TypeError of it, which no budget mends, is
    returned instead."""
    least = error.smallest_budget
    if not least or probing():
        return error
    keywords, short = {"vram_limit": least}, None
    for _ in range(TRIES):
        try:
            with own_probe(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the probe's own notes are not the caller's
                with make(**keywords) as probe:
                    if check is not None:
                        check(probe)
                    gen = probe._new_generation(probe.decoder_spec, batch, prompt, total)
                    try:
                        gen.hold(total)
                    finally:
                        gen.close()
                    hold_growth(probe, batch, total)
        except StepMemoryShort as e:  # ORT's own memory: that much more budget
            if not e.needed:
                return error  # of unknown size: nothing to try
            keywords["vram_limit"] += e.needed
            short = e
            continue
        except BudgetExceeded as e:
            more = advised(e)
            if e.device_full or not more or all(keywords.get(k) == v for k, v in more.items()):
                return error  # the device, not the budget, was short, or nothing new to try
            keywords.update(more)
            short = e
            continue
        except (ValueError, TypeError) as bad:
            return bad if check is not None else error
        except Exception:  # noqa: BLE001 - the probe says nothing more than the error it was for
            return error
        break
    else:
        return error  # no advice tried ran
    if short is None:
        return error  # the smallest budget holds the generation too
    said = ", ".join(f"{k}={v}" for k, v in keywords.items())
    why = str(short).split(":")[0]  # what ran short, without the advice that was tried after it
    # What drives the figure, as the shortage whose advice was followed last says it.
    drives = _DRIVES.search(str(short))
    drives = f" {drives.group(1)[0].upper()}{drives.group(1)[1:]}." if drives else ""
    out = BudgetExceeded(f"{error.reason} The smallest budget that runs it with this configuration is "
                         f"{fmt_bytes(least)} ({least} bytes); tried with {what}, it fell short ({why}).{drives} "
                         f"Tried, {fmt_bytes(keywords['vram_limit'])} holds both: pass {said}")
    out.smallest_budget, out.reason = least, error.reason
    return out
