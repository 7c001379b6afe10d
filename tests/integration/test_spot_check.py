"""Spot checks over real hivemind P2P: stage 0 sends microbatches to replicas of stage 1, one of which
returns wrong outputs (peer/faults.py's ``wrong_outputs``); a second replica recomputes the checked
ones (forward only) and the mismatch is caught, struck, and in the end banned, with nothing counted
twice."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

import pytest
import torch

from dht.records import ModelSpec, PeerRecord, RunSpec
from dht.registry import declare_peer
from dht.reputation import Reputation
from peer.faults import ALLOW_ENV, inject_wrong_outputs
from swarm.boundary_codec import boundary_codec
from swarm.data import TokenSampler, load_corpus
from swarm.router import Router
from swarm.spot_check import SpotChecker
from swarm.stage import Stage
from swarm.stage_server import StageServer
from swarm.task_pool import MicrobatchLedger
from swarm.trainer import Trainer
from swarm.view import SwarmView

SPEC = RunSpec(run_id="spot", model=ModelSpec(d_model=32, num_layers=2, num_heads=2, seq_len=16),
               stage_layers=((0, 1), (1, 2)), microbatch_size=4, target_batch_size=10_000)  # no step: same weights
CPU = torch.device("cpu")
MAX_PAYLOAD = 1 << 24
pytestmark = pytest.mark.timeout(120)


async def serve_stage1(dht, validator, *, faulty: bool, spec: RunSpec = SPEC) -> tuple[Stage, StageServer, str]:
    p2p = await dht.replicate_p2p()
    peer_id = dht.peer_id.to_base58()
    stage = Stage(spec, 1, device=CPU)
    if faulty:
        inject_wrong_outputs(stage)
    server = StageServer(p2p, stage, peer_id=peer_id, router=None, request_timeout=10, max_payload_bytes=MAX_PAYLOAD,
                         ledger=MicrobatchLedger())
    await server.start()
    record = PeerRecord(peer_id=peer_id, role="reliable", state="training", stage=1, flops=1e9)
    assert await declare_peer(dht, validator, spec.run_id, record, ttl=120)
    return stage, server, peer_id


async def stage0(dht, reputation: Reputation, events: list[dict], *, spec: RunSpec = SPEC) -> tuple[Trainer, SpotChecker]:
    p2p = await dht.replicate_p2p()
    view = SwarmView(dht, SPEC.run_id)
    await view.refresh()
    checker = SpotChecker(p2p, run_id=SPEC.run_id, fraction=1.0, tolerance=0.0, rng=random.Random(0), timeout=10,
                          max_payload_bytes=MAX_PAYLOAD, reputation=reputation,
                          on_event=lambda event, **fields: events.append({"event": event, **fields}))
    router = Router(p2p, view, run_id=SPEC.run_id, next_stage=1, next_stage_flops=1.0, request_timeout=10,
                    max_payload_bytes=MAX_PAYLOAD, rng=random.Random(0), reputation=reputation, spot_checker=checker,
                    codec=boundary_codec(spec.boundary_codec))
    sampler = TokenSampler(load_corpus(SPEC.dataset).text(), seq_len=SPEC.model.seq_len, seed=3)
    trainer = Trainer(Stage(spec, 0, device=CPU), sampler, router, peer_id=dht.peer_id.to_base58(), max_in_flight=1)
    return trainer, checker


def assert_counted_once(stages: list[Stage], num_microbatches: int) -> None:
    """Every microbatch counted by exactly one replica of stage 1; no graph left behind."""
    assert sum(s.counters.num_samples for s in stages) == num_microbatches * SPEC.microbatch_size
    assert sum(s.counters.num_microbatches for s in stages) == num_microbatches
    assert all(s.num_held_graphs == 0 for s in stages)


@pytest.mark.parametrize("dht_nodes", [3], indirect=True)
def test_a_mismatch_between_two_replicas_strikes_both_and_bans_neither(dht_nodes, monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    (dht0, _), (dht1, v1), (dht2, v2) = dht_nodes

    async def main():
        honest, _, honest_id = await serve_stage1(dht1, v1, faulty=False)
        faulty, _, faulty_id = await serve_stage1(dht2, v2, faulty=True)
        reputation, events = Reputation(max_strikes=8), []
        trainer, checker = await stage0(dht0, reputation, events)
        for _ in range(3):
            await trainer.run_microbatch()
        await checker.wait_checks_done()
        checks = [e for e in events if e["event"] == "spot_check"]
        assert [e["outcome"] for e in checks] == ["mismatch"] * 3, checks
        for check in checks:  # same seed weights on both: compared strictly, and no third replica to arbitrate
            assert check["strict"] and not check["arbitrated"]
            assert sorted(check["blamed"]) == sorted([honest_id, faulty_id])
            assert check["distance"] == pytest.approx(2.0, rel=1e-3)
        # suspicion strikes both, once per SUSPICION_PERIOD: suspicion alone never adds up to a ban
        assert sorted(checks[0]["struck"]) == sorted([honest_id, faulty_id])
        assert checks[1]["struck"] == checks[2]["struck"] == []
        assert reputation.num_strikes_of(honest_id) == reputation.num_strikes_of(faulty_id) == 1
        assert reputation.num_bans == 0
        assert checker.num_checks == {"mismatch": 3}
        assert_counted_once([honest, faulty], 3)

    asyncio.run(main())


@pytest.mark.parametrize("dht_nodes", [4], indirect=True)
def test_a_third_replica_arbitrates_and_the_wrong_one_is_banned(dht_nodes, monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    (dht0, _), *others = dht_nodes

    async def main():
        served = [await serve_stage1(dht, validator, faulty=position == 1) for position, (dht, validator) in enumerate(others)]
        stages = [stage for stage, _, _ in served]
        honest_ids = [served[0][2], served[2][2]]
        faulty_id = served[1][2]
        reputation, events = Reputation(max_strikes=3), []
        trainer, checker = await stage0(dht0, reputation, events)
        num_microbatches = 0
        while not reputation.is_banned(faulty_id):
            assert num_microbatches < 40, f"the faulty replica was not banned: {events}"
            await trainer.run_microbatch()
            await checker.wait_checks_done()
            num_microbatches += 1
        banned_after = len(events)
        for _ in range(4):  # after the ban: only honest replicas compute and check each other
            await trainer.run_microbatch()
            num_microbatches += 1
        await checker.wait_checks_done()
        checks = [e for e in events if e["event"] == "spot_check"]
        mismatches = [e for e in checks if e["outcome"] == "mismatch"]
        assert len(mismatches) == 3, mismatches
        assert all(e["blamed"] == e["struck"] == [faulty_id] and e["arbitrated"] for e in mismatches), mismatches
        assert all(faulty_id in e["peers"] for e in mismatches)
        assert all(e["outcome"] == "match" and faulty_id not in e["peers"] and e["strict"] for e in checks[banned_after:])
        assert all(e["distance"] < 1e-3 for e in checks if e["outcome"] == "match")
        assert all(reputation.num_strikes_of(peer_id) == 0 for peer_id in honest_ids)
        assert reputation.banned() == [faulty_id] and reputation.num_bans == 1
        assert checker.num_checks["mismatch"] == 3 and checker.num_checks["match"] == len(checks) - 3
        assert_counted_once(stages, num_microbatches)

    asyncio.run(main())


@pytest.mark.parametrize("dht_nodes", [3], indirect=True)
def test_under_the_int8_codec_honest_replicas_match_exactly(dht_nodes):
    """The check sends the second replica the very wire tensors the first got: both decode them to the
    same inputs, so honest replicas' fingerprints agree bit for bit, as without a codec."""
    (dht0, _), (dht1, v1), (dht2, v2) = dht_nodes
    spec = dataclasses.replace(SPEC, boundary_codec="int8")

    async def main():
        stages = [(await serve_stage1(dht, validator, faulty=False, spec=spec))[0] for dht, validator in ((dht1, v1), (dht2, v2))]
        reputation, events = Reputation(max_strikes=3), []
        trainer, checker = await stage0(dht0, reputation, events, spec=spec)
        losses = [await trainer.run_microbatch() for _ in range(4)]
        await checker.wait_checks_done()
        checks = [e for e in events if e["event"] == "spot_check"]
        assert [e["outcome"] for e in checks] == ["match"] * 4, checks
        assert all(e["strict"] and e["distance"] == 0.0 for e in checks), checks
        assert all(math.isfinite(loss) for loss in losses) and reputation.num_bans == 0
        assert_counted_once(stages, 4)

    asyncio.run(main())
