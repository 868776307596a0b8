"""The residency timeline, drawn with matplotlib (the optional extra ``[plot]``).

Top panel: one row per weight, in the order the model first uses them, one column per
segment acquire; each cell says whether the weight was resident (a hit), paged in to
stay (into the weights zone) or streamed through the transient zone (bypassed), or
absent. Bottom panel: every zone's committed bytes at each column, stacked, against
the budget.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

STATES = ("absent", "resident (hit)", "paged in", "bypassed (transient)")
COLORS = ("#ebebeb", "#1f77b4", "#2ca02c", "#ff7f0e")
ZONE_COLORS = {"weights": "#1f77b4", "kv": "#9467bd", "scratch": "#8c564b", "transient": "#ff7f0e"}
INSTALL = "pip install 'onnx-offload[plot]' (matplotlib)"


def states(timeline: Sequence[bytes]) -> np.ndarray:
    """weights x columns of indices into STATES: the residency manager records 0 (evicted),
    1 (in the weights zone) or 2 (in the transient zone); a weight in the weights zone
    that was not there a column before was paged in."""
    raw = np.frombuffer(b"".join(timeline), dtype=np.uint8).reshape(len(timeline), -1).T
    out = np.zeros(raw.shape, np.uint8)
    out[raw == 2] = 3
    resident = raw == 1
    before = np.concatenate([np.zeros((raw.shape[0], 1), bool), resident[:, :-1]], axis=1)
    out[resident & before] = 1
    out[resident & ~before] = 2
    return out


def residency_png(path: str, timeline: Sequence[bytes], zones: Sequence[Dict[str, int]] = (), *, budget: int = 0,
                  title: str = "") -> str:
    """Draws the timeline to `path` (PNG); returns the path."""
    if not timeline:
        raise ValueError("the timeline is empty: create the session with record_timeline=True and run it "
                         "(the streaming engine's steps are one graph each and record no timeline)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError(f"drawing the residency timeline needs matplotlib: {INSTALL}") from None
    grid = states(timeline)
    panels = 2 if zones else 1
    fig, axes = plt.subplots(panels, 1, figsize=(10, 7 if zones else 4.5), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2][:panels]}, sharex=True)
    ax = axes[0][0]
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(COLORS), vmin=0,
              vmax=len(STATES) - 1, extent=(-0.5, grid.shape[1] - 0.5, grid.shape[0] - 0.5, -0.5))
    ax.set_ylabel("weight (by first use)")
    ax.legend(handles=[Patch(color=c, label=s) for c, s in zip(COLORS, STATES)], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_title(title or "residency timeline")
    if zones:
        bx = axes[1][0]
        x = np.arange(len(zones))
        names: List[str] = [z for z in ZONE_COLORS if any(z in row for row in zones)]
        values = np.array([[row.get(z, 0) for row in zones] for z in names], dtype=np.float64) / 2**20
        bx.stackplot(x, values, labels=names, colors=[ZONE_COLORS[z] for z in names], step="mid")
        if budget:
            bx.axhline(budget / 2**20, color="black", linestyle="--", linewidth=1, label="budget")
        bx.set_ylabel("committed MiB")
        bx.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    axes[-1][0].set_xlabel("segment acquire (steps run left to right)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
