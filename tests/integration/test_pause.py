"""A paused stage server declines new microbatches (upstream sees no replica to use) and serves again on resume."""

from __future__ import annotations

import asyncio

import pytest

from swarm.router import NoPeerAvailableError
from tests.integration.test_pipeline import first_stage_trainer, serve_last_stage


def test_paused_server_declines_and_resumed_server_serves(dht_nodes):
    _, (dht0, _), (dht1, v1) = dht_nodes

    async def main():
        stage1, server, _ = await serve_last_stage(dht1, v1)
        _, trainer, router = await first_stage_trainer(dht0)
        server.is_paused = True
        with pytest.raises(NoPeerAvailableError, match="this peer is paused"):
            await trainer.run_microbatch()
        assert stage1.counters.num_samples == 0 and server.num_refused == 0  # declined politely, not refused as bad input
        server.is_paused = False
        for peer_id in list(router.failed_until):  # the router backs off a replica that declined; do not wait that out
            router.link_up(peer_id)
        loss = await trainer.run_microbatch()
        assert loss > 0 and stage1.counters.num_samples == stage1.spec.microbatch_size

    asyncio.run(main())
