"""Eight threads share one session: every output is right, and close() leaves nothing.

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


if __name__ == "__main__":
    import conftest as h  # this folder's: the script's folder leads sys.path
    h.emit(child_threads(h, sys.argv[1] == "split", sys.argv[2]))
