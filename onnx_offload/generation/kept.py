"""A generation's buffers, kept for the next generation of its shape.

A generation's KV cache and step buffers, and the graphs captured on them, stay with the
session when it ends, where the engine keeps graphs for the session's weights (the
streaming engine, or resident weights): the next generation of the same batch and length
takes them and only replays. Any shortage, a new plan or another shape gives them back
first (``release``). A generation cut short is never kept.

The functions take the session (``OffloadSession``) and use its lock, its engines and its
``_parked`` generation; they hold or take the session's lock as they say.
"""
from __future__ import annotations

from ..interrupts import deferred_interrupts
from .chat_cache import release_chat
from .steps import Generation
from .needs import generation_needs


def new_generation(session, spec, batch: int, prompt: int, total: int) -> Generation:
    """A generation's buffers: the kept ones when they fit it (their graphs replay), else
    new ones, the kept ones given back first. Before it, memory taken outside the budget
    is settled, and the engine is planned again where the generation's cache and largest
    step do not fit the plan in force."""
    gen = None
    try:
        with session._step():
            if session._parked is not None and not session._parked.fits(spec, batch, prompt, total):
                release_kept(session)
            # Memory another process took since the last step is charged before this
            # generation counts on it: a new plan, or BudgetExceeded saying so (Engines.run).
            session._engines.run(session._meter.settle)
            if session._engines.graph_possible:  # a new plan gives the kept ones back
                dev = session.device
                kv, scratch = generation_needs(spec, session.config, session._activations, dev.granularity,
                                               dev.is_cuda, batch, prompt, total)
                session._engines.prepare(kv, scratch, f"a generation of {batch} x {total} positions")
            gen, session._parked = session._parked, None
            if gen is None:
                gen = Generation(session, spec, batch, prompt, total)
    except BaseException:  # a Ctrl-C held back during the allocation arrives here
        if gen is not None:
            gen.close()
        raise
    return gen


def park(session, gen: Generation) -> None:
    """A generation that ended: its buffers are kept for the next generation of its shape
    where the engine keeps graphs for the session's weights; the one kept before goes
    back. Takes the session's lock."""
    with session._lock, deferred_interrupts():
        runner = session._engines.runner if session._engines is not None else None
        if session._closed or session._closing or runner is None or not gen.reusable() or \
                (runner.streaming and session.engine != "graph"):
            gen.close()
            return
        if session._parked is not gen:
            release_kept(session)
            session._parked = gen


def release_kept(session) -> bool:
    """Gives the kept generation's buffers back, and the kept chat's cache
    (chat_cache); whether there were any. The caller holds the session's lock."""
    chat = release_chat(session)
    gen, session._parked = session._parked, None
    if gen is None:
        return chat
    gen.close()
    return True
