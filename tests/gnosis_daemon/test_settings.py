from __future__ import annotations

import pytest

from gnosis_daemon.settings import Settings, SettingsError, load_settings


def test_defaults_when_nothing_is_set():
    s = load_settings(environ={})
    assert s.port == 8000
    assert s.host == "127.0.0.1"
    assert s.model is None
    assert s.liquid_memory is True


def test_precedence_defaults_toml_env_cli(tmp_path):
    config = tmp_path / "gnosis.toml"
    config.write_text('port = 9001\nhost = "0.0.0.0"\nlog_level = "debug"\nmax_batch_size = 4\n')
    s = load_settings(config_file=config, environ={"GNOSIS_PORT": "9002", "GNOSIS_LOG_LEVEL": "warning"},
                      cli={"port": 9003})
    assert s.port == 9003  # CLI beats env beats TOML
    assert s.log_level == "warning"  # env beats TOML
    assert s.host == "0.0.0.0"  # TOML beats default
    assert s.max_batch_size == 4


def test_thoth_liquid_memory_alias():
    assert load_settings(environ={"THOTH_LIQUID_MEMORY": "0"}).liquid_memory is False
    assert load_settings(environ={"THOTH_LIQUID_MEMORY": "1"}).liquid_memory is True


def test_tool_parser_setting():
    assert load_settings(environ={}).tool_parser == "auto"
    assert load_settings(environ={"GNOSIS_TOOL_PARSER": "llama3"}).tool_parser == "llama3"


def test_station_disable_list():
    s = load_settings(environ={"GNOSIS_STATION_DISABLE": "kv_session, decode_next,"})
    assert s.disabled_capabilities == frozenset({"kv_session", "decode_next"})


@pytest.mark.parametrize(
    ("environ", "needle"),
    [
        ({"GNOSIS_PORT": "eighty"}, "GNOSIS_PORT"),
        ({"GNOSIS_PORT": "70000"}, "'port'"),
        ({"GNOSIS_LOG_FORMAT": "xml"}, "'log_format'"),
        ({"GNOSIS_KV_BLOCK_SIZE": "0"}, "'kv_block_size'"),
        ({"THOTH_LIQUID_MEMORY": "maybe"}, "THOTH_LIQUID_MEMORY"),
        ({"GNOSIS_MODEL": "/nonexistent/model"}, "'model'"),
        ({"GNOSIS_DRAIN_GRACE_S": "-1"}, "'drain_grace_s'"),
        ({"GNOSIS_KV_IO_NICE": "20"}, "'kv_io_nice'"),
        ({"GNOSIS_KV_HOST_BYTES": "-1"}, "'kv_host_bytes'"),
        ({"GNOSIS_TOOL_PARSER": "xml"}, "'tool_parser'"),
        ({"GNOSIS_MAX_INFLIGHT_TENANT_SHARE": "0"}, "'max_inflight_tenant_share'"),
        ({"GNOSIS_MAX_INFLIGHT_TENANT_SHARE": "1.5"}, "'max_inflight_tenant_share'"),
        ({"GNOSIS_STREAM_STALL_TIMEOUT_S": "0"}, "'stream_stall_timeout_s'"),
        ({"GNOSIS_STREAM_BUFFER_BYTES": "0"}, "'stream_buffer_bytes'"),
    ],
)
def test_bad_values_name_the_setting(environ, needle):
    with pytest.raises(SettingsError) as info:
        load_settings(environ=environ)
    assert needle in str(info.value)


def test_bad_toml_and_unknown_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("port = \n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(config_file=bad, environ={})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("prot = 1\n")
    with pytest.raises(SettingsError, match="unknown setting 'prot'"):
        load_settings(config_file=unknown, environ={})
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(config_file=tmp_path / "missing.toml", environ={})


def test_to_env_round_trips():
    original = load_settings(environ={}, cli={"port": 8123, "liquid_memory": False,
                                              "disable_capabilities": "kv_session"})
    rebuilt = load_settings(environ=original.to_env())
    assert rebuilt == original


def test_cli_main_reports_bad_setting(capsys):
    from gnosis_daemon.cli import main

    assert main(["status", "--port", "99999"]) == 2
    assert "'port'" in capsys.readouterr().err


def test_settings_object_validates_directly():
    with pytest.raises(SettingsError, match="max_batch_size"):
        Settings(max_batch_size=0)
