"""Inputs a model changes in place (window-sized caches) across a step whose graph is made:
which inputs they are, and the copy that puts them back (engines/step_state.py)."""
import numpy as np
import onnxruntime as ort

from onnx_offload.config import OffloadConfig
from onnx_offload.engines.step_state import StateCopy
from onnx_offload.loading import window_cache_inputs
from onnx_offload.memory import Device, ZonePlan
from onnx_offload.models import decoder_lm


def test_the_window_sized_caches_are_the_state():
    model = decoder_lm("gqa", layers=3, hidden=64, heads=4, kv_heads=2, window_cache=8)
    assert window_cache_inputs(model) == {f"past_key_values.{i}.{kv}" for i in (0, 2) for kv in ("key", "value")}
    assert window_cache_inputs(decoder_lm("gqa", layers=2, hidden=64)) == frozenset()


def test_the_copy_puts_the_inputs_back_and_gives_its_memory_back():
    dev = Device("host", OffloadConfig(vram_limit=64 << 20, host_granularity=64 << 10))
    dev.set_zones({z: ZonePlan(64 << 20, 0) for z in ("weights", "kv", "scratch", "transient")})
    try:
        state = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
        other = np.ones(5, np.float32)
        feeds = {"past": ort.OrtValue.ortvalue_from_numpy(state.copy()),
                 "ids": ort.OrtValue.ortvalue_from_numpy(other)}
        assert dev.scratch.stats().live_bytes == 0
        with StateCopy(dev, feeds, {"past", "absent"}) as saved:
            assert saved
            assert dev.scratch.stats().live_bytes >= state.nbytes
            view = feeds["past"].numpy()  # the CPU OrtValue's own memory
            view[...] = -1
            feeds["ids"].numpy()[...] = 7  # not state: left as the step made it
            saved.restore()
            np.testing.assert_array_equal(feeds["past"].numpy(), state)
            assert (feeds["ids"].numpy() == 7).all()
        assert dev.scratch.stats().live_bytes == 0
        with StateCopy(dev, feeds, ()) as nothing:
            assert not nothing
            nothing.restore()
    finally:
        dev.close()


class _EvictingSession:
    """Stands in for an ORT session whose Run captures a CUDA graph (which no CPU run can
    do): each run shifts the window cache by one position and appends a row, as a
    GroupQueryAttention with sliding_window_cache=1 does in place; the first run under a
    graph id runs the model twice, as ORT's Run does when it captures."""

    def __init__(self, cache: np.ndarray):
        self.cache, self.captured = cache, False

    def _once(self):
        self.cache[:-1] = self.cache[1:].copy()
        self.cache[-1] = 100  # the step's new position

    def run_with_iobinding(self, io, options):
        self._once()
        if not self.captured:  # "another run for necessary memory allocation or graph capture"
            self.captured = True
            self._once()


def test_a_first_graph_run_leaves_the_cache_as_one_run_does():
    from onnx_offload.engines.step_state import run_once_on_state
    dev = Device("host", OffloadConfig(vram_limit=64 << 20, host_granularity=64 << 10))
    dev.set_zones({z: ZonePlan(64 << 20, 0) for z in ("weights", "kv", "scratch", "transient")})
    try:
        cache = np.arange(4, dtype=np.float32)
        value = ort.OrtValue.ortvalue_from_numpy(cache)
        view = value.numpy()
        one = _EvictingSession(np.arange(4, dtype=np.float32))
        one.captured = True
        one.run_with_iobinding(None, None)  # the step once, as plain ORT's loop without graphs runs it
        session = _EvictingSession(view)
        run_once_on_state(dev, session, None, None, {"past": value}, {"past"})
        np.testing.assert_array_equal(view, one.cache)  # [1, 2, 3, 100]: one position evicted
        twice = _EvictingSession(np.arange(4, dtype=np.float32))
        twice.run_with_iobinding(None, None)
        assert not np.array_equal(twice.cache, one.cache)  # without the copy: evicted twice
        assert dev.scratch.stats().live_bytes == 0
    finally:
        dev.close()
