"""The `Nudge` the daemon wires its parts with, in memory."""

from agent.core.nudge import Nudge


def test_a_nudge_calls_its_followers_in_order_and_only_those_following_then() -> None:
    calls: list[str] = []
    nudge = Nudge("record-changed")
    nudge()  # before anyone follows: it reaches no one
    nudge.follow(lambda: calls.append("heartbeat"))
    nudge.follow(lambda: calls.append("metrics"))
    nudge()
    nudge()
    assert calls == ["heartbeat", "metrics", "heartbeat", "metrics"]
    assert "2 following" in repr(nudge)
