"""Config from a TOML file, environment variables and flags: every field reachable, precedence, mistakes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from peer.cli import config_parser, load_config
from peer.config import BootstrapConfig, PeerConfig
from peer.config_sources import env_name, read_config_file, read_env

ROOT = Path(__file__).resolve().parents[2]
BOOT = "/ip4/127.0.0.1/tcp/31337/p2p/QmBoot"
# fields whose valid values are a closed set, or which must be consistent with others
SPECIAL = {"role": "unreliable", "device": "cpu", "log_level": "DEBUG", "run_id": "other-run", "flow_control": "fixed", "stripe_calls": "off",
           "terminal_view": "on", "status_host": "0.0.0.0", "num_stages": 1, "recovery": "restart",
           "aggregation": "mean", "pipeline_schedule": "delayed", "replica_sync": "periodic",
           "run_owner": "0123456789abcdef" * 2, "reachability": "direct", "boundary_codec": "int8",
           "gradient_codec": "int8"}
# flags a field's SPECIAL value needs beside it to be valid
COMPANIONS = {"pipeline_schedule": ["--replica-sync", "periodic"]}


def base_of(cls: type) -> dict[str, Any]:
    return {"bootstrap": (BOOT,)} if cls is PeerConfig else {}


def other_value(cls: type, field: dataclasses.Field) -> Any:
    """A valid value of ``field`` that differs from its default (so reaching it is visible)."""
    if field.name in SPECIAL:
        return SPECIAL[field.name]
    default = field.default
    if field.type == "bool":
        return not default
    if field.type == "int":
        return default + 1 if default >= 0 else 0
    if field.type == "float":
        return float(default * 2 if default else 1.5)
    if field.type in ("str", "str | None"):
        return "some-name"
    if field.type == "tuple[str, ...]":
        return ("/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2")
    raise AssertionError(f"no test value for {cls.__name__}.{field.name}: {field.type}")


def toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    return repr(value)


def env_literal(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def flag_args(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, tuple):
        return [flag, *value]
    return [flag, str(value)]


def cases() -> list:
    return [pytest.param(cls, f, id=f"{cls.__name__}.{f.name}")
            for cls in (PeerConfig, BootstrapConfig) for f in dataclasses.fields(cls) if f.init]


def load(cls: type, argv: list[str], env: dict[str, str] | None = None):
    config, _args = load_config(config_parser(cls), cls, argv, env=env or {})
    return config


@pytest.mark.parametrize("cls, field", cases())
def test_every_field_is_reachable_from_file_env_and_flag(cls, field, tmp_path):
    value = other_value(cls, field)
    assert value != field.default
    base_argv = [] if cls is BootstrapConfig else ["--bootstrap", BOOT]
    if field.name == "bootstrap":
        base_argv = []
    base_argv = [*base_argv, *COMPANIONS.get(field.name, [])]
    path = tmp_path / "config.toml"
    path.write_text(f"{field.name} = {toml_literal(value)}\n")
    from_file = load(cls, [*base_argv, "--config", str(path)])
    from_env = load(cls, base_argv, env={env_name(field.name): env_literal(value)})
    from_flag = load(cls, [*base_argv, *flag_args(field.name, value)])
    for config in (from_file, from_env, from_flag):
        assert getattr(config, field.name) == value


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text(f'bootstrap = ["{BOOT}"]\nrun_id = "from-file"\nmax_in_flight = 7\nstage = 1\nclient_mode = true\n')
    env = {"MURMURATION_RUN_ID": "from-env", "MURMURATION_MAX_IN_FLIGHT": "9"}
    config = load(PeerConfig, ["--config", str(path), "--max-in-flight", "4", "--no-client-mode"], env)
    assert config.bootstrap == (BOOT,)  # file only
    assert config.stage == 1  # file only
    assert config.run_id == "from-env"  # env beats file
    assert config.max_in_flight == 4  # a flag beats env and file, even when it names the default value
    assert config.client_mode is False  # a --no- flag beats the file's true
    assert config.settle_delay == PeerConfig(bootstrap=(BOOT,)).settle_delay  # default


def test_a_flag_list_replaces_the_file_list(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text('bootstrap = ["/ip4/1.2.3.4/tcp/1/p2p/QmA", "/ip4/1.2.3.4/tcp/2/p2p/QmB"]\n')
    assert load(PeerConfig, ["--config", str(path), "--bootstrap", BOOT]).bootstrap == (BOOT,)
    assert load(PeerConfig, ["--config", str(path)], {"MURMURATION_BOOTSTRAP": f"{BOOT} {BOOT}x"}).bootstrap == (BOOT, BOOT + "x")


@pytest.mark.parametrize("text, message", [
    ("max_inflight = 4\n", "unknown key 'max_inflight' (did you mean 'max_in_flight'?)"),
    ("no_such_thing = 1\n", "unknown key 'no_such_thing'"),
    ('max_in_flight = "four"\n', "key 'max_in_flight' must be an integer, got 'four'"),
    ("max_in_flight = 4.5\n", "key 'max_in_flight' must be an integer"),
    ("client_mode = 1\n", "key 'client_mode' must be true or false"),
    ("bootstrap = [1, 2]\n", "key 'bootstrap' must be a list of strings"),
    ("join_timeout = true\n", "key 'join_timeout' must be a number"),
    ("run_id = \n", "is not valid TOML"),
    ("[peer]\nrun_id = \"x\"\n", "unknown key 'peer'"),
])
def test_file_mistakes_are_one_sentence(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_config_file(PeerConfig, str(path))
    assert message in str(info.value) and str(path) in str(info.value)
    assert "\n" not in str(info.value).strip()


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(ValueError, match="cannot be read: No such file"):
        read_config_file(PeerConfig, str(tmp_path / "nope.toml"))


@pytest.mark.parametrize("name, text, message", [
    ("MURMURATION_MAX_IN_FLIGHT", "four", "must be an integer"),
    ("MURMURATION_JOIN_TIMEOUT", "soon", "must be a number"),
    ("MURMURATION_CLIENT_MODE", "maybe", "must be true or false"),
])
def test_env_mistakes_are_one_sentence(name, text, message):
    with pytest.raises(ValueError) as info:
        read_env(PeerConfig, {name: text})
    assert message in str(info.value) and name in str(info.value)


def test_env_reads_only_its_own_fields():
    env = {"MURMURATION_BOOTSTRAP": BOOT, "MURMURATION_NUM_LAYERS": "6", "MURMURATION_CLIENT_MODE": "yes",
           "MURMURATION_IDENTITY_PATH": "", "OTHER": "1"}
    both = {env_name(f.name) for cls in (PeerConfig, BootstrapConfig) for f in dataclasses.fields(cls)}
    assert read_env(PeerConfig, env, known=both) == {"bootstrap": (BOOT,), "client_mode": True, "identity_path": None}
    assert read_env(BootstrapConfig, env, known=both) == {"num_layers": 6, "identity_path": None}


def test_values_from_file_are_validated_by_the_dataclass(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text(f'bootstrap = ["{BOOT}"]\nheartbeat_period = 5.0\n')  # ttl 6 < 2 periods
    with pytest.raises(ValueError, match="--heartbeat-ttl must exceed two heartbeat periods"):
        load(PeerConfig, ["--config", str(path)])


@pytest.mark.parametrize("script", ["run_peer.py", "run_bootstrap.py"])
def test_entry_scripts_reject_a_bad_file_in_one_line(script, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("max_inflight = 4\n")
    result = subprocess.run([sys.executable, script, "--config", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown key 'max_inflight'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("script", ["run_peer.py", "run_bootstrap.py"])
def test_help_names_the_config_file_and_the_environment(script):
    result = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--config PATH.toml" in text and "MURMURATION_<NAME>" in text
    if script == "run_peer.py":
        assert "--dry-run" in text


def test_example_files_load(tmp_path):
    peer = load(PeerConfig, ["--config", str(ROOT / "examples" / "peer.toml")])
    assert peer.bootstrap and peer.max_memory_mb > 0
    bootstrap = load(BootstrapConfig, ["--config", str(ROOT / "examples" / "bootstrap.toml")])
    assert bootstrap.host_maddrs == ("/ip4/0.0.0.0/tcp/31337",)


@pytest.mark.parametrize("cls", [PeerConfig, BootstrapConfig])
def test_an_unknown_murmuration_variable_is_a_mistake_named_with_a_suggestion(cls):
    with pytest.raises(ValueError, match="MURMURATION_MAX_INFLIGHT is not an option of this script "
                                         r"\(did you mean MURMURATION_MAX_IN_FLIGHT\?\)"):
        load(cls, [], {"MURMURATION_MAX_INFLIGHT": "8"})


@pytest.mark.parametrize("cls", [PeerConfig, BootstrapConfig])
def test_the_other_scripts_options_and_the_tools_variables_are_not_mistakes(cls):
    env = {"MURMURATION_BOOTSTRAP": BOOT, "MURMURATION_NUM_LAYERS": "4", "MURMURATION_CPU_HOG": "1",
           "MURMURATION_INJECT_FAULTS": "nan_updates", "NOT_OURS": "x"}
    assert isinstance(load(cls, [], env), cls)
