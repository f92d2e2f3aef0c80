"""Markers and the `--long` flag of the fault harness, so its tiers can be selected:
`pytest tests/reliability` (the quick tier), `pytest tests/reliability --long` (every
scenario at long scale, docs/reliability.md). Registered here so the package stays
self-contained under `--strict-markers`."""

from __future__ import annotations

import pytest

from .tiers import LONG, QUICK, Tier


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="run the fault harness's scenarios at long-tier scale (docs/reliability.md)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "reliability: the fault harness (tests/reliability)")
    config.addinivalue_line("markers", "quick: the fault harness's quick tier (small, seeded)")


@pytest.fixture
def tier(request: pytest.FixtureRequest) -> Tier:
    """The scale this run's scenarios take: quick unless `--long` was given."""
    return LONG if request.config.getoption("--long") else QUICK
