"""Eight threads share one session: every output is right, and close() leaves nothing.
A thread that reads stats() while generate() makes room in the budget neither blocks nor
is blocked, and one that asks get_inputs() while generate() moves the weights to
segments sees the session open.

Runs in a child process: a race may crash or deadlock it."""
import os
import sys

import pytest

THREADS, STEPS = 8, 20


def child_threads(h, split: bool, policy: str) -> dict:
    import threading
    s = h.open_session(split=split, policy=policy)
    workdir = s._workdir
    wrong, errors = [], []
    start = threading.Barrier(THREADS)

    def worker(t: int):
        start.wait()
        for step in range(STEPS):
            seed = 1000 + t  # each thread its own input
            try:
                got = s.run(None, h.feed(seed))
            except Exception as e:  # noqa: BLE001 - reported to the parent
                errors.append(f"thread {t} step {step}: {type(e).__name__}: {e}")
                continue
            if not h.outputs_match(got, seed):
                wrong.append(f"thread {t} step {step}")

    for t in range(THREADS):
        h.reference(1000 + t)  # the references first, outside the race
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    from onnx_offload.stats import invariant_violations
    invariants = invariant_violations(s.stats().arena)
    final = s.close()
    return dict(wrong=wrong, errors=errors[:10], n_errors=len(errors), invariants=invariants,
                committed=final.committed, workdir_left=os.path.exists(workdir))


@pytest.mark.parametrize("split,policy", [(True, "planned"), (True, "lru"), (False, "planned")],
                         ids=["split-planned", "split-lru", "whole"])
def test_eight_threads_on_one_session(child, split, policy):
    res = child(__file__, "split" if split else "whole", policy, timeout=60).data
    assert res["n_errors"] == 0, res["errors"]
    assert res["wrong"] == [], f"{len(res['wrong'])} wrong outputs, e.g. {res['wrong'][:5]}"
    assert res["invariants"] == {}
    assert res["committed"] == 0
    assert not res["workdir_left"], "close() left the session's folder"


def child_stats_while_generating(h) -> dict:
    """generate() under budget pressure while another thread polls stats(). Each batch size
    wants a KV cache of its own size, which the ledger takes from the weights through
    their reclaimer; ORT runs on this thread alone and does not spin, so the poller is
    the thread that holds the GIL while the core makes room."""
    import faulthandler
    import threading
    import time

    import numpy as np
    import onnxruntime as ort

    from onnx_offload import OffloadSession
    from onnx_offload.models import weight_bytes
    from onnx_offload.models.decoder import decoder_lm
    faulthandler.dump_traceback_later(POLL_TIMEOUT - 15, exit=True)  # a hang shows every thread's stack
    model = decoder_lm("gqa", max_length=256)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = OffloadSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"], offload=True,
                       vmm=True, vram_limit=int(weight_bytes(model) * 0.9), scratch_bytes=64 << 10,
                       host_granularity=4096)
    done = threading.Event()
    polls, errors = [0], []

    def poll():
        while not done.is_set():
            try:
                s.stats()
            except Exception as e:  # noqa: BLE001 - reported to the parent
                errors.append(f"stats: {type(e).__name__}: {e}")
                return
            polls[0] += 1

    poller = threading.Thread(target=poll)
    poller.start()
    tokens, differ, rounds = {}, [], 0
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end and s.device.ledger.snapshot().reclaims < RECLAIMS:
            batch = 1 + rounds % 3
            got = s.generate(np.random.default_rng(batch).integers(0, 97, (batch, 6)), 2).tolist()
            if tokens.setdefault(batch, got) != got:
                differ.append(f"round {rounds} (batch {batch})")
            rounds += 1
    finally:
        done.set()
        poller.join()
    reclaims = s.stats().ledger.reclaims
    final = s.close()
    return dict(errors=errors, polls=polls[0], rounds=rounds, differ=differ, reclaims=reclaims,
                committed=final.committed)


POLL_TIMEOUT = 60
RECLAIMS = 200  # times the KV cache takes room from the weights, each a chance to deadlock


def test_stats_from_another_thread_while_generate_makes_room(child):
    res = child(__file__, "stats-while-generating", timeout=POLL_TIMEOUT).data
    assert res["errors"] == []
    assert res["reclaims"] >= 10, f"the KV cache borrowed from the weights only {res['reclaims']} times"
    assert res["polls"] > 0
    assert res["differ"] == [], "greedy generation gave other tokens while stats() was read"
    assert res["committed"] == 0


def child_members_while_the_runner_switches() -> dict:
    from onnx_offload.tools.reliability_hostile import hostile_members
    return hostile_members(str(ROUNDS))


ROUNDS = 6


def test_members_without_a_lock_wait_out_a_move_to_segments(child):
    """get_inputs() and get_outputs() from another thread while generate() moves the
    weights from resident to segments: the runner in force, or the new one, never a
    closed session (the bench's scenario, run here in a child of its own)."""
    res = child(__file__, "members-while-the-runner-switches", timeout=120).data
    assert res["notes"]["moved"] == ROUNDS, "generate() did not move the weights to segments"
    assert res["notes"]["asked"] > 0
    assert res["notes"]["errors"] == [], res["notes"]["errors"]
    assert res["wrong_outputs"] == 0 and res["leaks"] == 0


def child_stats_see_whole_steps(h) -> dict:
    """All-resident steps on one thread while another reads stats() with the interpreter
    switching threads every microsecond: every read sees a whole number of steps, each
    step's accesses, hits and bytes added together with it."""
    import threading

    s = h.open_session(split=False)
    s.run(None, h.feed(1))
    per = s.stats().last_step
    done = threading.Event()
    torn, polls = [], [0]

    def poll():
        while not done.is_set():
            c = s.stats().counters
            polls[0] += 1
            if (c.accesses, c.hits, c.access_bytes) != (c.steps * per.accesses, c.steps * per.hits,
                                                         c.steps * per.access_bytes):
                torn.append((c.steps, c.accesses, c.hits, c.access_bytes))

    sys.setswitchinterval(1e-6)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for _ in range(STATS_STEPS):
            s.run(None, h.feed(1))
    finally:
        done.set()
        poller.join()
    steps = s.stats().counters.steps
    s.close()
    return dict(torn=torn[:5], n_torn=len(torn), polls=polls[0], steps=steps, per=per.accesses)


STATS_STEPS = 3000


def test_stats_read_on_another_thread_never_see_half_a_step(child):
    res = child(__file__, "stats-whole-steps", timeout=120).data
    assert res["per"] > 0 and res["steps"] == STATS_STEPS + 1
    assert res["polls"] > 100, f"stats() was read only {res['polls']} times"
    assert res["n_torn"] == 0, f"{res['n_torn']} reads saw half a step: (steps, accesses, hits, bytes) {res['torn']}"


if __name__ == "__main__":
    import conftest as h  # this folder's: the script's folder leads sys.path
    if sys.argv[1] == "members-while-the-runner-switches":
        h.emit(child_members_while_the_runner_switches())
    elif sys.argv[1] == "stats-whole-steps":
        h.emit(child_stats_see_whole_steps(h))
    elif sys.argv[1] == "stats-while-generating":
        h.emit(child_stats_while_generating(h))
    else:
        h.emit(child_threads(h, sys.argv[1] == "split", sys.argv[2]))
