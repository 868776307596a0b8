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
