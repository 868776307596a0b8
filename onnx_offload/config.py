"""Configuration: one dataclass, built from keyword arguments or the environment.

Environment variables (the names the ONNX GenAI engine uses):

- ``ONNX_GENAI_WEIGHT_OFFLOAD``: ``1`` lets weights exceed their allowance and stream.
- ``ONNX_GENAI_WEIGHT_OFFLOAD_VMM``: ``1`` gives every weight a stable address (CUDA VMM);
  otherwise offloaded weights are allocated per page-in (the plain baseline).
- ``ONNX_GENAI_WEIGHT_OFFLOAD_DEVICE_BYTES``: the allowance of the weights zone, in bytes.
- ``ONNX_GENAI_WEIGHT_OFFLOAD_POLICY``: ``planned`` (default), ``stable``, ``lru`` or ``mru``.
- ``ONNX_GENAI_VRAM_LIMIT``: the device budget: ``6GiB``, ``6000000000``, ``0.9`` (a fraction
  of device memory) or ``auto`` (the memory free when the session starts, less the device's
  margin, ``BUDGET_MARGIN``).
- ``ONNX_GENAI_CUDA_GRAPH``: ``0`` or ``1``; unset means decide automatically.
"""
from __future__ import annotations

import dataclasses
import fractions
import operator
import os
import re
from typing import Mapping, Optional, Union

# The residency policies (memory/policies.py implements each, and checks at import that
# it implements these and no others).
POLICIES = ("planned", "stable", "lru", "mru")
DEFAULT_POLICY = "planned"

ENV_OFFLOAD = "ONNX_GENAI_WEIGHT_OFFLOAD"
ENV_VMM = "ONNX_GENAI_WEIGHT_OFFLOAD_VMM"
ENV_DEVICE_BYTES = "ONNX_GENAI_WEIGHT_OFFLOAD_DEVICE_BYTES"
ENV_POLICY = "ONNX_GENAI_WEIGHT_OFFLOAD_POLICY"
ENV_VRAM_LIMIT = "ONNX_GENAI_VRAM_LIMIT"
ENV_CUDA_GRAPH = "ONNX_GENAI_CUDA_GRAPH"
ENV_ENGINE = "ONNX_OFFLOAD_ENGINE"
ENV_CACHE_DIR = "ONNX_OFFLOAD_CACHE_DIR"
# How streamed weights run: "graph", the streaming engine (one ORT session captured into
# a graph with the page-ins in it; CUDA only); "segments", one ORT session per segment,
# each paged in before it runs; "auto", the graph where it can run, else segments.
ENGINES = ("auto", "graph", "segments")
ENV_EXPERTS = "ONNX_OFFLOAD_EXPERTS"
ENV_HOST_COMPUTE = "ONNX_OFFLOAD_HOST_COMPUTE"
# How a mixture-of-experts model's experts stream: "routed", only those its router picks
# for the step; "dense", every expert every step; "in_place", the streaming engine (CUDA)
# leaves each stack of experts in pinned host memory and ORT's MoE kernel reads the picked
# experts there, over the link (dense where that engine does not run); "auto", routed
# where the kernels are known to read only the routed experts (the CPU execution
# provider), in_place on CUDA with stable addresses, else dense.
EXPERTS = ("auto", "routed", "dense", "in_place")

MiB = 1 << 20
GiB = 1 << 30
# What the "auto" budget leaves of the device's free memory, by backend: memory that no
# ledger call sees and that the ORT meter (memory.ort_memory) may find only later. On CUDA
# the process's context is already out of the free memory read at the start, and what ORT
# takes for its arena and workspaces is measured and charged inside the budget; the margin
# covers the kernels loaded lazily on a step's first launch, captured graphs' uploads and
# the meter's SLACK (32 MiB). Measured by bench cards (H100, ORT 1.31.1, an 8B-shape
# model on 8, 12, 16 and 24 GiB cards): the process's device memory at its peak, less its
# context and the ledger's peak, was 32 MiB in every row; the margin is twice that. On the
# host the device is the process's own memory, which ORT's CPU arena and the pinned host
# store of the weights also take.
BUDGET_MARGIN = {"cuda": 64 * MiB, "host": 1 * GiB}

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

BYTES_FORMS = "an integer byte count (6000000000) or a size with a unit (6GiB, 512MiB, 6GB)"
LIMIT_FORMS = BYTES_FORMS + ", a fraction of device memory in (0, 1] (0.9), or 'auto'"
BOOL_FORMS = "'0' or '1' ('false' or 'true')"


MAX_BYTES = 2**63 - 1  # sizes travel as 64-bit integers


def fmt_bytes(n: float) -> str:
    """Bytes as a person reads them, in binary units ("2.05 GiB")."""
    import humanize
    return humanize.naturalsize(n, binary=True, format="%.2f")


def integer(value) -> Optional[int]:
    """`value` as an int where it is an integer (a Python or numpy integer, not a bool),
    else None: a count read from an array is as good as a literal one."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def parse_bytes(value: Union[str, int], name: str = "value", zero: bool = False) -> int:
    """Parses ``6GiB``, ``512MiB``, ``6GB`` or ``6000000000`` into bytes; 0 only with
    `zero` (a reserve that may be none, as kv_bytes)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not valid: expected {BYTES_FORMS}")
    if (n := integer(value)) is not None:
        value = n
        if value < 0 or (value == 0 and not zero):
            raise ValueError(f"{name}={value!r} is not valid: expected a positive size, {BYTES_FORMS}")
        if value > MAX_BYTES:
            raise ValueError(f"{name}={value!r} is not valid: more than {MAX_BYTES} bytes")
        return value
    m = _SIZE_RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"{name}={value!r} is not valid: expected {BYTES_FORMS}")
    if unit in ("", "b") and "." in m.group(1):
        raise ValueError(f"{name}={value!r} is not valid: a plain byte count must be an integer; expected {BYTES_FORMS}")
    n = int(fractions.Fraction(m.group(1)) * _UNITS[unit])  # exact: no float rounding at 2**63
    if n > MAX_BYTES:
        raise ValueError(f"{name}={value!r} is not valid: more than {MAX_BYTES} bytes")
    if n < 0 or (n == 0 and not zero):
        raise ValueError(f"{name}={value!r} is not valid: expected a positive size, {BYTES_FORMS}")
    return n


GRANULE = 2 * MiB  # the GPU's allocation granule; no budget can be smaller


def _size_text(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} byte" + ("" if n == 1 else "s")


def parse_vram_limit(value: Union[str, int, float, None], name: str = ENV_VRAM_LIMIT, granule: int = GRANULE):
    """Returns ``None`` (auto), a fraction (float in (0, 1]) or a byte count (int).

    A byte count below one granule is refused: ``1`` is one byte, not the whole device
    (that is ``1.0``). ``granule`` is 2 MiB, the GPU's; a host backend configured with
    smaller granules (``host_granularity``) passes its own."""
    n = _parse_vram_limit(value, name)
    if isinstance(n, int) and n < granule:
        raise ValueError(f"{name}={value!r} is {n} byte{'' if n == 1 else 's'}, less than one {_size_text(granule)} "
                         f"granule: write 1.0 for the whole device, or a size such as 1GiB")
    return n


def smallest_budget(host_granularity=None) -> int:
    """One GPU granule, or one host granule where a host backend is given smaller ones."""
    g = host_granularity
    return min(GRANULE, g) if isinstance(g, int) and not isinstance(g, bool) and g > 0 else GRANULE


def _parse_vram_limit(value, name):
    if value is None:
        return None
    if isinstance(value, float):
        if 0.0 < value <= 1.0:
            return value
        raise ValueError(f"{name}={value!r} is not valid: expected {LIMIT_FORMS}")
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return None
        if re.fullmatch(r"0?\.[0-9]+|1\.0*|0\.0*", text):
            f = float(text)
            if 0.0 < f <= 1.0:
                return f
            raise ValueError(f"{name}={value!r} is not valid: expected {LIMIT_FORMS}")
    try:
        return parse_bytes(value, name)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not valid: expected {LIMIT_FORMS}") from None


def parse_flag(value: Union[str, bool, int, None], name: str) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true"):
        return True
    if text in ("0", "false"):
        return False
    raise ValueError(f"{name}={value!r} is not valid: expected {BOOL_FORMS}")


def parse_policy(value: str, name: str = ENV_POLICY) -> str:
    text = str(value).strip().lower()
    if text not in POLICIES:
        raise ValueError(f"{name}={value!r} is not valid: expected one of {', '.join(POLICIES)}")
    return text


def parse_cache_dir(value, name: str = ENV_CACHE_DIR) -> str:
    """A folder, "auto" (the user cache directory) or "off" (no cache)."""
    text = str(value).strip()
    if text.lower() in ("auto", "off"):
        return text.lower()
    if text.lower() in ("0", "none", "false"):
        return "off"
    if text.lower() in ("1", "true", "on"):  # a switch turned on, not a folder named "1"
        return "auto"
    if not text:
        raise ValueError(f"{name}={value!r} is not valid: expected a folder, 'auto' or 'off'")
    return os.path.expanduser(text)


# ONNX Runtime holds a device id in 16 bits (OrtDevice::DeviceId, an int16_t).
MAX_DEVICE_ID = 2**15 - 1


def parse_index(value, name: str) -> int:
    """A non-negative integer, or its digits (as provider options give it)."""
    n = integer(value)
    if n is None and isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        n = int(value)
    if n is None:
        raise ValueError(f"{name}={value!r} is not valid: expected a non-negative integer")
    if n < 0:
        raise ValueError(f"{name}={value!r} is not valid: expected a non-negative integer")
    return n


def parse_device_id(value, name: str) -> int:
    """A device index: parse_index's, no larger than ONNX Runtime takes."""
    n = parse_index(value, name)
    if n > MAX_DEVICE_ID:
        raise ValueError(f"{name}={value!r} is out of range: ONNX Runtime takes device ids up to {MAX_DEVICE_ID}")
    return n


def default_cache_dir() -> str:
    """The user cache directory's onnx-offload folder (platformdirs: $XDG_CACHE_HOME on Linux)."""
    import platformdirs
    return platformdirs.user_cache_dir("onnx-offload")


def parse_engine(value: str, name: str = ENV_ENGINE) -> str:
    text = str(value).strip().lower()
    if text not in ENGINES:
        raise ValueError(f"{name}={value!r} is not valid: expected one of {', '.join(ENGINES)}")
    return text


def parse_experts(value: str, name: str = ENV_EXPERTS) -> str:
    text = str(value).strip().lower()
    if text not in EXPERTS:
        raise ValueError(f"{name}={value!r} is not valid: expected one of {', '.join(EXPERTS)}")
    return text


def parse_host_compute(value, name: str = ENV_HOST_COMPUTE):
    """"auto", "off", or a number of host threads (1 to 4096): host compute on, with that many."""
    text = str(value).strip().lower()
    n = int(text) if isinstance(value, str) and text.isascii() and text.isdigit() else integer(value)
    if text in ("auto", "off") and isinstance(value, str):
        return text
    if n is None or not 1 <= n <= 4096:
        raise ValueError(f"{name}={value!r} is not valid: expected auto, off or a number of host threads (1 to 4096)")
    return n


def env_is_set(name: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the variable holds a value (an empty one counts as unset)."""
    value = (os.environ if env is None else env).get(name)
    return value is not None and value.strip() != ""


ENV_FIELDS = (
    (ENV_OFFLOAD, "offload", parse_flag),
    (ENV_VMM, "vmm", parse_flag),
    (ENV_DEVICE_BYTES, "weight_bytes", parse_bytes),
    (ENV_POLICY, "policy", parse_policy),
    (ENV_VRAM_LIMIT, "vram_limit", parse_vram_limit),
    (ENV_CUDA_GRAPH, "cuda_graph", parse_flag),
    (ENV_ENGINE, "engine", parse_engine),
    (ENV_CACHE_DIR, "cache_dir", parse_cache_dir),
    (ENV_EXPERTS, "experts", parse_experts),
    (ENV_HOST_COMPUTE, "host_compute", parse_host_compute),
)


@dataclasses.dataclass
class OffloadConfig:
    """Everything that shapes an offloaded session. Build with ``from_env`` or directly."""

    offload: bool = False
    vmm: bool = False
    weight_bytes: Optional[int] = None  # allowance of the weights zone
    vram_limit: Union[None, int, float] = None  # bytes, fraction, or None (auto)
    cuda_graph: Optional[bool] = None  # explicit env value; None: auto
    graph_override: Optional[bool] = None  # programmatic override (kwarg cuda_graph=)
    policy: str = DEFAULT_POLICY
    device_id: int = 0
    min_weight_bytes: int = 4096  # smaller initializers stay inside the model
    kv_bytes: int = 0  # reserve of the KV zone
    scratch_bytes: Optional[int] = None  # reserve of the scratch zone (ORT's memory, boundary buffers);
    # None: 256 MiB or an eighth of the budget, whichever is less
    segment_bytes: Optional[int] = None  # weights per segment; None: a quarter of the allowance
    host_granularity: int = 2 * MiB  # the host backend's granule, matching the GPU's
    handle_classes: tuple = ()  # () means the arena's defaults: 1, 16, 64 and 256 granules
    zone_va_bytes: Optional[int] = None
    optimization_level: Optional[str] = None  # None: the SessionOptions' level
    # Keeps optimized models between sessions, keyed by the content of every file the model
    # reads: a folder, "auto" (the user cache directory) or "off".
    cache_dir: Optional[str] = "auto"
    engine: str = "auto"  # one of ENGINES
    experts: str = "auto"  # one of EXPERTS
    # generate() feeds a prompt longer than this in chunks of at most this many tokens, so
    # the memory a prompt step needs is bounded whatever the prompt's length.
    prefill_chunk: int = 512
    # The host's cores multiply part of a decode step's streamed weights (docs/host_compute.md):
    # "auto" where measured rates say it helps, "off" (default until measured on a GPU), or threads.
    host_compute: Union[str, int] = "off"

    def __post_init__(self):
        # The switches as the environment spells them too ("0" is off, not a true string).
        self.offload = parse_flag(self.offload, "offload")
        self.vmm = parse_flag(self.vmm, "vmm")
        self.host_granularity = parse_bytes(self.host_granularity, "host_granularity")
        if self.zone_va_bytes is not None:
            self.zone_va_bytes = parse_bytes(self.zone_va_bytes, "zone_va_bytes")
            # Four zones of it are reserved, in a user address space of 2**47 bytes.
            if not 0 < self.zone_va_bytes <= (1 << 47) // 4:
                raise ValueError(f"zone_va_bytes={self.zone_va_bytes} cannot be reserved: it must be between 1 "
                                 f"and {(1 << 47) // 4} bytes (four zones share a process's 2**47 bytes of address "
                                 f"space)")
        self.device_id = parse_device_id(self.device_id, "device_id")
        classes = self.handle_classes
        if not isinstance(classes, (tuple, list)) or not all(
                integer(c) is not None and c > 0 for c in classes):
            raise ValueError(f"handle_classes={classes!r} is not valid: expected a sequence of positive granule "
                             f"counts, or () for the arena's defaults")
        self.handle_classes = tuple(integer(c) for c in classes)
        self.vram_limit = parse_vram_limit(self.vram_limit, "vram_limit", smallest_budget(self.host_granularity))
        self.policy = parse_policy(self.policy, "policy")
        self.engine = parse_engine(self.engine, "engine")
        self.experts = parse_experts(self.experts, "experts")
        self.host_compute = parse_host_compute(self.host_compute, "host_compute")
        self.cache_dir = parse_cache_dir("off" if self.cache_dir is None else self.cache_dir, "cache_dir")
        if self.weight_bytes is not None:
            self.weight_bytes = parse_bytes(self.weight_bytes, "weight_bytes")
        if self.segment_bytes is not None:
            self.segment_bytes = parse_bytes(self.segment_bytes, "segment_bytes")
        chunk = integer(self.prefill_chunk)
        if chunk is None or chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk!r} is not valid: expected a positive number of "
                             f"tokens")
        self.prefill_chunk = chunk
        for field in ("kv_bytes", "scratch_bytes", "min_weight_bytes"):
            v = getattr(self, field)
            if v is None and field == "scratch_bytes":
                continue
            if isinstance(v, str):
                setattr(self, field, parse_bytes(v, field, zero=True))
                continue
            n = integer(v)
            if n is None or not 0 <= n <= MAX_BYTES:
                raise ValueError(f"{field}={v!r} is not valid: expected a non-negative byte count")
            setattr(self, field, n)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None, **overrides) -> "OffloadConfig":
        """Reads the ``ONNX_GENAI_*`` variables; keyword arguments win over them."""
        env = os.environ if env is None else env
        values = {}
        # A variable that a keyword overrides is not read: its value, even one that does not
        # parse, is not the configuration's. (None overrides nothing, except cache_dir=None: off.)
        given = {k for k, v in overrides.items() if v is not None or k == "cache_dir"}
        if given & {"cuda_graph", "graph_override"}:
            given.add("cuda_graph")  # ONNX_GENAI_CUDA_GRAPH's field; the keyword cuda_graph= sets graph_override
        granule = smallest_budget(overrides.get("host_granularity"))
        for var, field, parse in ENV_FIELDS:
            if field not in given and env_is_set(var, env):
                values[field] = parse(env[var], var, granule) if parse is parse_vram_limit else parse(env[var], var)
        if "cuda_graph" in overrides:
            values["graph_override"] = parse_flag(overrides.pop("cuda_graph"), "cuda_graph")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown OffloadConfig options: {', '.join(sorted(unknown))}")
        if "cache_dir" in overrides and overrides["cache_dir"] is None:
            overrides["cache_dir"] = "off"  # None given by name: no cache, as OffloadConfig(cache_dir=None)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def cache_path(self) -> Optional[str]:
        """The cache folder, or None when the cache is off."""
        if self.cache_dir == "off":
            return None
        return default_cache_dir() if self.cache_dir == "auto" else self.cache_dir

    def resolve_budget(self, free: int, total: int, margin: int = 0) -> int:
        """The device budget in bytes, given the device's free and total memory: "auto"
        (None) is the free memory less `margin` (the backend's BUDGET_MARGIN)."""
        if self.vram_limit is None:
            return max(0, free - margin)
        if isinstance(self.vram_limit, float):
            return int(total * self.vram_limit)
        return int(self.vram_limit)
