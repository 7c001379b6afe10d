"""A banned sender's forward streams are held unread, then closed (swarm.stage_server's tarpit): at
most MAX_TARPITTED at once, and none past the server's stop."""

from __future__ import annotations

import asyncio

import torch

from dht.records import ModelSpec, RunSpec
from swarm.stage import Stage
from swarm.stage_server import MAX_TARPITTED, StageServer

SPEC = RunSpec(run_id="tarpit", model=ModelSpec(d_model=16, num_layers=1, num_heads=2, seq_len=8), stage_layers=((0, 1),),
               microbatch_size=2, target_batch_size=2)


class Writer:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_held_streams_are_capped_and_released_when_the_server_stops():
    stage = Stage(SPEC, 0, device=torch.device("cpu"))

    async def main():
        server = StageServer(None, stage, peer_id="me", router=None, request_timeout=5.0, max_payload_bytes=1 << 20)
        held = [Writer() for _ in range(MAX_TARPITTED)]
        tasks = [asyncio.create_task(server._tarpit(w)) for w in held]
        while server.num_tarpitted < MAX_TARPITTED:
            await asyncio.sleep(0)
        extra = Writer()
        await server._tarpit(extra)  # one more than the cap: closed at once
        assert extra.closed and not any(w.closed for w in held)
        server._stopping.set()  # what stop() does first
        await asyncio.gather(*tasks)
        assert all(w.closed for w in held) and server.num_tarpitted == 0

    try:
        asyncio.run(main())
    finally:
        stage.shutdown()
