"""On the H200, a card smaller than the model: a second process holds all of the device's
free memory but the card's, and the session is the call a user writes, its budget left to
the package. It runs on the streaming engine, a prompt longer than a chunk in chunks, and
gives plain ORT's tokens within the card."""
import numpy as np
import pytest

from onnx_offload import OffloadSession
from onnx_offload.tools.bench_cards import Card, _Peak
from onnx_offload.models import weight_bytes
from onnx_offload.models.decoder import decoder_lm, genai_config, save_decoder

from conftest import reference_greedy

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
SHAPE = dict(layers=8, hidden=2048, heads=16, kv_heads=4, intermediate=5632, vocab=32000, max_length=2048)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    model = decoder_lm("gqa", dtype=np.float16, **SHAPE)  # 0.98 GB of weights
    folder = str(tmp_path_factory.mktemp("card") / "llm")
    cfg = genai_config(SHAPE["layers"], SHAPE["hidden"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["vocab"],
                       SHAPE["max_length"], eos_token_id=-1)
    return save_decoder(model, folder, config=cfg), model


@pytest.mark.parametrize("batch", [1, 2])
def test_the_users_call_on_a_card_smaller_than_the_model(model_path, batch, tmp_path):
    path, model = model_path
    ids = np.random.default_rng(batch).integers(0, SHAPE["vocab"], (batch, 700))
    # Plain ORT with its graph optimizations and without: before the card is held.
    want = {True: reference_greedy(model, ids, 8, providers=[CUDA]),
            False: reference_greedy(model, ids, 8, providers=[CUDA], optimized=False)}
    weights = weight_bytes(model)
    card = Card(weights * 6 // 10)
    peak = None
    try:
        peak = _Peak(card.free)
        with OffloadSession(path, providers=[CUDA], offload=True, vmm=True, cache_dir=str(tmp_path / "cache"),
                            prefill_chunk=256) as s:
            got = s.generate(ids, 8)
            st = s.stats()
            # ORT's CUDA optimization pass needs the weights on the device, which this card
            # cannot hold: the session runs the model as exported, and so does plain ORT here.
            exported = any("as it was exported" in n for n in st.notes)
            np.testing.assert_array_equal(got, want[not exported])
            assert s.engine == "graph", st.notes
            assert 0 < st.last_step.htod_bytes < weights  # some weights resident, the others streamed
            assert st.ledger.budget < card.free
            # The next generations of the shape run on the kept buffers and replay the
            # graphs captured on them. (The second may capture the steps that ran before a
            # plan made during the first: those graphs went with the plan.)
            np.testing.assert_array_equal(s.generate(ids, 8), got)
            kept, made = s._parked, s._runner.captures
            np.testing.assert_array_equal(s.generate(ids, 8), got)
            assert s._parked is kept and s._runner.captures == made
            final = s.close()
        assert final.committed == 0
        assert peak.close() <= card.free
    finally:
        if peak is not None:
            peak.close()
        card.close()


def test_the_advice_of_a_budget_too_small_for_the_session_runs_a_sequence_on_cuda(model_path, tmp_path):
    """CUDA: the advice of a budget too small for the session, followed, runs the streaming
    engine and generates a prompt in chunks without a second round, plain ORT's tokens."""
    import re
    from onnx_offload import BudgetExceeded
    path, model = model_path
    ids = np.random.default_rng(3).integers(0, SHAPE["vocab"], (1, 700))
    want = {True: reference_greedy(model, ids, 8, providers=[CUDA]),
            False: reference_greedy(model, ids, 8, providers=[CUDA], optimized=False)}
    kw = dict(providers=[CUDA], offload=True, vmm=True, cache_dir=str(tmp_path / "cache"), prefill_chunk=256)
    with pytest.raises(BudgetExceeded) as e:
        OffloadSession(path, vram_limit=64 << 20, **kw)
    m = re.search(r"pass ((?:\w+=\d+(?:, )?)+)", str(e.value))
    assert m, str(e.value)
    advice = {k: int(v) for k, v in (p.split("=") for p in m.group(1).rstrip(", ").split(", "))}
    assert advice["vram_limit"] < weight_bytes(model), str(e.value)  # the weights stream
    with OffloadSession(path, **{**kw, **advice}) as s:  # the advice may name a smaller prefill_chunk
        got = s.generate(ids, 8)
        exported = any("as it was exported" in n for n in s.stats().notes)
        np.testing.assert_array_equal(got, want[not exported])
        assert s.engine == "graph", s.stats().notes
        final = s.close()
    assert final.committed == 0


def test_a_card_that_holds_the_weights_and_the_generation_keeps_every_weight_resident(model_path, tmp_path):
    """A card of the weights and 640 MiB: the budget left to the package is the free memory
    less the margin, the reserves hold the generation asked, and every weight is resident
    (no bytes streamed), within the card, plain ORT's tokens."""
    path, model = model_path
    ids = np.random.default_rng(5).integers(0, SHAPE["vocab"], (1, 512))
    want = {True: reference_greedy(model, ids, 8, providers=[CUDA]),
            False: reference_greedy(model, ids, 8, providers=[CUDA], optimized=False)}
    weights = weight_bytes(model)
    card = Card(weights + (640 << 20))
    peak = None
    try:
        peak = _Peak(card.free)
        with OffloadSession(path, providers=[CUDA], offload=True, vmm=True, cache_dir=str(tmp_path / "cache"),
                            prefill_chunk=256) as s:
            got = s.generate(ids, 8)
            np.testing.assert_array_equal(s.generate(ids, 8), got)
            st = s.stats()
            exported = any("as it was exported" in n for n in st.notes)
            np.testing.assert_array_equal(got, want[not exported])
            assert not s._runner.streaming and st.last_step.htod_bytes == 0, st
            assert st.margin > 0 and st.ledger.budget == s.device.device_free - st.margin
            final = s.close()
        assert final.committed == 0
        assert peak.close() <= card.free
    finally:
        if peak is not None:
            peak.close()
        card.close()
