"""A plan that fills the card, on the CPU host backend: reserves sized to the generation
asked (not a share of the budget) keep more weights resident, a longer generation than
the one planned for plans again, and memory another process takes after the start gives
a typed error or a new plan, never a crash, and loses nothing."""
import contextlib
import gc
import weakref

import numpy as np
import onnxruntime as ort
import pytest

from onnx_offload import BudgetExceeded, OffloadSession
from onnx_offload import session as session_module
from onnx_offload.engines.ort_sessions import SessionFactory
from onnx_offload.config import BUDGET_MARGIN
from onnx_offload.generation.loop import FIRST_CONTEXT
from onnx_offload.memory import Device
from onnx_offload.memory.ort_memory import SLACK
from onnx_offload.models import weight_bytes
from onnx_offload.models.decoder import decoder_lm

from conftest import reference_greedy

CPU = ["CPUExecutionProvider"]
G = 4096


@pytest.fixture(scope="module")
def model():
    # Weights that dominate the generation's needs, as an LLM's do: 25 MB of weights beside
    # a KV cache of 8 KB a position.
    return decoder_lm("gqa", hidden=512, heads=8, kv_heads=1, intermediate=1536, vocab=512, max_length=4096)


def session(model, **kw):
    kw.setdefault("host_granularity", G)
    kw.setdefault("prefill_chunk", 64)
    return OffloadSession(model.SerializeToString(), providers=CPU, offload=True, vmm=True, **kw)


def prompt(batch, length, seed=0):
    return np.random.default_rng(seed).integers(0, 512, (batch, length))


def resident(s) -> int:
    return s.device.ledger.snapshot().zones["weights"].committed.current


def test_reserves_sized_to_the_generation_keep_more_weights_resident(model):
    ids = prompt(1, 40)
    want = reference_greedy(model, ids, 8)
    budget = weight_bytes(model) * 11 // 10
    # A reserve of an eighth of the budget for scratch, which is what a budget left to the
    # package set aside before it sized the reserves by the generation.
    with session(model, vram_limit=budget, scratch_bytes=budget // 8) as s:
        np.testing.assert_array_equal(s.generate(ids, 8), want)
        eighth = resident(s)
        assert len(s.segments) > 1  # the weights streamed
    with session(model, vram_limit=budget) as s:
        np.testing.assert_array_equal(s.generate(ids, 8), want)
        st = s.stats()
        assert resident(s) > eighth, (resident(s), eighth)
        reserves = {z: (n, how) for z, n, how in st.reserves}
        # Each reserve stated, with how it is sized: the first generation's cache and step.
        assert f"{FIRST_CONTEXT} positions" in reserves["kv"][1], reserves
        assert "largest step" in reserves["scratch"][1], reserves
        assert reserves["scratch"][0] < budget // 8
        assert st.margin == 0  # the budget was given
        assert "reserve of kv" in str(st)
        assert s.close().committed == 0


def test_a_budget_left_to_the_package_is_the_free_memory_less_the_margin(model):
    with session(model) as s:
        free = s.device.device_free
        assert s.device.budget == free - BUDGET_MARGIN["host"]
        st = s.stats()
        assert st.margin == BUDGET_MARGIN["host"] and "less a margin" in str(st)


def test_a_longer_generation_than_the_one_planned_for_plans_again_and_runs(model):
    budget = weight_bytes(model) * 11 // 10
    short, long = prompt(1, 20, 1), prompt(1, 3 * FIRST_CONTEXT, 2)
    want_short, want_long = reference_greedy(model, short, 6), reference_greedy(model, long, 6)
    with session(model, vram_limit=budget) as s:
        np.testing.assert_array_equal(s.generate(short, 6), want_short)
        kv_before = s.device.ledger.snapshot().zones["kv"].reserve
        with pytest.warns(Warning, match="KV cache needs"):
            np.testing.assert_array_equal(s.generate(long, 6), want_long)
        kv_after = s.device.ledger.snapshot().zones["kv"].reserve
        assert kv_after > kv_before, (kv_before, kv_after)
        assert any("the KV cache needs up to" in n for n in s.stats().notes), s.stats().notes
        # The shorter one again, in the plan made for the longer one.
        np.testing.assert_array_equal(s.generate(short, 6), want_short)
        assert s.close().committed == 0


def test_memory_taken_from_outside_after_the_start_is_a_typed_error_and_loses_nothing(model):
    ids = prompt(1, 30, 3)
    want = reference_greedy(model, ids, 6)
    budget = weight_bytes(model) * 11 // 10
    with session(model, vram_limit=budget) as s:
        dev = s.device
        taken = [0]

        def free_memory():
            # A device of the budget's size (and the meter's slack), of which the session
            # holds what its arena commits and pools (not the outside bytes the ledger
            # counts: those are what the device lost), and another process `taken`.
            snap = dev.ledger.snapshot()
            arena = snap.committed - sum(z.outside for z in snap.zones.values()) + snap.pooled
            return max(0, budget + SLACK - arena - taken[0])
        dev.free_memory_hook = free_memory
        np.testing.assert_array_equal(s.generate(ids, 6), want)
        # Another process takes a little: charged to scratch, which has room, and the
        # generation runs.
        taken[0] = 2 * G
        np.testing.assert_array_equal(s.generate(ids, 6), want)
        assert s.stats().outside_bytes >= 2 * G
        # It takes half of the device: no plan holds the weights beside it.
        taken[0] = budget // 2
        with pytest.raises(BudgetExceeded, match="another process"):
            s.generate(ids, 6)
        # Plain ORT in the same process runs.
        plain = ort.InferenceSession(model.SerializeToString(), providers=CPU)
        assert plain.get_inputs()
        # It gives the memory back: the session runs again, the charge given back.
        taken[0] = 0
        np.testing.assert_array_equal(s.generate(ids, 6), want)
        assert s.stats().outside_bytes == 0
        assert s.close().committed == 0


class _Played:
    """ORT's device memory as a card would show it, on the host backend: `nbytes` taken
    while any ORT session the segments made lives (its libraries' handles and
    workspaces), beside a device of the budget's size (see the test above). Installed as
    the session's Device, so that the memory is played while the first engine is made."""

    def __init__(self, monkeypatch, budget: int, nbytes: int):
        self.live = weakref.WeakSet()  # the ORT sessions the segments' factory made, while they live
        self.nbytes = nbytes
        played = self
        create = SessionFactory.create

        def counted(factory, *args, **kw):
            made = create(factory, *args, **kw)
            played.live.add(made[0])
            return made

        class PlayedDevice(Device):
            def __init__(self, kind, config):
                super().__init__(kind, config)

                def free_memory():
                    snap = self.ledger.snapshot()
                    arena = snap.committed - sum(z.outside for z in snap.zones.values()) + snap.pooled
                    return max(0, budget + SLACK - arena - (played.nbytes if len(played.live) else 0))
                self.free_memory_hook = free_memory

        monkeypatch.setattr(SessionFactory, "create", counted)
        monkeypatch.setattr(session_module, "Device", PlayedDevice)


@contextlib.contextmanager
def refcounts_only():
    """Objects freed by their reference counts alone while inside (no cycle collection)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_segments_whose_sessions_take_more_than_planned_are_planned_again_and_the_failed_ones_go(model, monkeypatch):
    ids = prompt(1, 30, 4)
    want = reference_greedy(model, ids, 6)
    budget = weight_bytes(model) * 11 // 10
    with session(model, vram_limit=budget) as s:
        snap = s.device.ledger.snapshot()
        assert len(s.segments) == 1  # every weight resident
        kv = snap.zones["kv"].reserve  # the first generation's KV cache
        room = snap.budget - snap.committed - kv - snap.zones["scratch"].reserve
    # ORT's sessions take more than the room the resident weights leave when they are made.
    nbytes = (room // G + 128) * G  # whole granules, as the meter charges
    played = _Played(monkeypatch, budget, nbytes)
    with refcounts_only(), session(model, vram_limit=budget) as s:
        notes = s.stats().notes
        assert any("planned again" in n and "for its sessions" in n for n in notes), notes
        assert len(s.segments) > 1  # the weights stream to make the room
        assert s.device.ledger.snapshot().zones["kv"].reserve == kv > 0  # the plan's KV reserve stays
        # The first plan's ORT session went when it failed: only the segments' own live.
        assert len(played.live) == len(s.segments), (len(played.live), len(s.segments))
        assert s.stats().outside_bytes == nbytes  # charged once, to the plan that holds it
        np.testing.assert_array_equal(s.generate(ids, 6), want)
        assert s.close().committed == 0


def test_segments_whose_sessions_no_plan_holds_are_a_typed_error_and_plain_ort_runs(model, monkeypatch):
    ids = prompt(1, 12, 5)
    want = reference_greedy(model, ids, 4)
    budget = weight_bytes(model) * 11 // 10
    _Played(monkeypatch, budget, budget)  # more than the budget holds beside any segment
    with pytest.raises(BudgetExceeded, match="for its own use"):
        session(model, vram_limit=budget)
    # The greedy loop on plain ORT sessions in the same process, as before.
    np.testing.assert_array_equal(reference_greedy(model, ids, 4), want)
