"""A model split across two GPUs: plain ORT's tokens, each stage on its own device with
its own ledger, and the builder layout's decode steps replayed per stage. Skipped with
the reason where fewer than two CUDA devices exist."""
import functools

import numpy as np
import pytest

from onnx_offload import OffloadSession, _core
from onnx_offload.models import weight_bytes
from onnx_offload.models.decoder import decoder_lm

from conftest import reference_greedy

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"


@functools.lru_cache(maxsize=None)
def _second_device() -> str:
    try:
        _core.make_cuda_backend(1)
    except Exception as e:  # noqa: BLE001 - any failure means no second device to use
        return f"no second CUDA device: {e}"
    return ""


@pytest.fixture(autouse=True)
def two_gpus():
    why = _second_device()
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("layout", ["gqa", "standard"])
@pytest.mark.parametrize("weights", ["resident", "streamed"])
def test_two_gpus_give_plain_ort_s_tokens(layout, weights):
    m = decoder_lm(layout, layers=4, hidden=256, heads=8, kv_heads=2, intermediate=512, vocab=512, max_length=512,
                   dtype=np.float16)
    ids = np.random.default_rng(1).integers(0, 512, (1, 9))
    want = reference_greedy(m, ids, 16, providers=[CUDA])
    kw = dict(offload=True, vmm=True, weight_bytes=[weight_bytes(m) // 6] * 2) if weights == "streamed" else {}
    with OffloadSession(m.SerializeToString(), providers=[CUDA], devices=[0, 1], vram_limit="2GiB", **kw) as s:
        assert [stage.device.backend.device for stage in s.stages] == [0, 1]
        np.testing.assert_array_equal(s.generate(ids, 16), want)
        st = s.stats()
        assert s.moved_bytes > 0
        if weights == "streamed":
            assert all(d.counters.htod_bytes > 0 for d in st.stages)
    assert all(f.committed == 0 for f in s.close())
