"""nvpair.toml and the plane settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cluster.heartbeat import NodeState, OwnRecord
from agent.config import ConfigError, load_config
from agent.engines.gpus import simulate
from agent.plane_link.sync import plane_settings
from tests.workload_manager.cluster_harness import free_port


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
        ("[artifacts]\nmax_bytes = -1\n", "max_bytes"),
        ("[artifacts]\nbudget = 1\n", "artifacts.budget"),
        ("[agent]\nlog_format = 'xml'\n", "log_format"),
        ("[tracing]\notlp_endpoint = 'collector:4318'\n", "tracing.otlp_endpoint"),
        ("[tracing]\notlp_endpoint = 'ftp://collector/v1/traces'\n", "tracing.otlp_endpoint"),
        ("[tracing]\nsample_ratio = 1.5\n", "sample_ratio"),
        ("[tracing]\nendpoint = 'http://x'\n", "tracing.endpoint"),
    ],
)
def test_bad_settings_are_named(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "nvpair.toml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path, {})


def test_tracing_is_off_unless_a_collector_is_named(tmp_path: Path) -> None:
    assert load_config(tmp_path, {}).tracing.otlp_endpoint is None
    (tmp_path / "nvpair.toml").write_text(
        '[tracing]\notlp_endpoint = "http://collector:4318/v1/traces"\nsample_ratio = 0.1\n'
    )
    tracing = load_config(tmp_path, {}).tracing
    assert (tracing.otlp_endpoint, tracing.sample_ratio) == ("http://collector:4318/v1/traces", 0.1)


def test_the_artifact_store_goes_where_it_is_told(tmp_path: Path) -> None:
    assert load_config(tmp_path, {}).artifacts_path == tmp_path / "artifacts"  # the default
    (tmp_path / "nvpair.toml").write_text('[artifacts]\npath = "/big/disk"\nmax_bytes = 10\n')
    config = load_config(tmp_path, {})
    assert (config.artifacts_path, config.artifacts.max_bytes) == (Path("/big/disk"), 10)


def test_plane_settings_from_toml_or_join(tmp_path: Path) -> None:
    assert plane_settings(tmp_path) is None
    (tmp_path / "plane.json").write_text('{"url": "http://plane:14330/", "token": "hgro1.x"}')
    (tmp_path / "plane.json").chmod(0o600)  # it holds a token (tests/agent/core/test_home_modes.py)
    assert plane_settings(tmp_path) == ("http://plane:14330", "hgro1.x")
    (tmp_path / "nvpair.toml").write_text('[plane]\nurl = "http://other"\ntoken = "hgro1.y"\n')
    (tmp_path / "nvpair.toml").chmod(0o600)
    assert plane_settings(tmp_path) == ("http://other", "hgro1.y")


# -- parsed once, typed, bounded, frozen (issue 10) ----------------------------------------------


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[agent]\nnode_port = "x"\n', "agent.node_port"),
        ('[agent]\nheartbeat_s = "fast"\n', "agent.heartbeat_s"),
        ("[agent]\nqueue_limit = 0\n", "agent.queue_limit"),
        ("[agent]\nbogus = 1\n", "agent.bogus"),
        ("[nope]\nx = 1\n", "nope"),
        ('[plane]\nurl = 5\ntoken = "hgro1.x"\n', "plane.url"),
        ('[plane]\nurl = "http://plane:14330"\ntoken = "hgro1.x"\nbogus = 1\n', "plane.bogus"),
    ],
    ids=["port", "number", "bounds", "agent-key", "table", "plane-type", "plane-key"],
)
def test_a_wrong_value_or_unknown_key_names_the_key_and_the_file(
    tmp_path: Path, text: str, key: str
) -> None:
    path = tmp_path / "nvpair.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config(tmp_path, {})
    assert key in str(refused.value)
    assert str(path) in str(refused.value)


def test_the_control_a_good_file_loads(tmp_path: Path) -> None:
    (tmp_path / "nvpair.toml").write_text(
        "[agent]\nnode_port = 15000\nheartbeat_s = 0.5\nqueue_limit = 1\n"
        '[plane]\nurl = "http://plane:14330"\ntoken = "hgro1.x"\n'
    )
    (tmp_path / "nvpair.toml").chmod(0o600)
    config = load_config(tmp_path, {})
    assert (config.node_port, config.heartbeat_s, config.queue_limit) == (15000, 0.5, 1)
    assert config.plane is not None
    assert (config.plane.url, config.plane.token) == ("http://plane:14330", "hgro1.x")


def test_the_configuration_is_frozen_and_plane_is_optional(tmp_path: Path) -> None:
    config = load_config(tmp_path, {})
    assert config.plane is None
    with pytest.raises(AttributeError):
        config.node_port = 1  # type: ignore[misc]  # the point: it cannot be assigned


def _agent_run(home: Path, *flags: str) -> tuple[int, str]:
    """`nvpair agent run` on `home` with free ports; its exit status and stderr. One that
    keeps running past 10 s is stopped and fails the test."""
    ports = [f"--{kind}-port={free_port()}" for kind in ("manager", "node", "api", "facade")]
    env = {**os.environ, "NVPAIR_HOME": str(home), "NVPAIR_BIND": "127.0.0.1"}
    command = [sys.executable, "-m", "agent", "agent", "run", *ports, *flags]
    with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as proc:
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.terminate()
            _, err = proc.communicate(timeout=20)
            raise AssertionError(f"agent run was still running after 10 s:\n{err}") from None
    return proc.returncode, err


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An initialised NVPAIR_HOME, so that only the configuration can be wrong."""
    home = tmp_path / "home"
    env = {**os.environ, "NVPAIR_HOME": str(home)}
    init = ["cluster", "init", "--name", "lab", "--node-name", "a"]
    done = subprocess.run(
        [sys.executable, "-m", "agent", *init], env=env, capture_output=True, timeout=20
    )
    assert done.returncode == 0, done.stderr
    return home


@pytest.mark.parametrize(
    ("text", "flags", "named"),
    [
        # heartbeat_s, not a port: the ports come from flags here, which override the file.
        ('[agent]\nheartbeat_s = "fast"\n', (), "agent.heartbeat_s"),
        ("[nope]\nx = 1\n", (), "nope"),
        ("", ("--simulate-gpus", "bogus:2"), "bogus"),
    ],
    ids=["wrong-type", "unknown-table", "device-class"],
)
def test_agent_run_refuses_a_bad_setting_in_one_line(
    home: Path, text: str, flags: tuple[str, ...], named: str
) -> None:
    (home / "nvpair.toml").write_text(text)
    code, err = _agent_run(home, *flags)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("nvpair: ")
    assert named in lines[0]


# -- advertised address and ports, apart from the listening ones (issue 11) -------------------


@pytest.mark.parametrize(
    ("value", "host", "ports"),
    [
        ("10.0.0.5", "10.0.0.5", None),
        ("gpu-a.example.com", "gpu-a.example.com", None),
        ("10.0.0.5:24320,24321,24323", "10.0.0.5", (24320, 24321, 24323)),
        ("proxy:1,2,3", "proxy", (1, 2, 3)),
        ("fd00::5", "fd00::5", None),
        ("[fd00::5]:24320,24321,24323", "fd00::5", (24320, 24321, 24323)),
    ],
)
def test_advertise_is_a_host_and_maybe_its_ports(
    tmp_path: Path, value: str, host: str, ports: tuple[int, int, int] | None
) -> None:
    (tmp_path / "nvpair.toml").write_text(f'[agent]\nadvertise = "{value}"\nnode_port = 15000\n')
    config = load_config(tmp_path, {})
    assert (config.advertise_host, config.advertise_ports) == (host, ports)
    assert config.node_port == 15000  # where it listens is unchanged
    assert config.advertised_ports == (ports or (14320, 15000, 14323))
    assert load_config(tmp_path, {"advertise": value}).advertise_ports == ports  # the flag too


@pytest.mark.parametrize(
    "value",
    [
        "10.0.0.5:",
        "10.0.0.5:1,2",
        "10.0.0.5:1,2,3,4",
        "10.0.0.5:0,2,3",
        "10.0.0.5:1,2,65536",
        "10.0.0.5:a,b,c",
        "10.0.0.5:-1,2,3",
        "10.0.0.5:1,2,\u00b2",  # a digit to str.isdigit(), not to int()
        "host name",
        "-host",
        "[fd00::5",
        "[10.0.0.5]:1,2,3",
        "[fd00::5]x",
        "fd00::zz",
        ":1,2,3",
        "http://host",
        "é.example",
    ],
)
def test_a_malformed_advertise_is_refused_naming_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=r"agent\.advertise is \"HOST\" or"):
        load_config(tmp_path, {"advertise": value})


def test_the_record_carries_the_advertised_address_and_ports(tmp_path: Path) -> None:
    config = load_config(tmp_path, {"advertise": "203.0.113.7:24320,24321,24323"})
    record = OwnRecord(config, "nod_x", NodeState(simulate("l4:1", "nod_x")), list).current
    assert (record.addresses, record.managerPort, record.nodePort, record.facadePort) == (
        ["203.0.113.7"],
        24320,
        24321,
        24323,
    )
    here = NodeState(simulate("l4:1", "nod_x"))
    plain = OwnRecord(load_config(tmp_path, {}), "nod_x", here, list).current
    assert (plain.addresses, plain.managerPort, plain.nodePort) == (["127.0.0.1"], 14320, 14321)


def test_dial_from_is_an_ip_address_or_refused_naming_the_key(tmp_path: Path) -> None:
    assert load_config(tmp_path, {}).dial_from is None
    (tmp_path / "nvpair.toml").write_text('[agent]\ndial_from = "127.0.0.2"\n')
    assert load_config(tmp_path, {}).dial_from == "127.0.0.2"
    (tmp_path / "nvpair.toml").write_text('[agent]\ndial_from = "gpu-a.example.com"\n')
    with pytest.raises(ConfigError, match=r"agent\.dial_from must be an IP address"):
        load_config(tmp_path, {})


@pytest.mark.parametrize(
    ("text", "key"),
    [("wait_queue = -1", "agent.wait_queue"), ("wait_timeout_s = 0", "agent.wait_timeout_s")],
)
def test_the_wait_line_settings_are_bounded(tmp_path: Path, text: str, key: str) -> None:
    (tmp_path / "nvpair.toml").write_text(f"[agent]\n{text}\n")
    with pytest.raises(ConfigError, match=key):
        load_config(tmp_path, {})
    # The control: in bounds they load, 0 turning waiting off.
    (tmp_path / "nvpair.toml").write_text("[agent]\nwait_queue = 0\nwait_timeout_s = 5\n")
    assert load_config(tmp_path, {}).wait == (0, 5.0)
    assert load_config(tmp_path / "none", {}).wait == (64, 30.0)  # the defaults
