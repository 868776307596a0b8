"""The reliability bench: the engine under stress (reliability_stress: soak, fault injection,
threads, interrupts, fork, bad inputs), files the session did not write (reliability_trust)
and hostile calls and models (reliability_hostile), each scenario in a child process so
that a crash or a hang is counted, not suffered. This module runs the children and makes
the table.

    onnx-offload bench reliability [--json FILE]

A child runs ``python -m onnx_offload.tools.reliability SCENARIO ARGS`` and prints one JSON line
of counts: attempts, clear (typed) errors, wrong outputs and leaks. The parent adds
crashes (a signal, or an exit without a result) and hangs (no exit in time).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, Optional

from ..stats import table
from . import reliability_hostile, reliability_stress, reliability_trust
from .reliability_rig import package_parent, result

COLUMNS = ("attempts", "clear_errors", "crashes", "wrong_outputs", "leaks", "hangs")

CHILDREN: Dict[str, Callable[..., dict]] = {
    f.__name__: f for f in (*reliability_stress.CHILDREN, *reliability_trust.CHILDREN, *reliability_hostile.CHILDREN)}

# (row label, child, its arguments, timeout in seconds)
SCENARIOS = [*reliability_stress.SCENARIOS, *reliability_trust.SCENARIOS, *reliability_hostile.SCENARIOS]


def run_scenario(child: str, args=(), timeout: float = 60) -> dict:
    """One child: its counts, plus crashes and hangs as the parent saw them."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "onnx_offload.tools.reliability", child, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=package_parent())
    except subprocess.TimeoutExpired:
        return dict(result(1), crashes=0, hangs=1, seconds=round(time.perf_counter() - t0, 2))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        why = signal.Signals(-proc.returncode).name if proc.returncode < 0 else proc.stderr.strip()[-300:]
        return dict(result(1, error=why), crashes=1, hangs=0, seconds=round(time.perf_counter() - t0, 2))
    return dict(json.loads(lines[-1]), crashes=0, hangs=0, seconds=round(time.perf_counter() - t0, 2))


def run_all(only: Optional[str] = None) -> dict:
    """Every scenario (or those whose label contains `only`), by row label."""
    return {label: run_scenario(child, args, timeout) for label, child, args, timeout in SCENARIOS
            if only is None or only in label}


def print_table(results: dict) -> str:
    rows = [[label] + [r[c] for c in COLUMNS] + [f"{r['seconds']:.1f}"] for label, r in results.items()]
    totals = ["total"] + [sum(r[c] for r in results.values()) for c in COLUMNS] + [""]
    text = table(rows + [totals], ("scenario", "attempts", "clear errors", "crashes", "wrong outputs", "leaks",
                                   "hangs", "s"))
    bad = [label for label, r in results.items() if r["crashes"] or r["wrong_outputs"] or r["leaks"] or r["hangs"]]
    return text + ("\n\nfailing: " + "; ".join(bad) if bad else "\n\nevery scenario held")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(json.dumps(CHILDREN[argv[0]](*argv[1:])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
