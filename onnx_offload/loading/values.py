"""How a graph's values are described: the numpy dtype of an ORT type string, and the
``IOInfo`` that get_inputs()/get_outputs() return for a split model."""
from __future__ import annotations

import numpy as np
import onnx

from ..errors import OffloadError
from .segmenter import dims, onnx_type_string


def numpy_dtype(type_str: str) -> np.dtype:
    """The numpy dtype of an ORT type string such as 'tensor(float16)', through onnx's own
    mapping (float8, int4 and bfloat16 come from ml_dtypes)."""
    name = type_str[len("tensor("):-1] if type_str.startswith("tensor(") and type_str.endswith(")") else ""
    code = name.upper()
    elem = getattr(onnx.TensorProto, code, None) if code else None
    if not isinstance(elem, int) or code in ("STRING", "UNDEFINED"):
        raise OffloadError(f"boundary tensors of type {type_str} are not supported")
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    except (KeyError, TypeError, ValueError):
        raise OffloadError(f"boundary tensors of type {type_str} are not supported") from None



class IOInfo:
    """What get_inputs()/get_outputs() return for a split model (like ORT's NodeArg)."""

    def __init__(self, vi: onnx.ValueInfoProto):
        self.name = vi.name
        self.type = onnx_type_string(vi.type)
        tensor = vi.type.HasField("tensor_type")
        self.shape = dims(vi.type.tensor_type) if tensor else []
        try:
            self.dtype = numpy_dtype(self.type) if tensor else None
        except OffloadError:  # a type no boundary or cache can hold
            self.dtype = None

    def __repr__(self):
        return f"IOInfo(name={self.name!r}, type={self.type!r}, shape={self.shape!r})"
