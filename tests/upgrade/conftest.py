"""The mixed-release tier's fixtures: the previous release, built once per run."""

from __future__ import annotations

import pytest

from .previous import Previous, build_previous


@pytest.fixture(scope="session")
def previous() -> Previous:
    """The previous release (tests/upgrade/PREVIOUS), ready to run."""
    return build_previous()
