"""Log lines that name their request (netkit.logs, issue 31 item 3): as text, the request's
ids after the message; as JSON, one object a line with them as fields and a traceback as
one; a line written outside any request says nothing of one."""

from __future__ import annotations

import contextvars
import io
import json
import logging
from collections.abc import Iterator

import pytest

from netkit import logs

_request: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="")


@pytest.fixture
def written() -> Iterator[io.StringIO]:
    """A stream for `logs.configure`, with the root logger's handlers put back after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    sources = list(logs._sources)
    yield io.StringIO()
    root.handlers[:] = handlers
    root.setLevel(level)
    logs._sources[:] = sources


def _in_request(request_id: str, message: str) -> None:
    _request.set(request_id)
    logging.getLogger("nvpair.test").warning(message, "x")


def test_json_lines_carry_the_requests_ids_and_a_traceback(written: io.StringIO) -> None:
    logs.configure(logging.INFO, "json", written)
    logs.add_context(lambda: {"request_id": _request.get(), "job_id": ""})
    contextvars.copy_context().run(_in_request, "req_1", "placed %s")
    logging.getLogger("nvpair.test").info("outside")  # the control: no request here
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("nvpair.test").exception("failed")
    lines = [json.loads(line) for line in written.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["placed x", "outside", "failed"]
    placed, outside, failed = lines
    assert placed["request_id"] == "req_1"
    assert "job_id" not in placed  # empty fields are left out
    assert (placed["level"], placed["logger"]) == ("warning", "nvpair.test")
    assert placed["time"].endswith("Z")
    assert "request_id" not in outside
    assert "ValueError: boom" in failed["exception"]


def test_text_lines_say_the_requests_ids_after_the_message(written: io.StringIO) -> None:
    logs.configure(logging.INFO, "text", written)
    logs.add_context(lambda: {"request_id": _request.get()})
    contextvars.copy_context().run(_in_request, "req_2", "placed %s")
    logging.getLogger("nvpair.test").info("outside")
    placed, outside = written.getvalue().splitlines()
    assert placed.endswith("WARNING nvpair.test: placed x [request=req_2]")
    assert outside.endswith("INFO nvpair.test: outside")
