"""IOBinding for a split session: the inputs and outputs of the whole graph, routed
to the segments that consume and produce them.

Inputs are copied into the runner's fixed buffers; outputs bound by the caller are
filled by a copy from the fixed buffers, and outputs bound to no memory are returned
as copies of their own, as ORT returns them (the fixed buffers are overwritten by the
next step).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import onnxruntime as ort

from ..errors import StateError
from .ortvalues import FixedBuffer, as_ortvalue, copy_into, detached, numpy_dtype, ortvalue_at


class OffloadIOBinding:
    """Checks names as ORT's binding does, with its messages: an input the graph does not
    have when it is bound; at the run, no output, an output the graph does not have, or a
    required input left unbound."""

    def __init__(self, runner_of, graph_inputs: List[str], required_inputs: List[str], graph_outputs: List[str],
                 device_id: int):
        self._runner_of = runner_of  # the session's runner at the time of each run
        self._device = runner_of().device
        self._graph_inputs = set(graph_inputs)
        self._required_inputs = required_inputs
        self._graph_outputs = graph_outputs
        self._device_id = device_id
        self._inputs: Dict[str, ort.OrtValue] = {}
        self._outputs: Dict[str, Optional[ort.OrtValue]] = {}
        self._results: Dict[str, ort.OrtValue] = {}

    def _input(self, name) -> None:
        if name not in self._graph_inputs:
            raise RuntimeError(f"Failed to find NodeArg with name: {name} in the def list")

    def bind_cpu_input(self, name, arr):
        self._input(name)
        self._inputs[name] = as_ortvalue(arr)

    def bind_ortvalue_input(self, name, value):
        self._input(name)
        self._inputs[name] = value

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr):
        self._input(name)
        on_cuda = str(device_type).lower() == "cuda"
        self._inputs[name] = ortvalue_at(buffer_ptr, shape, np.dtype(element_type), on_cuda, device_id)

    def bind_output(self, name, device_type="cpu", device_id=0, element_type=None, shape=None, buffer_ptr=None):
        if buffer_ptr is not None:
            on_cuda = str(device_type).lower() == "cuda"
            self._outputs[name] = ortvalue_at(buffer_ptr, shape, np.dtype(element_type), on_cuda, device_id)
        else:
            self._outputs[name] = None

    def bind_ortvalue_output(self, name, value):
        self._outputs[name] = value

    def clear_binding_inputs(self):
        self._inputs.clear()

    def clear_binding_outputs(self):
        self._outputs.clear()
        self._results.clear()

    def synchronize_inputs(self):
        pass

    def synchronize_outputs(self):
        self._device.compute_stream.synchronize()

    def run(self, run_options) -> None:
        if not self._outputs:
            raise RuntimeError("Error in execution: At least one output should be requested.")
        unknown = [n for n in self._outputs if n not in self._graph_outputs]
        if unknown:
            raise RuntimeError(f"Error in execution: Invalid output name: {unknown[0]}")
        missing = [n for n in self._required_inputs if n not in self._inputs]
        if missing:
            raise RuntimeError(f"Error in execution: Missing Input: {missing[0]}")
        values = self._runner_of().run_segments(self._inputs, run_options)
        names = list(self._outputs)
        self._results = {}
        for n in names:
            target = self._outputs.get(n)
            if target is not None:
                buf = FixedBuffer(target.data_ptr(), target.shape(), numpy_dtype(target.data_type()), target)
                copy_into(self._device, buf, values[n])
                self._results[n] = target
            else:
                self._results[n] = detached(self._device, values[n], self._device_id)
        self._device.compute_stream.synchronize()

    def get_outputs(self):
        return list(self._results.values())

    @property
    def input_names(self) -> List[str]:
        return list(self._inputs)

    def get_outputs_as_ortvaluevector(self):
        raise StateError("get_outputs_as_ortvaluevector returns ORT's internal value vector, which a split session's "
                         "outputs, gathered from several segments, are not: use get_outputs()")

    def copy_outputs_to_cpu(self):
        return [np.array(v.numpy(), copy=True) for v in self._results.values()]
