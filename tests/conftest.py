"""Fixtures every test package shares.

The helpers themselves live in `tests/fixtures/` so harness modules can import them
(a conftest is not for importing): `eventually` (wait for an observable condition, with a
deadline and a description -- never a sleep), `FakeClock`, and the workload record
builders. Tests take the fake clock as the `fake_clock` fixture.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from tests.fixtures.clock import FakeClock
from tests.fixtures.records import lifecycle_event, workload, workload_record
from tests.fixtures.waiting import eventually

__all__ = ["FakeClock", "eventually", "lifecycle_event", "workload", "workload_record"]

# No property test has a deadline: Hypothesis' default (200 ms an example) is an absolute
# time, and on a loaded two-core machine an example that takes 20 ms can take 250 (a
# `DeadlineExceeded`, then `Flaky` when the replay is fast). A test never asserts a time.
settings.register_profile("nvpair", deadline=None)
settings.load_profile("nvpair")


@pytest.fixture
def fake_clock() -> FakeClock:
    """A clock at a fixed instant that moves only by `advance()`."""
    return FakeClock()
