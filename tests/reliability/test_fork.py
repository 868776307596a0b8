"""os.fork() after a split session: the child's run() and close() neither hang nor
corrupt anything (they work, or raise a StateError that mentions the fork), and the
parent's session still runs.

The whole scenario runs in a child process; the forked grandchild reports through a
pipe and is killed if it outlives its timer."""
import sys

import pytest

CHILD_TIMEOUT = 20.0


def _attempt(fn) -> dict:
    from onnx_offload import StateError
    try:
        return dict(ok=True, value=fn())
    except StateError as e:
        return dict(ok=False, clear="fork" in str(e).lower(), error=f"StateError: {e}")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        return dict(ok=False, clear=False, error=f"{type(e).__name__}: {e}")


def child_fork(h, warm: bool) -> dict:
    import json
    import os
    import signal
    import time
    s = h.open_session(split=True, policy="lru")
    workdir = s._workdir
    if warm:
        s.run(None, h.feed(0))
    h.reference(5)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forked child: report and leave without running the parent's atexit hooks
        os.close(read_fd)
        try:
            run = _attempt(lambda: h.outputs_match(s.run(None, h.feed(5)), 5))
            close = _attempt(lambda: getattr(s.close(), "committed", None))
            os.write(write_fd, json.dumps(dict(run=run, close=close)).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + CHILD_TIMEOUT
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with os.fdopen(read_fd, "rb") as f:
        report = f.read().decode()
    res = dict(hung=status is None, signal=os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else 0,
               child=json.loads(report) if report else None, workdir_kept=os.path.isdir(workdir))
    res["parent_correct"] = all(h.outputs_match(s.run(None, h.feed(seed)), seed) for seed in (5, 6, 7))
    res["parent_committed"] = s.close().committed
    return res


@pytest.mark.parametrize("warm", [False, True], ids=["fork-before-a-step", "fork-after-a-step"])
def test_a_forked_child_neither_hangs_nor_corrupts(child, warm):
    res = child(__file__, str(int(warm)), timeout=60).data
    assert not res["hung"], "run() or close() in the forked child hung"
    assert res["signal"] == 0, f"the forked child died of signal {res['signal']}"
    assert res["child"] is not None, "the forked child reported nothing"
    for what in ("run", "close"):
        r = res["child"][what]
        if r["ok"]:
            if what == "run":
                assert r["value"] is True, "run() in the forked child gave a wrong output"
            else:
                # None: the child owned no device memory to release
                assert r["value"] in (0, None), "close() in the forked child left committed bytes"
        else:
            assert r["clear"], f"{what}() in the forked child: {r['error']} (expected a StateError naming the fork)"
    assert res["workdir_kept"], "the forked child removed the parent's session folder"
    assert res["parent_correct"], "the parent's session gave wrong outputs after the fork"
    assert res["parent_committed"] == 0


if __name__ == "__main__":
    import conftest as h  # this folder's: the script's folder leads sys.path
    h.emit(child_fork(h, sys.argv[1] == "1"))
