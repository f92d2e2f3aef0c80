"""The endpoints API in process (plane.desired.endpoints_api) on a real PostgreSQL: a tenant's
endpoints are its own, bad bodies are refused naming the field with nothing written, and
the routing table (plane.desired.routes_sql) says where each target runs and whether it is ready."""

from __future__ import annotations

from typing import Any

from plane.db.connection import connection
from plane.desired.routes_sql import routes

from ..endpoint_rows import Rows
from ..plane_client import ADMIN, Plane, enrol


def weighted(*pairs: tuple[str, int]) -> list[dict[str, Any]]:
    return [{"deployment": d, "weight": n} for d, n in pairs]


async def _world(plane: Plane, pg_dsn: str) -> dict[str, Any]:
    rows = Rows(pg_dsn)
    east, _ = await enrol(plane, "east")
    west, token = await enrol(plane, "west")
    acme, acme_project, acme_key = await rows.tenant("acme", host="Chat.Acme.Example")
    _, other_project, other_key = await rows.tenant("other")
    return {
        "rows": rows, "east": east, "west": west, "west_token": token, "acme": acme,
        "acme_key": acme_key, "other_key": other_key,
        "blue": await rows.deployment(acme_project, "blue", east),
        "green": await rows.deployment(acme_project, "green", west),
        "theirs": await rows.deployment(other_project, "theirs", east),
    }  # fmt: skip


async def test_a_tenants_endpoints_are_its_own(plane: Plane, pg_dsn: str) -> None:
    w = await _world(plane, pg_dsn)
    key, other = w["acme_key"], w["other_key"]
    body = {
        "modelName": "chat",
        "targets": [
            {"deployment": w["blue"], "weight": 90},
            {"deployment": w["green"], "weight": 10},
        ],
    }
    status, made = await plane.call("POST", "/v1/endpoints", key, body)
    assert status == 201, made
    assert made["tenant"] == w["acme"]
    assert made["mode"] == "weighted"
    path = f"/v1/endpoints/{made['id']}"
    assert await plane.call("GET", path, key) == (200, made)
    # Another tenant: as if it were not there, and nothing it does changes it.
    for method, sent in (("GET", None), ("PATCH", {"modelName": "x"}), ("DELETE", None)):
        status, said = await plane.call(method, path, other, sent)
        assert status == 404, (method, said)
    assert await plane.call("GET", "/v1/endpoints", other) == (200, {"items": []})
    assert await plane.call("GET", f"/v1/endpoints?tenant={w['acme']}", other) == (
        200,
        {"items": []},
    )
    assert (await plane.call("GET", "/v1/endpoints", w["west_token"]))[0] == 403
    # ... nor may it point its own endpoint at acme's deployment
    theirs = {"modelName": "x", "targets": weighted((w["blue"], 1))}
    status, said = await plane.call("POST", "/v1/endpoints", other, theirs)
    assert status == 400
    assert said["error"].startswith("targets[0].deployment:")
    # The admin sees every tenant's and names the tenant it creates for.
    status, listed = await plane.call("GET", "/v1/endpoints", ADMIN)
    assert status == 200
    assert [e["id"] for e in listed["items"]] == [made["id"]]
    status, said = await plane.call("POST", "/v1/endpoints", ADMIN, {**body, "modelName": "c2"})
    assert status == 400
    assert said["error"].startswith("tenant:")
    named = {**body, "modelName": "c2", "tenant": w["acme"]}
    status, _ = await plane.call("POST", "/v1/endpoints", ADMIN, named)
    assert status == 201
    # The same public name twice in one tenant: 409 naming the field.
    status, said = await plane.call("POST", "/v1/endpoints", key, body)
    assert status == 409
    assert said["error"].startswith("modelName:")
    # PATCH the targets: the canary's weight moves.
    patched = {"targets": weighted((w["blue"], 50), (w["green"], 50))}
    status, changed = await plane.call("PATCH", path, key, patched)
    assert status == 200, changed
    assert changed["targets"] == patched["targets"]
    blue_green = [{"deployment": w["green"]}, {"deployment": w["blue"]}]  # orders by place
    status, changed = await plane.call(
        "PATCH", path, key, {"mode": "failover", "targets": blue_green}
    )
    assert status == 200, changed
    assert changed["targets"] == [{**t, "order": n} for n, t in enumerate(blue_green)]
    assert await plane.call("DELETE", path, key) == (200, {"deleted": made["id"]})
    assert (await plane.call("GET", path, key))[0] == 404


async def test_bad_bodies_are_refused_naming_the_field(plane: Plane, pg_dsn: str) -> None:
    w = await _world(plane, pg_dsn)
    key, blue, green = w["acme_key"], w["blue"], w["green"]
    good = {"modelName": "chat", "targets": [{"deployment": blue, "weight": 1}]}
    for body, field in (
        ({**good, "modelName": ""}, "modelName"),
        ({**good, "modelName": "two words"}, "modelName"),
        ({**good, "mode": "random"}, "mode"),
        ({**good, "targets": []}, "targets"),
        ({**good, "targets": [{"deployment": blue, "weight": 0}]}, "targets"),
        ({**good, "targets": [{"deployment": blue, "weight": -1}]}, "targets[0].weight"),
        ({**good, "targets": [{"deployment": blue, "weight": True}]}, "targets[0].weight"),
        ({**good, "targets": [{"deployment": blue}]}, "targets[0].weight"),
        ({**good, "targets": [{"deployment": "dep_x", "weight": 1}]}, "targets[0].deployment"),
        ({**good, "targets": weighted((blue, 1), (blue, 1))}, "targets[1].deployment"),
        ({**good, "targets": [{"deployment": w["theirs"], "weight": 1}]}, "targets[0].deployment"),
        ({**good, "targets": [{"deployment": blue, "order": 0}]}, "targets[0].order"),
        ({**good, "mode": "failover", "targets": [{"deployment": blue, "order": 1},
                                                  {"deployment": green, "order": 1}]},
         "targets[1].order"),
        ({**good, "prompt": "secret"}, "prompt"),
        # Another id than acme's (a fixed last digit would be acme's own one time in 32).
        ({**good, "tenant": w["acme"][:-1] + ("1" if w["acme"][-1] == "0" else "0")}, "tenant"),
    ):  # fmt: skip
        status, said = await plane.call("POST", "/v1/endpoints", key, body)
        assert status == 400, (body, status, said)
        assert said["error"].startswith(field + ":"), (field, said)
    status, said = await plane.call("POST", "/v1/endpoints", key, b"[1, 2")
    assert status == 400
    assert await plane.call("GET", "/v1/endpoints", key) == (200, {"items": []})  # nothing written
    status, made = await plane.call("POST", "/v1/endpoints", key, good)  # the control
    assert status == 201, made
    path = f"/v1/endpoints/{made['id']}"
    for body, field in (
        ({"mode": "failover"}, "targets"),  # a new mode needs its targets
        ({"tenant": w["acme"]}, "tenant"),
        ({"targets": [{"deployment": blue, "weight": 0}]}, "targets"),
    ):
        status, said = await plane.call("PATCH", path, key, body)
        assert status == 400, (body, status, said)
        assert said["error"].startswith(field + ":"), (field, said)
    assert await plane.call("GET", path, key) == (200, made)  # unchanged
    assert (await plane.call("GET", "/v1/endpoints/end_nothing", key))[0] == 404


async def test_the_routing_table_says_where_and_whether_ready(plane: Plane, pg_dsn: str) -> None:
    w = await _world(plane, pg_dsn)
    rows: Rows = w["rows"]
    east, west = w["east"], w["west"]
    n1 = await rows.node(west, "http://10.0.0.1:14323")
    await rows.node(west, "http://10.0.0.2:14323")
    await rows.node(west, "http://10.0.0.3:14323", reachable=False)  # not listed
    e1 = await rows.node(east, "http://10.0.1.1:14323")
    await rows.replica(w["green"], west, n1)
    await rows.replica(w["blue"], east, e1, state="starting")
    body = {
        "modelName": "chat",
        "targets": [
            {"deployment": w["blue"], "weight": 90},
            {"deployment": w["green"], "weight": 10},
        ],
    }
    status, made = await plane.call("POST", "/v1/endpoints", w["acme_key"], body)
    assert status == 201
    before = await rows.sql("SELECT desired_generation FROM clusters ORDER BY id")
    async with connection(plane.store.pool) as conn:
        (route,) = await routes(conn)
    assert (route.endpoint, route.tenant, route.host, route.model, route.mode) == (
        made["id"], w["acme"], "chat.acme.example", "chat", "weighted"
    )  # fmt: skip
    blue, green = route.targets
    assert (blue.cluster, blue.name, blue.weight, blue.ready, blue.urls) == (
        east, "blue", 90, False, ["http://10.0.1.1:14323"]
    )  # fmt: skip
    assert (green.cluster, green.name, green.weight, green.ready) == (west, "green", 10, True)
    assert sorted(green.urls) == ["http://10.0.0.1:14323", "http://10.0.0.2:14323"]
    # A deployment that goes leaves its endpoint's table; a change bumps every cluster's
    # desired generation.
    await rows.sql("DELETE FROM deployments WHERE id = %s", w["green"])
    async with connection(plane.store.pool) as conn:
        (route,) = await routes(conn)
    assert [t.name for t in route.targets] == ["blue"]
    # A replica of the cluster's own deployment of that name makes it ready (what its
    # facades serve under the name); one in another cluster does not.
    await rows.replica(None, west, n1, name="blue")
    async with connection(plane.store.pool) as conn:
        assert not (await routes(conn))[0].targets[0].ready
    await rows.replica(None, east, e1, name="blue")
    async with connection(plane.store.pool) as conn:
        assert (await routes(conn))[0].targets[0].ready
    await plane.call("PATCH", f"/v1/endpoints/{made['id']}", w["acme_key"], {"modelName": "chat2"})
    after = await rows.sql("SELECT desired_generation FROM clusters ORDER BY id")
    assert all(a[0] == b[0] + 1 for a, b in zip(after, before, strict=True))  # type: ignore[operator]
