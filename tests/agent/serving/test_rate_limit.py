"""Per-key limits (`agent.serving.rate_limit`, `agent.serving.key_check`) with a fake clock:
the sliding minute, each member's share, tokens counted after the request, and the answers a refused
request gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.cluster.api_keys import ApiKeys, KeyExists, KeyRefused, KeyRequest
from agent.serving.key_check import Access, KeyCheck
from agent.serving.rate_limit import KeyLimiter, Window


class Clock:
    def __init__(self, at: float = 1000.0) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


def test_the_window_forgets_after_a_minute() -> None:
    window = Window()
    window.add(0.5, 3)
    window.add(30.2, 2)
    assert window.total(59.9) == 5
    assert window.wait_s(31.0, most=2) == 29  # when the first second leaves
    assert window.wait_s(31.0, most=1) == 59  # when the second one leaves too
    assert window.total(60.0) == 2  # the first second left the window
    assert window.total(90.0) == 0


def test_a_member_admits_its_share_and_says_when_to_retry() -> None:
    limiter = KeyLimiter()
    admitted = [
        limiter.admit("k", rpm=60, tpm=0, share=1 / 3, now=100.0 + i / 10) for i in range(50)
    ]
    assert admitted[:20] == [None] * 20  # 60 a minute over three members: 20 here
    refused = admitted[20:]
    assert all(r is not None and r.kind == "requests" for r in refused)
    first = refused[0]
    assert first is not None
    assert 1 <= first.retry_after_s <= 60
    # As the first second leaves the window, requests are admitted again -- as many as left.
    later = 100.0 + 60
    assert limiter.admit("k", rpm=60, tpm=0, share=1 / 3, now=later) is None
    # A key without limits is never counted; another key has its own window.
    assert all(limiter.admit("free", rpm=0, tpm=0, share=1, now=100) is None for _ in range(500))
    assert limiter.admit("other", rpm=60, tpm=0, share=1 / 3, now=100.0) is None


def test_a_share_never_rounds_to_nothing() -> None:
    limiter = KeyLimiter()
    assert limiter.admit("k", rpm=1, tpm=0, share=1 / 3, now=0.0) is None  # at least one
    assert limiter.admit("k", rpm=1, tpm=0, share=1 / 3, now=1.0) is not None


def test_tokens_counted_after_the_request_close_the_key() -> None:
    limiter = KeyLimiter()
    assert limiter.admit("k", rpm=0, tpm=1000, share=1.0, now=0.0) is None
    limiter.record_tokens("k", 600, now=1.0)
    assert limiter.admit("k", rpm=0, tpm=1000, share=1.0, now=2.0) is None  # 600 < 1000
    limiter.record_tokens("k", 600, now=3.0)  # one request may overshoot by its own tokens
    refused = limiter.admit("k", rpm=0, tpm=1000, share=1.0, now=4.0)
    assert refused is not None
    assert refused.kind == "tokens"
    assert refused.retry_after_s == 57  # the 600 of second 1 leave at 61
    assert limiter.admit("k", rpm=0, tpm=1000, share=1.0, now=61.0) is None


def _keys(tmp_path: Path, clock: Clock) -> ApiKeys:
    return ApiKeys(tmp_path, sign=lambda k: k, clock=clock)


async def test_keys_are_checked_by_hash_and_answered_as_openai_does(tmp_path: Path) -> None:
    wall, mono = Clock(1_700_000_000.0), Clock(500.0)
    keys = _keys(tmp_path, wall)
    check = KeyCheck({}, keys, members_alive=lambda: 3, clock=wall, monotonic=mono)
    assert check.requester("") is Access.OPEN  # no key anywhere: open, as before
    made, secret = keys.create(KeyRequest(name="team-a", models=["m1"], rpm=60, expiresInS=60))
    stored = (tmp_path / "api-keys.json").read_text()
    assert secret not in stored
    assert made.keyHash in stored
    assert check.requester(f"Bearer {secret}") == "team-a"
    for bad in ("", "Bearer ", "Bearer sk-nvp-wrong", secret, f"Basic {secret}"):
        assert check.requester(bad) is Access.REFUSED, bad
    assert await check.admit("team-a", "m1") is None
    forbidden = await check.admit("team-a", "m2")
    assert forbidden is not None
    assert forbidden.status == 403
    assert json.loads(forbidden.body)["error"]["code"] == "model_not_allowed"  # type: ignore[arg-type]
    for _ in range(19):
        assert await check.admit("team-a", "m1") is None
    limited = await check.admit("team-a", "m1")  # the 21st here: over 60 / 3 members
    assert limited is not None
    assert limited.status == 429
    error = json.loads(limited.body)["error"]  # type: ignore[arg-type]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert 1 <= int(limited.headers["Retry-After"]) <= 60
    wall.at += 61  # expired
    assert check.requester(f"Bearer {secret}") is Access.REFUSED


async def test_revoked_and_static_keys(tmp_path: Path) -> None:
    wall = Clock(1_700_000_000.0)
    keys = _keys(tmp_path, wall)
    check = KeyCheck({"ops": "sk-static-123"}, keys, clock=wall)
    assert check.requester("") is Access.REFUSED  # a static key alone closes the facade
    assert check.requester("Bearer sk-static-123") == "ops"
    assert await check.admit("ops", "any-model") is None  # static: no scope, no limit
    _, secret = keys.create(KeyRequest(name="team-b"))
    with pytest.raises(KeyExists):
        keys.create(KeyRequest(name="team-b"))
    assert check.requester(f"Bearer {secret}") == "team-b"
    keys.revoke("team-b")
    assert check.requester(f"Bearer {secret}") is Access.REFUSED
    with pytest.raises(KeyRefused):
        keys.revoke("team-b")
    with pytest.raises(KeyRefused):
        keys.create(KeyRequest(name="bad name!"))
    # Revoked keys keep the facade closed: a cluster that used keys does not fall open.
    alone = KeyCheck({}, _keys(tmp_path, wall), clock=wall)
    assert alone.requester("") is Access.REFUSED


def test_the_requesters_a_request_can_carry_with_their_models(tmp_path: Path) -> None:
    # What /metrics keeps a series for (agent.serving.usage_metrics): usable keys and static keys.
    wall = Clock(1_700_000_000.0)
    keys = _keys(tmp_path, wall)
    check = KeyCheck({"ops": "sk-static-123"}, keys, clock=wall)
    assert check.scopes() == {"ops": None}
    keys.create(KeyRequest(name="team-a", models=["m1"]))
    keys.create(KeyRequest(name="team-b"))
    keys.create(KeyRequest(name="brief", expiresInS=60))
    assert check.scopes() == {
        "ops": None,
        "team-a": frozenset({"m1"}),
        "team-b": None,
        "brief": None,
    }
    keys.revoke("team-a")
    wall.at += 61
    assert check.scopes() == {"ops": None, "team-b": None}  # revoked, expired: gone


def test_an_unreadable_keys_file_keeps_the_facade_closed(tmp_path: Path) -> None:
    (tmp_path / "api-keys.json").write_text("[{not json")
    keys = ApiKeys(tmp_path, sign=lambda k: k)
    assert keys.all() == []
    assert keys.in_use()
    assert KeyCheck({}, keys).requester("") is Access.REFUSED
    assert (tmp_path / "api-keys.json.corrupt").exists()
