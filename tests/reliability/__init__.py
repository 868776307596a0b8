"""Reliability: soak, faults, threads, interrupts, fork and bad inputs (a package, so
that its conftest does not shadow tests/conftest.py)."""
