"""What the fuzz scenarios (test_fuzz.py) throw at every input, and how they send it.

`cases(valid, ...)` turns one valid body into the input kinds issue 11 (item 7) names:
deep nesting, huge numbers, invalid UTF-8, wrong types, unknown methods and fields,
mutated bytes and a body just over the route's limit. Fixed inputs come first, then what
hypothesis draws (`draw`), seeded, so a run is the same every time.
"""

from __future__ import annotations

import asyncio
import copy
import json
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import msgspec
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

__all__ = [
    "HUGE",
    "RPC_CODES",
    "Answer",
    "Case",
    "Rows",
    "cases",
    "changed",
    "deep_bodies",
    "draw",
    "is_json_value",
    "json_values",
    "openai_error",
    "reaches_engine",
    "rpc_documented",
    "slow_request",
    "text_error",
    "throw",
]  # fmt: skip

T = TypeVar("T")

DEPTH: Final = 100_000
# Numbers no field takes: past float and int64 range, negative zero, not numbers at all.
HUGE: Final = (
    b"1e400", b"-1e400", str(2**200).encode(), b"-0.0", b"NaN", b"Infinity",
    b"-Infinity", b"1" * 5000, b"1e-400", b"0x10", b"9223372036854775808",
)  # fmt: skip
VALID_ODDITIES: Final = (b"-0", b'"\\u0000"')  # zero and a NUL: odd, but valid JSON values
# Inside a JSON string: bytes that are not UTF-8, overlong forms, encoded surrogates, and
# escapes of lone surrogates (valid JSON, not valid text).
BAD_TEXT: Final = (
    b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80abc", b"ab\xfe",
    b"\\ud800", b"\\udfff\\ud800", b"\x00",
)  # fmt: skip

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@dataclass(frozen=True)
class Case:
    """One input: its kind (named in a failure), its bytes, whether a route may take it (a
    mutation can turn into another valid body, an unknown field is ignored, zero and a NUL
    are valid values) and whether, taken, it may change state (an unknown field rides on a
    body already taken: it may not)."""

    kind: str
    body: bytes
    may_be_taken: bool = False
    may_change: bool = False

    def __repr__(self) -> str:  # a failure names the input without 8 MiB of it
        shown = self.body[:120] + (b"..." if len(self.body) > 120 else b"")
        return f"Case({self.kind}, {len(self.body)} bytes: {shown!r})"


def draw(strategy: st.SearchStrategy[T], count: int) -> list[T]:
    """`count` values of `strategy`, the same list every run.

    Why not `@given` on the tests themselves: the agents live on the module's event loop
    (pytest-asyncio, loop_scope="module"), which is not running while a sync hypothesis
    test body runs, and `@given` on an async test would re-enter it per example. So the
    inputs are drawn up front (derandomize: seeded from this function, generate phase only,
    no database so no .hypothesis folder) and replayed on the loop; a failure names the
    exact input (`Case.__repr__`), which is what shrinking would otherwise find.
    """
    drawn: list[T] = []

    @settings(
        max_examples=count,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value: T) -> None:
        drawn.append(value)

    collect()
    return drawn


def deep_bodies(valid: dict[str, Any]) -> list[Case]:
    """100,000 levels of nesting: bare, as an object chain, unclosed, and in a valid body."""
    inner = b"[" * DEPTH + b"]" * DEPTH
    key, _ = next(iter(valid.items()))
    nested = json.dumps({**valid, key: "@"}).encode().replace(b'"@"', inner)
    return [
        Case("deep", b"[" * DEPTH),
        Case("deep", inner),
        Case("deep", b'{"a":' * DEPTH + b"1" + b"}" * DEPTH),
        Case("deep", b"[" * DEPTH + b"{" * DEPTH),
        Case("deep", nested),
    ]


def _paths(value: Any, here: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    # Every place in a JSON value, the root included.
    yield here
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*here, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*here, index))


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


def _put(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    changed = copy.deepcopy(value)
    _get(changed, path[:-1])[path[-1]] = new
    return changed


def _marked(valid: Any, path: tuple[Any, ...], raw: bytes) -> bytes:
    # The valid body with the value at `path` replaced by raw bytes (not JSON-encodable).
    marker = "\u2603fuzz\u2603"
    return json.dumps(_put(valid, path, marker)).encode().replace(json.dumps(marker).encode(), raw)


def _mutated(valid: bytes) -> st.SearchStrategy[bytes]:
    # Up to four edits of the valid bytes: flip a bit, delete a run, insert bytes, truncate.
    edit = st.tuples(
        st.sampled_from(["flip", "delete", "insert", "truncate"]),
        st.integers(min_value=0, max_value=len(valid) - 1),
        st.integers(min_value=0, max_value=255),
        st.binary(min_size=1, max_size=4),
    )

    def apply(edits: list[tuple[str, int, int, bytes]]) -> bytes:
        body = bytearray(valid)
        for op, pos, bit, insert in edits:
            pos = min(pos, max(len(body) - 1, 0))
            if op == "flip" and body:
                body[pos] ^= 1 << (bit % 8)
            elif op == "delete":
                del body[pos : pos + 1 + bit % 8]
            elif op == "insert":
                body[pos:pos] = insert
            else:
                del body[pos:]
        return bytes(body)

    return st.lists(edit, min_size=1, max_size=4).map(apply).filter(lambda b: b != valid)


def cases(
    valid: dict[str, Any],
    *,
    count: int,
    limit: int,
    targets: Callable[[tuple[Any, ...]], bool] = lambda path: True,
    unknown: Callable[[dict[str, Any], str], dict[str, Any]] | None = None,
) -> list[Case]:
    """Every input kind made from one valid body: nothing here may be taken except the
    cases marked `may_be_taken`.

    `targets(path)` says which places of the body must hold their type for the body to be
    refused (a field the route passes through untouched is not one); `unknown(valid, name)`
    gives the valid body with an unknown method or field `name` (None: a top-level field).
    `limit` is the route's documented body limit: one case is one byte over it.
    """
    # A place holding null is left out: a nullable field takes more than one type.
    places = [p for p in _paths(valid) if targets(p) and _get(valid, p) is not None]
    scalars = [p for p in places if p and not isinstance(_get(valid, p), dict | list)]
    numbers = [p for p in scalars if type(_get(valid, p)) is int]
    texts = [p for p in scalars if type(_get(valid, p)) is str]
    found = deep_bodies(valid)
    found += [Case("huge", _marked(valid, p, n)) for p in numbers for n in HUGE]
    found += [Case("utf8", _marked(valid, p, b'"' + t + b'"')) for p in texts for t in BAD_TEXT]
    found += [
        Case("oddity", _marked(valid, p, odd), may_be_taken=True, may_change=True)
        for p, odd in [(p, VALID_ODDITIES[0]) for p in numbers]
        + [(p, VALID_ODDITIES[1]) for p in texts]
    ]

    def retyped(place: tuple[Any, ...]) -> st.SearchStrategy[Case]:
        kind = type(_get(valid, place))
        others = json_values.filter(
            lambda v: type(v) is not kind and not (kind is int and type(v) is bool)
        )
        return others.map(lambda v: Case("types", json.dumps(_put(valid, place, v)).encode()))

    found += draw(st.sampled_from(places).flatmap(retyped), count)
    names = st.text(min_size=1, max_size=16).filter(lambda n: n not in json.dumps(valid))
    extra = unknown or (lambda body, name: {**body, name: 1})
    found += [
        Case("unknown", json.dumps(extra(valid, n)).encode(), may_be_taken=True)
        for n in draw(names, max(4, count // 4))
    ]
    body = json.dumps(valid).encode()
    found += [
        Case("mutated", b, may_be_taken=True, may_change=True) for b in draw(_mutated(body), count)
    ]
    padding = b" " * (limit + 1 - len(body))  # whitespace: still the valid body, one byte over
    found.append(Case("oversize", body + padding))
    return found


async def slow_request(
    port: int,
    request: bytes,
    *,
    pace_s: float,
    context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
) -> bytes:
    """Send one HTTP request a byte at a time, `pace_s` apart (the pace is the fault, not a
    wait for anything), and return the status line of its answer."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=server_hostname
    )
    try:
        for i in range(len(request)):
            writer.write(request[i : i + 1])
            await writer.drain()
            await asyncio.sleep(pace_s)
        return await reader.readline()
    finally:
        writer.close()
        await asyncio.gather(writer.wait_closed(), return_exceptions=True)


# -- answers ---------------------------------------------------------------------------

RPC_CODES: Final = (-32700, -32600, -32601, -32602)  # docs/protocol.md; -32603 is our bug


def rpc_documented(reply: Any) -> str | None:
    """Why a JSON-RPC reply (one response or a batch's array) is not a documented one."""
    if isinstance(reply, list):
        return next(filter(None, map(rpc_documented, reply)), None) if reply else "empty batch"
    if not isinstance(reply, dict) or reply.get("jsonrpc") != "2.0":
        return "not a JSON-RPC 2.0 response"
    if ("result" in reply) == ("error" in reply):
        return "not exactly one of result and error"
    error = reply.get("error")
    if error is not None and (error.get("code") not in RPC_CODES or not error.get("message")):
        return f"error {error} is not a documented one"
    return None


Rows = dict[tuple[str, ...], Any]  # a Jobs list by job


@dataclass(frozen=True)
class Answer:
    """What a route said: status 0 when the connection dropped without an answer."""

    status: int
    content_type: str
    body: bytes


async def throw(
    batch: list[Case],
    send: Callable[[bytes], Awaitable[Answer]],
    documented: Callable[[Answer], str | None],
) -> int:
    """Send every case; fail naming each answer that is not documented or takes what must
    not be taken. Returns how many were taken that may change state."""
    problems: list[str] = []
    taken = 0
    statuses: Counter[int] = Counter()
    for case in batch:
        answer = await send(case.body)
        statuses[answer.status] += 1
        why = "dropped: " + answer.body.decode() if answer.status == 0 else documented(answer)
        if why is None and answer.status < 300:
            taken += case.may_change
            why = None if case.may_be_taken else f"taken ({answer.status})"
        if why is not None:
            problems.append(f"{case!r} -> {answer.status} {answer.body[:200]!r}: {why}")
    assert not problems, f"{len(problems)} of {len(batch)} answers:\n" + "\n".join(problems[:15])
    kinds = Counter(case.kind for case in batch)
    print(f"fuzz: {len(batch)} inputs ({dict(kinds)}), answers {dict(sorted(statuses.items()))}")
    return taken


def changed(before: Rows, after: Rows) -> list[tuple[str, ...]]:
    """The rows that differ, appeared or went."""
    return [k for k in before.keys() | after.keys() if before.get(k) != after.get(k)]


def text_error(*statuses: int) -> Callable[[Answer], str | None]:
    """A route whose errors are plain text (the local and node APIs): a 2xx, or one of
    `statuses` with a non-empty text body."""

    def check(answer: Answer) -> str | None:
        if answer.status < 300:
            return None
        if answer.status not in statuses:
            return f"status {answer.status} is not one of {statuses}"
        if answer.content_type != "text/plain" or not answer.body.strip():
            return f"error body is {answer.content_type}, not a text reason"
        return None

    return check


def is_json_value(answer: Answer) -> bool:
    try:
        json.loads(answer.body)
    except ValueError:
        return False
    return answer.content_type == "application/json"


def openai_error(answer: Answer) -> str | None:
    """The facade's errors are OpenAI's shape: {"error": {"message", "type", ...}}."""
    if answer.status < 300:
        return None
    if answer.status not in (400, 401, 404, 413, 429, 502, 503):
        return f"status {answer.status} is not a documented facade error"
    try:
        error = msgspec.json.decode(answer.body)["error"]
        words = (error["message"], error["type"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return "not an OpenAI error body"
    return None if all(isinstance(w, str) for w in words) else "not an OpenAI error body"


def reaches_engine(body: bytes) -> bool:
    """Whether the facade passes this body on (a job): JSON with a model it serves."""
    try:
        decoded = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return False
    return isinstance(decoded, dict) and decoded.get("model") == "llama"
