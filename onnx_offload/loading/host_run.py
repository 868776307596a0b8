"""Running a model rewritten for host compute on plain onnxruntime, the host's part done
by a function given: the proof that the rewrite computes what the model computes.

Each run feeds the Y inputs computed from the previous run's X outputs (zeros the first
time). A host MatMul whose X depends on another's Y gets the right X one run after that
Y is right, so after depth + 1 runs (depth: the longest chain of host MatMuls) every X and
every Y is right; the run whose Xs equal the previous run's is the answer.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ..errors import OffloadError
from .host_compute import HostMatMul

# compute(host, x, weights) -> y: x is [..., K] as ORT gave it, y [..., N] of host.y_dtype.
Compute = Callable[[HostMatMul, np.ndarray, Mapping[str, np.ndarray]], np.ndarray]


def dequantize_nbits(host: HostMatMul, weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """The [K, N] float32 weight of an int4 MatMulNBits, as ORT's contrib spec defines it:
    B [N, blocks, block_size / 2] uint8 (low nibble first), scales [N * blocks], zero points
    [N, ceil(blocks / 2)] uint8 (low nibble first; 8 without them)."""
    b = np.asarray(weights[host.weights[0]], np.uint8)
    n, blocks = host.n, b.shape[1]
    q = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, blocks, host.block_size).astype(np.float32)
    scales = np.asarray(weights[host.weights[1]]).astype(np.float32).reshape(n, blocks, 1)
    if host.zero_points:
        zp = np.asarray(weights[host.zero_points], np.uint8).reshape(n, -1)
        zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float32)[..., None]
    else:
        zp = np.float32(8)
    w = ((q - zp) * scales).reshape(n, blocks * host.block_size)[:, :host.k]
    return np.ascontiguousarray(w.T)


def numpy_matmul(host: HostMatMul, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """Y = X @ W in float32 with numpy, rounded once to Y's type."""
    if host.kind == "int4":
        w = dequantize_nbits(host, weights)
    else:
        w = np.asarray(weights[host.weights[0]]).astype(np.float32)
    y = x.reshape(-1, host.k).astype(np.float32) @ w
    return y.astype(host.y_dtype).reshape(x.shape[:-1] + (host.n,))


def core_matmul(threads: Optional[int] = None) -> Compute:
    """The compiled core's host kernels (_core.host_matmul, _core.host_matmul_nbits) as a
    `compute` for run_host_split."""
    from .. import _core

    def compute(host: HostMatMul, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> np.ndarray:
        x2 = np.ascontiguousarray(x.reshape(-1, host.k))
        if host.kind == "int4":
            zp = weights[host.zero_points] if host.zero_points else None
            y = _core.host_matmul_nbits(x2, weights[host.weights[0]], weights[host.weights[1]], zp, k=host.k,
                                        n=host.n, block_size=host.block_size, threads=threads)
        else:
            y = _core.host_matmul(x2, weights[host.weights[0]], threads=threads)
        return y.reshape(x.shape[:-1] + (host.n,))
    return compute


def load_host_weights(model: onnx.ModelProto, hosts: Sequence[HostMatMul], folder: str = "") -> Dict[str, np.ndarray]:
    """The arrays of the hosts' weights, from the original `model` (external data read from
    `folder`); no other weight is read."""
    wanted = {w for h in hosts for w in h.weights}
    return {t.name: numpy_helper.to_array(t, base_dir=folder) for t in model.graph.initializer if t.name in wanted}


def chain_depth(model: onnx.ModelProto, hosts: Sequence[HostMatMul]) -> int:
    """The longest chain of host MatMuls in the rewritten `model`, each reading through its
    X a value that depends on the one before's Y (1 when none depends on another)."""
    level: Dict[str, int] = {h.y_input: 0 for h in hosts}
    by_output = {h.output: h for h in hosts}
    for node in model.graph.node:
        here = max((level.get(i, 0) for i in node.input if i), default=0)
        if node.op_type == "Where" and node.output[0] in by_output:
            h = by_output[node.output[0]]
            here = max(here, level.get(h.x_output, 0) + 1)
        for o in node.output:
            level[o] = here
    return max((level[h.output] for h in hosts), default=0)


def run_host_split(model: onnx.ModelProto, hosts: Sequence[HostMatMul], feeds: Mapping[str, np.ndarray],
                   weights: Mapping[str, np.ndarray], compute: Compute = numpy_matmul, folder: str = "",
                   providers: Sequence = ("CPUExecutionProvider",),
                   options: Optional[ort.SessionOptions] = None) -> Tuple[Dict[str, np.ndarray], int]:
    """({output name: array} of every output of the rewritten `model`, X outputs included;
    the runs it took), with `compute` doing each host MatMul. `folder` holds the model's
    external data. Raises OffloadError where the Xs do not settle in depth + 1 runs."""
    runnable = onnx.ModelProto()
    runnable.CopyFrom(model)
    y_inputs = {h.y_input for h in hosts}
    for v in runnable.graph.input:  # the first run's Y is [N], which the Where broadcasts to X's leading dims
        if v.name in y_inputs:
            v.type.tensor_type.ClearField("shape")
    options = options or ort.SessionOptions()
    if folder:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", os.path.abspath(folder))
    session = ort.InferenceSession(runnable.SerializeToString(), options, providers=list(providers))
    names = [o.name for o in session.get_outputs()]
    x_names = list(dict.fromkeys(h.x_output for h in hosts))
    inputs = dict(feeds)
    inputs.update({h.y_input: np.zeros(h.n, h.y_dtype) for h in hosts})
    previous: Optional[List[np.ndarray]] = None
    depth = chain_depth(model, hosts)
    for run in range(1, depth + 2):
        results = dict(zip(names, session.run(names, inputs)))
        xs = [results[x] for x in x_names]
        if not hosts or previous is not None and all(_same(a, b) for a, b in zip(previous, xs)):
            return results, run
        for h in hosts:
            inputs[h.y_input] = compute(h, results[h.x_output], weights)
        previous = xs
    raise OffloadError(f"the host split did not settle in {depth + 1} runs (chain depth {depth})")


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
