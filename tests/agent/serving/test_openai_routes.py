"""The route table's model readers, in memory: a form's `model` found in the bytes as a real
encoder frames them, wherever the field is, and every malformed body a BadBody (a 400 at
the facade), never another exception."""

from __future__ import annotations

import contextlib

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.serving.openai_routes import ROUTES, BadBody, form_model, json_model, model_of

BOUNDARY = "b0undary-1234"
FORM = f"multipart/form-data; boundary={BOUNDARY}"


def part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    head = f"Content-Disposition: {disposition}\r\n"
    if filename:
        head += "Content-Type: audio/wav\r\n"
    return f"--{BOUNDARY}\r\n{head}\r\n".encode() + value + b"\r\n"


def form(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


AUDIO = b"RIFF" + bytes(range(256)) * 64 + f"\r\n--{BOUNDARY[:-1]}".encode()  # near one


async def encoded(fields: list[tuple[str, bytes | str, str | None]]) -> tuple[str, bytes]:
    """A form as aiohttp's own encoder writes it: (Content-Type, body)."""
    data = aiohttp.FormData()
    for name, value, filename in fields:
        data.add_field(name, value, filename=filename)
    payload = data()
    chunks: list[bytes] = []

    class Sink:
        async def write(self, chunk: bytes) -> None:
            chunks.append(bytes(chunk))

    await payload.write(Sink())  # type: ignore[arg-type]  # a writer: all it needs is write()
    return payload.content_type, b"".join(chunks)


async def test_a_real_encoders_form_names_its_model_before_or_after_the_file() -> None:
    forms: list[list[tuple[str, bytes | str, str | None]]] = [
        [("model", "whisper-1", None), ("file", AUDIO, "a.wav")],
        [("file", AUDIO, "a.wav"), ("language", "en", None), ("model", "org/whisper", None)],
    ]
    for fields in forms:
        content_type, body = await encoded(fields)
        assert form_model(content_type, body) == next(v for n, v, _ in fields if n == "model")


def test_forms_framed_by_hand() -> None:
    assert form_model(FORM, form(part("model", b"m1"), part("file", AUDIO, "a.wav"))) == "m1"
    assert form_model(FORM, form(part("file", AUDIO, "a.wav"), part("model", b"m2"))) == "m2"
    # A quoted boundary, a preamble, padding after a delimiter, a name without quotes.
    quoted = f'multipart/form-data; charset=utf-8; boundary="{BOUNDARY}"'
    assert form_model(quoted, b"preamble\r\n" + form(part("model", b"m3"))) == "m3"
    opening = f"--{BOUNDARY}\r\n".encode()
    padded = form(part("model", b"m4")).replace(opening, opening[:-2] + b"  \r\n")
    assert form_model(FORM, padded) == "m4"
    bare = f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=model\r\n\r\nm5\r\n"
    assert form_model(FORM, bare.encode() + f"--{BOUNDARY}--".encode()) == "m5"
    # `filename="model"` is not the field's name; a field named `model_x` is another field.
    named = form(part("file", AUDIO, "model"), part("model_x", b"no"), part("model", b"m6"))
    assert form_model(FORM, named) == "m6"


@pytest.mark.parametrize(
    ("content_type", "body", "says"),
    [
        (FORM, form(part("file", AUDIO, "a.wav")), "no model"),
        (FORM, form(part("model", b"a"), part("model", b"b")), "two models"),
        (FORM, form(part("model", b"")), "empty"),
        (FORM, form(part("model", b"m" * 1025)), "too long"),
        (FORM, form(part("model", b"\xff\xfe")), "not UTF-8"),
        ("multipart/form-data", form(part("model", b"m")), "no valid boundary"),
        ("multipart/form-data; boundary=", form(part("model", b"m")), "no valid boundary"),
        (f"multipart/form-data; boundary={'x' * 71}", b"", "no valid boundary"),
        ("multipart/form-data; boundary=bad\x00", b"", "no valid boundary"),
        ("application/json", b'{"model": "m"}', "must be multipart"),
        ("multipart/mixed; boundary=b", b"", "must be multipart"),
        ("multipart/form-data; boundary=other", form(part("model", b"m")), "malformed"),
        (FORM, form(part("model", b"m"))[:-4], "malformed"),  # the closing `--` is cut off
        (FORM, part("model", b"m"), "malformed"),  # never closed
        (FORM, f"--{BOUNDARY}junk\r\n".encode(), "malformed"),
        # The delimiter inside a part: strict, refused (an encoder picks one the data lacks).
        (
            FORM,
            form(part("file", f"\r\n--{BOUNDARY}x".encode(), "a"), part("model", b"m")),
            "malformed",
        ),
        (FORM, f"--{BOUNDARY}\r\n".encode() + b"x" * 9000, "malformed"),  # a header block
        (
            FORM,
            b"".join(part("f", b"") for _ in range(1001)) + b"--" + BOUNDARY.encode() + b"--",
            "more than 1000 parts",
        ),
    ],
)
def test_a_bad_form_is_a_bad_body(content_type: str, body: bytes, says: str) -> None:
    with pytest.raises(BadBody, match=says):
        form_model(content_type, body)


@given(st.binary(max_size=300), st.sampled_from([FORM, "multipart/form-data; boundary=a"]))
def test_nothing_but_bad_body_escapes_the_form_reader(body: bytes, content_type: str) -> None:
    with contextlib.suppress(BadBody):
        assert form_model(content_type, body)


@given(st.integers(min_value=0, max_value=200))
def test_every_cut_of_a_valid_form_is_refused(cut: int) -> None:
    whole = form(part("file", AUDIO[:100], "a.wav"), part("model", b"m"))
    if cut < len(whole) - 2:  # the CRLF after the closing delimiter is epilogue
        with pytest.raises(BadBody):
            form_model(FORM, whole[:cut])


def test_json_models() -> None:
    assert json_model(b'{"model": "m", "input": [1, {"x": null}]}') == "m"
    for bad in (b'{"model": ""}', b'{"model": 3}', b"[]", b'{"input": "x"}', b"{", b""):
        with pytest.raises(BadBody, match="JSON with a model"):
            json_model(bad)
    with pytest.raises(BadBody):
        json_model(b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    # Invalid anywhere is invalid: not a job for the engine to refuse (the fault tier's fuzz).
    for elsewhere in (b'"\xff"', b"1e400"):
        with pytest.raises(BadBody):
            json_model(b'{"model": "m", "x": ' + elsewhere + b"}")


def test_every_route_reads_as_its_kind() -> None:
    audio = form(part("model", b"w"), part("file", AUDIO, "a.wav"))
    for path, route in ROUTES.items():
        body, content_type = (audio, FORM) if "/audio/trans" in path else (b'{"model":"w"}', "")
        assert model_of(route, content_type, body) == "w", path
        assert route.form == ("/audio/trans" in path)
        assert route.engine_content_type(FORM) == (FORM if route.form else "application/json")
