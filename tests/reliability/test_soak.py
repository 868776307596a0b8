"""Soak: many evict/page-in cycles leave no committed byte, handle or descriptor behind."""
import gc
import os

import pytest

from onnx_offload.tools.reliability_rig import Churn, soak_sizes

CYCLES = 10_000


def test_arena_soak_of_ten_thousand_cycles(rig, helpers):
    fds = helpers.open_fds()
    r = rig(budget=8 * (64 << 10))
    slots = [r.slot(f"w{i}", n, seed=i) for i, n in enumerate(soak_sizes(r.g))]

    def check(page_ins, s):
        assert r.reads_back(s), f"cycle {page_ins}: {s.key} reads back wrong bytes"
        st = r.arena.stats()
        assert r.invariants() == {}, f"cycle {page_ins}"
        assert helpers.handle_leak(st) is None, f"cycle {page_ins}: {helpers.handle_leak(st)}"
        assert r.ledger.committed <= r.ledger.budget

    churn = Churn(slots, r.stream)
    churn.run(CYCLES, check)
    assert churn.page_ins == CYCLES
    assert churn.refusals > CYCLES // 10, "the budget should force evictions"
    churn.evict_all()
    assert r.ledger.snapshot().zones["weights"].committed.current == 0
    st = r.arena.stats()
    assert st.refcount_underflows == 0 and r.invariants() == {}
    del slots, churn
    r.arena.close()
    st = r.arena.stats()
    assert r.ledger.snapshot().committed == 0
    assert r.invariants() == {}
    assert helpers.handle_leak(st) is None
    assert st.live_handles == 0 and st.handles_created == st.handles_released
    del r
    gc.collect()
    assert helpers.open_fds() == fds


@pytest.mark.parametrize("vmm", [True, False], ids=["vmm", "plain"])
def test_session_soak_with_lru(helpers, vmm):
    fds = helpers.open_fds()
    s = helpers.open_session(split=True, vmm=vmm, policy="lru")
    workdir = s._workdir
    for step in range(300):
        seed = step % 7
        got = s.run(None, helpers.feed(seed))
        assert helpers.outputs_match(got, seed), f"step {step}: wrong output"
        if step % 50 == 49:
            st = s.stats()
            assert helpers.handle_leak(st.arena) is None, f"step {step}: {helpers.handle_leak(st.arena)}"
            assert st.arena.refcount_underflows == 0
            assert st.ledger.committed <= st.ledger.budget
    st = s.stats()
    assert st.counters.evictions > 100, "the soak should evict"
    from onnx_offload.stats import invariant_violations
    assert invariant_violations(st.arena) == {}
    final = s.close()
    assert final.committed == 0
    assert all(z.committed.current == 0 for z in final.zones.values())
    arena = s.stats().arena
    assert invariant_violations(arena) == {}
    assert arena.live_handles == 0 and arena.handles_created == arena.handles_released
    assert not os.path.exists(workdir)
    del s
    gc.collect()
    assert helpers.open_fds() == fds
