"""Boundary values moved from the device of the stage that made them to the device of
the stage that reads them.

A value goes into a buffer of the reading device's scratch zone (in that device's
ledger), copied through host memory: a device-to-host copy on the source device's copy
stream, then, ordered by an event, a host-to-device copy on the destination's. The
reading stage's compute stream waits on an event of that copy; the host backend's
stage, which ORT runs on the calling thread, waits for it on the host. The staging
memory is pageable: peer copies, and staging registered with both drivers, are what a
machine with two GPUs is to measure.
"""
from __future__ import annotations

from typing import List

import numpy as np
import onnxruntime as ort

from ..engines import FixedBuffer, nbytes_of, numpy_dtype
from ..generation import DeviceBuffers


class StepMoves:
    """The moves of one step into one stage's device; freed together once the stage has
    run (its ORT run returns after reading them)."""

    def __init__(self, device, shortage=None):
        """`shortage`: what the buffers ask when the budget has no room (DeviceBuffers)."""
        self.device = device
        self._bufs = DeviceBuffers(device, "scratch", shortage)
        self._keep: List[np.ndarray] = []
        self.bytes = 0
        self._last = None  # the event of the last copy

    def move(self, source, value: ort.OrtValue) -> ort.OrtValue:
        """`value`, made on the device `source`, in a new buffer of this stage's device."""
        dtype = numpy_dtype(value.data_type())
        dst: FixedBuffer = self._bufs.new(list(value.shape()), dtype,
                                          what=f"a value moved from device {source.config.device_id}")
        self.move_into(source, value, dst)
        return dst.value

    def move_into(self, source, value: ort.OrtValue, dst: FixedBuffer) -> None:
        """`value`, made on the device `source`, copied into `dst` on this stage's device
        (a buffer of its shape and type)."""
        nbytes = nbytes_of(dst.shape, dst.dtype)
        if list(value.shape()) != dst.shape or numpy_dtype(value.data_type()) != dst.dtype:
            raise ValueError(f"a {value.data_type()} {value.shape()} value does not fit a {dst.dtype} {dst.shape} "
                             f"buffer")
        if nbytes == 0:
            return
        staging = np.empty(nbytes, np.uint8)
        self._keep.append(staging)
        src_stream, dst_dev = source.copy_stream, self.device
        source.backend.copy_d2h(staging.ctypes.data, value.data_ptr(), nbytes, src_stream)
        copied = source.backend.create_event()
        copied.record(src_stream)
        copied.wait_on(dst_dev.copy_stream)
        dst_dev.backend.copy_h2d(dst.ptr, staging.ctypes.data, nbytes, dst_dev.copy_stream)
        landed = dst_dev.backend.create_event()
        landed.record(dst_dev.copy_stream)
        landed.wait_on(dst_dev.compute_stream)
        if not dst_dev.is_cuda:
            landed.synchronize()
        self.bytes += nbytes
        self._last = landed

    def close(self) -> None:
        """Frees the buffers and the staging, once the last copy is done."""
        if self._last is not None:
            self._last.synchronize()
        self._bufs.close()
        self._keep.clear()
