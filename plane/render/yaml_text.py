"""Plain data (dicts, lists, strings, integers, booleans, None) as block-style YAML, the way
`kubectl` manifests are written. Sans-I/O, and no YAML library at run time.

Every string is double-quoted with YAML's escapes (`\\"`, `\\\\`, `\\xXX`, `\\uXXXX`,
`\\UXXXXXXXX`), so the text is pure ASCII and no value is ever read back as another type (a
model called `yes`, `1e3` or `null` stays a string) nor folded (a line break inside a value
is written `\\x0a`). Keys are written plain when they are names (`apiVersion`,
`app.kubernetes.io/managed-by`), quoted otherwise, and as an explicit `? key` past YAML's
1,024-character limit on a simple key. The tests load the output with PyYAML
and compare it with the input.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["dump"]

_PLAIN_KEY: Final = re.compile(r"[A-Za-z][A-Za-z0-9_./-]*")
# Words YAML 1.1 readers (PyYAML among them) take as booleans or null, written plain.
_RESERVED: Final = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null"})
# A simple (implicit) key is at most 1024 characters in YAML; a longer one is written explicit.
_MAX_SIMPLE_KEY: Final = 1000


def dump(value: object) -> str:
    """`value` as a YAML document (ends with a newline); `TypeError` for a float or any
    other type than the ones above, or a key that is not a string."""
    lines: list[str] = []
    _emit(value, 0, lines)
    return "\n".join(lines) + "\n"


def _emit(value: object, indent: int, lines: list[str]) -> None:
    pad = " " * indent
    if isinstance(value, dict) and value:
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"a mapping key is a string, not {type(key).__name__}")
            written = _key(key)
            if len(written) > _MAX_SIMPLE_KEY:  # YAML's explicit key: `? key` then `: value`
                lines.append(f"{pad}? {written}")
                written = ""
            if _nested(item):
                lines.append(f"{pad}{written}:")
                _emit(item, indent + 2, lines)
            else:
                lines.append(f"{pad}{written}: {_scalar(item)}")
    elif isinstance(value, list) and value:
        for item in value:
            if _nested(item):
                start = len(lines)
                _emit(item, indent + 2, lines)
                lines[start] = f"{pad}- {lines[start][indent + 2 :]}"
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    else:
        lines.append(f"{pad}{_scalar(value)}")


def _nested(value: object) -> bool:
    return isinstance(value, dict | list) and bool(value)


def _key(key: str) -> str:
    if _PLAIN_KEY.fullmatch(key) and key.lower() not in _RESERVED:
        return key
    return _quote(key)


def _scalar(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _quote(value)
    if isinstance(value, dict):
        return "{}"  # empty: a non-empty one is nested
    if isinstance(value, list):
        return "[]"
    raise TypeError(f"cannot write a {type(value).__name__} as YAML here")


def _quote(text: str) -> str:
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)
