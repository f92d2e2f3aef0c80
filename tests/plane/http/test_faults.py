"""Whose fault, over HTTP on a real PostgreSQL: the caller's mistakes are 4xx (a name enrolled
twice is 409, malformed parameters 400, never 500), and a database that is down -- at start
or while serving -- is a 503 with `Retry-After`, not a crash."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from plane.core.ids import new_id
from plane.db.devserver import free_port, throwaway_postgres
from plane.http.service import PlaneService
from tests.fixtures.waiting import eventually

from ..db.test_store import batch, job
from ..plane_client import ADMIN, Plane, enrol

JSON = {"Content-Type": "application/json"}


async def test_enrolling_a_name_twice_is_a_409_and_keeps_the_first(plane: Plane) -> None:
    first, token = await enrol(plane, "lab")
    status, body = await plane.call("POST", "/v1/clusters", ADMIN, {"name": "lab"})
    assert status == 409
    assert body["error"] == "a cluster named 'lab' is enrolled already"
    # The first enrolment is untouched: its token still syncs, and one "lab" is listed.
    node = new_id("nod")
    raw = msgspec.json.encode(batch(node, 1, [job(node, "1", 1)]))
    assert (await plane.call("POST", "/v1/sync", token, raw, headers=JSON))[0] == 200
    listed = (await plane.call("GET", "/v1/clusters", ADMIN))[1]
    assert [(c["id"], c["name"]) for c in listed] == [(first, "lab")]


@pytest.mark.parametrize(
    "body",
    [{"name": ""}, {"name": "x" * 129}, {"name": 7}, {"name": "a\u0000b"}, {}, b"{oops"],
)
async def test_a_bad_cluster_name_is_a_400(plane: Plane, body: Any) -> None:
    status, answer = await plane.call("POST", "/v1/clusters", ADMIN, body)
    assert (status, answer["error"]) == (400, 'the body is {"name": "1 to 128 characters"}')


@pytest.mark.parametrize(
    "query",
    [
        "after=" + urllib.parse.quote("[1, 2, 3, 4, 5]"),  # numbers where the cursor has text
        "after=" + urllib.parse.quote('["x", "a", "b", "c", "d"]'),  # text where it has a time
        "after=" + urllib.parse.quote('[1, "a\\u0000", "b", "c", "d"]'),  # a NUL
        "after=" + urllib.parse.quote('[99999999999999999999, "a", "b", "c", "d"]'),
        "after=" + urllib.parse.quote('{"a": 1}'),
        "after=",
        "limit=1e3",
        "limit=99999999999999999999999",
        "limit=",
        "model=" + urllib.parse.quote("llama\x00"),
        "model=" + "m" * 300,
        "state=Completed",
    ],
)
async def test_malformed_job_queries_are_400_not_500(plane: Plane, query: str) -> None:
    status, body = await plane.call("GET", f"/v1/jobs?{query}", ADMIN)
    assert status == 400, (query, body)
    assert body["error"]


@pytest.mark.parametrize("window", ["x", "0", "-1", "1e9", "99999999999999999999", "31622401"])
async def test_a_malformed_window_is_400_not_500(plane: Plane, window: str) -> None:
    status, body = await plane.call("GET", f"/v1/fleet/summary?window={window}", ADMIN)
    assert status == 400, body
    assert "window" in body["error"]
    # The control: the largest window allowed is answered.
    assert (await plane.call("GET", "/v1/fleet/summary?window=31622400", ADMIN))[0] == 200


async def test_unknown_and_malformed_cluster_ids_are_404(plane: Plane) -> None:
    for cluster in (new_id("clu"), "nope", urllib.parse.quote("clu_\x00")):
        assert (await plane.call("GET", f"/v1/clusters/{cluster}", ADMIN))[0] == 404
        assert (await plane.call("POST", f"/v1/clusters/{cluster}/revoke", ADMIN))[0] == 404


async def test_values_the_database_refuses_are_400_and_write_nothing(plane: Plane) -> None:
    # (A NUL in a string is stored as U+FFFD, not refused: tests/plane/http/test_server.py.)
    _, token = await enrol(plane, "a")
    node = new_id("nod")
    too_new = msgspec.json.encode(batch(node, 2**63, []))
    assert (await plane.call("POST", "/v1/sync", token, too_new, headers=JSON))[0] == 400
    assert (await plane.call("GET", "/v1/jobs", ADMIN))[1]["jobs"] == []
    # The control: a batch of the same node at a generation in range is written.
    good = msgspec.json.encode(batch(node, 1, [job(node, "1", 1)]))
    assert (await plane.call("POST", "/v1/sync", token, good, headers=JSON))[0] == 200
    assert len((await plane.call("GET", "/v1/jobs", ADMIN))[1]["jobs"]) == 1


@pytest.mark.parametrize(
    ("token", "status"),
    [
        (b"\xff\xfe\xed", b"401"),
        (b"hgro1.\xc3", b"401"),
        (b"nvpadm1.\x01", b"400"),  # aiohttp's parser refuses a control character itself
    ],
)
async def test_a_token_of_raw_bytes_is_refused_not_a_500(
    plane: Plane, token: bytes, status: bytes
) -> None:
    # Raw bytes in a header, as no HTTP client library would send them.
    host, port = plane.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"GET /v1/clusters HTTP/1.1\r\nHost: plane\r\nAuthorization: Bearer "
        + token
        + b"\r\nConnection: close\r\n\r\n"
    )
    answer = await reader.read()
    writer.close()
    assert answer.split(b" ", 2)[1] == status, answer[:200]
    # The control: the same request with the admin token is answered.
    assert (await plane.call("GET", "/v1/clusters", ADMIN))[0] == 200


# -- the database down ----------------------------------------------------------------------


async def call(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any, str | None]:
    """(status, decoded body, Retry-After) of one admin call."""
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url + path, json=body, headers=headers) as response,
    ):
        text = await response.read()
        decoded = msgspec.json.decode(text) if text else None
        return response.status, decoded, response.headers.get("Retry-After")


@pytest.fixture
async def service_on_a_closed_port() -> AsyncIterator[tuple[PlaneService, str, int]]:
    """A plane whose DSN names a port where nothing listens (yet)."""
    port = free_port()
    service = PlaneService(
        f"postgresql://nvpair@127.0.0.1:{port}/postgres",
        host="127.0.0.1",
        port=0,
        admin_token=ADMIN,
        pool_timeout_s=2.0,
    )
    bound = await service.start()
    yield service, f"http://127.0.0.1:{bound}", port
    await service.aclose()


async def test_a_plane_without_its_database_starts_and_answers_503_then_recovers(
    pg_server: str, service_on_a_closed_port: tuple[PlaneService, str, int]
) -> None:
    service, url, pg_port = service_on_a_closed_port
    status, body, retry = await call(url, "GET", "/healthz")
    assert (status, body["ok"], retry) == (503, False, "1")
    for method, path in (("GET", "/v1/clusters"), ("POST", "/v1/sync"), ("GET", "/v1/jobs")):
        status, body, retry = await call(url, method, path)
        assert (status, retry) == (503, "1"), (path, body)
        assert "database" in body["error"]
        assert str(pg_port) not in body["error"]  # where the database lives stays in the log

    async def says_why() -> bool:
        _, health, _ = await call(url, "GET", "/healthz")
        return "database is not reachable" in health["error"]

    await eventually(says_why, "/healthz says the database is not reachable")
    assert not service.ready
    with contextlib.ExitStack() as stack:
        # The database appears where the DSN points: the plane migrates and serves.
        await asyncio.to_thread(stack.enter_context, throwaway_postgres(pg_port))

        async def serving() -> bool:
            return (await call(url, "GET", "/healthz"))[0] == 200

        await eventually(serving, "the plane serves once its database answers", within_s=30)
        assert service.ready
        status, body, _ = await call(url, "POST", "/v1/clusters", {"name": "late"})
        assert status == 201, body
        # And now it goes away while the plane serves: 503 with Retry-After, not 500.
        await asyncio.to_thread(stack.close)
        for method, path, payload in (
            ("GET", "/v1/clusters", None),
            ("POST", "/v1/clusters", {"name": "later"}),
        ):
            status, body, retry = await call(url, method, path, payload)
            assert (status, retry) == (503, "1"), body
            assert "database" in body["error"]
