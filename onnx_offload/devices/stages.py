"""A model cut into stage models, one per device.

Each stage is written as an ONNX file of its own in the session's folder: its nodes, the
values it takes from the caller or from earlier stages, the values later stages or the
caller read, and the initializers its nodes read. Those keep their external data
references, and the model's data files are copied beside the stage files (by the kernel
where it can, which on a file system that shares extents writes nothing), once for all
stages. A hard link would write nothing either, but while it exists onnx.load refuses
the caller's own data file, as it refuses any file with several links. The files are
checked by ORT's rules before any is read (loading.materialize).
"""
from __future__ import annotations

import dataclasses
import os
from typing import List, Sequence, Union

import numpy as np
import onnx
from onnx import helper

from ..errors import UnsupportedModel
from ..loading import (DecoderSpec, IOInfo, ModelMeta, Segment, check_external_data, copy_regular, decoder_spec,
                       external_info, materialize, model_file, rotary_rows, saving, split, window_caches)
from .balance import DeviceShare, StageSplit, split_stages


@dataclasses.dataclass
class StagedModel:
    paths: List[str]  # each stage's model file
    segments: List[Segment]  # each stage's inputs and outputs
    split: StageSplit
    inputs: List[IOInfo]  # the model's inputs a caller feeds
    required: List[str]  # those a caller must feed (not of optional type)
    overridable: List[IOInfo]  # initializers the model also lists as inputs
    outputs: List[IOInfo]
    decoder: Union[DecoderSpec, Exception]  # the layout generate() runs, or why it cannot
    meta: ModelMeta
    name: str


def tensor_bytes(t: onnx.TensorProto) -> int:
    """The bytes of an initializer's data, without reading it."""
    if t.data_location == onnx.TensorProto.EXTERNAL:
        length = external_info(t).get("length")
        if length is not None:
            return int(length)
    elif t.HasField("raw_data"):
        return len(t.raw_data)
    count = int(np.prod([int(d) for d in t.dims], dtype=np.int64))
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (count + 1) // 2
    try:
        return count * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        return count


def stage_models(path_or_bytes, workdir: str, shares: Sequence[DeviceShare], min_weight_bytes: int,
                 external_folder: str) -> StagedModel:
    """The stage models of `path_or_bytes` (a model file, a model folder or bytes) over
    devices offering `shares`, written under `workdir`."""
    from_file = isinstance(path_or_bytes, (str, os.PathLike))
    if from_file:
        path_or_bytes = model_file(os.fspath(path_or_bytes))
    src, model = materialize(path_or_bytes, workdir, external_folder)
    folder = os.path.dirname(os.path.abspath(src))
    weights = {t.name: n for t in model.graph.initializer if (n := tensor_bytes(t)) >= min_weight_bytes}
    if not weights:
        raise UnsupportedModel("the model holds no weights to split over devices: run it on one device")
    cut = split_stages(model, weights, shares)
    segments = split(model, cut.groups, lambda n: n in weights, instead="run it on one device")
    stage_dir = os.path.join(workdir, "stages")
    os.makedirs(stage_dir, exist_ok=True)
    for location in check_external_data(model, folder, "the model"):
        dest = os.path.join(stage_dir, location)
        if not os.path.lexists(dest):
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with saving(stage_dir, "the data of the stage models"):
                copy_regular(os.path.realpath(os.path.join(folder, location)), dest)
    paths = []
    for seg in segments:
        m = seg.model
        m.functions.extend(model.functions)
        m.graph.name = f"{model.graph.name or 'graph'}_stage{seg.index}"
        path = os.path.join(stage_dir, f"stage{seg.index}.onnx")
        onnx.save(m, path)
        paths.append(path)
    inits = {t.name for t in model.graph.initializer}
    inputs = [IOInfo(v) for v in model.graph.input if v.name not in inits]
    required = [v.name for v in model.graph.input if v.name not in inits and not v.type.HasField("optional_type")]
    outputs = [IOInfo(v) for v in model.graph.output]
    overridable = [IOInfo(v) for v in model.graph.input if v.name in inits]
    made = {o for node in model.graph.node for o in node.output}
    unmade = [o.name for o in outputs if o.name not in made]
    if unmade:
        raise UnsupportedModel(f"the outputs {unmade} are made by no node of the model (an input or an initializer "
                               f"passed through); a split model returns only what its stages compute")
    op_types = {n.op_type for n in model.graph.node}
    model_dir = folder if from_file else None
    try:
        spec = decoder_spec(inputs, outputs, op_types, model_dir, rotary_rows(model), window_caches(model))
    except UnsupportedModel as e:
        spec = e
    name = os.path.basename(os.fspath(path_or_bytes)) if from_file else "model (bytes)"
    return StagedModel(paths, segments, cut, inputs, required, overridable, outputs, spec, ModelMeta.of(model), name)
