"""The host store: every weight in one page-locked buffer, registered once, laid out in
the order given (first use) at DEFAULT_ALIGNMENT, as the streaming engine's plan expects
of the weights one node reads.

It is filled straight from the optimized model's data file with ``preadv``, so the
weights are never held twice in RAM. Page-ins copy from here.

Paged weights (``paged``: the stacks of experts the streaming engine reads in place) are
held apart, each in host handles of one granule (``backend.create_host``: on CUDA, VMM
allocations of location HOST) mapped one after another into a reservation that the host
and the device both read and write. The same handles map again behind a stack's stable
address (``memory.expert_pages``), where the device pages of its hot experts may take
their place: no byte is held twice. Where the driver cannot make host handles, they stay
with the rest.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from typing import Callable, Dict, Iterable, List, Optional

import numpy as np

from .._core import DEFAULT_ALIGNMENT as ALIGN
from ..errors import CudaUnavailable
from ..loading import Files, WeightInfo, opened


class HostStore:
    def __init__(self, backend, weights: Iterable[WeightInfo], paged: Iterable[str] = ()):
        self._backend = backend
        self._offsets: Dict[str, int] = {}
        self._sizes: Dict[str, int] = {}
        weights, paged = list(weights), set(paged)
        self.pages = PagedRegion(backend, [w for w in weights if w.name in paged and w.nbytes])
        total = 0
        for w in weights:
            if w.name in self.pages.offsets:
                continue
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
            try:
                self._register(total)
            except BaseException:
                self.pages.close()
                raise

    def _register(self, total: int) -> None:
        backend = self._backend
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
        done, whole = 0, self.nbytes + sum(self.pages.sizes.values())
        with contextlib.ExitStack() as stack:
            fds: Dict[str, int] = {}
            for w in sorted(weights, key=lambda w: (w.path or path, w.offset)):
                where = w.path or path
                if where not in fds:
                    fds[where] = stack.enter_context(opened(where, files))
                view = memoryview(self.view(w.name))
                got = 0
                while got < w.nbytes:
                    n = os.preadv(fds[where], [view[got:]], w.offset + got)
                    if not n:
                        raise OSError(f"{where}: weight {w.name!r} is truncated ({got} of {w.nbytes} bytes)")
                    got += n
                done += w.nbytes
                if progress:
                    progress(done, whole)

    def ptr(self, name: str) -> int:
        if name in self.pages.offsets:
            return self.pages.address(name)
        return self.base + self._offsets[name]

    def device_address(self, name: str) -> int:
        """Where the device's kernels read the weight in place, over the link."""
        if name in self.pages.offsets:
            return self.pages.address(name)  # one address for the host and the device
        return self._device_base + self._offsets[name]

    def view(self, name: str) -> np.ndarray:
        if name in self.pages.offsets:
            return self.pages.view(name)
        o = self._offsets[name]
        return self._array[o:o + self._sizes[name]]

    def close(self) -> None:
        self.pages.close()
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


class PagedRegion:
    """The paged weights of a host store: each from a granule-aligned offset of one
    reservation, its granules host handles mapped there for the host and the device.
    Empty where the backend has no host handles (CudaUnavailable): the store keeps them."""

    def __init__(self, backend, weights: List[WeightInfo]):
        self._backend = backend
        self.granularity = g = backend.granularity
        self.offsets: Dict[str, int] = {}
        self.sizes: Dict[str, int] = {}
        self.handles: List[int] = []  # granule i of the region
        self.va = 0
        self.nbytes = 0
        total = 0
        for w in weights:
            self.offsets[w.name], self.sizes[w.name] = total, w.nbytes
            total += -(-w.nbytes // g) * g
        if not total:
            return
        try:
            for _ in range(total // g):
                self.handles.append(backend.create_host(g))
            self.va = map_granules(backend, self.handles, g, backend.set_host_access)
        except BaseException as e:
            for h in self.handles:
                backend.release(h)
            self.handles = []
            if not isinstance(e, CudaUnavailable):
                raise
            self.offsets, self.sizes = {}, {}
            return
        self.nbytes = total

    def address(self, name: str) -> int:
        return self.va + self.offsets[name]

    def view(self, name: str) -> np.ndarray:
        n = self.sizes[name]
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(self.address(name))) if n else \
            np.empty(0, np.uint8)

    def granules(self, name: str) -> List[int]:
        """The host handles of `name`'s granules, in order."""
        first = self.offsets[name] // self.granularity
        return self.handles[first:first + -(-self.sizes[name] // self.granularity)]

    def close(self) -> None:
        if self.nbytes:
            unmap_granules(self._backend, self.va, len(self.handles), self.granularity)
            for h in self.handles:
                self._backend.release(h)
            self.handles = []
            self.va = self.nbytes = 0
            self.offsets, self.sizes = {}, {}


def map_granules(backend, handles: List[int], g: int, access: Callable[[int, int], None]) -> int:
    """A reservation of its own with `handles` mapped one after another, a granule each, and
    `access(va, bytes)` granted over them: its address. Nothing stays mapped or reserved
    where a step fails."""
    va = backend.reserve(len(handles) * g)
    mapped = 0
    try:
        for i, h in enumerate(handles):
            backend.map(va + i * g, g, h)
            mapped += 1
        access(va, len(handles) * g)
    except BaseException:
        for i in range(mapped):
            backend.unmap(va + i * g, g)
        backend.free_reservation(va, len(handles) * g)
        raise
    return va


def unmap_granules(backend, va: int, count: int, g: int) -> None:
    """Unmaps the `count` granules map_granules mapped at `va` and frees its reservation."""
    for i in range(count):
        backend.unmap(va + i * g, g)
    backend.free_reservation(va, count * g)


def read_bytes(backend, stream, va: int, nbytes: int) -> np.ndarray:
    """Copies device (or host-backend) memory back into a new numpy array."""
    out = np.empty(nbytes, dtype=np.uint8)
    backend.copy_d2h(out.ctypes.data, va, nbytes, stream)
    stream.synchronize()
    return out
