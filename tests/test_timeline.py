"""The residency timeline, drawn with matplotlib: which weights were resident, paged in or
bypassed at each acquire, and the zones' committed bytes against the budget."""
import sys

import numpy as np
import pytest

from onnx_offload import OffloadSession
from onnx_offload.models import mlp_stack, weight_bytes
from onnx_offload.timeline import residency_png, states


def test_states_tell_hits_from_page_ins_and_bypasses():
    # Two weights, three acquires: 0 evicted, 1 weights zone, 2 transient zone.
    grid = states([bytes([1, 2]), bytes([1, 0]), bytes([0, 1])])
    np.testing.assert_array_equal(grid, [[2, 1, 0], [3, 0, 2]])


def test_a_streamed_session_draws_its_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    m = mlp_stack(layers=8, hidden=512, batch=2)
    x = np.ones((2, 512), np.float32)
    with OffloadSession(m.SerializeToString(), offload=True, vmm=True, host_granularity=64 << 10,
                        weight_bytes=weight_bytes(m) // 3, record_timeline=True) as s:
        for _ in range(3):
            s.run(None, {"x": x})
        res = s.residency
        assert len(res.timeline) == len(res.zone_timeline) >= 3 * len(s.segments)  # construction acquires too
        path = s.timeline_png(str(tmp_path / "t.png"))
    import matplotlib.image
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 400 and img.shape[1] > 800


def test_without_matplotlib_it_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"onnx-offload\[plot\]"):
        residency_png(str(tmp_path / "t.png"), [bytes([1])])
