"""A session's arguments, read as ORT reads them: the providers and their options, and
the configuration they and the keywords make.

The CUDA provider's ``device_id`` and ``gpu_mem_limit`` are the device and the VRAM
limit unless the configuration names them itself; ``enable_cuda_graph`` in its options
is the caller's explicit request for capture.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Callable, Optional

from .config import ENV_VRAM_LIMIT, OffloadConfig, env_is_set, parse_device_id, parse_flag, parse_index
from .env_names import unknown_env_names
from .errors import OffloadWarning
from .loading import CUDA_DEFAULTS, CUDA_EP, choose_providers, normalize_providers


@dataclasses.dataclass
class SessionArguments:
    config: OffloadConfig
    on_cuda: bool
    cuda_options: dict  # the CUDA provider's options, less what the package takes from them
    graph_request: Optional[bool]  # enable_cuda_graph as the caller gave it, or None


def read_arguments(providers, provider_options, config: Optional[OffloadConfig], config_kwargs: dict,
                   cuda_status: Callable[[], str]) -> SessionArguments:
    """The session's arguments; warns of the providers it skips or replaces."""
    if config is not None and config_kwargs:
        raise TypeError("pass either config= or configuration keywords, not both")
    if config is None:
        for note in unknown_env_names(os.environ):
            warnings.warn(note, OffloadWarning, stacklevel=3)
    cfg = config if config is not None else OffloadConfig.from_env(**config_kwargs)
    names, options = normalize_providers(providers, provider_options)
    cuda_given = next((o for n, o in zip(names, options) if n == CUDA_EP), {})
    names, options, notes = choose_providers(names, options, cuda_status)
    for note in notes:
        warnings.warn(note, OffloadWarning, stacklevel=3)
    on_cuda = names[0] == CUDA_EP
    # The CUDA provider's device_id and gpu_mem_limit, as ORT reads them, unless the
    # configuration names a device or a limit itself.
    given = set(config_kwargs) | ({"vram_limit"} if env_is_set(ENV_VRAM_LIMIT) else set())
    if config is not None:
        given |= {f for f in ("device_id", "vram_limit") if getattr(config, f) != getattr(OffloadConfig(), f)}
    taken = {}
    if "device_id" in cuda_given and "device_id" not in given and on_cuda:
        taken["device_id"] = parse_device_id(cuda_given["device_id"], "device_id (CUDA provider option)")
    if "gpu_mem_limit" in cuda_given and "vram_limit" not in given and on_cuda:
        taken["vram_limit"] = parse_index(cuda_given["gpu_mem_limit"], "gpu_mem_limit (CUDA provider option)")
    if taken:
        try:
            cfg = dataclasses.replace(cfg, **taken)
        except ValueError as e:
            raise ValueError(f"the CUDA provider options {taken} cannot be the session's configuration: "
                             f"{e}") from None
    cuda_options = {**CUDA_DEFAULTS, **options[0]} if on_cuda else {}
    # enable_cuda_graph in the provider options is the caller's explicit request, as
    # plain ORT takes it; the runner sets it on the sessions that capture.
    request = parse_flag(cuda_options.pop("enable_cuda_graph", None), "enable_cuda_graph (CUDA provider option)")
    return SessionArguments(cfg, on_cuda, cuda_options, request)
