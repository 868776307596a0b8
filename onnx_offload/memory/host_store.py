"""The host store: every weight in one page-locked buffer, registered once, laid out in
the order given (first use) at DEFAULT_ALIGNMENT, as the streaming engine's plan expects
of the weights one node reads.

It is filled straight from the optimized model's data file with ``preadv``, so the
weights are never held twice in RAM. Page-ins copy from here.
"""
from __future__ import annotations

import contextlib
import mmap
import os
from typing import Callable, Dict, Iterable, Optional

import numpy as np

from .._core import DEFAULT_ALIGNMENT as ALIGN
from ..loading import Files, WeightInfo, opened


class HostStore:
    def __init__(self, backend, weights: Iterable[WeightInfo]):
        self._backend = backend
        self._offsets: Dict[str, int] = {}
        self._sizes: Dict[str, int] = {}
        total = 0
        for w in weights:
            total = -(-total // ALIGN) * ALIGN
            self._offsets[w.name] = total
            self._sizes[w.name] = w.nbytes
            total += w.nbytes
        self.nbytes = total
        self._map = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self._array.ctypes.data
        self._registered = False
        self._device_base = self.base
        if total:
            backend.host_register(self.base, total)
            try:
                self._device_base = backend.host_device_address(self.base)
            except BaseException:
                backend.host_unregister(self.base)  # the store is never returned: nothing else would
                raise
            self._registered = True

    def fill_from_file(self, path: str, weights: Iterable[WeightInfo],
                       progress: Optional[Callable[[int, int], None]] = None, files: Optional[Files] = None) -> None:
        """Reads each weight from its own data file (`w.path`), else from `path`: through
        the descriptor `files` holds for it (the one its fingerprint was checked through,
        see loading.fingerprints.HeldFiles), else from the file opened here, a regular file only."""
        weights = list(weights)
        if not weights:
            return  # no initializer reached the threshold: ORT wrote no data file
        done = 0
        with contextlib.ExitStack() as stack:
            fds: Dict[str, int] = {}
            for w in sorted(weights, key=lambda w: (w.path or path, w.offset)):
                where = w.path or path
                if where not in fds:
                    fds[where] = stack.enter_context(opened(where, files))
                view = memoryview(self._array)[self._offsets[w.name]:self._offsets[w.name] + w.nbytes]
                got = 0
                while got < w.nbytes:
                    n = os.preadv(fds[where], [view[got:]], w.offset + got)
                    if not n:
                        raise OSError(f"{where}: weight {w.name!r} is truncated ({got} of {w.nbytes} bytes)")
                    got += n
                done += w.nbytes
                if progress:
                    progress(done, self.nbytes)

    def ptr(self, name: str) -> int:
        return self.base + self._offsets[name]

    def device_address(self, name: str) -> int:
        """Where the device's kernels read the weight in place, over the link."""
        return self._device_base + self._offsets[name]

    def view(self, name: str) -> np.ndarray:
        o = self._offsets[name]
        return self._array[o:o + self._sizes[name]]

    def close(self) -> None:
        if self._map is None:
            return
        if self._registered:
            self._backend.host_unregister(self.base)
            self._registered = False
        self._array = None
        try:
            self._map.close()
        except BufferError:
            # A view is still exported somewhere; the mapping goes with the last reference.
            pass
        self._map = None


def read_bytes(backend, stream, va: int, nbytes: int) -> np.ndarray:
    """Copies device (or host-backend) memory back into a new numpy array."""
    out = np.empty(nbytes, dtype=np.uint8)
    backend.copy_d2h(out.ctypes.data, va, nbytes, stream)
    stream.synchronize()
    return out
