"""The broker's end of the local channel, in memory: frames in, actions out."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.channel import (
    MAX_SNAPSHOT_PAGE,
    Answered,
    BrokerChannel,
    ChannelAction,
    ManagerReady,
    Refused,
    SendToManager,
    SnapshotWanted,
    StoreRemove,
    StoreUpsert,
)
from broker.errors import InvalidCursor
from tests.fixtures.records import workload, workload_record
from workload_manager.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    ErrorObject,
)
from workload_manager.manager import Manager, View, broker_frame
from workload_manager.workload import WorkloadRemoval


def frame(method: str, params: Any = None, request_id: int | str | None = None) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    if request_id is not None:
        message["id"] = request_id
    return json.dumps(message).encode()


def error_code(action: object) -> int:
    assert isinstance(action, SendToManager), action
    return int(json.loads(action.frame)["error"]["code"])


def test_ready_upsert_and_remove_become_actions_with_no_reply() -> None:
    channel = BrokerChannel()
    assert channel.receive(Manager(version="1.2", port=1).ready_frame()) == [ManagerReady("1.2")]
    record = workload_record("1", 2, prompt="never stored")
    assert channel.receive(frame("workloads:upsert", {"workloadInfo": record})) == [
        StoreUpsert(workload("1", 2))
    ]
    removal = {"workloadId": "1", "originatedFrom": "nod_a"}
    assert channel.receive(frame("workloads:remove", removal)) == [
        StoreRemove(WorkloadRemoval(workloadId="1", originatedFrom="nod_a"))
    ]


def test_a_batch_is_taken_whole() -> None:
    channel = BrokerChannel()
    batch = (
        b"["
        + b",".join(
            frame("workloads:upsert", {"workloadInfo": workload_record(str(i))}) for i in range(3)
        )
        + b"]"
    )
    assert channel.receive(batch) == [StoreUpsert(workload(str(i))) for i in range(3)]


def test_bad_frames_are_answered_with_the_codec_errors() -> None:
    channel = BrokerChannel()
    [parse] = channel.receive(b'{"jsonrpc": "2.0", "method": ')
    assert error_code(parse) == PARSE_ERROR
    [invalid] = channel.receive(b'{"jsonrpc": "1.0", "method": "ready", "id": 1}')
    assert error_code(invalid) == INVALID_REQUEST
    [unknown] = channel.receive(frame("peers:get", {}, request_id=7))
    assert error_code(unknown) == METHOD_NOT_FOUND
    assert json.loads(unknown.frame)["id"] == 7  # type: ignore[union-attr]
    [bad] = channel.receive(frame("workloads:upsert", {"workloadInfo": {"id": "1"}}, request_id=8))
    assert error_code(bad) == INVALID_PARAMS
    [no_params] = channel.receive(frame("workloads:remove", request_id=9))
    assert error_code(no_params) == INVALID_PARAMS


def test_bad_notifications_are_ignored_and_counted_never_answered() -> None:
    channel = BrokerChannel()
    assert channel.receive(frame("workloads:upsert", {"workloadInfo": {"id": "1"}})) == []
    assert channel.receive(frame("no:such", {})) == []
    assert channel.dispatcher.notification_errors == 2
    # The control: a good notification beside them is taken.
    good = frame("workloads:upsert", {"workloadInfo": workload_record("1")})
    assert channel.receive(good) == [StoreUpsert(workload("1"))]


def test_a_snapshot_request_is_deferred_to_the_store_and_bounded() -> None:
    channel = BrokerChannel()
    assert channel.receive(frame("workloads:snapshot", {"limit": 5}, request_id="s1")) == [
        SnapshotWanted("s1", None, 5)
    ]
    big = frame("workloads:snapshot", {"limit": 10**9, "cursor": "c"}, request_id="s2")
    assert channel.receive(big) == [SnapshotWanted("s2", "c", MAX_SNAPSHOT_PAGE)]
    [zero] = channel.receive(frame("workloads:snapshot", {"limit": 0}, request_id="s3"))
    assert error_code(zero) == INVALID_PARAMS
    assert channel.receive(frame("workloads:snapshot", request_id="s4")) == [
        SnapshotWanted("s4", None, 2000)
    ]


def test_snapshot_failures_say_whose_fault() -> None:
    foreign = BrokerChannel.snapshot_failed("s1", InvalidCursor("[1]"))
    assert json.loads(foreign)["error"]["code"] == INVALID_PARAMS
    broken = BrokerChannel.snapshot_failed("s2", OSError("disk"))
    assert json.loads(broken) == {
        "jsonrpc": "2.0",
        "error": {
            "code": INTERNAL_ERROR,
            "message": "Internal error",
            "data": "the Jobs store could not be read: OSError",
        },
        "id": "s2",
    }


def test_a_view_reaches_a_manager_in_pages() -> None:
    # The two cores talk to each other, as over stdio: the manager asks, the channel says
    # what the store must read, the store's page goes back, the manager asks for the next.
    records = sorted((workload(str(i), 1 + i % 3) for i in range(7)), key=lambda w: w.id)
    removed = [WorkloadRemoval(workloadId="gone", originatedFrom="nod_a")]
    page_size = 3
    to_channel: list[bytes] = []
    loaded: list[bool] = []
    manager = Manager(
        version="1",
        port=1,
        send_to_broker=to_channel.append,
        on_view_loaded=lambda: loaded.append(True),
    )
    channel = BrokerChannel()
    to_channel.append(manager.snapshot_request())
    pages = 0
    while to_channel:
        [wanted] = channel.receive(to_channel.pop(0))
        assert isinstance(wanted, SnapshotWanted)
        start = int(wanted.cursor or 0)
        end = start + min(page_size, wanted.limit)
        view = View(
            workloads=records[start:end],
            removed=removed if wanted.cursor is None else [],
            next=str(end) if end < len(records) else None,
        )
        pages += 1
        assert manager.handle_local(channel.snapshot_reply(wanted.request_id, view)) is None
    assert pages == 3
    assert loaded == [True]
    assert manager.relay.live_count == 7
    assert manager.relay.is_removed("nod_a", "gone")


def test_answers_to_our_requests() -> None:
    channel = BrokerChannel()
    first, request = channel.request("manager:status")
    assert json.loads(request) == {"jsonrpc": "2.0", "method": "manager:status", "id": first}
    second, _ = channel.request("manager:status", {"verbose": True})
    assert first != second
    assert channel.pending == 2
    ok = json.dumps({"jsonrpc": "2.0", "result": {"held": 1}, "id": first}).encode()
    [answered] = channel.receive(ok)
    assert isinstance(answered, Answered)
    assert answered.request_id == first
    assert msgspec.json.decode(answered.result) == {"held": 1}
    refused = {"jsonrpc": "2.0", "error": {"code": -32000, "message": "no"}, "id": second}
    assert channel.receive(json.dumps(refused).encode()) == [
        Refused(second, "manager:status", ErrorObject(code=-32000, message="no"))
    ]
    assert channel.pending == 0
    # A late answer to what was answered already, or forgotten, or never asked: dropped.
    assert channel.receive(ok) == []
    third, _ = channel.request("manager:status")
    channel.forget(third)
    assert channel.receive(ok.replace(first.encode(), third.encode())) == []
    fourth, _ = channel.request("manager:status")
    assert channel.abandon() == [fourth]
    assert channel.pending == 0


def test_frames_we_send() -> None:
    removal = WorkloadRemoval(workloadId="1", originatedFrom="nod_a")
    assert json.loads(BrokerChannel.removal_frame(removal)) == {
        "jsonrpc": "2.0",
        "method": "workloads:remove",
        "params": {"workloadId": "1", "originatedFrom": "nod_a"},
    }
    event = json.loads(BrokerChannel.event_frame("workload:started", workload("1", 2)))
    assert event["params"]["workloadInfo"] == workload_record("1", 2)
    assert json.loads(BrokerChannel.peers_frame([])) == {
        "jsonrpc": "2.0",
        "method": "peers:set",
        "params": {"peers": []},
    }


@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_nothing_but_actions_come_out_of_any_bytes(payload: bytes) -> None:
    # Random bytes are at most one bad frame: never an exception, at most one error reply.
    actions = BrokerChannel().receive(payload)
    assert all(isinstance(action, ChannelAction) for action in actions)
    assert len([a for a in actions if isinstance(a, SendToManager)]) <= 1


def test_a_frame_the_manager_refused_is_logged_not_dropped_unseen(
    caplog: pytest.LogCaptureFixture,
) -> None:
    channel = BrokerChannel()
    refusal = {
        "jsonrpc": "2.0",
        "error": {"code": -32600, "message": "Invalid Request", "data": "frame exceeds 1048576"},
        "id": None,
    }
    assert channel.receive(json.dumps(refusal).encode()) == []
    assert "the workload manager refused a frame: Invalid Request frame exceeds" in caplog.text


def test_the_managers_upsert_frames_are_taken_in_one_pass_and_nothing_else_is() -> None:
    record = workload("1", 2)
    sent = broker_frame(record)  # the manager's own encoding
    assert BrokerChannel.upsert_of(sent) == record
    assert BrokerChannel().receive(sent) == [StoreUpsert(record)]  # the same by dispatch
    others = [
        frame("workloads:upsert", {"workloadInfo": workload_record("1", 2)}),  # spaced: dispatch
        frame("workloads:remove", {"workloadId": "1", "originatedFrom": "nod_a"}),
        sent[:-1] + b',"id":1}',  # a request: answered by the dispatcher
        sent[:40] + b"\xff" + sent[41:],  # the head, then not JSON
        sent.replace(b'"seq":2', b'"seq":0'),  # out of bounds
    ]
    for other in others:
        assert BrokerChannel.upsert_of(other) is None, other
    assert BrokerChannel().receive(others[0]) == [StoreUpsert(record)]  # the control


@given(
    st.binary(max_size=300).map(
        lambda tail: b'{"jsonrpc":"2.0","method":"workloads:upsert",' + tail
    )
)
def test_any_bytes_after_the_upsert_head_are_a_record_or_left_to_receive(payload: bytes) -> None:
    record = BrokerChannel.upsert_of(payload)
    if record is not None:
        assert BrokerChannel().receive(payload) == [StoreUpsert(record)]
