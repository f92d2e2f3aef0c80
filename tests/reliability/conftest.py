"""Markers of the fault harness, so its tiers can be selected: `pytest tests/reliability`
(all of it), `-m quick` (the quick tier). Registered here so the package stays self-contained
under `--strict-markers`."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "reliability: the fault harness (tests/reliability)")
    config.addinivalue_line("markers", "quick: the fault harness's quick tier (small, seeded)")
