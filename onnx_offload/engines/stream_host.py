"""The streaming engine's members for host compute (host_step.py): the second ORT session,
on the model rewritten for the split, and the choice of graph for each step.

A step runs on the rewrite, with the host's MatMuls in its graph, where the split helps a
step of its rows (HostPlan.helps) and the shapes of the host's results follow from its
feeds; every other step runs the whole model and streams every weight. Mixed into
StreamEngine, whose state (plan, ring, builders, graphs, notes) these use.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import onnxruntime as ort

from ..errors import BudgetExceeded, HostComputeFailed, HostComputeRefused
from ..loading import WeightInfo, save_model
from ..memory import StepMemoryShort
from .host_step import plan_host_compute
from .ortvalues import FixedBuffer, nbytes_of
from .stream_capture import StepGraph


class HostComputeMembers:
    @property
    def captures(self) -> int:
        """Graphs made (a replayed step makes none), the host graphs' too."""
        host = self._host_builder.captures if self._host_builder is not None else 0
        return self._builder.captures + self._host_captures + host

    def _check_host(self, g: StepGraph) -> None:
        """After a host-computed step's replay: HostComputeFailed where a host MatMul gave no
        result (the step's outputs are not to be used); under "auto" the next steps then run
        the whole model."""
        try:
            g.host.check()
        except HostComputeFailed as e:
            if self._host_mode == "auto":
                self._host_off(f"host compute is off: {e}")
            raise
        self.host_steps += 1

    def _start_host_compute(self, mode, factory, model, weights: Sequence[WeightInfo], workdir: str) -> None:
        """The host compute split (host_step.py) and the ORT session of the model rewritten
        for it. Under "auto", a split that cannot be made leaves host compute off, with the
        reason in the notes; a thread count given raises it."""
        self._host_mode = mode
        try:
            host, self.host_note = plan_host_compute(mode, self.device, self.store, model, self.plan, self.info,
                                                     self._ring.address)
            if host is not None:
                so = factory.session_options()
                dropped = set(host.host_weights)
                for w, value in zip(weights, self._initializer_values):
                    if w.name not in dropped:
                        so.add_initializer(w.name, value)
                path = save_model(host.model, os.path.join(workdir, "model_host.onnx"))
                mark = self._meter.mark()
                self.host_session = factory.create(path, so, False)[0]
                self._meter.charge_since(mark, creating=True)
        except StepMemoryShort:
            raise  # the engine is planned again with more room, host compute with it
        except Exception as e:  # noqa: BLE001 - under "auto", whatever the rewrite meets turns it off
            if mode != "auto":
                raise
            host, self.host_session = None, None
            self.host_note = f"host compute is off: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if host is None:
            if mode != "off":
                self.notes.append(self.host_note)
            return
        self.host = host
        self.notes.append(self.host_note)
        # Each graph input's dims by name, to size the host results' buffers from a step's feeds.
        self._host_dims = {i.name: [d.dim_param or None for d in i.type.tensor_type.shape.dim]
                           for i in host.model.graph.input if i.type.tensor_type.HasField("shape")}

    def _host_shapes(self, feeds: Dict[str, ort.OrtValue]) -> Optional[Dict[str, List[int]]]:
        """The shape of each host MatMul's result for a step of `feeds`, where host compute
        runs the step (the split helps a step of that many rows); else None."""
        if self.host is None or self._host_builder is None:
            return None
        dims: Dict[str, int] = {}
        for name, v in feeds.items():
            for d, n in zip(self._host_dims.get(name, ()), v.shape()):
                if d is not None:
                    dims.setdefault(d, int(n))
        shapes: Dict[str, List[int]] = {}
        for h in self.host.hosts:
            shape = [d if isinstance(d, int) and d > 0 else dims.get(d) if isinstance(d, str) else None
                     for d in h.y_shape]
            if any(d is None for d in shape):
                return None
            shapes[h.y_input] = shape
        rows = max(int(np.prod(s[:-1], dtype=np.int64)) for s in shapes.values())
        return shapes if self.host.helps(rows) else None

    def _build(self, feeds: Dict[str, ort.OrtValue], outputs: Dict[str, ort.OrtValue],
               buffers: Dict[str, FixedBuffer]) -> Tuple[StepGraph, bool]:
        """One signature's graph, with the host's MatMuls where host compute runs the step
        (see _host_shapes), and whether it may be kept for the signature: a step host
        compute would run, built before the ring is placed, runs the whole model once."""
        shapes = self._host_shapes(feeds)
        if shapes is None:
            return self._builder.build(feeds, outputs, buffers), True
        if not self._ring.placed_by_reads:
            return self._builder.build(feeds, outputs, buffers), False
        made = []
        try:
            fed = dict(feeds)
            for name, shape in shapes.items():
                h = next(h for h in self.host.hosts if h.y_input == name)
                ptr = self.device.scratch.allocate(max(1, nbytes_of(shape, h.y_dtype)))
                buffers[name] = FixedBuffer.on(self.device, ptr, shape, h.y_dtype)
                made.append(name)
                fed[name] = buffers[name].value
            g = self._host_builder.build(fed, outputs, buffers)
        except BaseException as e:
            for name in made:
                self.device.scratch.deallocate(buffers.pop(name).ptr)
            # A graph the host's nodes cannot go in ends host compute for the session, and the
            # step runs the whole model; under "auto", so does any failure of the rewrite's own
            # (a thread count given raises it). Memory short is planned for as in any step; no
            # room for the host's buffers this once runs the whole model this once.
            if isinstance(e, BudgetExceeded) and not isinstance(e, StepMemoryShort):
                return self._builder.build(feeds, outputs, buffers), False
            if isinstance(e, StepMemoryShort) or not isinstance(e, Exception) or (
                    self._host_mode != "auto" and not isinstance(e, HostComputeRefused)):
                raise
            self._host_off(f"host compute is off: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            return self._builder.build(feeds, outputs, buffers), True
        for h in self.host.hosts:  # the host MatMuls' X and Y are the engine's, not the caller's
            if h.x_output not in outputs and h.x_output not in self._graph_outputs:
                g.outputs.pop(h.x_output, None)
        return g, True

    def _host_off(self, why: str) -> None:
        """Host compute ends for the session: its graphs go, and so does its ORT session."""
        for sig in [k for k, g in self._graphs.items() if g.host is not None]:
            self._free(self._graphs.pop(sig))
        if self._host_builder is not None:
            self._host_captures += self._host_builder.captures
        self.host = self._host_builder = self.host_session = None
        self.host_note = why
        self.notes.append(why)

    def host_report(self) -> dict:
        """What stats() says of host compute."""
        if self.host is None:
            return dict(on=False, why=self.host_note, steps=self.host_steps)
        return self.host.report(self.host_steps)
