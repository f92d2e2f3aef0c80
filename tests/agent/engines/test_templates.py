"""Launch templates (issue 13, item 3): rendering, the built-ins' real command lines, and
custom `[templates.NAME]` tables refused at load when they are wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.config import ConfigError, load_config
from agent.engines.templates import (
    BUILTIN_TEMPLATES,
    LaunchSpec,
    TemplateError,
    custom_template,
    render,
)


def _spec(**changes: object) -> LaunchSpec:
    values: dict[str, object] = {
        "replica_id": "rep_01",
        "kind": "vllm",
        "model": "/models/llama-8b",
        "served": "llama",
        "tp": 2,
        "gpu_uuids": ("GPU-aaa", "GPU-bbb"),
        "extra_args": ("--max-model-len", "4096"),
        "port": 18005,
    }
    values.update(changes)
    return LaunchSpec(**values)  # type: ignore[arg-type]  # keyword values of mixed types


def test_vllm_renders_its_real_command_line_with_the_extra_args_last() -> None:
    argv, env = render(BUILTIN_TEMPLATES["vllm"], _spec())
    assert argv == [
        "vllm", "serve", "/models/llama-8b", "--served-model-name", "llama",
        "--host", "127.0.0.1", "--port", "18005", "--tensor-parallel-size", "2",
        "--max-model-len", "4096",
    ]  # fmt: skip
    assert env == {}
    assert BUILTIN_TEMPLATES["vllm"].ready_path == "/health"


def test_sglang_llamacpp_and_mock_command_lines() -> None:
    sglang, _ = render(BUILTIN_TEMPLATES["sglang"], _spec(extra_args=()))
    assert sglang == [
        "python", "-m", "sglang.launch_server", "--model-path", "/models/llama-8b",
        "--served-model-name", "llama", "--host", "127.0.0.1", "--port", "18005",
        "--tp-size", "2",
    ]  # fmt: skip
    llama, _ = render(BUILTIN_TEMPLATES["llamacpp"], _spec(model="/m.gguf", extra_args=()))
    assert llama == [
        "llama-server", "-m", "/m.gguf", "--alias", "llama",
        "--host", "127.0.0.1", "--port", "18005", "--metrics",
    ]  # fmt: skip
    mock, _ = render(BUILTIN_TEMPLATES["mock"], _spec(extra_args=("--latency-ms", "5")))
    assert mock == [
        sys.executable, "-m", "agent.mock", "mock-engine", "--model", "llama",
        "--weights", "/models/llama-8b", "--port", "18005", "--latency-ms", "5",
    ]  # fmt: skip
    # The mock's /health answers without its API key, as the real engines' do.
    assert [BUILTIN_TEMPLATES[k].ready_path for k in ("sglang", "llamacpp", "mock")] == [
        "/health",
        "/health",
        "/health",
    ]
    assert BUILTIN_TEMPLATES["mock"].ready_timeout_s < BUILTIN_TEMPLATES["vllm"].ready_timeout_s


def test_a_replica_key_reaches_each_engine_the_way_it_reads_one() -> None:
    key = "sk-nvpair-replica"
    vllm, vllm_env = render(BUILTIN_TEMPLATES["vllm"], _spec(api_key=key))
    assert vllm_env == {"VLLM_API_KEY": key}  # not on the command line others can read
    assert key not in vllm
    llama, llama_env = render(BUILTIN_TEMPLATES["llamacpp"], _spec(api_key=key))
    assert key not in llama
    assert llama_env == {"LLAMA_API_KEY": key}
    sglang, _ = render(BUILTIN_TEMPLATES["sglang"], _spec(api_key=key, extra_args=()))
    assert sglang[-2:] == ["--api-key", key]  # SGLang reads it from its flag only
    _, mock_env = render(BUILTIN_TEMPLATES["mock"], _spec(api_key=key))
    assert mock_env == {"NVPAIR_MOCK_API_KEY": key}
    # The control: no key, nothing added.
    assert render(BUILTIN_TEMPLATES["vllm"], _spec())[1] == {}
    ollama, ollama_env = render(BUILTIN_TEMPLATES["ollama"], _spec())
    assert ollama[:2] == ["ollama", "serve"]
    assert ollama_env == {"OLLAMA_HOST": "127.0.0.1:18005"}
    assert BUILTIN_TEMPLATES["ollama"].ready_path == "/api/version"
    custom = custom_template("mine", ["srv"], {}, key_env="SRV_KEY")
    assert render(custom, _spec(api_key=key, extra_args=()))[1] == {"SRV_KEY": key}
    with pytest.raises(TemplateError, match="api_key_flag"):
        custom_template("mine", ["srv"], {}, key_flag="--key; rm")


def test_custom_placeholders_env_and_literal_braces() -> None:
    template = custom_template(
        "mine",
        ["srv", "--gpus={gpus}", '--json={{"tp": {tp}}}'],
        {"SRV_PORT": "{port}", "SRV_MODEL": "{model}"},
        "/ready",
    )
    # A value that looks like a placeholder is a value, not a second round of formatting.
    argv, env = render(template, _spec(model="{port}", extra_args=("{model}",)))
    assert argv == ["srv", "--gpus=GPU-aaa,GPU-bbb", '--json={"tp": 2}', "{model}"]
    assert env == {"SRV_PORT": "18005", "SRV_MODEL": "{port}"}
    assert template.ready_path == "/ready"


@pytest.mark.parametrize(
    ("argv", "env", "ready", "message"),
    [
        (["srv", "--port", "{prot}"], {}, "/v1/models", r"unknown placeholder \{prot\}"),
        (["srv", "{port:d}"], {}, "/v1/models", "unknown placeholder"),
        (["srv", "{model.name}"], {}, "/v1/models", "unknown placeholder"),
        (["srv", "{}"], {}, "/v1/models", "unknown placeholder"),
        (["srv", "{port"], {}, "/v1/models", "brace"),
        ([], {}, "/v1/models", "argv names the program"),
        (["srv"], {"X": "{gpu}"}, "/v1/models", r"env.X .*unknown placeholder \{gpu\}"),
        (["srv"], {"CUDA_VISIBLE_DEVICES": "0"}, "/v1/models", "set by nvpair"),
        (["srv"], {"A B": "1"}, "/v1/models", "not a variable name"),
        (["srv"], {}, "health", "ready is a URL path"),
    ],
)
def test_bad_custom_templates_are_refused_naming_the_table(
    argv: list[str], env: dict[str, str], ready: str, message: str
) -> None:
    with pytest.raises(TemplateError, match=message) as caught:
        custom_template("mine", argv, env, ready)
    assert "[templates.mine]" in str(caught.value)


def test_a_custom_template_cannot_take_a_built_in_name() -> None:
    with pytest.raises(TemplateError, match="built-in"):
        custom_template("vllm", ["srv"], {})


def test_bad_replica_ids_are_refused_where_the_spec_is_built() -> None:
    for bad in ("../etc", "", "a/b", "x" * 65):
        with pytest.raises(ValueError, match="replica id"):
            _spec(replica_id=bad)


def test_nvpair_toml_templates_and_engine_settings(tmp_path: Path) -> None:
    (tmp_path / "nvpair.toml").write_text(
        '[engines]\nport_range = "20000-20009"\nstop_grace_s = 5\n'
        "ready_timeout_s = { vllm = 1200, mine = 7 }\n"
        '[templates.mine]\nargv = ["srv", "--port", "{port}"]\nenv = { A = "1" }\n'
        'ready = "/ok"\n'
    )
    launch = load_config(tmp_path, {}).launch
    assert (launch.port_range, launch.stop_grace_s) == ((20000, 20009), 5.0)
    templates = launch.template_map()
    assert templates["mine"].argv == ("srv", "--port", "{port}")
    assert templates["mine"].env == (("A", "1"),)
    assert (templates["mine"].ready_path, templates["mine"].ready_timeout_s) == ("/ok", 7.0)
    assert templates["vllm"].ready_timeout_s == 1200.0
    assert templates["mock"].ready_timeout_s == BUILTIN_TEMPLATES["mock"].ready_timeout_s


def test_defaults_without_an_engines_table(tmp_path: Path) -> None:
    launch = load_config(tmp_path, {}).launch
    assert launch.port_range == (18000, 18999)
    assert launch.stop_grace_s == 30.0
    assert set(launch.template_map()) == {"vllm", "sglang", "llamacpp", "ollama", "mock"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[templates.mine]\nargv = ["srv", "{prot}"]\n', r"\[templates.mine\].*\{prot\}"),
        ("[templates.mine]\nenv = {}\n", "argv"),
        ('[templates.mine]\nargv = ["srv"]\nbogus = 1\n', r"mine\]: bogus: unknown setting"),
        ('[engines]\nport_range = "9-5"\n', "engines.port_range"),
        ('[engines]\nport_range = "80-90"\n', "engines.port_range"),
        ("[engines]\nready_timeout_s = { nope = 3 }\n", "engines.ready_timeout_s.nope"),
        ("[engines]\nstop_grace_s = 0\n", "engines.stop_grace_s"),
    ],
)
def test_bad_engine_settings_stop_the_configuration(
    tmp_path: Path, text: str, message: str
) -> None:
    (tmp_path / "nvpair.toml").write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(tmp_path, {})
    assert "nvpair.toml" in str(caught.value)
