"""The release's version is written once (workload_manager/_version.py) and the installed
distribution says the same: pyproject.toml reads it from there, so a stale install -- one
made before the version moved -- shows here, not as a member that names the wrong release."""

from __future__ import annotations

import re
from importlib.metadata import version

from workload_manager import VERSION


def test_the_installed_distribution_is_this_release() -> None:
    assert version("nvpair") == VERSION


def test_the_version_is_a_release_number() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION
