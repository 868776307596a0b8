"""The hostile-use scenarios of the reliability bench: calls and models a user may give
that the session must answer right or refuse by name.

- ``hostile_calls``: a right-padded prompt, ``__init__`` run twice on one session, an
  invalid environment variable that a keyword overrides, a zone larger than the address
  space, a reserve larger than the device, a deeply nested ``genai_config.json``;
- ``hostile_models``: an initializer named twice (refused), a big-endian input, an fp16 Gemm chain
  split before its first weight, a session under ``ulimit -v``;
- ``hostile_stats``: ``stats()`` from another thread while ``generate()`` makes room in
  the budget (a deadlock is a hang, caught by the parent's timeout);
- ``hostile_members``: ``get_inputs()`` and ``get_outputs()`` from another thread while
  ``generate()`` moves the weights from resident to segments.

Each is a child of ``python -m onnx_offload.tools.reliability`` returning the counts of
``reliability_rig.result``: a wrong answer, a refusal of a valid call, or an error of the
wrong type is a wrong output; a file descriptor or memfd left behind is a leak. They use
only the public API, so they run against any version of the package.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from typing import Callable, List

import numpy as np

from .reliability_rig import package_parent, result

CPU = ["CPUExecutionProvider"]


class _Tally:
    def __init__(self):
        self.attempts = self.clear = self.wrong = self.leaks = 0

    def refused(self, fn: Callable, want: tuple) -> None:
        """`fn` must raise one of `want`."""
        self.attempts += 1
        try:
            fn()
        except want:
            self.clear += 1
        except Exception:  # noqa: BLE001 - the wrong type
            self.wrong += 1
        else:
            self.wrong += 1

    def right(self, fn: Callable[[], bool]) -> None:
        """`fn` must run and return True."""
        self.attempts += 1
        try:
            self.wrong += not fn()
        except Exception:  # noqa: BLE001 - a valid call refused
            self.wrong += 1

    def result(self) -> dict:
        return result(self.attempts, self.clear, self.wrong, self.leaks)


def _decoder_folder(config: dict = None) -> str:
    from ..models.decoder import decoder_lm, save_decoder
    folder = tempfile.mkdtemp(prefix="hostile-")
    save_decoder(decoder_lm("gqa", max_length=64), folder, config=config)
    return os.path.join(folder, "model.onnx")


def hostile_calls() -> dict:
    from ..errors import BudgetExceeded, UnsupportedModel
    from ..models import mlp_stack
    from ..session import OffloadSession
    t = _Tally()
    path = _decoder_folder()
    s = OffloadSession(path, providers=CPU, offload=True, vmm=True)
    ids = np.array([[5, 6, 7]])
    t.refused(lambda: s.generate(ids, 3, attention_mask=np.array([[1, 1, 0]])), (ValueError,))
    t.right(lambda: s.generate(ids, 3).shape == (1, 6))
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        s.__init__(path, providers=CPU, offload=True, vmm=True)
    s.close()
    t.attempts += 1
    t.leaks += len(os.listdir("/proc/self/fd")) > fds
    m = mlp_stack(layers=3, hidden=256, batch=4).SerializeToString()
    os.environ["ONNX_GENAI_VRAM_LIMIT"] = "garbage"
    try:
        t.right(lambda: OffloadSession(m, providers=CPU, vram_limit="64MiB").close().committed == 0)
    finally:
        del os.environ["ONNX_GENAI_VRAM_LIMIT"]
    t.refused(lambda: OffloadSession(m, providers=CPU, zone_va_bytes=2**62), (ValueError,))
    t.refused(lambda: OffloadSession(m, providers=CPU, vram_limit="64MiB", kv_bytes=10**15), (BudgetExceeded,))
    deep = os.path.join(os.path.dirname(_decoder_folder()), "genai_config.json")
    with open(deep, "w") as f:
        f.write("[" * 100000 + "]" * 100000)
    try:
        with OffloadSession(os.path.join(os.path.dirname(deep), "model.onnx"), providers=CPU) as d:
            t.refused(lambda: d.generate(ids, 2), (UnsupportedModel, ValueError))
    except RecursionError:
        t.attempts += 1
        t.wrong += 1
    return t.result()


def hostile_models() -> dict:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from ..errors import CorruptModel
    from ..models import mlp_stack
    from ..models.generators import build_model
    from ..session import OffloadSession
    t = _Tally()
    rng = np.random.default_rng(0)

    def w(name, shape, dtype=np.float32):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(dtype), name)

    def agrees(model, feeds, **kw) -> bool:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        data = model if isinstance(model, bytes) else model.SerializeToString()
        want = ort.InferenceSession(data, so, providers=CPU).run(None, {k: v.astype(v.dtype.newbyteorder("="))
                                                                       for k, v in feeds.items()})
        with OffloadSession(data, so, providers=CPU, offload=True, vram_limit="64MiB", **kw) as s:
            return all(np.allclose(g, x, rtol=1e-4, atol=1e-4) for g, x in zip(s.run(None, feeds), want))

    x256 = rng.standard_normal((4, 256)).astype(np.float32)
    twice = build_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 256])],
                        [w("w", (256, 256)), w("w", (256, 256))], "twice")
    mlp = mlp_stack(layers=4, hidden=256, batch=4)
    nodes, inits, prev = [], [], "x"
    for i in range(3):
        inits += [w(f"w{i}", (64, 64), np.float16), w(f"b{i}", (64,), np.float16)]
        nodes.append(helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [f"h{i}"]))
        prev = f"h{i}"
    fp16 = build_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 64])],
                       [helper.make_tensor_value_info(prev, TensorProto.FLOAT16, [4, 64])], inits, "fp16")
    x16 = rng.standard_normal((4, 64)).astype(np.float16)
    for vmm in (True, False):  # refused: ORT takes the first or the last, by where the data is stored
        t.refused(lambda: OffloadSession(twice.SerializeToString(), providers=CPU, offload=True, vmm=vmm,
                                         weight_bytes="128KiB"), (CorruptModel,))
        t.right(lambda: agrees(mlp, {"x": x256.astype(">f4")}, vmm=vmm, weight_bytes=300000))
        t.right(lambda: agrees(fp16, {"x": x16}, vmm=vmm, weight_bytes=20000, segment_bytes=1))
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
            "import numpy as np\nfrom onnx_offload import OffloadSession\nfrom onnx_offload.models import mlp_stack\n"
            "m = mlp_stack(layers=3, hidden=256, batch=4).SerializeToString()\n"
            "with OffloadSession(m, providers=['CPUExecutionProvider'], offload=True, weight_bytes=300000) as s:\n"
            "    s.run(None, {'x': np.ones((4, 256), np.float32)})\nprint('ran')\n")
    t.right(lambda: "ran" in subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                            cwd=package_parent(), timeout=60).stdout)
    return t.result()


def hostile_stats(seconds: str = "10") -> dict:
    """generate() under budget pressure while another thread polls stats()."""
    import time

    import onnxruntime as ort

    from ..models import weight_bytes
    from ..models.decoder import decoder_lm
    from ..session import OffloadSession
    model = decoder_lm("gqa", max_length=256)
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = OffloadSession(model.SerializeToString(), so, providers=CPU, offload=True, vmm=True,
                       vram_limit=int(weight_bytes(model) * 0.9), scratch_bytes=64 << 10, host_granularity=4096)
    done, polls, errors = threading.Event(), [0], []

    def poll():
        while not done.is_set():
            try:
                s.stats()
            except Exception as e:  # noqa: BLE001 - counted below
                errors.append(e)
                return
            polls[0] += 1

    poller = threading.Thread(target=poll)
    poller.start()
    tokens: dict = {}
    rounds = differ = 0
    try:
        end = time.monotonic() + float(seconds)
        while time.monotonic() < end:
            batch = 1 + rounds % 3
            got = s.generate(np.random.default_rng(batch).integers(0, 97, (batch, 6)), 2).tolist()
            differ += tokens.setdefault(batch, got) != got
            rounds += 1
    finally:
        done.set()
        poller.join()
    final = s.close()
    return result(rounds, 0, differ + len(errors), int(final.committed != 0), polls=polls[0])


def hostile_members(rounds: str = "6") -> dict:
    """generate() moves a session from resident weights to segments (its KV cache outgrew
    the budget) while another thread asks get_inputs() and get_outputs() without the
    session's lock, as ORT's members take none. Each round is a new session, so each
    makes the move once; the asking thread must see the runner in force or wait for the
    new one, never a closed session. An error, a wrong list or a round that did not move
    is a wrong output."""
    import re
    import warnings

    from ..errors import BudgetExceeded
    from ..models.decoder import decoder_lm
    from ..session import OffloadSession
    model = decoder_lm("gqa", max_length=256).SerializeToString()

    def make(**kw):
        return OffloadSession(model, providers=CPU, host_granularity=4096, **kw)
    try:
        make(offload=False, vram_limit=4096)
        return result(1, 0, 1, 0, errors=["a budget of 4096 bytes ran every weight resident"])
    except BudgetExceeded as e:
        least = int(re.search(r"is [^(]+\((\d+) bytes\)", str(e)).group(1))
    ids = np.random.default_rng(0).integers(0, 97, (2, 6))
    errors: List[str] = []
    asked, moved, leaks = [0], 0, 0
    for _ in range(int(rounds)):
        s = make(offload=True, vmm=True, vram_limit=least)
        done = threading.Event()

        def ask():
            while not done.is_set():
                try:
                    names = [i.name for i in s.get_inputs()] + [o.name for o in s.get_outputs()]
                except Exception as e:  # noqa: BLE001 - counted below
                    errors.append(f"{type(e).__name__}: {e}")
                    return
                if "input_ids" not in names or "logits" not in names:
                    errors.append(f"members listed {names}")
                    return
                asked[0] += 1

        asker = threading.Thread(target=ask)
        asker.start()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the move's warning is the generate tests'
                s.generate(ids, 24)
        finally:
            done.set()
            asker.join()
        moved += len(s.segments) > 1
        leaks += int(s.close().committed != 0)
    return result(int(rounds), 0, len(errors) + int(rounds) - moved, leaks, errors=errors[:5], asked=asked[0],
                  moved=moved)


CHILDREN: List[Callable[..., dict]] = [hostile_calls, hostile_models, hostile_stats, hostile_members]

SCENARIOS = [
    ("hostile: calls", "hostile_calls", (), 90),
    ("hostile: models", "hostile_models", (), 90),
    ("hostile: stats() while generate() makes room", "hostile_stats", ("10",), 60),
    ("hostile: get_inputs() while generate() moves to segments", "hostile_members", ("6",), 120),
]

