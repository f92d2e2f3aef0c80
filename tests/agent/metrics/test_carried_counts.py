"""The workload manager's counts carried across restarts of the child (`agent.metrics.carried`):
what `/metrics` shows of them never falls while the agent lives."""

from __future__ import annotations

from typing import Any

from agent.metrics.carried import PEER_COUNTS, CarriedCounts, carried_status


def _status(accepted: int, sent: int, *, peer: str = "nod_b") -> dict[str, Any]:
    peer_row: dict[str, Any] = dict.fromkeys(PEER_COUNTS, 0) | {"nodeId": peer, "queued": 4}
    peer_row["sent"] = sent
    return {"version": "1", "counters": {"accepted": accepted}, "broadcast": [peer_row]}


def test_a_restarted_childs_counts_add_to_the_last_ones_read() -> None:
    counts: CarriedCounts[tuple[str, ...]] = CarriedCounts()
    first = carried_status(counts, 0, _status(accepted=10, sent=7))
    assert first["counters"]["accepted"] == 10
    assert first["broadcast"][0]["sent"] == 7
    assert first["broadcast"][0]["queued"] == 4  # a gauge: as the child says
    # The child restarted (generation 1) and counted again from zero; a new child that
    # counts past the old value before the first scrape is carried the same.
    again = carried_status(counts, 1, _status(accepted=12, sent=2))
    assert again["counters"]["accepted"] == 22
    assert again["broadcast"][0]["sent"] == 9
    assert again["version"] == "1"  # the rest of the status as it was


def test_no_answer_holds_the_relays_counts() -> None:
    counts: CarriedCounts[tuple[str, ...]] = CarriedCounts()
    carried_status(counts, 0, _status(accepted=5, sent=3))
    held = carried_status(counts, None, {})  # the child did not answer, or changed meanwhile
    assert held == {"counters": {"accepted": 5}}
    assert carried_status(counts, 1, _status(accepted=1, sent=1))["counters"]["accepted"] == 6


def test_a_series_that_starts_again_within_one_child_is_carried() -> None:
    counts: CarriedCounts[str] = CarriedCounts()
    assert counts.read(3, {"sent": 40}) == {"sent": 40}
    assert counts.read(3, {"sent": 2}) == {"sent": 42}  # the peer left and came back
    assert counts.read(3, {"sent": 5}) == {"sent": 45}
    assert counts.value("never-read") == 0
