"""The Workload record: exactly the seed's fields, absent vs null, unknown fields dropped."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from workload_manager.workload import (
    MAX_SEQ,
    Workload,
    WorkloadState,
    decode_workload,
    encode_workload,
)

from .strategies import workload_dicts

SEED_FIELDS = [
    "id",
    "model",
    "engine",
    "runId",
    "state",
    "originatedFrom",
    "scheduledOn",
    "createdAt",
    "startedAt",
    "completedAt",
    "error",
    "requesterId",
    "seq",
]


def base(**changes: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": "1",
        "model": "llama-3-8b",
        "engine": "vllm",
        "runId": "01jabcdefghjkmnpqrstvwxyz0",
        "state": "queued",
        "originatedFrom": "nod_01jabcdefghjkmnpqrstvwxyz0",
        "createdAt": 1_764_000_000_000,
        "seq": 1,
    }
    record.update(changes)
    return record


def test_exactly_the_seed_fields() -> None:
    assert list(Workload.__struct_fields__) == SEED_FIELDS


def test_states_are_the_seed_states() -> None:
    assert {s.value for s in WorkloadState} == {
        "queued",
        "running",
        "completed",
        "failed",
        "cancelled",
    }


@given(workload_dicts())
def test_round_trip_preserves_absent_and_null(record: dict[str, Any]) -> None:
    encoded = encode_workload(decode_workload(json.dumps(record)))
    assert json.loads(encoded) == record


@given(workload_dicts(), st.text(min_size=1))
def test_unknown_fields_are_dropped(record: dict[str, Any], marker: str) -> None:
    secret = "PROMPT-MARKER-" + marker
    noisy = {
        **record,
        "prompt": secret,
        "messages": [{"role": "user", "content": secret}],
        "response": {"choices": [{"text": secret}]},
    }
    encoded = encode_workload(decode_workload(json.dumps(noisy)))
    assert json.loads(encoded) == record
    assert b"PROMPT-MARKER-" not in encoded


def test_scheduled_on_absent_until_chosen_and_never_null() -> None:
    assert "scheduledOn" not in json.loads(encode_workload(decode_workload(json.dumps(base()))))
    with pytest.raises(msgspec.ValidationError, match="scheduledOn"):
        decode_workload(json.dumps(base(scheduledOn=None)))


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"seq": 0}, "seq"),
        ({"seq": -3}, "seq"),
        ({"seq": "1"}, "seq"),
        ({"seq": 1.5}, "seq"),
        ({"state": "exploded"}, "state"),
        ({"state": None}, "state"),
        ({"createdAt": -1}, "createdAt"),
        # Past int64: the Jobs store's INTEGER cannot hold it (it failed the writer's batch).
        ({"seq": 2**63}, "seq"),
        # Past the sane bound (MAX_SEQ, workload.py says why).
        ({"seq": 2**53}, "seq"),
        ({"createdAt": 2**200}, "createdAt"),
        ({"completedAt": 2**63}, "completedAt"),
        ({"createdAt": "yesterday"}, "createdAt"),
        ({"startedAt": "noon"}, "startedAt"),
        ({"id": 7}, "id"),
        ({"id": ""}, "id"),
        ({"model": None}, "model"),
        ({"model": "m" * 257}, "model"),
        ({"error": "e" * 4097}, "error"),
    ],
)
def test_bad_values_are_rejected_with_the_field_named(changes: dict[str, Any], where: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=where):
        decode_workload(json.dumps(base(**changes)))


@pytest.mark.parametrize("missing", ["id", "model", "engine", "runId", "state", "seq"])
def test_required_fields(missing: str) -> None:
    record = base()
    del record[missing]
    with pytest.raises(msgspec.ValidationError, match=f"missing required field `{missing}`"):
        decode_workload(json.dumps(record))


def test_records_are_immutable() -> None:
    workload = decode_workload(json.dumps(base()))
    with pytest.raises(AttributeError):
        workload.seq = 2  # type: ignore[misc]


def test_the_largest_seq_taken_is_max_seq() -> None:
    assert MAX_SEQ == 2**53 - 1
    assert decode_workload(json.dumps(base(seq=MAX_SEQ))).seq == MAX_SEQ
