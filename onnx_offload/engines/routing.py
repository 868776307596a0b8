"""The segment runner's reading of a router: which experts each routed stack of a segment
reads this step, from the router's logits (``loading.experts``), before the segment's
weights are paged in. The segments are cut so that each MoE node starts one: its
router's logits come out of an earlier segment (on CUDA a copy to the host, after that
segment's run)."""
from __future__ import annotations

from typing import Dict, List, Optional

from ..loading import routed_experts


class Router:
    """The MoE nodes of each segment whose experts the residency carved one slot each."""

    def __init__(self, routing, segments, residency):
        self.residency = residency
        self.nodes: Dict[int, list] = {}
        self.notes: List[str] = []  # the MoE nodes whose experts stream whole, and why
        for node in (routing.nodes if routing is not None else ()):
            seg = next((seg for seg in segments if node.index in seg.node_indices), None)
            if seg is None or not any(stack in residency.parts for stack in node.stacks):
                continue
            if node.router not in seg.inputs:
                # Its segment computes the logits itself (no weight before the node to cut
                # at, or a value each segment computes again): known only once it has run.
                self.notes.append(f"the experts of MoE node {node.index} stream whole: its router's logits "
                                  f"({node.router!r}) are computed in the segment that reads its experts")
                continue
            self.nodes.setdefault(seg.index, []).append(node)

    def picks(self, k: int, values, feeds) -> Optional[Dict[str, List[int]]]:
        """The experts each routed stack of segment k reads this step; None for a segment
        without one."""
        if k not in self.nodes:
            return None
        out: Dict[str, List[int]] = {}
        for node in self.nodes[k]:
            logits = values[node.router] if node.router in values else feeds.get(node.router)
            if logits is None:  # an optional input left out: ORT's run says what is missing
                continue
            picked = routed_experts(logits.numpy(), node.k, node.experts)
            for stack in node.stacks:
                if stack in self.residency.parts:
                    out[stack] = picked
        return out
