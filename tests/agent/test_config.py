"""nvpair.toml and the plane settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import ConfigError, load_config
from agent.plane_sync import plane_settings


def test_flags_override_the_file(tmp_path: Path) -> None:
    (tmp_path / "nvpair.toml").write_text(
        '[agent]\nname = "gpu-a"\nnode_port = 15000\n[[agent.engines]]\nkind = "vllm"\nurl = "http://127.0.0.1:8000"\n'
    )
    config = load_config(tmp_path, {"node_port": 16000, "name": None})
    assert (config.name, config.node_port) == ("gpu-a", 16000)
    assert config.engines == (("vllm-0", "vllm", "http://127.0.0.1:8000"),)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[agent]\nbogus = 1\n", "unknown setting agent.bogus"),
        ("[agent]\nnode_port = 99999\n", "must be a port number"),
        ("[agent]\nlog_level = 'loud'\n", "log_level"),
        ("[agent\n", "nvpair.toml"),
        ('[agent]\nengines = ["tgi=http://x"]\n', "kind is one of"),
    ],
)
def test_bad_settings_are_named(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "nvpair.toml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path, {})


def test_plane_settings_from_toml_or_join(tmp_path: Path) -> None:
    assert plane_settings(tmp_path) is None
    (tmp_path / "plane.json").write_text('{"url": "http://plane:14330/", "token": "hgro1.x"}')
    assert plane_settings(tmp_path) == ("http://plane:14330", "hgro1.x")
    (tmp_path / "nvpair.toml").write_text('[plane]\nurl = "http://other"\ntoken = "hgro1.y"\n')
    assert plane_settings(tmp_path) == ("http://other", "hgro1.y")
