"""OrtValues over memory the package owns, and copies between them.

Fixed buffers, weights and bound outputs are non-owning OrtValues over arena memory,
made through DLPack so that ORT reads and writes them in place. Copies run on the
device's compute stream, in order with the segments that read and write them.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import onnx
import onnxruntime as ort

from .. import _core
from ..errors import OffloadError
from ..loading import IOInfo, elem_name, numpy_dtype

try:  # the type ORT itself raises for a bad input or output name
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument
except ImportError:  # pragma: no cover - a build without it
    InvalidArgument = ValueError


class _DLPackTensor:
    """A DLPack capsule with the dtype beside it: what ORT's public OrtValue.from_dlpack
    reads (before 1.32 it learns that a tensor is bool from the dtype alone)."""

    def __init__(self, capsule, dtype: np.dtype, device: tuple):
        self._capsule, self.dtype, self._device = capsule, dtype, device

    def __dlpack__(self, stream=None):
        return self._capsule

    def __dlpack_device__(self):
        return self._device


_BOOL_CODE = []  # whether this ORT takes DLPack's own bool code (1.32 and later)


def _takes_dlpack_bool() -> bool:
    """ORT 1.32 takes bool tensors with DLPack's bool code and reads flagged uint8 as
    uint8; earlier versions reject the bool code and take uint8 flagged as bool. Asked
    once, of ORT itself, with a one-element host tensor."""
    if not _BOOL_CODE:
        probe = np.ones(1, np.bool_)
        try:
            cap = _core.make_dlpack(probe.ctypes.data, [1], "bool", 1, 0)
            v = ort.OrtValue.from_dlpack(_DLPackTensor(cap, np.dtype(np.bool_), (1, 0)))
            _BOOL_CODE.append(v.data_type() == "tensor(bool)" and bool(v.numpy()[0]))
        except Exception:  # noqa: BLE001 - ORT's own types: the code is refused
            _BOOL_CODE.append(False)
    return _BOOL_CODE[0]


def ortvalue_at(ptr: int, shape: Sequence[int], dtype: np.dtype, on_cuda: bool, device_id: int) -> ort.OrtValue:
    """A non-owning OrtValue over memory the arena owns (DLPack, zero-copy), through
    ORT's public OrtValue.from_dlpack."""
    dtype = np.dtype(dtype)
    is_bool = dtype == np.bool_
    name = "uint8" if is_bool and not _takes_dlpack_bool() else dtype.name
    device = (2, device_id) if on_cuda else (1, 0)
    cap = _core.make_dlpack(ptr, [int(d) for d in shape], name, device[0], device[1])
    return ort.OrtValue.from_dlpack(_DLPackTensor(cap, dtype, device))


# Element types a weight can be handed to ORT in place as (DLPack, bool as flagged uint8).
_SHAREABLE = frozenset(("float32", "float16", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8",
                        "uint16", "uint32", "uint64", "bool"))


def shareable(dtype: np.dtype) -> bool:
    return np.dtype(dtype).name in _SHAREABLE


def signature(values, prefix: str = "", addresses: bool = False) -> tuple:
    """What fixed buffers and captured graphs are keyed by: each value's name (with
    `prefix`), shape and type, and with `addresses` where it lives."""
    return tuple(sorted((prefix + k, tuple(v.shape()), v.data_type()) + ((v.data_ptr(),) if addresses else ())
                        for k, v in values.items()))


def nbytes_of(shape: Sequence[int], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _element_type(dtype):
    """What ORT's OrtValue factories take for `dtype`: the numpy type, or the ONNX element
    type for the types numpy has only through ml_dtypes (bfloat16, float8), which ORT's
    numpy conversions refuse. Sub-byte types are refused: numpy holds one element per
    byte, ORT two."""
    dtype = np.dtype(dtype)
    if dtype.type.__module__.split(".")[0] != "ml_dtypes":
        return dtype
    if dtype.name in ("int4", "uint4", "float4_e2m1fn"):
        raise OffloadError(f"values of the sub-byte type {dtype.name} cannot be passed between segments")
    return onnx.helper.np_dtype_to_tensor_dtype(dtype)


def native_order(a: np.ndarray) -> np.ndarray:
    """`a` in the machine's byte order. ORT reads an array's bytes as native, so a
    big-endian array (``>f4``) would run on garbled values; its values are kept instead."""
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def as_ortvalue(value) -> ort.OrtValue:
    if isinstance(value, ort.OrtValue):
        return value
    a = native_order(np.asarray(value))
    if not a.flags.c_contiguous:  # (np.ascontiguousarray alone would make a 0-d array 1-d)
        a = np.ascontiguousarray(a)
    elem = _element_type(a.dtype)
    if isinstance(elem, int):  # kept alive by the OrtValue, which views it
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(f"u{a.dtype.itemsize}"), elem)
    return ort.OrtValue.ortvalue_from_numpy(a)


class FixedBuffer:
    """A buffer of one shape and dtype at a fixed address, and its OrtValue."""

    __slots__ = ("ptr", "shape", "dtype", "value")

    def __init__(self, ptr: int, shape: Sequence[int], dtype: np.dtype, value: ort.OrtValue):
        self.ptr, self.shape, self.dtype, self.value = ptr, list(shape), np.dtype(dtype), value

    @classmethod
    def on(cls, device, ptr: int, shape: Sequence[int], dtype) -> "FixedBuffer":
        """A buffer at `ptr` in `device`'s memory, with an OrtValue over it."""
        return cls(ptr, shape, dtype, ortvalue_at(ptr, list(shape), np.dtype(dtype), device.is_cuda,
                                                  device.config.device_id))


def copy_into(device, target: FixedBuffer, value: ort.OrtValue) -> None:
    """Copies `value` into `target`, in order on the compute stream. Returns once the
    copy no longer needs host memory (a host source or destination is waited for)."""
    if tuple(value.shape()) != tuple(target.shape) or numpy_dtype(value.data_type()) != target.dtype:
        raise ValueError(f"a {value.data_type()} {value.shape()} value does not fit a {target.dtype} "
                         f"{list(target.shape)} buffer")
    nbytes = nbytes_of(target.shape, target.dtype)
    backend, stream = device.backend, device.compute_stream
    src_host = value.device_name().lower() == "cpu"
    dst_host = target.value.device_name().lower() == "cpu"
    if not device.is_cuda or src_host:
        # The host backend's device memory is host memory; a host source is the caller's.
        backend.copy_h2d(target.ptr, value.data_ptr(), nbytes, stream)
        stream.synchronize()
    elif dst_host:
        backend.copy_d2h(target.ptr, value.data_ptr(), nbytes, stream)
        stream.synchronize()
    else:
        backend.copy_d2d(target.ptr, value.data_ptr(), nbytes, stream)


def detached(device, value: ort.OrtValue, device_id: int) -> ort.OrtValue:
    """A copy of `value` in memory ORT allocated and the OrtValue owns (so that a numpy()
    view of it stays valid as ORT's own outputs' do), on the same device; complete when
    this returns."""
    dtype = numpy_dtype(value.data_type())
    on_host = value.device_name().lower() == "cpu"
    out = ort.OrtValue.ortvalue_from_shape_and_type(value.shape(), _element_type(dtype),
                                                    "cpu" if on_host else "cuda", 0 if on_host else device_id)
    if on_host:
        ctypes.memmove(out.data_ptr(), value.data_ptr(), nbytes_of(value.shape(), dtype))
    else:
        copy_into(device, FixedBuffer(out.data_ptr(), value.shape(), dtype, out), value)
        device.compute_stream.synchronize()  # the copy is queued on the compute stream
    return out


def as_arrays(inputs: Sequence[IOInfo], feeds) -> dict:
    """Feeds given as Python lists made arrays of their input's element type, as ORT
    converts them (it takes no tuple or scalar: check_feeds raises what it raises),
    arrays in the machine's byte order (native_order); everything else as it is."""
    by_name = {i.name: i for i in inputs}
    out = {}
    for name, value in feeds.items():
        info = by_name.get(name)
        if isinstance(value, list) and info is not None and info.dtype is not None:
            value = np.asarray(value, dtype=info.dtype)
        elif isinstance(value, np.ndarray):
            value = native_order(value)
        out[name] = value
    return out


def check_required(required: Sequence[str], feeds) -> None:
    """Raises what ORT's Python layer raises when a required input is not fed."""
    missing = [n for n in required if n not in feeds]
    if missing:
        raise ValueError(f"Required inputs ({missing}) are missing from input feed ({list(feeds)}).")


def check_feeds(required: Sequence[str], inputs: Sequence[IOInfo], known_outputs: Sequence[str], feeds,
                output_names, run_options=None) -> None:
    """Raises what ORT's run() and run_with_ort_values() raise for feeds, output names or
    run options that do not match the graph or the call: an unknown or missing name, a
    wrong element type, rank or fixed dimension, an argument of the wrong type."""
    by_name = {i.name: i for i in inputs}
    check_required(required, feeds)  # ORT's Python layer checks this first
    check_run_options(run_options)
    if isinstance(output_names, (str, bytes)):
        raise TypeError(f"run(): incompatible function arguments: output_names must be a sequence of names, not "
                        f"{type(output_names).__name__} {output_names!r}")
    odd = [n for n in output_names or () if not isinstance(n, (str, bytes))]  # ORT's binding takes bytes too
    if odd:
        raise TypeError(f"run(): incompatible function arguments: output_names must be a sequence of str, not one "
                        f"holding {type(odd[0]).__name__} {odd[0]!r}")
    for name, value in feeds.items():  # what ORT's Python layer cannot make a tensor of
        if isinstance(value, (str, tuple)):
            raise RuntimeError(f"Input must be a list of dictionaries or a single numpy array for input '{name}'.")
        if not isinstance(value, (np.ndarray, ort.OrtValue)):
            raise RuntimeError(f"Unable to handle object of type {type(value)}")
    unknown = [n for n in feeds if n not in by_name]
    if unknown:
        raise InvalidArgument(f"Invalid input name: {unknown[0]} (the model's inputs are {list(by_name)})")
    for name, value in feeds.items():
        info = by_name[name]
        if isinstance(value, ort.OrtValue):
            type_str, shape = value.data_type(), list(value.shape())
        else:
            arr = np.asarray(value)
            type_str, shape = _type_string(arr.dtype), list(arr.shape)
        if type_str != info.type:
            raise InvalidArgument(f"Unexpected input data type for {name}. Actual: ({type_str}), "
                                  f"expected: ({info.type})")
        if len(shape) != len(info.shape):
            raise InvalidArgument(f"Invalid rank for input: {name} Got: {len(shape)} Expected: {len(info.shape)}")
        bad = [i for i, (got, want) in enumerate(zip(shape, info.shape)) if isinstance(want, int) and got != want]
        if bad:
            raise InvalidArgument(f"Got invalid dimensions for input: {name} for the following indices: "
                                  + ", ".join(f"index: {i} Got: {shape[i]} Expected: {info.shape[i]}" for i in bad))
    for n in output_names or ():
        if n not in known_outputs:
            raise InvalidArgument(f"Invalid output name: {n} (the model's outputs are {list(known_outputs)})")


def check_run_options(run_options) -> None:
    """Raises the TypeError ORT's binding raises in run() and run_with_ort_values() for run
    options that are not RunOptions (run_with_iobinding reads them first in Python, and
    raises AttributeError, as the segments' own calls of it do)."""
    if run_options is not None and not isinstance(run_options, ort.RunOptions):
        raise TypeError(f"run(): incompatible function arguments: run_options must be an onnxruntime.RunOptions "
                        f"or None, not {type(run_options).__name__} {run_options!r}")


def _type_string(dtype: np.dtype) -> str:
    """ORT's type string of a numpy dtype, such as 'tensor(float)', through onnx's mapping."""
    try:
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (KeyError, TypeError, ValueError):
        return f"tensor({np.dtype(dtype).name})"
    return f"tensor({elem_name(elem)})"
