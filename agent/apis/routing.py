"""The routing routes of the local API (issue 29): how this member's facade picks a
deployment's replica, and why it would pick one for a given request.

- `GET /v1/routing` -- `{policy, policies}`.
- `PUT /v1/routing` -- `{policy}`: `prefix`, `load` or `round-robin`, until the agent
  restarts (`[routing] policy` in nvpair.toml is what it starts with).
- `POST /v1/routing/explain` -- `{model, request, session?}`: `request` is an OpenAI
  request body (chat `messages`, a `prompt`, a Responses `input`); the answer is
  `agent.serving.routing.explain`'s: each replica's place in the request's anchor order,
  its work and load score, the bound, and the choice. Nothing of the prompt is kept or said
  back: the anchor is shown as its first six bytes of keyed hash.
"""

from __future__ import annotations

from typing import Any, Final, get_args

import msgspec
from aiohttp import web

from agent.apis.answers import bad_request, json_answer, read_json
from agent.serving.facade import Facade
from agent.serving.routing import POLICIES, Policy

__all__ = ["routing_routes"]


class _PolicyBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    policy: Policy


class _ExplainBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    model: str
    request: dict[str, Any]
    session: str = ""


_policy_decoder: Final = msgspec.json.Decoder(_PolicyBody)
_explain_decoder: Final = msgspec.json.Decoder(_ExplainBody)
assert set(get_args(Policy)) == set(POLICIES)


def routing_routes(facade: Facade) -> list[web.RouteDef]:
    """The routes over this member's facade."""

    async def policy(request: web.Request) -> web.Response:
        return json_answer({"policy": facade.policy, "policies": list(POLICIES)})

    async def set_policy(request: web.Request) -> web.Response:
        body = await read_json(request, _policy_decoder, "not a routing policy")
        facade.policy = body.policy
        return json_answer({"policy": facade.policy, "policies": list(POLICIES)})

    async def explain(request: web.Request) -> web.Response:
        body = await read_json(request, _explain_decoder, "not an explain request")
        if not body.model or len(body.model) > 1024:
            raise bad_request("model must be 1 to 1024 characters", "not an explain request")
        return json_answer(facade.explain(body.model, body.request, body.session))

    return [
        web.get("/v1/routing", policy),
        web.put("/v1/routing", set_policy),
        web.post("/v1/routing/explain", explain),
    ]
