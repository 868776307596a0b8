"""A model cut into stage models, one per device.

The model is optimized whole first, by the pass one session runs (loading.optimize_once,
for the target provider, with the caller's options), and the optimized graph is what is
cut: every stage runs the nodes and kernels plain ORT runs for that part of the model,
and the whole optimized model is there to write where the caller's SessionOptions ask
for it (optimized_model_filepath). Where the CUDA pass cannot hold the whole model on
one device, the model is cut as exported and each stage optimizes its own part.

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
from typing import List, Optional, Sequence, Union

import numpy as np
import onnx
from onnx import helper

from ..errors import CorruptModel, OffloadError, UnsupportedModel
from ..loading import (OPTIMIZED, OPTIMIZED_DATA, DecoderSpec, IOInfo, ModelMeta, Segment, check_external_data,
                       copy_regular, decoder_spec, external_info, load_optimized, materialize, model_file,
                       optimize_once, rotary_rows, saving, split, window_caches)
from ..memory import Device
from .balance import DeviceShare, StageSplit, split_stages


@dataclasses.dataclass
class WholePass:
    """How the whole model is optimized before it is cut, as one session's pipeline
    optimizes it."""

    on_cuda: bool
    level: object  # the ort.GraphOptimizationLevel
    config: object  # the first device's OffloadConfig: the CUDA pass runs on that device
    disabled_optimizers: List[str]
    options: object  # the caller's SessionOptions as ORT takes them (a copy), or None


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
    optimized: Optional[str]  # the whole optimized model's file; None where each stage optimizes its own part
    note: str  # why the stages optimize their own parts, or ''


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


def optimize_whole(src: str, folder: str, whole: WholePass) -> str:
    """Optimizes the model at `src` into `folder` (OPTIMIZED and OPTIMIZED_DATA); '' once
    it is there, else why not: the CUDA pass, which holds every weight on the device
    once, did not fit the first device's free memory."""
    device = Device("cuda", whole.config) if whole.on_cuda else None
    try:
        optimize_once(src, folder, whole.on_cuda, whole.level, whole.config.min_weight_bytes, device, None,
                      whole.disabled_optimizers, whole.options)
        return ""
    except CorruptModel:
        raise
    except OffloadError as e:
        if not whole.on_cuda:
            raise
        for name in (OPTIMIZED, OPTIMIZED_DATA):
            if os.path.lexists(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
        return (f"ORT's optimization pass of the whole model did not fit device {whole.config.device_id}'s free "
                f"memory ({e}); each stage optimizes its own part of the model as exported")
    finally:
        if device is not None:
            device.close()


def stage_models(path_or_bytes, workdir: str, shares: Sequence[DeviceShare], whole: WholePass,
                 external_folder: str) -> StagedModel:
    """The stage models of `path_or_bytes` (a model file, a model folder or bytes) over
    devices offering `shares`, written under `workdir`: cut from the whole model as
    optimized by `whole` (see optimize_whole)."""
    from_file = isinstance(path_or_bytes, (str, os.PathLike))
    if from_file:
        path_or_bytes = model_file(os.fspath(path_or_bytes))
    src, original = materialize(path_or_bytes, workdir, external_folder)
    stage_dir = os.path.join(workdir, "stages")
    os.makedirs(stage_dir, exist_ok=True)
    note = optimize_whole(src, stage_dir, whole)
    optimized = None if note else os.path.join(stage_dir, OPTIMIZED)
    model = original if note else load_optimized(optimized)
    folder = os.path.dirname(os.path.abspath(src)) if note else stage_dir
    weights = {t.name: n for t in model.graph.initializer if (n := tensor_bytes(t)) >= whole.config.min_weight_bytes}
    if not weights:
        raise UnsupportedModel("the model holds no weights to split over devices: run it on one device")
    cut = split_stages(model, weights, shares)
    segments = split(model, cut.groups, lambda n: n in weights, instead="run it on one device")
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
    # The inputs and outputs as the caller's model declares them, as ORT lists them.
    inits = {t.name for t in original.graph.initializer}
    inputs = [IOInfo(v) for v in original.graph.input if v.name not in inits]
    required = [v.name for v in original.graph.input if v.name not in inits and not v.type.HasField("optional_type")]
    outputs = [IOInfo(v) for v in original.graph.output]
    overridable = [IOInfo(v) for v in original.graph.input if v.name in inits]
    made = {o for node in model.graph.node for o in node.output}
    unmade = [o.name for o in outputs if o.name not in made]
    if unmade:
        raise UnsupportedModel(f"the outputs {unmade} are made by no node of the model (an input or an initializer "
                               f"passed through); a split model returns only what its stages compute")
    op_types = {n.op_type for n in model.graph.node}
    model_dir = os.path.dirname(os.path.abspath(os.fspath(path_or_bytes))) if from_file else None  # its config files
    try:
        spec = decoder_spec(inputs, outputs, op_types, model_dir, rotary_rows(model), window_caches(model))
    except UnsupportedModel as e:
        spec = e
    name = os.path.basename(os.fspath(path_or_bytes)) if from_file else "model (bytes)"
    return StagedModel(paths, segments, cut, inputs, required, overridable, outputs, spec, ModelMeta.of(original), name,
                       optimized, note)
