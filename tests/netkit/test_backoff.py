"""`netkit.backoff.Backoff`: full jitter below an exponential ceiling, capped."""

from __future__ import annotations

from netkit.backoff import Backoff


def test_jitter_draws_below_the_ceiling() -> None:
    backoff = Backoff(base_s=1.0, cap_s=30.0)
    assert backoff.delay(3, lambda: 0.25) == 2.0
    assert backoff.delay(100, lambda: 0.5) == 15.0
