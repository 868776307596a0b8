"""Device buffers of one zone, freed together, with every byte in the ledger: the KV
cache's and a generation's step buffers (kv_cache), and the values moved between devices."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np

from .. import _core
from ..engines import FixedBuffer, nbytes_of
from ..errors import BudgetExceeded
from ..memory import describe_zones


class DeviceBuffers:
    """Buffers in one zone, freed together; every byte is in the ledger. They come from
    an allocator of their own, which gives back whatever it holds in one call (or when it
    is dropped): an interrupt between an allocation and its bookkeeping, or half way
    through close(), leaves nothing behind."""

    def __init__(self, device, zone: str, shortage: Optional[Callable[[int, bool], Optional[str]]] = None):
        self.device = device
        self._alloc = _core.ScratchAllocator(device.arena, zone)
        self.zone = zone
        # Called when the budget cannot give a buffer (with the bytes, and whether the
        # budget had room but the device did not): None once it made room (the allocation
        # is tried again), else advice for the error.
        self._shortage = shortage
        self._ptrs: List[int] = []
        self._blocks = None  # the allocator of blocks in whole granules (block()), made when first asked
        self._block_ptrs: List[int] = []

    def new(self, shape: Sequence[int], dtype, *, zero: bool = False, what: str = "") -> FixedBuffer:
        dtype = np.dtype(dtype)
        nbytes = max(1, nbytes_of(shape, dtype))
        ptr = self._allocate(self._alloc, nbytes, what)
        self._ptrs.append(ptr)
        dev = self.device
        buf = FixedBuffer.on(dev, ptr, shape, dtype)
        if zero:
            dev.backend.fill(ptr, 0, nbytes, dev.compute_stream)
        return buf

    def block(self, nbytes: int, *, what: str = "") -> int:
        """The address of `nbytes` in whole granules of their own: a block shares no
        granule with another allocation, so that giving it back gives back every granule
        it took (a granule shared with a live neighbour keeps its whole mapping), and a
        group of buffers laid out in it commits its rounded size, wherever it lies."""
        if self._blocks is None:
            self._blocks = _core.ScratchAllocator(self.device.arena, self.zone, self.device.granularity)
        ptr = self._allocate(self._blocks, max(1, nbytes), what)
        self._block_ptrs.append(ptr)
        return ptr

    def free_block(self, *ptrs: int) -> None:
        """Blocks back to the budget now, once the stream has run what it queued on them."""
        if not ptrs:
            return
        self.device.compute_stream.synchronize()
        for ptr in ptrs:
            self._block_ptrs.remove(ptr)
            self._blocks.deallocate(ptr)
        self._blocks.empty_cache()

    def _allocate(self, alloc, nbytes: int, what: str) -> int:
        ledger = self.device.ledger
        if nbytes > ledger.snapshot().budget:
            # No plan makes room for it in this budget: the shortage, asked, plans nothing
            # again and answers with the budget that would.
            advice = self._shortage(nbytes, False) if self._shortage is not None else None
            raise BudgetExceeded(f"{what or 'a buffer'} needs {nbytes} bytes, more than the whole budget: "
                                 f"{describe_zones(ledger)}. Lower the batch or the length, or raise the budget"
                                 f"{': ' + advice if advice else ''}")
        advice = None
        for attempt in range(2):
            try:
                # A shortage makes the allocator ask lower-priority zones (the weights first)
                # to give way, then try once more.
                ptr = alloc.allocate(nbytes)
                break
            except BudgetExceeded as e:
                full = e.device_full
                if attempt == 0 and self._shortage is not None:
                    advice = self._shortage(nbytes, full)
                    if advice is None:
                        continue
                why = (f"the device cannot give them although the budget has room ({e})" if full else
                       "the budget cannot give them, after every weight that can give way did")
                short = BudgetExceeded(
                    f"{what or 'a buffer'} needs {nbytes} bytes in the {self.zone} zone and {why}: "
                    f"{describe_zones(ledger)}. Lower the batch or the length, or raise the budget"
                    f"{': ' + advice if advice else ''}")
                short.device_full = full
                raise short from e
        return ptr

    def free(self, *bufs: FixedBuffer) -> None:
        """Buffers back to the budget now (a cache that grew, a mask replaced, an
        allocation rolled back), once the stream has run what it queued on them (a zero
        fill, a copy): their memory is unmapped."""
        if not bufs:
            return
        self.device.compute_stream.synchronize()
        for buf in bufs:
            self._ptrs.remove(buf.ptr)
            self._alloc.deallocate(buf.ptr)
        self._alloc.empty_cache()

    def close(self) -> None:
        self._ptrs.clear()
        self._block_ptrs.clear()
        if self.device.closed:  # the session closed first: the arena gave everything back
            return
        self.device.compute_stream.synchronize()  # no copy still reads or writes them
        try:
            self._alloc.release_all()  # the zone's committed bytes: back to what they were
        finally:
            if self._blocks is not None:
                self._blocks.release_all()


def write(device, *pairs) -> None:
    """Host values into device buffers ((buffer, array) pairs), in order on the compute
    stream. The arrays may be temporaries: on CUDA a copy from pageable memory returns
    once the driver has staged it; the host backend's stream is a thread, waited for."""
    keep = []
    for buf, array in pairs:
        a = np.ascontiguousarray(array, dtype=buf.dtype).reshape(buf.shape)
        keep.append(a)
        device.backend.copy_h2d(buf.ptr, a.ctypes.data, a.nbytes, device.compute_stream)
    if not device.is_cuda:
        device.compute_stream.synchronize()
