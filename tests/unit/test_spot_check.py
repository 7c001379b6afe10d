"""Spot checks (swarm/spot_check.py), the stage's check forward and weight tags, the test-only faults
(peer/faults.py), weighted strikes and the metrics that show them."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

from dht.reputation import Reputation
from peer.config import PeerConfig
from peer.errors import UserError
from peer.faults import ALLOW_ENV, FAULTS_ENV, inject_corrupt_shards, inject_wrong_outputs, read_faults
from peer.status.prometheus import PeerCollector, make_registry
from peer.status.snapshot import ServiceCounters
from swarm.spot_check import (
    FINGERPRINT_DIMS,
    STRICT_TOLERANCE,
    SUSPICION_PERIOD,
    SpotChecker,
    fingerprint_distance,
    output_fingerprint,
)
from tests.unit.test_prometheus_metrics import samples, training_peer
from tests.unit.test_stage import batch, make_spec, open_stages, run

BOOTSTRAP = ("/ip4/127.0.0.1/tcp/1/p2p/QmX",)
REPO = Path(__file__).resolve().parents[2]


def test_fingerprints_are_deterministic_small_and_tell_wrong_outputs_apart():
    outputs = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))
    fingerprint = output_fingerprint(outputs)
    assert fingerprint.shape == (4, 16, FINGERPRINT_DIMS) and fingerprint.dtype == torch.float32
    assert torch.equal(fingerprint, output_fingerprint(outputs.clone()))  # the same directions every time
    assert fingerprint_distance(fingerprint, fingerprint) == 0.0
    assert fingerprint_distance(fingerprint, output_fingerprint(-outputs)) == pytest.approx(2.0)
    assert fingerprint_distance(fingerprint, output_fingerprint(torch.zeros_like(outputs))) == pytest.approx(1.0)
    assert fingerprint_distance(fingerprint, output_fingerprint(outputs * 1.5)) == pytest.approx(1 / 3, rel=1e-4)
    assert fingerprint_distance(fingerprint, output_fingerprint(outputs + 1e-6 * torch.randn_like(outputs))) < STRICT_TOLERANCE
    assert fingerprint_distance(fingerprint, fingerprint[:2]) == float("inf")
    assert fingerprint_distance(fingerprint, fingerprint * float("nan")) == float("inf")


def test_a_check_forward_keeps_no_graph_counts_nothing_and_equals_the_real_answer():
    spec = make_spec(target_batch_size=1000)

    async def main(first, last):
        inputs, targets = batch(0)
        hidden, prints, tag = await first.forward_fingerprinted("m", inputs)
        assert tag == f"seed{spec.seed}" and first.num_held_graphs == 1
        loss, grad, logit_prints, last_tag = await last.forward_loss_backward_fingerprinted(hidden, targets)
        await first.backward("m", grad)
        assert last_tag == tag and logit_prints.shape == (*targets.shape, FINGERPRINT_DIMS)
        accumulated = {name: g.clone() for name, g in last.accumulated_gradients().items()}
        samples_before = last.counters.num_samples
        checked, checked_tag = await last.check_forward(hidden)
        assert checked_tag == last_tag and fingerprint_distance(checked, logit_prints) < STRICT_TOLERANCE
        assert last.num_held_graphs == 0 and last.counters.num_samples == samples_before
        for name, g in last.accumulated_gradients().items():
            assert torch.equal(g, accumulated[name]), name  # nothing added to the batch
        first_check, _ = await first.check_forward(inputs)
        assert fingerprint_distance(first_check, prints) < STRICT_TOLERANCE and first.num_held_graphs == 0

    with open_stages(spec, 0, 1) as (first, last):
        run(main, first, last)


def test_weight_tags_follow_steps_and_averaging_and_a_check_can_use_the_snapshot():
    spec = make_spec(stage_layers=((0, 4),), target_batch_size=2)

    async def main(stage):
        inputs, targets = batch(1)
        assert stage.weights_tag == f"seed{spec.seed}"
        digest = await stage.run(stage.publish_averaged, 1700)
        averaged = f"avg1700:{digest}"
        assert stage.weights_tag == averaged and digest == await stage.run(stage.params_digest)
        before, tag = await stage.check_forward(inputs)
        assert tag == averaged
        loss, _ = await stage.forward_loss_backward(inputs, targets)
        stage.record_microbatch(2, loss)
        await stage.wait_step_done()
        assert stage.version == 1 and stage.weights_tag == ""  # its own weights now
        now, tag = await stage.check_forward(inputs)
        assert tag == "" and fingerprint_distance(now, before) > STRICT_TOLERANCE
        again, tag = await stage.check_forward(inputs, weights_tag=averaged)  # the round's snapshot
        assert tag == averaged and torch.equal(again, before)
        _, tag = await stage.check_forward(inputs, weights_tag="avg1699:" + digest)  # a round it does not hold
        assert tag == ""
        await stage.run(stage.load_state_tensors, stage.state_tensors())
        assert stage.weights_tag == ""

    with open_stages(spec, 0) as (stage,):
        run(main, stage)


def test_faults_are_refused_without_the_allow_variable_and_unknown_ones_always(monkeypatch):
    assert read_faults({}) == {}
    with pytest.raises(UserError, match=ALLOW_ENV):
        read_faults({FAULTS_ENV: "corrupt_shards"})
    with pytest.raises(UserError, match="unknown faults melt_gpu"):
        read_faults({FAULTS_ENV: "melt_gpu", ALLOW_ENV: "1"})
    assert read_faults({FAULTS_ENV: "corrupt_shards, wrong_outputs", ALLOW_ENV: "1"}) == {"corrupt_shards": "", "wrong_outputs": ""}
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with open_stages(make_spec(), 1) as (stage,):
        with pytest.raises(UserError, match=ALLOW_ENV):
            inject_wrong_outputs(stage)
        assert stage.output_fault is None


def test_the_wrong_outputs_fault_negates_what_a_stage_computes(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    spec = make_spec(target_batch_size=1000)

    async def main(honest, faulty):
        inputs, _ = batch(2)
        good, _ = await honest.check_forward(inputs)
        inject_wrong_outputs(faulty)
        bad, _ = await faulty.check_forward(inputs)
        assert fingerprint_distance(good, bad) == pytest.approx(2.0)

    with open_stages(spec, 0, 0) as (honest, faulty):
        run(main, honest, faulty)


def test_the_corrupt_shards_fault_flips_a_byte_of_each_piece_of_every_second_request_the_first_included(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    data = bytes(range(256)) * 64  # 4 pieces of 4096 bytes

    async def load_shard(version, shard_bytes, index, count=1, **kwargs):
        return memoryview(data)[index * shard_bytes:(index + count) * shard_bytes]

    server = types.SimpleNamespace(load_shard=load_shard)
    inject_corrupt_shards(server)
    served = asyncio.run(server.load_shard(1, 4096, 1, 3))  # the first: corrupted
    assert len(served) == 3 * 4096
    diffs = [4096 + i for i in range(len(served)) if served[i] != data[4096 + i]]
    assert diffs == [4096 + 2048, 2 * 4096 + 2048, 3 * 4096 + 2048]  # one byte in each piece
    assert bytes(asyncio.run(server.load_shard(1, 4096, 0, 2))) == data[:2 * 4096]  # the second: honest
    served = asyncio.run(server.load_shard(1, 4096, 3, 1))  # the third: corrupted again
    assert [i for i in range(4096) if served[i] != data[3 * 4096 + i]] == [2048]


def test_fault_injection_is_not_in_the_help():
    text = subprocess.run([sys.executable, str(REPO / "run_peer.py"), "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=60).stdout
    assert "--spot-check-fraction" in text
    for hidden in ("INJECT", "FAULT_INJECTION", "corrupt", "wrong_outputs"):
        assert hidden not in text, hidden


def test_spot_check_options_are_validated():
    assert PeerConfig(bootstrap=BOOTSTRAP).spot_check_fraction == 0.01
    assert PeerConfig(bootstrap=BOOTSTRAP, spot_check_fraction=0).spot_check_fraction == 0
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="spot-check-fraction"):
            PeerConfig(bootstrap=BOOTSTRAP, spot_check_fraction=bad)
    with pytest.raises(ValueError, match="spot-check-tolerance"):
        PeerConfig(bootstrap=BOOTSTRAP, spot_check_tolerance=-1.0)


def test_a_weighted_strike_counts_as_several():
    reputation = Reputation(max_strikes=8, window=30.0)
    assert not reputation.strike("liar", "corrupted piece", weight=4)
    assert reputation.num_strikes_of("liar") == 4 and reputation.num_strikes == 4
    assert reputation.strike("liar", "corrupted piece again", weight=4)
    assert reputation.is_banned("liar") and reputation.num_bans == 1
    with pytest.raises(ValueError):
        reputation.strike("x", "no", weight=0)


def test_spot_checks_strikes_and_bans_are_in_the_metrics():
    reputation = Reputation(max_strikes=2)
    reputation.strike("QmBad", "spot check mismatch")
    reputation.strike("QmBad", "spot check mismatch")
    snapshot, history = training_peer()
    snapshot = dataclasses.replace(snapshot, bans=reputation.num_bans, strikes=reputation.num_strikes,
                                   services=ServiceCounters(spot_checks=Counter(match=7, mismatch=2)))
    got = samples(make_registry(PeerCollector(lambda: snapshot, lambda: history)))
    assert got[("murmuration_spot_checks_total", (("outcome", "match"),))] == 7.0
    assert got[("murmuration_spot_checks_total", (("outcome", "mismatch"),))] == 2.0
    assert got[("murmuration_spot_checks_total", (("outcome", "skipped"),))] == 0.0
    assert got[("murmuration_bans_total", ())] == 1.0 and got[("murmuration_strikes_total", ())] == 2.0


def test_suspicion_strikes_a_peer_at_most_once_per_period():
    now = [100.0]
    checker = SpotChecker(None, run_id="r", fraction=0.5, tolerance=0.0, rng=random.Random(0),
                          timeout=1.0, max_payload_bytes=1, clock=lambda: now[0])
    assert checker._suspect(["a", "b"]) == ["a", "b"]
    now[0] += SUSPICION_PERIOD / 2
    assert checker._suspect(["a", "c"]) == ["c"]
    now[0] += SUSPICION_PERIOD / 2
    assert checker._suspect(["a", "b", "c"]) == ["a", "b"]
    with pytest.raises(ValueError):
        SpotChecker(None, run_id="r", fraction=1.5, tolerance=0.0, rng=None, timeout=1.0, max_payload_bytes=1)
