"""The built-in `llamacpp` template against the real server (issue 14, item 3): every flag
it passes appears in `llama-server --help`, parsed once, so a flag llama.cpp renames fails
this tier instead of every replica an operator deploys."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from agent.engines.templates import BUILTIN_TEMPLATES

from .test_llama_server import ENGINE_ARGS

_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def real_flags(llama_server: Path) -> set[str]:
    """Every flag `llama-server --help` names (`-np,   --parallel N` gives both)."""
    helped = subprocess.run(
        [str(llama_server), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    return set(_FLAG.findall(helped.stdout + helped.stderr))


def test_the_llamacpp_template_uses_only_flags_the_real_server_has(llama_server: Path) -> None:
    known = real_flags(llama_server)
    assert {"--metrics", "--port", "-m"} <= known  # the parse read the real flag list
    argv = BUILTIN_TEMPLATES["llamacpp"].argv
    assert argv[0] == "llama-server"
    used = [part for part in argv if part.startswith("-")]
    assert used == ["-m", "--alias", "--host", "--port", "--metrics"]
    tier = [part for part in ENGINE_ARGS if part.startswith("-")]  # the tier's own extra flags
    assert [flag for flag in used + tier if flag not in known] == []


def test_a_spanning_llamacpp_replica_uses_only_flags_its_programs_have(llama_server: Path) -> None:
    """The head's added flags are llama-server's; the worker's command line is
    ggml-rpc-server's (built with GGML_RPC=ON, beside llama-server)."""
    span = BUILTIN_TEMPLATES["llamacpp"].span
    assert span is not None
    head = [part for part in span.head_args if part.startswith("-")]
    assert head == ["--rpc", "-ngl"]
    assert [flag for flag in head if flag not in real_flags(llama_server)] == []
    rpc_server = llama_server.parent / "ggml-rpc-server"
    assert span.worker_argv[0] == rpc_server.name
    known = real_flags(rpc_server)
    assert {"-H", "-p", "--threads"} <= known  # the parse read the real flag list
    used = [part for part in span.worker_argv if part.startswith("-")]
    assert used == ["-H", "-p"]
    assert [flag for flag in used if flag not in known] == []
