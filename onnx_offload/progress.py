"""Progress over a session's whole load: optimizing the model, reading the weights,
creating the ORT sessions. Drawn with tqdm on stderr when stderr is a terminal (or
when asked), silent otherwise."""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, Optional, Union


class LoadProgress:
    def __init__(self, show: Union[None, bool, Callable[[int, int], None]]):
        """`show`: None (a bar when stderr is a terminal), True, False, or a callable
        (done, total) that receives the weights' bytes as they are read."""
        self._callback = show if callable(show) else None
        wanted = sys.stderr.isatty() if show is None else show is True
        self._tqdm = None
        if wanted:
            try:
                from tqdm import tqdm
                self._tqdm = tqdm
            except ImportError:  # pragma: no cover - tqdm is a dependency
                pass

    @contextlib.contextmanager
    def phase(self, what: str, total: Optional[int] = None, unit: str = "it") -> Iterator[Callable[[int, int], None]]:
        """A phase of the load; yields update(done, total)."""
        bar = None
        if self._tqdm is not None:
            # A phase without a count shows its name and its time, not "0it [00:02, ?it/s]".
            fmt = None if total else "{desc}: {elapsed}"
            bar = self._tqdm(total=total, desc=what, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                             leave=True, file=sys.stderr, dynamic_ncols=True, bar_format=fmt)

        def update(done: int, total_now: int) -> None:
            if bar is not None:
                if total_now and bar.total != total_now:
                    bar.total = total_now
                bar.n = done
                bar.refresh()
            if self._callback is not None and unit == "B":
                self._callback(done, total_now)

        try:
            yield update
        finally:
            if bar is not None:
                if bar.total:
                    bar.n = bar.total
                bar.close()
