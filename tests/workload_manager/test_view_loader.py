"""The view loader's timing and bounds, in one process with a broker that answers late or
never (short waits passed in)."""

from __future__ import annotations

import asyncio
import json

from workload_manager.manager import Manager
from workload_manager.view_loader import ViewLoader


async def test_a_broker_that_never_answers_leaves_an_incomplete_view_not_a_silent_one() -> None:
    loaded: list[bool] = []
    sent: list[bytes] = []
    loader = ViewLoader(wait_s=0.01, retries=3, backoff_s=(0.001, 0.002))
    manager = Manager(
        version="1",
        port=1,
        on_view_loaded=lambda: loaded.append(True),
        on_snapshot_answer=loader.on_answer,
    )
    manager.snapshot_request()
    await asyncio.wait_for(loader.load(manager, sent.append), timeout=5)
    assert len(sent) == 3  # asked again three times, then gave up
    assert {json.loads(frame)["method"] for frame in sent} == {"workloads:snapshot"}
    assert manager.view_state == "incomplete"
    assert loaded == [True]  # senders go ahead with what there is


async def test_a_page_answered_after_a_retry_completes_the_view() -> None:
    loaded: list[bool] = []
    loader = ViewLoader(wait_s=0.01, retries=3, backoff_s=(0.001, 0.002))
    manager = Manager(
        version="1",
        port=1,
        on_view_loaded=lambda: loaded.append(True),
        on_snapshot_answer=loader.on_answer,
    )
    manager.snapshot_request()

    def broker(frame: bytes) -> None:
        # The retry is answered, at once, with the whole (empty) view.
        request = json.loads(frame)
        reply = {"jsonrpc": "2.0", "result": {"workloads": [], "removed": []}}
        manager.handle_local(json.dumps({**reply, "id": request["id"]}).encode())

    await asyncio.wait_for(loader.load(manager, broker), timeout=5)
    assert (manager.view_state, manager.snapshot_retries, loaded) == ("loaded", 1, [True])
