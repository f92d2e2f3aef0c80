"""The release's version: the one place it is written (pyproject.toml reads it from here).

A constant, not `importlib.metadata.version("nvpair")`: that lookup imports the metadata
machinery and scans the installed distributions, ~50 ms at the start of every agent, workload
manager, engine and CLI call. `tests/test_version.py` holds it equal to the installed one."""

from __future__ import annotations

VERSION = "0.2.0"
