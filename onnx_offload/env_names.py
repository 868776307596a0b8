"""The environment variables named as the package's that it does not read.

A mistyped name (ONNX_GENAI_VRAM_LIMT) is otherwise ignored without a word, and the
session runs as if it were not set: each such name is warned about once a process, with
the closest name the package reads.
"""
from __future__ import annotations

import difflib
import threading
from typing import List, Mapping

from .config import ENV_FIELDS

ENV_PREFIXES = ("ONNX_GENAI_", "ONNX_OFFLOAD_")
CORE_ENV = ("ONNX_OFFLOAD_HOST_SPIN_US",)  # read by the compiled core itself (host_pool.cpp)
LIKE = 0.75  # a name at least this alike to a known one is offered as what was meant
_WARNED_NAMES: set = set()
_WARNED_LOCK = threading.Lock()  # sessions made on several threads warn of a name once


def _likeness(name: str, known: str) -> float:
    """How alike two names are (difflib's ratio), whole or after their prefixes: the part
    after the prefix says what the variable sets, whichever prefix it was given."""
    def tail(n: str) -> str:
        return next((n[len(p):] for p in ENV_PREFIXES if n.startswith(p)), n)
    return max(difflib.SequenceMatcher(None, name, known).ratio(),
               difflib.SequenceMatcher(None, tail(name), tail(known)).ratio())


def unknown_env_names(env: Mapping[str, str]) -> List[str]:
    """What to warn about: each variable of `env` named as the package's that it does not
    read and that no warning named yet in this process."""
    known = [var for var, _, _ in ENV_FIELDS] + list(CORE_ENV)
    notes = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIXES) or name in known:
            continue
        with _WARNED_LOCK:
            if name in _WARNED_NAMES:
                continue
            _WARNED_NAMES.add(name)
        score, close = max((_likeness(name, k), k) for k in known)
        hint = f"did you mean {close}?" if score >= LIKE else f"the variables it reads are {', '.join(known)}"
        notes.append(f"{name} is not a variable onnx-offload reads, and is ignored: {hint}")
    return notes
