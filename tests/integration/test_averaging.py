"""In-stage averaging over real hivemind: replicas hold bit-identical state after a round."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dht.records import ModelSpec, RunSpec
from dht.clock import SYSTEM_CLOCK
from swarm.averaging import StageAverager
from swarm.stage import Stage
from swarm.view import SwarmView

SPEC = RunSpec(run_id="avgtest", model=ModelSpec(d_model=32, num_layers=2, num_heads=2, seq_len=16),
               stage_layers=((0, 1), (1, 2)), microbatch_size=4, target_batch_size=8, averaging_period=5.0)


@pytest.mark.parametrize("client_mode", [False, True], ids=["both-reliable", "one-unreliable"])
def test_a_round_leaves_replicas_bit_identical_at_the_mean(dht_nodes, client_mode):
    _, (dht_a, _), (dht_b, _) = dht_nodes
    stages = [Stage(SPEC, 1, device=torch.device("cpu")) for _ in range(2)]
    with torch.no_grad():
        for index, param in enumerate(stages[1].model.parameters()):
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(index)))
    for stage in stages:  # as many optimizer steps as such a move takes (swarm/plausibility.py drops a round
        for param in stage.model.parameters():  # whose result no AdamW training could reach)
            stage.optimizer.state[param]["step"] = torch.tensor(1000.0)
    expected = [(p + q) / 2 for p, q in zip(stages[0].model.parameters(), stages[1].model.parameters())]
    averagers = [
        StageAverager(stages[0], dht_a, SwarmView(dht_a, SPEC.run_id), client_mode=False, matchmaking_time=1.5),
        StageAverager(stages[1], dht_b, SwarmView(dht_b, SPEC.run_id), client_mode=client_mode, matchmaking_time=1.5),
    ]
    try:
        async def main():
            at = SYSTEM_CLOCK.dht_time() + 3.0
            stop = asyncio.Event()
            return await asyncio.gather(*(a.run_round(at, stop) for a in averagers))

        assert asyncio.run(main()) == [True, True]
        digests = [s.params_digest() for s in stages]
        assert digests[0] == digests[1]
        for param, mean in zip(stages[0].model.parameters(), expected):
            torch.testing.assert_close(param.detach(), mean.detach(), rtol=1e-6, atol=1e-6)
        assert [a.num_rounds for a in averagers] == [1, 1]
        (version_a, state_a), (version_b, state_b) = stages[0].snapshot, stages[1].snapshot
        assert version_a == version_b and sorted(state_a) == sorted(state_b)
        assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in state_a)
        for name in state_a:
            assert torch.equal(state_a[name], state_b[name]), f"snapshots differ in {name}"
    finally:
        for averager in averagers:
            averager.shutdown()
