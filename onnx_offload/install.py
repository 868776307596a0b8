"""What is installed beside the package: the onnxruntime distributions.

``onnxruntime`` and ``onnxruntime-gpu`` install into the same ``onnxruntime`` folder, so
with both present whichever was installed last decides what ``import onnxruntime``
loads, and a later install or upgrade of the other silently swaps it (a known ORT
pitfall: a CPU-only build where CUDA was expected, or the reverse). The package says so
at import, naming what to remove.
"""
from __future__ import annotations

import importlib.metadata
from typing import Callable, Dict, Optional

ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu")


def installed_versions(version_of: Callable[[str], str] = importlib.metadata.version) -> Dict[str, str]:
    """{distribution: version} of the onnxruntime distributions installed."""
    found = {}
    for name in ORT_DISTRIBUTIONS:
        try:
            found[name] = version_of(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def conflict(found: Dict[str, str], loaded: str) -> Optional[str]:
    """The warning when both distributions are installed, else None."""
    if len(found) < 2:
        return None
    return (f"both onnxruntime {found['onnxruntime']} and onnxruntime-gpu {found['onnxruntime-gpu']} are installed; "
            f"they share one 'onnxruntime' folder, so what imports is whichever was installed last (now "
            f"{loaded}). Remove the one you do not use: 'pip uninstall onnxruntime' keeps the CUDA build, "
            f"'pip uninstall onnxruntime-gpu' the CPU one (then reinstall the one you keep, since both wrote the "
            f"same files)")
