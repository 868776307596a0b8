"""Where a model splits into one contiguous stage per device.

A stage's step time on its device is ``max(its weights / the device's compute rate,
its streamed weights / the device's link rate)``: the weights past the device's
allowance cross its own host-to-device link each step. The split minimizes the largest
stage time, not the largest stage's bytes, so a device with a larger budget takes more
of the model, and no device keeps allowance unused while another streams. (The stages of
one sequence run one after the other, so a step costs the sum of the stage times; while
every stage streams, that sum is the bytes past all the allowances over the links, and
it is least where the largest is.) Within 5% of that balanced time the split cuts where
the fewest values cross between stages: each crossing value is a copy from one device to
the next, and a decoder's layer boundaries carry only the residual stream.

A cut may fall only before a node that reads a weight no earlier node read: every
stage then starts at a weight, and a stage's weights are what its nodes read (a weight
read by two stages, such as tied embeddings, is in both).
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Dict, List, Sequence

import numpy as np
import onnx

from ..errors import UnsupportedModel
from ..loading import node_inputs, recomputed_values

# The rate an H200 step reads resident weights over the rate its link streams them:
# an fp16 Llama-3-8B shape with every weight resident ran at 5.76 ms per token (16.06 GB
# read, 2.79 TB/s), and pinned copies host to device ran at about 55 GB/s on that machine.
COMPUTE_TO_LINK = 51.0
# How far over the balanced step time a split may go to cut where fewer values cross.
CROSSING_SLACK = 0.05


@dataclasses.dataclass(frozen=True)
class DeviceShare:
    """What a device offers a stage: the weight bytes it keeps resident, and the rates it
    streams and reads weights at (any unit, the same for every device)."""
    allowance: int
    link: float = 1.0
    compute: float = COMPUTE_TO_LINK

    def step_time(self, weight_bytes):
        """The stage time of `weight_bytes` (a number, or an array of them)."""
        return np.maximum(weight_bytes / self.compute, np.maximum(0, weight_bytes - self.allowance) / self.link)


@dataclasses.dataclass
class StageSplit:
    groups: List[List[int]]  # the node indices of each stage, in order
    weight_bytes: List[int]  # the weight bytes each stage reads
    times: List[float]  # each stage's step time, in the unit of the shares' rates
    crossings: List[int]  # the values that cross each cut


class _Ranges:
    """The weight bytes of any contiguous range of candidate positions, and the values
    crossing each position."""

    def __init__(self, model: onnx.ModelProto, weight_bytes: Dict[str, int]):
        nodes = model.graph.node
        uses: Dict[str, List[int]] = {}
        for i, node in enumerate(nodes):
            for name in dict.fromkeys(node_inputs(node)):
                if name in weight_bytes:
                    uses.setdefault(name, []).append(i)
        self.n = len(nodes)
        first = np.zeros(self.n + 1, np.int64)
        for name, at in uses.items():
            first[at[0] + 1] += weight_bytes[name]
        # Positions a later stage may start at: a node reading a weight for the first time,
        # after the first such node (the nodes before it, which read none, join the first
        # stage: alone they would make a stage with no weights, whose values the next stage
        # computes again, and so with no outputs).
        starts = sorted({at[0] for at in uses.values()})
        self.positions = np.array([0] + starts[1:] + [self.n], np.int64)
        self.prefix = np.cumsum(first)[self.positions]
        self.reused = [(weight_bytes[n], at) for n, at in uses.items() if len(at) > 1]
        self.crossing = self._crossings(model, recomputed_values(model, lambda n: n in weight_bytes))

    def _crossings(self, model: onnx.ModelProto, recomputed) -> np.ndarray:
        """Per position, the values made before it that a node at or after it reads (a
        value each stage computes again from the inputs does not cross)."""
        graph = model.graph
        made: Dict[str, int] = {}
        last: Dict[str, int] = {}
        for i, node in enumerate(graph.node):
            for name in node_inputs(node):
                if name in made:
                    last[name] = i
            for o in node.output:
                if o and o not in recomputed:
                    made[o] = i
        diff = np.zeros(self.n + 2, np.int64)
        for name, end in last.items():
            diff[made[name] + 1] += 1  # crosses each position p with made < p <= last reader
            diff[end + 1] -= 1
        per_node = np.cumsum(diff)[:self.n + 1]
        return per_node[self.positions]

    def bytes_to(self, j: int) -> np.ndarray:
        """The weight bytes of the ranges [positions[i], positions[j]) for every i < j."""
        out = self.prefix[j] - self.prefix[:j]
        hi = self.positions[j]
        for nbytes, at in self.reused:
            for idx, lo in enumerate(self.positions[:j]):
                k = bisect.bisect_left(at, lo)
                if at[0] < lo and k < len(at) and at[k] < hi:
                    out[idx] += nbytes
        return out


def split_stages(model: onnx.ModelProto, weight_bytes: Dict[str, int], shares: Sequence[DeviceShare]) -> StageSplit:
    """The stages of `model` over devices offering `shares`, in order: stage s runs on
    the device of shares[s]. `weight_bytes`: each weight's bytes, by name."""
    r = _Ranges(model, weight_bytes)
    count, slots = len(shares), len(r.positions)
    if count > slots - 1:
        raise UnsupportedModel(f"the model's nodes read weights in {slots - 1} places where a stage can start; it "
                               f"cannot be split over {count} devices")
    table = [r.bytes_to(j) for j in range(slots)]

    def stage_times(s: int, j: int) -> np.ndarray:
        """Stage s's time over [positions[i], positions[j]), for every i < j."""
        return shares[s].step_time(table[j].astype(np.float64))

    best = _balanced(count, slots, stage_times)
    limit = best * (1 + CROSSING_SLACK)
    cuts = _fewest_crossings(count, slots, stage_times, limit, r.crossing)
    bounds = [0] + cuts + [slots - 1]
    groups, nbytes, spent = [], [], []
    for s in range(count):
        i, j = bounds[s], bounds[s + 1]
        groups.append(list(range(int(r.positions[i]), int(r.positions[j]))))
        nbytes.append(int(table[j][i]))
        spent.append(float(stage_times(s, j)[i]))
    return StageSplit(groups, nbytes, spent, [int(r.crossing[c]) for c in cuts])


def _balanced(count: int, slots: int, stage_times) -> float:
    """The least possible largest stage time (a stage per device, each non-empty)."""
    inf = np.inf
    f = np.full(slots, inf)  # f[j]: the best largest time of stages 0..s covering positions [0, j)
    f[0] = 0.0
    for s in range(count):
        g = np.full(slots, inf)
        for j in range(1, slots):
            t = stage_times(s, j)
            g[j] = np.min(np.maximum(f[:j], t))
        f = g
    return float(f[slots - 1])


def _fewest_crossings(count: int, slots: int, stage_times, limit: float, crossing: np.ndarray) -> List[int]:
    """The cut positions (indices into the candidate positions) with the fewest crossing
    values, every stage within `limit`."""
    inf = np.inf
    f = np.full(slots, inf)
    f[0] = 0.0
    back = []
    for s in range(count):
        g = np.full(slots, inf)
        arg = np.zeros(slots, np.int64)
        for j in range(1, slots):
            ok = stage_times(s, j) <= limit * (1 + 1e-12)
            cand = np.where(ok, f[:j], inf)
            i = int(np.argmin(cand))
            if np.isfinite(cand[i]):
                g[j] = cand[i] + (crossing[j] if j < slots - 1 else 0)
                arg[j] = i
        back.append(arg)
        f = g
    cuts, j = [], slots - 1
    for s in range(count - 1, 0, -1):
        j = int(back[s][j])
        cuts.append(j)
    return cuts[::-1]
