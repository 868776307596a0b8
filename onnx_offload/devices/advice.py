"""The advice of a budget too small for a model split across devices, tried whole.

A stage's shortage names one device's entry of a budget keyword (``on_device``). The
split balances the stages by their allowances, so following one device's entry moves
more of the model onto that device, which may then be short of something else, or
leave another device short: advice given one entry at a time takes several rounds.
Here each entry a shortage names is applied and the whole split made again, with the
generation's caches held on every device at their last size, until it holds; the
advice given is every entry that was changed, as whole lists of one value per device:
one round runs.
"""
from __future__ import annotations

import re
import warnings
from typing import Callable, Dict, List, Optional

import numpy as np

from ..errors import BudgetExceeded
from ..generation import default_generation, hold_growth, own_probe

PER_DEVICE = ("vram_limit", "weight_bytes", "kv_bytes", "scratch_bytes")
# One device's entry of a budget keyword, as on_device words a stage's advice.
DEVICE_ENTRY = re.compile(r"\b(" + "|".join(PER_DEVICE) + r")=(\w+) for device (\d+) "
                          r"\(its entry in a list of one value per device\)")


def entries(value, devices: list) -> list:
    """A budget keyword's value as one entry per device: its list, or the one value for each."""
    return list(value) if isinstance(value, (list, tuple)) else [value] * len(devices)


def hold_generation(session, batch: int, prompt: int, total: int) -> None:
    """Runs a generation's first prompt step (of the prompt's chunk, or the whole prompt
    where it runs in one), then allocates its caches on every device at their last size,
    and gives everything back. The step is run, not planned: what it moves between the
    devices (a chunk's hidden states, a mask of its length) lies in each device's
    scratch, in shapes the stage models do not declare."""
    spec = session.decoder_spec
    gen = session._new_generation(spec, batch, prompt, total)
    try:
        n = min(prompt, session.stages[0].config.prefill_chunk)
        gen.prompt(np.zeros((batch, n), spec.ids_dtype), None)
        gen.hold(total)
    finally:
        gen.close()
    hold_growth(session, batch, total)


class Followed:
    """What trying a staged shortage's advice found: `session`, made with `tried` (None
    where nothing held); `first` and `last` the shortages met (None where the keywords
    given held); `changed` the keywords whose entries were changed."""

    def __init__(self, tried: dict):
        self.session = None
        self.tried = tried
        self.first: Optional[BudgetExceeded] = None
        self.last: Optional[BudgetExceeded] = None
        self.changed: set = set()
        self.noted: list = []  # the warnings of the session that held

    def said(self, devices: list, entry: Callable[[str, list], str] = None) -> str:
        """The keywords changed, in PER_DEVICE's order, as whole lists of one value per device."""
        entry = entry or (lambda k, v: f"{k}=[{', '.join(map(repr, v))}]")
        return ", ".join(entry(k, entries(self.tried[k], devices)) for k in PER_DEVICE if k in self.changed)


def _apply(out: Followed, error: BudgetExceeded, devices: List[int]) -> bool:
    """Applies the entries `error` names to `out.tried`; whether any was new."""
    out.first, out.last = out.first or error, error
    fresh = False
    for m in DEVICE_ENTRY.finditer(str(error)):
        key, value, device = m.group(1), int(m.group(2)), int(m.group(3))
        now = entries(out.tried.get(key), devices)
        if device in devices and now[devices.index(device)] != value:
            now[devices.index(device)] = value
            out.tried[key], fresh = now, True
            out.changed.add(key)
    return fresh


def follow(make: Callable[..., object], devices: List[int], given: Dict[str, object],
           use: Callable[[object], None], start: Optional[BudgetExceeded] = None) -> Followed:
    """`make(**keywords)` with the budget keywords `given`, then `use(session)` (which
    holds a generation, or checks its arguments first); each BudgetExceeded's entries for
    one device applied in turn, until a session holds or a shortage names nothing new.
    `start`: the shortage `given` already met, whose entries are applied first. Sessions
    made here give their errors as they are (own_probe) and their warnings are recorded,
    not shown: the caller says which are the user's."""
    out = Followed(dict(given))
    if start is not None and not _apply(out, start, devices):
        return out
    for _ in range(4 * len(devices)):
        s = None
        try:
            with own_probe(), warnings.catch_warnings(record=True) as noted:
                warnings.simplefilter("always")
                s = make(**out.tried)
                use(s)
        except BudgetExceeded as e:
            if s is not None:
                s.close()
            if not _apply(out, e, devices):
                return out  # nothing new to try
            continue
        except BaseException:
            if s is not None:
                s.close()
            raise
        out.session, out.noted = s, noted
        return out
    return out


def reason(error: BaseException) -> str:
    """An error's text without the advice it ends with."""
    return str(error).split(": pass ")[0]


def whole_advice(error: BudgetExceeded, make: Callable[..., object], devices: List[int], asked: dict,
                 spec) -> BaseException:
    """The error of a staged session too small for its budget keywords `asked`, with the
    advice that holds it and, for a decoder (`spec` not an exception), the generation its
    sessions plan for (generation.advice.default_generation) on every device: found by
    trying (follow), so that one round runs. `make(**keywords)` makes the staged session."""
    decoder = spec is not None and not isinstance(spec, Exception)
    batch, prompt, total = default_generation(spec) if decoder else (0, 0, 0)
    got = follow(make, devices, asked, (lambda s: hold_generation(s, batch, prompt, total)) if decoder else
                 (lambda s: None), start=error)
    if got.session is not None:
        got.session.close()
    if not got.changed:
        return error
    said = got.said(devices)
    if got.session is None:
        return BudgetExceeded(f"{reason(error)}; with {said} it still fell short: {reason(got.last)}")
    what = f" with a generation of one sequence of up to {total} positions" if decoder else ""
    return BudgetExceeded(f"{reason(error)}; tried{what} on every device, these hold it: pass {said}")
