"""Peer and bootstrap configuration: flags derived from the dataclasses, validation raises ValueError."""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

from peer.cli import add_dataclass_arguments, dataclass_from_args
from peer.config import BootstrapConfig, PeerConfig

ROOT = Path(__file__).resolve().parents[2]
BOOT = ("/ip4/127.0.0.1/tcp/31337/p2p/QmBoot",)


def parser_for(cls) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=cls.__name__)
    add_dataclass_arguments(parser, cls)
    return parser


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize("cls", [PeerConfig, BootstrapConfig])
def test_every_field_has_a_flag_with_its_help(cls):
    help_text = " ".join(parser_for(cls).format_help().split())  # undo line wrapping
    for field in dataclasses.fields(cls):
        assert flag(field.name) in help_text, field.name
        assert field.metadata.get("help"), f"{cls.__name__}.{field.name} has no help text"
        first_words = " ".join(field.metadata["help"].split()[:3])
        assert first_words in help_text, field.name


@pytest.mark.parametrize("script, cls", [("run_peer.py", PeerConfig), ("run_bootstrap.py", BootstrapConfig)])
def test_entry_script_help_lists_every_field(script, cls):
    result = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for field in dataclasses.fields(cls):
        assert flag(field.name) in result.stdout, field.name


@pytest.mark.parametrize("cls, argv", [(PeerConfig, ["--bootstrap", BOOT[0]]), (BootstrapConfig, [])])
def test_parser_defaults_equal_dataclass_defaults(cls, argv):
    parser = parser_for(cls)
    args = parser.parse_args(argv)
    for field in dataclasses.fields(cls):
        if field.type == "tuple[str, ...]":
            continue  # parsed as None and resolved by dataclass_from_args (checked below)
        assert parser.get_default(field.name) == field.default, field.name
    built = dataclass_from_args(cls, args)
    expected = cls(bootstrap=BOOT) if cls is PeerConfig else cls()
    assert built == expected


def test_flags_reach_the_config():
    argv = ["--bootstrap", "a", "b", "--bootstrap", "c", "--run-id", "r-1", "--role", "unreliable", "--client-mode",
            "--stage", "2", "--max-memory-mb", "512.5", "--data", "x.txt", "y.txt", "--identity-path", "id.key",
            "--heartbeat-period", "2", "--heartbeat-ttl", "5", "--max-in-flight", "8"]
    config = dataclass_from_args(PeerConfig, parser_for(PeerConfig).parse_args(argv))
    assert config.bootstrap == ("a", "b", "c")
    assert config.run_id == "r-1" and config.role == "unreliable" and config.client_mode is True
    assert config.stage == 2 and config.max_memory_mb == 512.5 and config.data == ("x.txt", "y.txt")
    assert config.identity_path == "id.key" and config.max_in_flight == 8
    assert config.heartbeat_period == 2.0 and config.heartbeat_ttl == 5.0
    assert config.resolved_role == "unreliable"
    config = dataclass_from_args(PeerConfig, parser_for(PeerConfig).parse_args(["--bootstrap", "a", "--no-client-mode"]))
    assert config.client_mode is False and config.resolved_role == "reliable"


def test_overrides_and_bad_flag_values():
    args = parser_for(BootstrapConfig).parse_args(["--num-layers", "6", "--num-stages", "3"])
    assert dataclass_from_args(BootstrapConfig, args, seed=9).seed == 9
    with pytest.raises(SystemExit):
        parser_for(BootstrapConfig).parse_args(["--num-layers", "six"])
    with pytest.raises(ValueError):
        dataclass_from_args(BootstrapConfig, parser_for(BootstrapConfig).parse_args(["--num-stages", "5"]))


def test_stage_pins_first_stage_only_starts_and_both_at_once_is_refused():
    assert PeerConfig(bootstrap=BOOT).start_stage == -1
    assert PeerConfig(bootstrap=BOOT, stage=1).start_stage == 1
    assert PeerConfig(bootstrap=BOOT, first_stage=2).start_stage == 2
    with pytest.raises(ValueError, match="not both"):
        PeerConfig(bootstrap=BOOT, stage=1, first_stage=1)
    with pytest.raises(ValueError, match="--first-stage must be -1"):
        PeerConfig(bootstrap=BOOT, first_stage=-2)


def test_resolved_role():
    assert PeerConfig(bootstrap=BOOT).resolved_role == "reliable"
    assert PeerConfig(bootstrap=BOOT, client_mode=True).resolved_role == "unreliable"
    assert PeerConfig(bootstrap=BOOT, role="unreliable").resolved_role == "unreliable"


BAD_PEER = {
    "no bootstrap": dict(bootstrap=()),
    "bad run id": dict(run_id="has space"),
    "empty run id": dict(run_id=""),
    "bad role": dict(role="leader"),
    "reliable client mode": dict(role="reliable", client_mode=True),
    "stage below -1": dict(stage=-2),
    "negative threads": dict(num_threads=-1),
    "zero in flight": dict(max_in_flight=0),
    "zero join timeout": dict(join_timeout=0.0),
    "negative join timeout": dict(join_timeout=-1.0),
    "nan join timeout": dict(join_timeout=math.nan),
    "inf request timeout": dict(request_timeout=math.inf),
    "negative request timeout": dict(request_timeout=-5.0),
    "zero heartbeat period": dict(heartbeat_period=0.0),
    "ttl equal two periods": dict(heartbeat_period=1.0, heartbeat_ttl=2.0),
    "ttl below two periods": dict(heartbeat_period=3.0, heartbeat_ttl=5.0),
    "negative ttl": dict(heartbeat_ttl=-6.0),
    "zero payload": dict(max_payload_mb=0.0),
    "negative status period": dict(status_period=-1.0),
    "negative memory": dict(max_memory_mb=-1.0),
    "negative run for": dict(run_for=-1.0),
    "negative settle delay": dict(settle_delay=-0.5),
    "log level": dict(log_level="LOUD"),
}


@pytest.mark.parametrize("overrides", BAD_PEER.values(), ids=BAD_PEER.keys())
def test_invalid_peer_config_raises_value_error(overrides):
    with pytest.raises(ValueError):
        PeerConfig(**{"bootstrap": BOOT, **overrides})


def test_invalid_peer_flags_exit_with_a_usage_error():
    # run_peer.main turns the ValueError into argparse's usage error (exit status 2)
    import run_peer

    with pytest.raises(SystemExit) as exit_info:
        run_peer.main(["--bootstrap", "a", "--role", "reliable", "--client-mode"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("overrides", [
    dict(heartbeat_period=2.0, heartbeat_ttl=4.01),
    dict(stage=0),
    dict(role="unreliable", client_mode=True),
    dict(log_level="debug"),
    dict(settle_delay=0.0, run_for=0.0, max_memory_mb=0.0),
])
def test_valid_peer_config_edge_cases_are_accepted(overrides):
    config = PeerConfig(**{"bootstrap": BOOT, **overrides})
    for key, value in overrides.items():
        assert getattr(config, key) == value


def test_configs_are_frozen():
    config = PeerConfig(bootstrap=BOOT)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stage = 3  # type: ignore[misc]


BAD_BOOTSTRAP = {
    "bad run id": dict(run_id="a/b"),
    "zero refresh": dict(spec_refresh_period=0.0),
    "negative refresh": dict(spec_refresh_period=-1.0),
    "negative stages": dict(num_stages=-1),
    "no stage memory": dict(num_stages=0, stage_memory_gb=0.0),
    "a preset beside a model flag": dict(preset="tiny", num_layers=8),
    "more stages than layers": dict(num_layers=4, num_stages=5),
}


@pytest.mark.parametrize("overrides", BAD_BOOTSTRAP.values(), ids=BAD_BOOTSTRAP.keys())
def test_invalid_bootstrap_config_raises_value_error(overrides):
    with pytest.raises(ValueError):
        BootstrapConfig(**overrides)


def test_a_delayed_schedule_with_a_swarm_wide_batch_is_refused_in_one_sentence():
    from peer.config import BootstrapConfig

    with pytest.raises(ValueError, match="--replica-sync gradients needs --pipeline-schedule flush"):
        BootstrapConfig(pipeline_schedule="delayed")
    with pytest.raises(ValueError, match="--pipeline-schedule must be one of flush, delayed"):
        BootstrapConfig(pipeline_schedule="sometimes")
    assert BootstrapConfig(pipeline_schedule="delayed", replica_sync="periodic").replica_sync == "periodic"
