"""Cleanup failures surface as OffloadWarning, on both backends: the core queues them
(it may hold the arena lock) and the binding emits them when a call returns."""
import gc
import warnings

import pytest

from conftest import make_slot, page_in
from onnx_offload import _core
from onnx_offload.errors import OffloadWarning


def test_failed_unmap_during_close_warns(rig_factory):
    rig = rig_factory()
    slot = make_slot(rig, "w", 3 * rig.g, 1, align=rig.g)
    page_in(rig, [slot])
    rig.backend.inject_failure("unmap", 1)
    with pytest.warns(OffloadWarning) as caught:
        rig.arena.close()
    # On CUDA a second warning follows: the reservation cannot be freed while still mapped.
    assert "injected failure" in str(caught[0].message)
    assert str(caught[0].message).startswith("close could not unmap or release")
    assert rig.ledger.committed == 0  # close still refunds every byte


def test_a_dropped_slot_warns_on_the_next_drain(rig_factory):
    rig = rig_factory()
    slot = make_slot(rig, "dropped", rig.g, 1, align=rig.g)
    page_in(rig, [slot])
    rig.backend.inject_failure("unmap", 1)
    del slot  # the destructor decommits, the unmap fails, and it cannot raise
    gc.collect()
    with pytest.warns(OffloadWarning, match="dropping slot 'dropped' failed.*injected failure"):
        _core.drain_warnings()


def test_under_an_error_filter_the_warning_raises_from_the_call(rig_factory):
    rig = rig_factory()
    slot = make_slot(rig, "w", rig.g, 1, align=rig.g)
    page_in(rig, [slot])
    rig.backend.inject_failure("unmap", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadWarning)
        with pytest.raises(OffloadWarning, match="injected failure"):
            rig.arena.close()
    assert rig.arena.closed  # the close itself completed
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _core.drain_warnings()  # any later warning of the close (CUDA: freeing the reservation) waited here
    with warnings.catch_warnings(record=True) as left:
        warnings.simplefilter("always")
        _core.drain_warnings()
    assert left == []
