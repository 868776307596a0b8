"""The command line's arguments: the argparse types, the configuration flags (and how an
error's advice names them), the device a command runs on, and the files and ids the
arguments name (feeds, prompt ids, the tokenizer), read and checked before any weight loads.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import re

import numpy as np

from ..config import (ENV_HOST_COMPUTE, ENV_CACHE_DIR, ENV_CUDA_GRAPH, ENV_DEVICE_BYTES, ENV_ENGINE, ENV_EXPERTS, ENV_OFFLOAD,
                      ENV_POLICY, ENV_VMM, ENV_VRAM_LIMIT, env_is_set)
from ..errors import OffloadError, UnsupportedModel
from ..loading import config_problem, open_regular, read_config
from ..memory import cuda_available


def device_kind(args) -> str:
    """'cuda' where a GPU and ORT's CUDA provider are there (and --cpu is not given), else 'host'."""
    if getattr(args, "cpu", False):
        return "host"
    ok, _ = cuda_available()
    if ok:
        import onnxruntime as ort
        if "CUDAExecutionProvider" in ort.get_available_providers():
            return "cuda"
    return "host"


def provider(kind: str) -> str:
    """ORT's execution provider for a device kind."""
    return "CUDAExecutionProvider" if kind == "cuda" else "CPUExecutionProvider"


def make_feeds(inputs, seed: int = 0):
    """Random feeds from the model's input shapes; dynamic dimensions become 1."""
    from ..engines import numpy_dtype
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in inputs:
        try:
            dtype = numpy_dtype(i.type)
        except OffloadError:
            raise OffloadError(f"cannot generate a feed for input {i.name!r} of type {i.type}: "
                               f"pass --inputs") from None
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
        if np.issubdtype(dtype, np.floating):
            feeds[i.name] = (rng.standard_normal(shape) * 0.1).astype(dtype)
        else:
            feeds[i.name] = rng.integers(0, 2, shape).astype(dtype)
    return feeds


# (flag attribute, OffloadConfig field, the variable the flag overrides, the command's
# default where neither the flag nor the variable is given)
_CONFIG_FLAGS = (
    ("vram_limit", "vram_limit", ENV_VRAM_LIMIT, None),
    ("weight_bytes", "weight_bytes", ENV_DEVICE_BYTES, None),
    ("policy", "policy", ENV_POLICY, None),
    ("offload", "offload", ENV_OFFLOAD, True),
    ("vmm", "vmm", ENV_VMM, True),
    ("cuda_graph", "cuda_graph", ENV_CUDA_GRAPH, None),
    ("cache_dir", "cache_dir", ENV_CACHE_DIR, None),
    ("kv_bytes", "kv_bytes", None, None),
    ("scratch_bytes", "scratch_bytes", None, None),
    ("prefill_chunk", "prefill_chunk", None, None),
    ("engine", "engine", ENV_ENGINE, None),
    ("experts", "experts", ENV_EXPERTS, None),
    ("host_compute", "host_compute", ENV_HOST_COMPUTE, None),
)

# The configuration's keywords as this command's flags, for the advice an error gives.
_FLAG_OF = {"vram_limit": "--vram-limit", "weight_bytes": "--weight-bytes", "kv_bytes": "--kv-bytes",
            "scratch_bytes": "--scratch-bytes", "prefill_chunk": "--prefill-chunk", "engine": "--engine",
            "experts": "--experts", "host_compute": "--host-compute"}
_KEYWORD = re.compile(r"\b(" + "|".join(_FLAG_OF) + r")='?(\w+)'?")
_KEYWORD_LIST = re.compile(r"\b(" + "|".join(_FLAG_OF) + r")=\[((?:'?\w+'?(?:, )?)+)\]")


# The budget flags that take one value per device with --devices (StagedSession's lists).
PER_DEVICE_FLAGS = ("vram_limit", "weight_bytes", "kv_bytes", "scratch_bytes")
ZERO_OK = ("kv_bytes", "scratch_bytes")  # reserves, which the API takes as 0 too
# A staged session's advice names one device's entry of such a list (devices.generation).
DEVICE_ENTRY = re.compile(r"\b(" + "|".join(PER_DEVICE_FLAGS) + r")=(\w+) for device (\d+) "
                           r"\(its entry in a list of one value per device\)")


def per_device(value, devices: list) -> list:
    """A budget flag's value as one entry per device: its list, or the one value for each."""
    return list(value) if isinstance(value, list) else [value] * len(devices)


def flag_list(flag: str, entries: list) -> str:
    """A budget flag with one value per device, as this command takes it (auto: none given)."""
    return f"{_FLAG_OF[flag]} {','.join('auto' if e is None else str(e) for e in entries)}"


def as_flags(message: str, args=None) -> str:
    """An error's advice in this command's terms: `kv_bytes=N` becomes `--kv-bytes N`,
    `offload=True` becomes `--offload`. With --devices, one device's entry becomes the
    flag's whole list, that entry changed and the others as given (auto where none was)."""
    devices = getattr(args, "devices", None)
    if devices:
        def whole(m) -> str:
            attr, value, device = m.group(1), m.group(2), int(m.group(3))
            entries = per_device(getattr(args, attr, None), devices)
            if device in devices:
                entries[devices.index(device)] = value
            return flag_list(attr, entries)
        message = DEVICE_ENTRY.sub(whole, message)
    # A staged session's advice names a whole list of one value per device.
    message = _KEYWORD_LIST.sub(lambda m: f"{_FLAG_OF[m.group(1)]} {_entries(m.group(2))}", message)
    message = _KEYWORD.sub(lambda m: f"{_FLAG_OF[m.group(1)]} {m.group(2)}", message)
    message = message.replace("offload=True", "--offload")
    # Flags one after another, as a shell line takes them: a comma after a flag's value
    # would join the next flag's to it ("--vram-limit 1, --kv-bytes 2" is a list of values).
    while True:
        joined = _FLAG_THEN_FLAG.sub(r"\1 ", message)
        if joined == message:
            return message
        message = joined


def _entries(listed: str) -> str:
    """A Python list's entries ("1, None, '2MiB'") as a flag's value takes them: "1,auto,2MiB"."""
    return ",".join("auto" if v == "None" else v.strip("'") for v in listed.split(", "))


# A flag and its value (a list of one value per device included), then ", " and a flag.
_FLAG_THEN_FLAG = re.compile(r"(--[\w-]+ [^\s,]+(?:,[^\s,]+)*), (?=--[\w-])")


def config_kwargs(args) -> dict:
    """The configuration the user asked for: the flags given win, then the environment,
    then the command's own defaults (offload with stable addresses)."""
    kw = {"devices": args.devices} if getattr(args, "devices", None) else {}
    for attr, field, env, default in _CONFIG_FLAGS:
        value = getattr(args, attr, None)
        if value is not None:
            kw[field] = value
        elif default is not None and not env_is_set(env):
            kw[field] = default
    return kw


def check_config_flags(args) -> None:
    """The budget flags, parsed before any weight loads (their errors name the flag). With
    --devices, each may be a comma-separated list of one value per device, in their order
    (auto: the package's own for that device), which becomes the session's list."""
    from ..config import parse_bytes, parse_vram_limit
    for attr in PER_DEVICE_FLAGS:
        text, flag = getattr(args, attr, None), "--" + attr.replace("_", "-")
        if attr == "vram_limit":
            parse = parse_vram_limit
        else:  # a reserve (kv, scratch) may be 0, as the API's kv_bytes default is
            parse = functools.partial(parse_bytes, zero=attr in ZERO_OK)
        if text is None:
            continue
        if "," not in text:
            value = parse(text, flag)
            # As parsed, so that advice naming the flag's value repeats it whole ("auto"
            # stays the word: given, it overrides the environment).
            setattr(args, attr, text.strip() if value is None else value)
            continue
        devices = getattr(args, "devices", None)
        entries = [t.strip() for t in text.split(",")]
        if not devices:
            raise ValueError(f"{flag} {text!r}: a list of values (one per device) needs --devices")
        if len(entries) != len(devices):
            raise ValueError(f"{flag} {text!r} gives {len(entries)} values for the {len(devices)} devices of "
                             f"--devices {','.join(map(str, devices))}")
        setattr(args, attr, [None if t.lower() == "auto" else parse(t, flag) for t in entries])


def positive_int(text: str, least: int = 1) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {text!r}")
    return n


def host_compute(text: str):
    """An argparse type: auto, off or a number of host threads (config.parse_host_compute)."""
    from ..config import parse_host_compute
    try:
        return parse_host_compute(text, "--host-compute")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).split(" is not valid: ")[-1]) from None


def device_list(text: str) -> list:
    """An argparse type: device ids separated by commas, each at least 0, none twice."""
    ids = [positive_int(t.strip(), least=0) for t in text.split(",") if t.strip()]
    if not ids or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"expected distinct device ids separated by commas, such as 0,1; got {text!r}")
    return ids


def count(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    return positive_int(text, least=0)


def _finite(text: str, zero: bool, what: str) -> float:
    """A finite number above 0 (at least 0 with `zero`), or the argparse error `what` names."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(x) or x < 0 or (x == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return x


def temperature(text: str) -> float:
    """An argparse type: a finite number of at least 0; 0 is greedy decoding, as llama.cpp
    and Hugging Face users mean it."""
    return _finite(text, True, "a finite number of at least 0 (0: greedy)")


def top_p(text: str) -> float:
    """An argparse type: a probability above 0 and at most 1."""
    x = _finite(text, False, "a number above 0 and at most 1")
    if x > 1:
        raise argparse.ArgumentTypeError(f"must be a number above 0 and at most 1, got {text!r}")
    return x


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    return _finite(text, False, "a finite number above 0")


def load_feeds(path: str) -> dict:
    """The arrays of an .npz file of feeds, read before the session loads any weight."""
    import zipfile
    if not os.path.exists(path):
        raise FileNotFoundError(f"--inputs {path!r}: no such file")
    if os.path.isdir(path):
        raise IsADirectoryError(f"--inputs {path!r} is a folder, not an .npz file of feeds")
    bad = f"--inputs {path!r} is not an .npz file of feeds (np.savez)"
    try:
        fd = open_regular(path)  # a FIFO or a device is refused, never waited on or read without end
    except OSError as e:
        raise ValueError(f"{bad}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:  # np.load leaves a path it opened unclosed where the zip is bad
        magic = f.read(6)
        f.seek(0)
        if magic.startswith(b"\x93NUMPY"):
            raise ValueError(f"{bad}: it is an .npy file of one array; save the feeds by name with "
                             f"np.savez(path, name=array)")
        if not magic.startswith(b"PK"):
            raise ValueError(f"{bad}: it is not a zip archive" + ("" if magic else " (the file is empty)"))
        try:
            data = np.load(f, allow_pickle=False)
            with data:
                return {k: data[k] for k in data.files}
        except (EOFError, zipfile.BadZipFile) as e:
            raise ValueError(f"{bad}: {e or type(e).__name__}") from None
        except ValueError as e:
            raise ValueError(f"{bad}: {e}") from None


def check_feeds(feeds: dict, inputs, source: str = "--inputs") -> None:
    """Refuses feeds that do not match the model's inputs by name, dtype or static shape;
    nothing is converted."""
    from ..engines import numpy_dtype
    wanted = {i.name: i for i in inputs}
    missing = [n for n in wanted if n not in feeds]
    unknown = [n for n in feeds if n not in wanted]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing feeds for the model inputs {missing}")
        if unknown:
            parts.append(f"unknown names {unknown}")
        raise ValueError(f"{source}: {'; '.join(parts)}; the model's inputs are {list(wanted)}")
    for name, i in wanted.items():
        value = np.asarray(feeds[name])
        try:
            expected = numpy_dtype(i.type)
        except OffloadError:
            expected = None
        if expected is not None and value.dtype != expected:
            raise ValueError(f"{source}: input {name!r} is {value.dtype}, the model expects {expected} ({i.type}); "
                             f"convert it before saving (nothing is converted silently)")
        shape = list(i.shape) if i.shape is not None else None
        if shape is not None and (len(shape) != value.ndim or any(
                isinstance(d, int) and d > 0 and d != v for d, v in zip(shape, value.shape))):
            want = "(" + ", ".join(str(d) if isinstance(d, int) and d > 0 else str(d or "?") for d in shape) + ")"
            raise ValueError(f"{source}: input {name!r} has shape {tuple(value.shape)}, the model expects {want}")


def parse_prompt_ids(text: str) -> np.ndarray:
    """'1,2,3' -> [[1, 2, 3]]; rows separated by ';' make a batch of equal lengths."""
    try:
        rows = [[int(t) for t in row.split(",")] for row in text.split(";")]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected integers separated by commas (rows by ';')") from None
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"--prompt-ids {text!r}: every row needs the same number of token ids")
    if any(not 0 <= t < 2 ** 63 for r in rows for t in r):
        raise ValueError(f"--prompt-ids {text!r}: token ids are non-negative 64-bit integers")
    return np.array(rows, np.int64)


TOKENIZER_BYTES = 512 << 20  # the largest tokenizer.json read (the largest vocabularies' are tens of MB)


def load_tokenizer(model: str):
    """The tokenizer.json beside the model, through the `tokenizers` package."""
    folder = model if os.path.isdir(model) else os.path.dirname(os.path.abspath(model))
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--prompt needs a tokenizer.json beside the model ({path}); "
                                f"pass --prompt-ids instead")
    try:
        import tokenizers
    except ImportError:
        raise ValueError("--prompt needs the 'tokenizers' package (pip install tokenizers); "
                         "pass --prompt-ids instead") from None
    try:
        # Read here, as a regular file of bounded size, and handed over as text: tokenizers
        # would wait on a FIFO for ever, and read /dev/zero until memory runs out.
        text = read_config(path, TOKENIZER_BYTES).decode("utf-8")
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise UnsupportedModel(config_problem(path, e)) from None
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
        raise ValueError(f"{path} cannot be read by tokenizers: {e}") from None
