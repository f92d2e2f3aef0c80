"""Hypothesis strategies for workload records as JSON objects."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from workload_manager.workload import LIFECYCLE_METHODS, MAX_SEQ, WorkloadState

ABSENT: Any = object()

names = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40
)
epoch_ms = st.integers(min_value=0, max_value=2**53)
nullable_ms = st.one_of(st.just(ABSENT), st.none(), epoch_ms)
nullable_name = st.one_of(st.just(ABSENT), st.none(), names)


@st.composite
def workload_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A valid workload record as a JSON object, with optional fields absent, null or set."""
    record: dict[str, Any] = {
        "id": str(draw(st.integers(min_value=1, max_value=10**9))),
        "model": draw(names),
        "engine": draw(st.sampled_from(["vllm", "sglang", "llamacpp", "ollama", "openai"])),
        "runId": draw(names),
        "state": draw(st.sampled_from([s.value for s in WorkloadState])),
        "originatedFrom": draw(names),
        "scheduledOn": draw(st.one_of(st.just(ABSENT), names)),
        "createdAt": draw(epoch_ms),
        "startedAt": draw(nullable_ms),
        "completedAt": draw(nullable_ms),
        "error": draw(nullable_name),
        "requesterId": draw(nullable_name),
        "seq": draw(st.integers(min_value=1, max_value=MAX_SEQ)),
    }
    return {key: value for key, value in record.items() if value is not ABSENT}


def method_for(state: str) -> str:
    """The lifecycle method that carries a state."""
    for method, states in LIFECYCLE_METHODS.items():
        if WorkloadState(state) in states:
            return method
    raise AssertionError(state)
