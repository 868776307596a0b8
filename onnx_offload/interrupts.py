"""Keeps Ctrl-C from landing in the middle of a state change.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread. A
step changes slot states, pins, recency and fixed buffers in many small moves; an
interrupt between two of them would leave a slot freed but marked resident, or a
policy tracking a weight that is gone. Inside ``deferred_interrupts()`` a SIGINT is
recorded instead of raised, and raised once the block has finished, so the session
is consistent when the caller sees it.

Only the main thread receives ``KeyboardInterrupt`` and only it may set signal
handlers; elsewhere, and when the program has its own SIGINT handler, the block runs
as it is. A ``KeyboardInterrupt`` that another signal's handler raises is not held
back either: what it cuts short is made whole by the code it lands in, or before the
next step (``ResidencyManager.settle``: pins, streamed pages and the policy's state;
each generation's allocators give back all they hold).
"""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def deferred_interrupts():
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    except BaseException as e:
        signal.signal(signal.SIGINT, previous)
        if pending:
            raise KeyboardInterrupt from e
        raise
    signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt
