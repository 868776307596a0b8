"""A closed session gives back its native threads and file descriptors at close(), not at GC."""
import gc
import os
import time

import numpy as np
import pytest

from onnx_offload import OffloadSession, StateError, _core
from onnx_offload.models import mlp_stack, weight_bytes

CPU = ["CPUExecutionProvider"]
SESSIONS = 30


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def threads_settled(limit: int, timeout: float = 5.0) -> int:
    """The thread count once it is at most `limit`, or after `timeout` seconds.

    pthread_join returns when the kernel clears the thread's tid, which is before the task
    leaves /proc/self/task, so a joined thread can still be listed for a moment.
    """
    deadline = time.monotonic() + timeout
    while (n := native_threads()) > limit and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def steady_threads() -> int:
    """The thread count once it has held for 50 ms: a thread an earlier test joined may still be listed."""
    last, since = native_threads(), time.monotonic()
    while time.monotonic() - since < 0.05:
        time.sleep(0.01)
        if (n := native_threads()) != last:
            last, since = n, time.monotonic()
    return last


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_closed_sessions_release_threads_and_fds():
    model = mlp_stack(layers=4, hidden=1024, batch=4)
    data = model.SerializeToString()
    half = weight_bytes(model) // 2
    x = np.random.default_rng(0).standard_normal((4, 1024)).astype(np.float32)

    def one_session():
        s = OffloadSession(data, providers=CPU, offload=True, vmm=True, vram_limit="256MiB", weight_bytes=half)
        s.run(None, {"x": x})
        s.close()
        return s

    # A first session warms up whatever ORT and the allocator create once per process.
    warm = one_session()
    gc.collect()
    threads0, fds0 = steady_threads(), open_fds()
    kept = [one_session() for _ in range(SESSIONS)]  # still referenced: close() alone must release
    extra = threads_settled(threads0) - threads0
    assert extra <= 0, f"{extra} threads outlive {SESSIONS} closed sessions"
    assert open_fds() - fds0 <= 0, f"{open_fds() - fds0} fds outlive {SESSIONS} closed sessions"
    del kept, warm


def test_closed_stream_refuses_work_and_its_events_still_answer():
    backend = _core.make_host_backend(64 << 10)
    threads0 = steady_threads()
    s = backend.create_stream()
    assert native_threads() == threads0 + 1
    e = backend.create_event()
    backend.enqueue_delay(s, 20)
    e.record(s)
    s.close()  # drains the queue: the delay and the record run before the worker ends
    assert threads_settled(threads0) == threads0
    assert e.query()
    e.synchronize()
    s.close()  # idempotent
    with pytest.raises(StateError, match="closed"):
        e.record(s)
    with pytest.raises(StateError, match="closed"):
        s.synchronize()
    with pytest.raises(StateError, match="closed"):
        backend.fill(0, 0, 0, s)
    with pytest.raises(StateError, match="closed"):
        e.wait_on(s)
    assert not s.is_capturing()


def test_closed_device_streams_are_closed():
    model = mlp_stack(layers=2, hidden=256, batch=4)
    s = OffloadSession(model.SerializeToString(), providers=CPU, offload=True, vmm=True, vram_limit="256MiB")
    dev = s._device
    s.close()
    with pytest.raises(StateError, match="closed"):
        dev.compute_stream.synchronize()
    with pytest.raises(StateError, match="closed"):
        dev.copy_stream.synchronize()


def test_a_forked_child_drops_its_parents_session_and_makes_its_own():
    """The child cannot use the parent's session (StateError); dropping it must not free
    it there, where ORT's thread pools and the stream workers it would wait for do not
    exist. The child then runs a session of its own, and the parent runs on."""
    import signal
    import warnings
    from onnx_offload.models.decoder import decoder_lm
    model = decoder_lm("standard", max_length=64).SerializeToString()
    ids = np.arange(4)[None]

    def make():
        return OffloadSession(model, providers=CPU, vram_limit="64MiB", host_granularity=4096)
    s = make()
    want = s.generate(ids, 4)
    time.sleep(0.3)  # ORT's pool threads stop spinning and wait on their condition variables
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running: this test's point
        pid = os.fork()
    if pid == 0:  # 0: as it should be; 1: the parent's session was usable; 2: anything else
        code = 2
        try:
            try:  # not even its counters: a lock of the arena's may be held for good here
                s.stats()
                os._exit(3)
            except StateError:
                pass
            try:
                s.generate(ids, 4)
                code = 1
            except StateError:
                s = None  # dropped
                gc.collect()
                with make() as own:
                    code = 0 if np.array_equal(own.generate(ids, 4), want) else 2
        finally:
            os._exit(code)  # onnxruntime, once imported, hangs a forked child's normal exit
    deadline, status = time.monotonic() + 30, None
    while status is None and time.monotonic() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        status = st if done else None
        time.sleep(0.02)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert status is not None, "the child hung"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    np.testing.assert_array_equal(s.generate(ids, 4), want)
    assert s.close().committed == 0


def memfds() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def test_init_again_on_a_live_session_closes_what_the_first_made():
    """As ORT's InferenceSession.__init__ run again drops the session it had: the second
    __init__ closes what the first made (memory, streams, threads, fds, the session's
    folder), then builds; what it built runs, and close() gives every byte back."""
    from onnx_offload.loading.workdir import _owned
    model = mlp_stack(layers=4, hidden=256, batch=4)
    data = model.SerializeToString()
    kw = dict(providers=CPU, offload=True, vmm=True, vram_limit="256MiB", weight_bytes=weight_bytes(model) // 2)
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    want = OffloadSession(data, **kw).run(None, {"x": x})
    gc.collect()
    threads0, fds0, memfds0, folders0 = steady_threads(), open_fds(), memfds(), len(_owned)
    for _ in range(10):
        s = OffloadSession(data, **kw)
        first = s._device
        s.__init__(data, **kw)
        assert first.closed and s._device is not first
        np.testing.assert_allclose(s.run(None, {"x": x})[0], want[0], rtol=1e-6)
        assert s.close().committed == 0
    assert memfds() - memfds0 <= 0, f"{memfds() - memfds0} memfds outlive the sessions"
    assert len(_owned) == folders0, f"{len(_owned) - folders0} session folders outlive the sessions"
    assert threads_settled(threads0) - threads0 <= 0, "threads outlive the sessions"
    assert open_fds() - fds0 <= 0, f"{open_fds() - fds0} fds outlive the sessions"
