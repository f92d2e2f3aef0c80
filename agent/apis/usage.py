"""`POST /v1/usage` on the local API: the usage of jobs this member originated, for
`nvpair jobs --usage`.

The body is `{"jobs": [[runId, id], ...]}` (at most `MAX_JOBS`); the answer is
`{"usage": {"runId/id": {promptTokens, completionTokens, ttftMs, totalMs}}}` for those this
member holds a row of: the jobs it originated and finished (others are left out, and the
CLI shows them as `-`: each job's usage is kept on its origin only).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
from aiohttp import web

from agent.apis.answers import json_answer, read_json
from agent.serving.usage_book import UsageBook

__all__ = ["MAX_JOBS", "usage_routes"]

MAX_JOBS: Final = 10_000
_Key = Annotated[str, msgspec.Meta(max_length=256)]


class _Asked(msgspec.Struct, frozen=True):
    jobs: Annotated[list[tuple[_Key, _Key]], msgspec.Meta(max_length=MAX_JOBS)]


_asked: Final = msgspec.json.Decoder(_Asked)


def usage_routes(book: UsageBook) -> list[web.RouteDef]:
    """The route, over `book`'s store."""

    async def usage(request: web.Request) -> web.Response:
        asked = await read_json(request, _asked, 'the body is {"jobs": [[runId, id], ...]}')
        rows = await book.store.of(asked.jobs)
        answer = {
            f"{run}/{job}": {
                "promptTokens": row.prompt_tokens,
                "completionTokens": row.completion_tokens,
                "ttftMs": row.ttft_ms,
                "totalMs": row.total_ms,
            }
            for (run, job), row in rows.items()
        }
        return json_answer({"usage": answer})

    return [web.post("/v1/usage", usage)]
