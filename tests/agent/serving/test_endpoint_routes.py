"""The facade's endpoint routing table in memory (agent.serving.endpoint_routes): host matching, the
weighted split, a weight change on the next update, failover order and down marking, and
tables that make no sense answered without a crash."""

from __future__ import annotations

import collections
from collections.abc import Iterable

import msgspec
import pytest

from agent.serving.endpoint_routes import (
    DOWN_S,
    EndpointRoutes,
    ready_in,
    request_host,
)
from agent.serving.openai_routes import ROUTES, form_model, json_model, with_model
from certs.ids import prefixed_ulid
from plane.desired.state import DesiredState, Route, RouteTarget
from scheduler.replicas import ReplicaView

HERE = prefixed_ulid("clu")
THERE = prefixed_ulid("clu")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


URLS = ("http://127.0.0.1:1",)


def target(name: str, *, cluster: str = HERE, weight: int = 0, order: int = 0,
           ready: bool = True, urls: Iterable[str] = URLS) -> RouteTarget:  # fmt: skip
    return RouteTarget(
        deployment=prefixed_ulid("dep"), cluster=cluster, name=name, weight=weight,
        order=order, ready=ready, urls=list(urls),
    )  # fmt: skip


def route(model: str, *targets: RouteTarget, host: str = "", mode: str = "weighted",
          tenant: str | None = None) -> Route:  # fmt: skip
    return msgspec.convert(
        {
            "endpoint": prefixed_ulid("end"), "tenant": tenant or prefixed_ulid("ten"),
            "host": host, "model": model, "mode": mode,
            "targets": [msgspec.to_builtins(t) for t in targets],
        },
        Route,
    )  # fmt: skip


def state(*routes: Route, generation: int = 1) -> DesiredState:
    return DesiredState(cluster=HERE, generation=generation, routes=list(routes))


def table(
    *routes: Route, ready: Iterable[str] = ("blue", "green"), clock: Clock | None = None
) -> EndpointRoutes:
    up = set(ready)
    routes_ = EndpointRoutes(ready_here=up.__contains__, clock=clock or Clock())
    routes_.replace(state(*routes))
    return routes_


def first(routes: EndpointRoutes, model: str, host: str = "") -> str:
    picks = routes.pick(host, model)
    assert picks, (model, picks)
    return picks[0].target.name


def split(routes: EndpointRoutes, model: str, n: int) -> collections.Counter[str]:
    return collections.Counter(first(routes, model) for _ in range(n))


def test_the_host_picks_the_tenant_else_a_tenant_without_one() -> None:
    routes = table(
        route("chat", target("blue", weight=1), host="A.example.com"),
        route("chat", target("green", weight=1), host="b.example.com"),
        route("chat", target("other", weight=1)),
        route("only-any", target("other", weight=1)),
        ready=["blue", "green", "other"],
    )
    assert first(routes, "chat", "a.example.com:8443") == "blue"  # port and case ignored
    assert first(routes, "chat", "B.EXAMPLE.COM.") == "green"
    assert first(routes, "chat", "c.example.com") == "other"  # no tenant there: the hostless
    assert first(routes, "only-any", "a.example.com") == "other"
    assert routes.pick("a.example.com", "not-an-endpoint") is None  # the facade's own lookup
    assert routes.models("a.example.com") == ["chat", "only-any"]
    assert request_host("[::1]:8080") == "[::1]"
    assert request_host("h:x") == "h:x"


def test_an_empty_table_routes_nothing() -> None:
    routes = EndpointRoutes()
    assert routes.pick("a", "chat") is None
    assert len(routes) == 0
    assert routes.models("a") == []


def test_ninety_ten_over_a_thousand_requests() -> None:
    routes = table(route("chat", target("blue", weight=90), target("green", weight=10)))
    counts = split(routes, "chat", 1000)
    assert abs(counts["blue"] - 900) <= 30, counts  # the issue's +- 3 %
    assert counts == {"blue": 900, "green": 100}  # smooth round-robin: exact over each cycle
    # spread out, not in runs: every 10 picks hold exactly one green
    window = [first(routes, "chat") for _ in range(100)]
    assert all(window[i : i + 10].count("green") == 1 for i in range(0, 100, 10))


def test_a_weight_change_applies_on_the_next_update() -> None:
    blue, green = target("blue", weight=90), target("green", weight=10)
    chat = route("chat", blue, green)
    routes = table(chat)
    assert split(routes, "chat", 100) == {"blue": 90, "green": 10}
    patched = msgspec.structs.replace(
        chat, targets=[msgspec.structs.replace(blue, weight=0), green]
    )
    routes.replace(state(patched, generation=2))
    assert split(routes, "chat", 50) == {"green": 50}
    canary = msgspec.structs.replace(
        chat,
        targets=[msgspec.structs.replace(blue, weight=3), msgspec.structs.replace(green, weight=1)],
    )
    routes.replace(state(canary, generation=3))
    assert split(routes, "chat", 400) == {"blue": 300, "green": 100}
    assert routes.generation == 3


def test_a_weighted_target_that_is_down_gives_its_share_to_the_others() -> None:
    clock = Clock()
    remote = target("far", cluster=THERE, weight=50)
    routes = table(route("chat", target("blue", weight=50), remote), clock=clock)
    assert split(routes, "chat", 100) == {"blue": 50, "far": 50}
    routes.failed(remote)
    assert split(routes, "chat", 20) == {"blue": 20}
    picks = routes.pick("", "chat")
    assert picks is not None
    assert [p.target.name for p in picks] == ["blue"]
    clock.now += DOWN_S
    assert split(routes, "chat", 100) == {"blue": 50, "far": 50}


def test_failover_takes_the_first_target_up_by_order() -> None:
    clock = Clock()
    far = target("far", cluster=THERE, order=0)
    routes = table(
        route("chat", target("green", order=2), far, target("blue", order=1), mode="failover"),
        clock=clock,
    )
    picks = routes.pick("", "chat")
    assert picks is not None
    assert [(p.target.name, p.local) for p in picks] == [
        ("far", False),
        ("blue", True),
        ("green", True),
    ]
    routes.failed(far)  # a forward failed: skipped for DOWN_S
    assert first(routes, "chat") == "blue"
    clock.now += DOWN_S - 0.1
    assert first(routes, "chat") == "blue"
    clock.now += 0.2
    assert first(routes, "chat") == "far"  # tried again


def test_up_here_is_a_ready_replica_and_there_the_planes_ready() -> None:
    routes = table(
        route(
            "chat",
            target("blue", order=0),  # no ready replica here
            target("far", cluster=THERE, order=1, ready=False),  # the plane saw none ready
            target("nowhere", cluster=THERE, order=2, urls=()),  # no facade to forward to
            target("green", order=3),
            mode="failover",
        ),
        ready=["green"],
    )
    assert first(routes, "chat") == "green"
    views = [
        ReplicaView("r1", "n1", "blue", state="starting"),
        ReplicaView("r2", "n2", "blue", reachable=False),
        ReplicaView("r3", "n3", "green"),
    ]
    assert not ready_in(views, "blue")
    assert ready_in(views, "green")


def test_tables_that_make_no_sense_route_nothing_without_a_crash() -> None:
    duplicate = target("blue", weight=1)
    routes = table(
        route("zero", target("blue", weight=0), target("green", weight=0)),
        route("empty"),
        route("none-up", target("far", cluster=THERE, ready=False, weight=5)),
        route("twice", duplicate, duplicate),
        route("clash", target("blue", weight=1), tenant="ten_" + "0" * 26),
        route("clash", target("green", weight=1), tenant="ten_" + "1" * 26),
    )
    for model in ("zero", "empty", "none-up"):
        assert routes.pick("", model) == [], model  # an endpoint, with nothing to send to
    assert split(routes, "twice", 10) == {"blue": 10}
    assert split(routes, "clash", 4) == {"blue": 4}  # one of two tenants' routes, always the same
    routes.replace(DesiredState(cluster=HERE, generation=9))  # the endpoints all gone
    assert routes.pick("", "zero") is None
    assert len(routes) == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/audio/transcriptions"])
def test_the_body_names_the_deployment_instead(path: str) -> None:
    if ROUTES[path].form:
        kind = "multipart/form-data; boundary=xyz"
        body = (
            b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nRIFF'
            b'\r\n--xyz\r\nContent-Disposition: form-data; name="model"\r\n\r\nchat'
            b"\r\n--xyz--\r\n"
        )
        rewritten = with_model(ROUTES[path], kind, body, "blue-v2")
        assert form_model(kind, rewritten) == "blue-v2"
        assert rewritten.replace(b"blue-v2", b"chat") == body  # nothing else changed
    else:
        body = b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}'
        rewritten = with_model(ROUTES[path], "application/json", body, "blue-v2")
        assert json_model(rewritten) == "blue-v2"
        assert msgspec.json.decode(rewritten)["messages"] == [{"role": "user", "content": "hi"}]
