"""`nvpair keys create --expires`: the durations it takes and the ones it refuses."""

from __future__ import annotations

import argparse

import pytest

from agent.cli.keys import parse_duration


def test_durations() -> None:
    assert parse_duration("30d") == 30 * 86400
    assert parse_duration("12h") == 12 * 3600
    assert parse_duration(" 90m ") == 5400
    assert parse_duration("2w") == 14 * 86400
    for bad in ("", "30", "d", "0d", "-1d", "1.5h", "30 days", "9" * 12 + "s"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration(bad)
