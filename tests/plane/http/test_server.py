"""The plane's HTTP API on a real PostgreSQL: tokens, sync, bad input, fleet, jobs."""

from __future__ import annotations

import io

import aiohttp
import msgspec
import pytest

from plane.core.ids import new_id
from plane.http.server import MAX_BODY

from ..db.test_store import batch, job
from ..plane_client import ADMIN, Plane, enrol


async def test_tokens(plane: Plane) -> None:
    a, token_a = await enrol(plane, "a")
    b, token_b = await enrol(plane, "b")
    node = new_id("nod")
    sync = msgspec.json.encode(batch(node, 1, [job(node, "1", 1)]))
    json_type = {"headers": {"Content-Type": "application/json"}}
    assert (await plane.call("POST", "/v1/sync", "nonsense", sync, **json_type))[0] == 401
    assert (await plane.call("POST", "/v1/sync", token_a + "x", sync, **json_type))[0] == 401
    assert (await plane.call("POST", "/v1/sync", token_a, sync, **json_type))[0] == 200
    assert (await plane.call("POST", "/v1/clusters", token_a, {"name": "c"}))[0] == 403
    # b cannot read a, nor write a's node
    assert (await plane.call("GET", f"/v1/clusters/{a}", token_b))[0] == 403
    assert (await plane.call("GET", f"/v1/jobs?cluster={a}", token_b))[0] == 403
    status, body = await plane.call("POST", "/v1/sync", token_b, sync, **json_type)
    assert (status, body["error"]) == (400, f"{node} belongs to another cluster")
    # a sees itself only
    status, body = await plane.call("GET", "/v1/fleet/summary", token_a)
    assert [c["id"] for c in body["clusters"]] == [a]
    assert (await plane.call("POST", f"/v1/clusters/{a}/revoke", ADMIN))[0] == 200
    assert (await plane.call("POST", "/v1/sync", token_a, sync, **json_type))[0] == 401
    assert b


@pytest.mark.parametrize(
    ("body", "content_type", "status"),
    [
        (b"{not json", "application/json", 400),
        (b'{"nodeId": "nod_x", "generation": 1}', "application/json", 400),
        (b'{"nodeId": "nod_01arz3ndektsv4rrffq69g5fav", "generation": 0}', "application/json", 400),
        (b"[]", "text/plain", 415),
        # Nested past the recursion limit (msgspec's RecursionError was a 500).
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "application/json", 400),
    ],
)
async def test_malformed_sync_writes_nothing(
    plane: Plane, body: bytes, content_type: str, status: int
) -> None:
    _, token = await enrol(plane, "a")
    got, answer = await plane.call(
        "POST", "/v1/sync", token, body, headers={"Content-Type": content_type}
    )
    assert got == status
    assert answer["error"]
    summary = await plane.store.fleet_summary()
    assert summary["clusters"][0]["nodes"] == {"reachable": 0, "unreachable": 0, "cordoned": 0}


async def test_aiohttp_refusals_are_error_objects_too(plane: Plane) -> None:
    # A body past MAX_BODY and a route's wrong method were aiohttp's plain-text answers.
    _, token = await enrol(plane, "a")
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    # Signature headers (of another body: the size is refused first, as the body is read).
    headers |= plane.ca(token).headers(b"{}")
    big = io.BytesIO(b" " * (MAX_BODY + 1))
    async with (
        aiohttp.ClientSession() as session,
        session.post(plane.url + "/v1/sync", data=big, headers=headers) as response,
    ):
        assert response.status == 413
        assert "Maximum request body size" in (await response.json())["error"]
    got, answer = await plane.call("GET", "/v1/sync", token)
    assert got == 405
    assert answer["error"]


async def test_half_bad_batch_writes_nothing(plane: Plane) -> None:
    _, token = await enrol(plane, "a")
    node, other = new_id("nod"), new_id("nod")
    bad = msgspec.json.encode(batch(node, 1, [job(node, "1", 1), job(other, "2", 1)]))
    status, _ = await plane.call(
        "POST", "/v1/sync", token, bad, headers={"Content-Type": "application/json"}
    )
    assert status == 400
    status, body = await plane.call("GET", "/v1/jobs", ADMIN)
    assert body["jobs"] == []


async def test_jobs_filters_and_bad_queries(plane: Plane) -> None:
    a, token = await enrol(plane, "a")
    node = new_id("nod")
    jobs = [job(node, str(i), 3 if i % 2 else 1) for i in range(6)]
    raw = msgspec.json.encode(batch(node, 1, jobs))
    await plane.call("POST", "/v1/sync", token, raw, headers={"Content-Type": "application/json"})
    status, body = await plane.call("GET", f"/v1/jobs?cluster={a}&state=completed&limit=2", ADMIN)
    assert status == 200
    assert len(body["jobs"]) == 2
    status, rest = await plane.call(
        "GET", f"/v1/jobs?cluster={a}&state=completed&limit=2&after={body['next']}", ADMIN
    )
    assert len(rest["jobs"]) == 1
    for query in ("state=exploded", "cluster=nope", "limit=x", "after=[1]"):
        assert (await plane.call("GET", f"/v1/jobs?{query}", ADMIN))[0] == 400


async def test_a_nul_in_a_jobs_text_is_kept_as_a_replacement_character(plane: Plane) -> None:
    # PostgreSQL's text cannot hold a NUL; refusing the batch would stop the node's sync for
    # good (its outbox sends the same job again and again). The control: the job beside it.
    cluster, token = await enrol(plane, "a")
    node = new_id("nod")
    sync = msgspec.json.encode(
        batch(node, 1, [job(node, "1", 3, error="bad\x00byte", model="m\x00"), job(node, "2", 1)])
    )
    assert b"\\u0000" in sync
    status, answer = await plane.call(
        "POST", "/v1/sync", token, sync, headers={"Content-Type": "application/json"}
    )
    assert status == 200, answer
    _, listed = await plane.call("GET", f"/v1/jobs?cluster={cluster}", token)
    jobs = {j["id"]: j for j in listed["jobs"]}
    assert set(jobs) == {"1", "2"}
    assert (jobs["1"]["error"], jobs["1"]["model"]) == ("bad\ufffdbyte", "m\ufffd")
    assert jobs["2"]["model"] == "llama"
