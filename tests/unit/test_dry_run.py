"""The dry run's plan: the stage a join would take, its memory verdict and the throughput it would add."""

from __future__ import annotations

import pytest

from dht.records import PeerRecord
from peer.bootstrap import build_run_spec
from peer.config import BootstrapConfig
from peer.dry_run import DryRunPlan, format_plan, plan_join
from peer.join import stage_costs

SPEC = build_run_spec(BootstrapConfig(num_stages=2))
GFLOPS = 1e9


def record(peer_id: str, stage: int, *, state: str = "training", flops: float = GFLOPS, announced_at: float = 0.0) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="reliable", state=state, stage=stage, flops=flops, announced_at=announced_at)


def plan(records, *, forced_stage: int = -1, budget: int = 10**12) -> DryRunPlan:
    return plan_join(SPEC, records, peer_id="me", flops=2 * GFLOPS, now=100.0, forced_stage=forced_stage,
                     needed_bytes_fn=lambda k: 1000 + k, budget_bytes=budget, budget_source="--max-memory-mb")


def test_empty_swarm_takes_stage_zero_and_cannot_raise_the_bottleneck_alone():
    result = plan([])
    costs = stage_costs(SPEC)
    assert result.stage == 0 and result.chosen_by == "negotiated"
    assert result.before == [0.0, 0.0] and result.after == pytest.approx([2 * GFLOPS / costs[0], 0.0])
    assert result.bottleneck_gain == 0.0 and result.peers_per_stage == [0, 0]


def test_fills_the_stage_with_the_largest_deficit_and_raises_the_bottleneck():
    costs = stage_costs(SPEC)
    result = plan([record("a", 0)])
    assert result.stage == 1 and result.peers_per_stage == [1, 0]
    assert result.bottleneck_gain == pytest.approx(min(GFLOPS / costs[0], 2 * GFLOPS / costs[1]))
    assert result.own_samples_per_s == pytest.approx(2 * GFLOPS / costs[1])
    assert result.needed_bytes == 1001


def test_earlier_joiners_are_placed_first_and_idle_peers_add_nothing():
    records = [record("a", 0), record("b", -1, state="joining", flops=10 * GFLOPS, announced_at=50.0),
               record("c", 1, state="paused", flops=100 * GFLOPS), record("d", 1, state="leaving", flops=100 * GFLOPS)]
    result = plan(records)
    assert result.peers_per_stage == [1, 0]  # the paused and the leaving peer are not members
    assert result.stage == 0  # b (fast, announced earlier) takes stage 1; then stage 0 has the larger deficit


def test_a_forced_stage_and_the_memory_verdict():
    result = plan([record("a", 0)], forced_stage=0, budget=1000)
    assert result.stage == 0 and result.chosen_by == "--stage"
    assert result.needed_bytes == 1000 and result.fits
    assert not plan([], budget=999).fits


def test_report_says_stage_memory_and_throughput():
    text = format_plan(plan([record("a", 0)], budget=500), SPEC, peer_id="me", flops=2 * GFLOPS, device="cpu")
    assert "would take stage 1 of 2 (layers 2-3; negotiated)" in text
    assert "does NOT fit: raise --max-memory-mb" in text
    assert "the swarm's bottleneck would go from 0 to" in text and "stage 0: 1 peer," in text
