"""What is installed beside the package: the onnxruntime distributions.

``onnxruntime`` and ``onnxruntime-gpu`` install into the same ``onnxruntime`` folder, so
with both present whichever was installed last decides what ``import onnxruntime``
loads, and a later install or upgrade of the other silently swaps it (a known ORT
pitfall: a CPU-only build where CUDA was expected, or the reverse). The package says so
at import, naming what to remove.
"""
from __future__ import annotations

import importlib.metadata
import os
from typing import Dict, Iterable, Optional

ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu")


def installed_versions(loaded_init: str,
                       distributions: Optional[Iterable[importlib.metadata.Distribution]] = None) -> Dict[str, str]:
    """{distribution: version} of the onnxruntime distributions whose files are the
    ``onnxruntime`` folder that imported (its ``__init__.py`` is `loaded_init`). One in
    another site folder (a system install under a virtual environment's) is shadowed,
    not mixed in, and is left out."""
    here = os.path.realpath(loaded_init)
    found = {}
    for d in (importlib.metadata.distributions() if distributions is None else distributions):
        name = (d.metadata["Name"] or "").lower().replace("_", "-")
        if name in ORT_DISTRIBUTIONS and name not in found:
            if os.path.realpath(str(d.locate_file("onnxruntime/__init__.py"))) == here:
                found[name] = d.version
    return found


def conflict(found: Dict[str, str], loaded: str) -> Optional[str]:
    """The warning when both distributions installed into the imported folder, else None."""
    if len(found) < 2:
        return None
    return (f"both onnxruntime {found['onnxruntime']} and onnxruntime-gpu {found['onnxruntime-gpu']} are installed "
            f"into one 'onnxruntime' folder, so what imports is whichever was installed last (now "
            f"{loaded}). Remove the one you do not use: 'pip uninstall onnxruntime' keeps the CUDA build, "
            f"'pip uninstall onnxruntime-gpu' the CPU one (then reinstall the one you keep, since both wrote the "
            f"same files)")
