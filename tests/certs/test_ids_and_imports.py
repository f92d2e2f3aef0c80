"""Prefixed ULIDs, and what `import certs` costs: no web framework."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from certs import is_node_id, new_node_id, prefixed_ulid

_CROCKFORD_LOWER = re.compile(r"^[0-9a-hjkmnp-tv-z]{26}$")


@pytest.mark.parametrize("prefix", ["nod", "clu", "opr"])
def test_prefixed_ulid_is_prefix_underscore_and_lowercase_crockford(prefix: str) -> None:
    minted = prefixed_ulid(prefix)
    head, _, tail = minted.partition("_")
    assert head == prefix
    assert _CROCKFORD_LOWER.match(tail), minted


def test_prefixed_ulids_are_unique_and_sort_by_time() -> None:
    minted = [prefixed_ulid("opr") for _ in range(200)]
    assert len(set(minted)) == len(minted)
    # A ULID's first 10 characters are its millisecond timestamp: never decreasing.
    stamps = [m[4:14] for m in minted]
    assert stamps == sorted(stamps)


def test_node_ids_are_prefixed_ulids() -> None:
    node_id = new_node_id()
    assert node_id.startswith("nod_")
    assert is_node_id(node_id)
    assert not is_node_id(prefixed_ulid("clu"))


def test_import_certs_loads_no_aiohttp() -> None:
    # A fresh interpreter: this test process has aiohttp loaded already.
    probe = "import certs, sys; print('aiohttp' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False"
    # The control: the same probe does see a module certs does load.
    control = "import certs, sys; print('cryptography' in sys.modules)"
    seen = subprocess.run(
        [sys.executable, "-c", control], capture_output=True, text=True, timeout=60, check=True
    )
    assert seen.stdout.strip() == "True"
