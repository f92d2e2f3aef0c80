"""The manager's method table and how relay actions become broker frames (no I/O)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from workload_manager.manager import Manager
from workload_manager.relay import Event
from workload_manager.workload import Workload, WorkloadRemoval, decode_workload

from .strategies import workload_dicts

MARKER = "PROMPT-MARKER-7f3a"


def remote_record(**extra: Any) -> bytes:
    return json.dumps(
        {
            "id": "9",
            "model": "m",
            "engine": "vllm",
            "runId": "r",
            "state": "running",
            "originatedFrom": "nod_a",
            "scheduledOn": "nod_b",
            "createdAt": 5,
            "startedAt": 6,
            "completedAt": None,
            "seq": 2,
            **extra,
        }
    ).encode()


def started_frame() -> bytes:
    """`remote_record()` as a peer sends it: a `workload:started` notification."""
    record = json.loads(remote_record())
    message = {"jsonrpc": "2.0", "method": "workload:started", "params": {"workloadInfo": record}}
    return json.dumps(message).encode()


def test_remote_event_becomes_one_upsert_without_unknown_fields() -> None:
    to_broker: list[bytes] = []
    to_peers: list[tuple[Event, tuple[str, ...]]] = []
    manager = Manager(
        version="1",
        port=1,
        send_to_broker=to_broker.append,
        send_to_peers=lambda e, x: to_peers.append((e, x)),
    )
    event = decode_workload(remote_record(prompt=MARKER, messages=[{"content": MARKER}]))
    for sender in ("nod_b", "nod_c"):
        manager.carry_out(manager.relay.receive_remote(event, sender, now=0))
    assert len(to_broker) == 1
    frame = json.loads(to_broker[0])
    assert frame["method"] == "workloads:upsert"
    assert "id" not in frame  # a notification
    assert frame["params"]["workloadInfo"] == json.loads(remote_record())
    assert MARKER not in to_broker[0].decode()
    assert to_peers == [(event, ("nod_b", "nod_a"))]


def test_remote_removal_becomes_workloads_remove() -> None:
    to_broker: list[bytes] = []
    manager = Manager(version="1", port=1, send_to_broker=to_broker.append)
    manager.carry_out(
        manager.relay.receive_remote(
            WorkloadRemoval(workloadId="9", originatedFrom="nod_a"), "nod_b", now=0
        )
    )
    assert json.loads(to_broker[0]) == {
        "jsonrpc": "2.0",
        "method": "workloads:remove",
        "params": {"workloadId": "9", "originatedFrom": "nod_a"},
    }


def test_local_event_goes_to_peers_only() -> None:
    to_broker: list[bytes] = []
    to_peers: list[tuple[Event, tuple[str, ...]]] = []
    manager = Manager(
        version="1",
        port=1,
        send_to_broker=to_broker.append,
        send_to_peers=lambda e, x: to_peers.append((e, x)),
    )
    payload = json.dumps(
        {
            "jsonrpc": "2.0",
            "method": "workload:started",
            "params": {"workloadInfo": json.loads(remote_record(prompt=MARKER))},
        }
    ).encode()
    assert manager.handle_local(payload) is None
    assert to_broker == []
    [(event, exclude)] = to_peers
    assert isinstance(event, Workload)
    assert exclude == ()
    assert not hasattr(event, "prompt")


def test_ready_frame() -> None:
    assert json.loads(Manager(version="9.9", port=1).ready_frame()) == {
        "jsonrpc": "2.0",
        "method": "ready",
        "params": {"version": "9.9"},
    }


def test_handle_remote_delivers_once_and_peers_cannot_call_local_methods() -> None:
    to_broker: list[bytes] = []
    manager = Manager(version="1", port=1, send_to_broker=to_broker.append)
    frame = started_frame()
    batch = b"[" + b",".join([frame, frame]) + b"]"
    assert manager.handle_remote(batch, "nod_b").body is None
    assert manager.handle_remote(frame, "nod_c").body is None
    assert len(to_broker) == 1
    assert manager.relay.counters.received_remote == 3
    for method in ("peers:set", "manager:status"):
        reply = manager.handle_remote(
            json.dumps({"jsonrpc": "2.0", "method": method, "params": {}, "id": 1}).encode(),
            "nod_b",
        )
        assert json.loads(reply.body or b"")["error"]["code"] == -32601
        assert reply.invalid == 1


def test_a_deferred_batch_is_answered_first_and_relayed_by_its_callback() -> None:
    # The inter-node server passes `loop.call_soon`: the sender has its answer, then the
    # batch is relayed. A batch that is not all lifecycle notifications is not deferred.
    to_broker: list[bytes] = []
    later: list[Callable[[], None]] = []
    manager = Manager(version="1", port=1, send_to_broker=to_broker.append)
    frame = started_frame()
    reply = manager.handle_remote(b"[" + frame + b"]", "nod_b", later.append)
    assert (reply.body, reply.invalid, to_broker) == (None, 0, [])
    assert len(later) == 1
    later.pop()()
    assert len(to_broker) == 1  # the control: relayed by the callback
    bad = frame.replace(b'"state": "running"', b'"state": "queued"')  # not what the method says
    reply = manager.handle_remote(b"[" + bad + b"]", "nod_b", later.append)
    assert (later, reply.invalid) == ([], 1)


def test_fast_path_methods_are_the_lifecycle_methods() -> None:
    import typing

    from workload_manager.manager import _LifecycleFrame
    from workload_manager.workload import LIFECYCLE_METHODS

    hints = typing.get_type_hints(_LifecycleFrame)
    assert set(typing.get_args(hints["method"])) == set(LIFECYCLE_METHODS)


frame_parts = st.fixed_dictionaries(
    {
        "jsonrpc": st.sampled_from(["2.0", "2.0", "1.0"]),
        "method": st.sampled_from(
            [
                "workload:submitted",
                "workload:started",
                "workload:completed",
                "workload:errored",
                "workloads:remove",
                "manager:status",
            ]
        ),
    },
    optional={
        "id": st.integers(0, 3),
        "result": st.just(1),
        "extra": st.just("x"),
    },
)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    def one() -> dict[str, Any]:
        frame = draw(frame_parts)
        record = draw(workload_dicts())
        record["originatedFrom"] = draw(st.sampled_from(["nod_a", "nod_b"]))
        record["id"] = draw(st.sampled_from(["1", "2"]))
        record["runId"] = "r"
        record["seq"] = draw(st.integers(1, 4))
        if frame["method"] == "workloads:remove":
            frame["params"] = {
                "workloadId": record["id"],
                "originatedFrom": record["originatedFrom"],
            }
        else:
            frame["params"] = {"workloadInfo": record}
        return frame

    if draw(st.booleans()):
        return json.dumps(one()).encode()
    return json.dumps([one() for _ in range(draw(st.integers(0, 4)))]).encode()


def collector(sink: list[Any]) -> Callable[[Event, tuple[str, ...]], None]:
    return lambda event, exclude: sink.append((event, exclude))


@settings(max_examples=150)
@given(st.lists(payloads(), min_size=1, max_size=8), st.sampled_from([None, "nod_c"]))
def test_fast_and_general_paths_give_the_same_answers(
    sequence: list[bytes], sender: str | None
) -> None:
    results = []
    for fast in (True, False):
        to_broker: list[bytes] = []
        to_peers: list[Any] = []
        manager = Manager(
            version="1",
            port=1,
            clock=lambda: 0.0,
            send_to_broker=to_broker.append,
            send_to_peers=collector(to_peers),
            fast_path=fast,
        )
        replies = [
            manager.handle_local(p) if sender is None else manager.handle_remote(p, sender)
            for p in sequence
        ]
        results.append((replies, to_broker, to_peers, manager.relay.counters))
    assert results[0] == results[1]


def test_a_failed_snapshot_page_is_asked_for_again_and_the_view_never_silently_empty() -> None:
    frames: list[bytes] = []
    answers: list[bool] = []
    loaded: list[bool] = []
    manager = Manager(
        version="1",
        port=1,
        send_to_broker=frames.append,
        on_view_loaded=lambda: loaded.append(True),
        on_snapshot_answer=answers.append,
    )
    first = json.loads(manager.snapshot_request())
    page = {"workloads": [], "removed": [{"workloadId": "9", "originatedFrom": "n"}]}
    reply = {"jsonrpc": "2.0", "result": {**page, "next": "c2"}, "id": first["id"]}
    assert manager.handle_local(json.dumps(reply).encode()) is None
    second = json.loads(frames.pop())
    assert second["params"]["cursor"] == "c2"
    error = {"jsonrpc": "2.0", "error": {"code": -32603, "message": "disk"}, "id": second["id"]}
    manager.handle_local(json.dumps(error).encode())
    assert answers == [True, False]
    assert loaded == []  # not "loaded": the second page is missing
    assert manager.view_state == "loading"
    retry = manager.retry_snapshot()
    assert retry is not None
    third = json.loads(retry)
    assert third["params"]["cursor"] == "c2"  # the failed page again, not the first
    assert third["id"] != second["id"]
    late = {"jsonrpc": "2.0", "result": page, "id": second["id"]}  # the old id: dropped
    manager.handle_local(json.dumps(late).encode())
    assert answers == [True, False]
    manager.handle_local(json.dumps({"jsonrpc": "2.0", "result": page, "id": third["id"]}).encode())
    assert (manager.view_state, loaded, manager.snapshot_retries) == ("loaded", [True], 1)
    assert manager.retry_snapshot() is None


def test_a_view_that_never_comes_is_said_to_be_incomplete() -> None:
    loaded: list[bool] = []
    manager = Manager(version="1", port=1, on_view_loaded=lambda: loaded.append(True))
    manager.snapshot_request()
    manager.snapshot_refused()  # the framer refused a frame while the page was awaited
    manager.snapshot_abandoned()
    assert loaded == [True]
    status = json.loads(
        manager.handle_local(b'{"jsonrpc":"2.0","method":"manager:status","id":1}') or b""
    )
    assert status["result"]["view"] == {"state": "incomplete", "retries": 0}


def test_anything_from_a_peer_says_it_is_up() -> None:
    heard: list[str] = []
    manager = Manager(version="1", port=1, on_peer_heard=heard.append)
    manager.handle_remote(b"[]", "nod_b")  # even a payload it refuses
    manager.handle_remote(remote_record(), "nod_c")
    assert heard == ["nod_b", "nod_c"]
