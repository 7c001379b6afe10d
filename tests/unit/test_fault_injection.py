"""Test-only fault injection: refused unless allowed, hidden from --help, and it does what it says."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from dht.records import ModelSpec, RunSpec
from peer.config import AGGREGATIONS as CONFIG_AGGREGATIONS
from peer.config import PeerConfig
from peer.errors import UserError
from peer.faults import ALLOW_ENV, FAULTS_ENV, SLOW_DEVICE_FACTOR, inject_bad_updates, inject_slow_device, read_faults
from swarm.robust import AGGREGATIONS
from swarm.links import LinkMeter
from swarm.stage import Stage

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {ALLOW_ENV: "1"}
SPEC = RunSpec(run_id="faults", model=ModelSpec(d_model=16, num_layers=1, num_heads=2, seq_len=8),
               stage_layers=((0, 1),), microbatch_size=2, target_batch_size=2)


def test_parse_needs_the_environment_and_a_known_fault():
    with pytest.raises(UserError, match=ALLOW_ENV):
        read_faults({FAULTS_ENV: "scale_updates=100"})
    with pytest.raises(UserError, match=ALLOW_ENV):
        read_faults({FAULTS_ENV: "scale_updates=100", ALLOW_ENV: "yes"})
    assert read_faults({FAULTS_ENV: "scale_updates=100", **ALLOWED}) == {"scale_updates": "100"}
    assert read_faults({FAULTS_ENV: "nan_updates, scale_updates=2", **ALLOWED}) == {"nan_updates": "", "scale_updates": "2"}
    for bad in ("scale_updates", "scale_updates=x", "scale_updates=-1", "scale_updates=nan", "nan_updates=1", "drop_all"):
        with pytest.raises(UserError, match=FAULTS_ENV):
            read_faults({FAULTS_ENV: bad, **ALLOWED})


def run_peer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "run_peer.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)


def test_run_peer_refuses_fault_injection_without_the_environment_and_hides_it_from_help():
    result = run_peer("--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/QmX",
                      env={"PATH": "/usr/bin:/bin", FAULTS_ENV: "scale_updates=100"})
    assert result.returncode == 2 and ALLOW_ENV in result.stdout + result.stderr, result.stdout + result.stderr
    help_text = run_peer("--help").stdout
    assert "--aggregation" in help_text and "centered_clip" in help_text
    assert "--fault" not in help_text and "inject" not in help_text.lower()


def stepped(**faults) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Parameters before and after one optimizer step of a fresh stage, with ``faults`` injected."""
    stage = Stage(SPEC, 0, device=torch.device("cpu"))
    if faults:
        inject_bad_updates(stage, **faults)
    before = [p.detach().clone() for p in stage.model.parameters()]
    for index, param in enumerate(stage.model.parameters()):
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(index))
    stage.optimizer.step()
    stage.shutdown()
    return before, [p.detach().clone() for p in stage.model.parameters()]


def test_scale_updates_multiplies_each_step_and_nan_updates_poisons_it(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(UserError, match=ALLOW_ENV):
        stepped(scale=100.0)
    monkeypatch.setenv(ALLOW_ENV, "1")
    before, honest = stepped()
    _, scaled = stepped(scale=100.0)
    for old, new, bad in zip(before, honest, scaled):
        torch.testing.assert_close(bad - old, 100 * (new - old), rtol=1e-4, atol=1e-6)
    _, poisoned = stepped(nan=True)
    assert all(torch.isnan(p).all() for p in poisoned)


def test_slow_device_reports_a_thousandth_of_its_compute_and_goodput_and_ten_times_its_round_trips(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    links = LinkMeter()
    links.round_trip("b", 0.02)
    links.transfer("b", 1_000_000, 0.1)  # 80 Mbit/s
    links.round_trip("c", 0.05)  # no goodput measured
    peer = SimpleNamespace(flops=2e10, ctx=SimpleNamespace(links=links))
    inject_slow_device(peer)
    figures = {f.peer_id: f for f in links.summary()}
    assert peer.flops == 2e10 / SLOW_DEVICE_FACTOR
    assert figures["b"].mbit_per_s == pytest.approx(80 / SLOW_DEVICE_FACTOR, abs=0.01) and figures["b"].rtt_ms == pytest.approx(200, rel=0.01)
    assert figures["c"].mbit_per_s == 0.05 and figures["c"].rtt_ms == pytest.approx(500, rel=0.01)
    assert read_faults({ALLOW_ENV: "1", FAULTS_ENV: "slow_device"}) == {"slow_device": ""}


def test_aggregation_option():
    assert CONFIG_AGGREGATIONS == AGGREGATIONS
    assert PeerConfig(bootstrap=("x",)).aggregation == "centered_clip"
    with pytest.raises(ValueError, match="--aggregation"):
        PeerConfig(bootstrap=("x",), aggregation="median")
