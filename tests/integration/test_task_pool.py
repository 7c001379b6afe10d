"""Re-delivered and replayed microbatches over real hivemind P2P: answered, never counted twice."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dht.rpc import call_peer, forward_handler
from swarm.router import NoPeerAvailableError
from swarm.task_pool import MicrobatchLedger
from tests.integration.test_pipeline import MAX_PAYLOAD, SPEC, first_stage_trainer, serve_last_stage


def request(mb_id: str, seed: int) -> tuple[dict, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    acts = torch.randn(2, SPEC.model.seq_len, SPEC.model.d_model, generator=generator)
    targets = torch.randint(0, SPEC.model.vocab_size, (2, SPEC.model.seq_len), generator=generator)
    return {"mb_id": mb_id, "route": [["upstream", 0, 0]], "batch_size": 2}, [acts, targets]


@pytest.mark.parametrize("cache_bytes", [MicrobatchLedger().cache_bytes, 0], ids=["cached", "evicted"])
def test_a_redelivered_microbatch_is_answered_alike_and_counted_once(dht_nodes, cache_bytes):
    _, (dht0, _), (dht1, v1) = dht_nodes

    async def main():
        stage1, server, peer1 = await serve_last_stage(dht1, v1)
        server.ledger = MicrobatchLedger(cache_bytes=cache_bytes)
        counted = []
        server.on_event = lambda event, **fields: counted.append(fields["mb_id"])
        p2p = await dht0.replicate_p2p()

        async def send(mb_id: str, seed: int):
            header, tensors = request(mb_id, seed)
            return await call_peer(p2p, peer1, forward_handler(SPEC.run_id), header, tensors,
                                   timeout=10, max_payload_bytes=MAX_PAYLOAD)

        first, again = await send("a", 1), await send("a", 1)  # the upstream never heard the first answer
        assert again[0]["loss"] == pytest.approx(first[0]["loss"])
        torch.testing.assert_close(again[1][0], first[1][0])
        concurrent = await asyncio.gather(send("b", 2), send("b", 2))  # a replay while the first is computed
        torch.testing.assert_close(concurrent[0][1][0], concurrent[1][1][0])
        assert counted == ["a", "b"], "each microbatch counts once toward the stage's batch"
        assert stage1.counters.num_samples == 4
        ledger = server.ledger
        assert ledger.num_cached + ledger.num_joined + ledger.num_recomputed == 2
        if cache_bytes == 0:  # "a" again is computed anew; "b" joins its first delivery or, if that finished, too
            assert ledger.num_cached == 0 and ledger.num_recomputed >= 1
        else:  # "a" again is answered from the cache; "b" joins or hits the cache
            assert ledger.num_recomputed == 0 and ledger.num_cached >= 1

    asyncio.run(main())


def test_a_broken_microbatch_is_replayed_with_its_id_and_data_and_counted_once(dht_nodes):
    _, (dht0, _), (dht1, v1) = dht_nodes

    async def main():
        stage0, trainer, router = await first_stage_trainer(dht0)
        events = []
        trainer.on_event = lambda event, **fields: events.append((event, fields["mb_id"]))
        task = trainer.next_task()
        inputs = task.inputs.clone()
        with pytest.raises(NoPeerAvailableError):  # nobody serves stage 1 yet
            await trainer.run_task(task)
        assert len(trainer.pool) == 1 and stage0.num_held_graphs == 0

        stage1, server, _ = await serve_last_stage(dht1, v1)
        server.ledger = MicrobatchLedger()
        stage1_counted = []
        server.on_event = lambda event, **fields: stage1_counted.append(fields["mb_id"])
        await router.view.refresh()
        for _ in range(50):
            if (replay := trainer.next_task()) is not None:
                break
            await asyncio.sleep(0.1)
        assert replay is task and replay.attempt == 1
        torch.testing.assert_close(replay.inputs, inputs)  # the same data, not a new draw
        await trainer.run_task(replay)
        assert events == [("injected", task.mb_id), ("replayed", task.mb_id), ("accumulated", task.mb_id)]
        assert stage1_counted == [task.mb_id]
        assert stage0.counters.num_samples == stage1.counters.num_samples == SPEC.microbatch_size
        assert len(trainer.pool) == 0

    asyncio.run(main())


def test_a_peer_that_keeps_sending_garbage_is_banned_and_others_are_still_served(dht_nodes):
    (other, _), (dht0, _), (dht1, v1) = dht_nodes
    from dht.reputation import Reputation
    from dht.rpc import PeerUnavailableError, RemoteError

    async def main():
        stage1, server, peer1 = await serve_last_stage(dht1, v1)
        banned = []
        server.reputation = Reputation(max_strikes=3, on_ban=lambda peer_id, reason: banned.append(peer_id))
        p2p = await dht0.replicate_p2p()
        header, tensors = request("ok", 1)
        for _ in range(3):
            with pytest.raises(RemoteError, match="route"):
                await call_peer(p2p, peer1, forward_handler(SPEC.run_id), {**header, "route": []}, tensors,
                                timeout=10, max_payload_bytes=MAX_PAYLOAD)
        assert banned == [dht0.peer_id.to_base58()]
        # even a good request goes unanswered now: held unread (a tarpit), then closed
        call = asyncio.create_task(call_peer(p2p, peer1, forward_handler(SPEC.run_id), header, tensors, timeout=10,
                                             max_payload_bytes=MAX_PAYLOAD))
        for _ in range(100):
            if server.num_tarpitted == 1 or call.done():
                break
            await asyncio.sleep(0.05)
        assert server.num_tarpitted == 1 and not call.done()
        with pytest.raises(PeerUnavailableError):
            await call
        assert server.num_tarpitted == 0
        assert stage1.counters.num_samples == 0
        reply, _ = await call_peer(await other.replicate_p2p(), peer1, forward_handler(SPEC.run_id), header, tensors,
                                   timeout=10, max_payload_bytes=MAX_PAYLOAD)  # someone else is still served
        assert reply["ok"] and stage1.counters.num_samples == 2

    asyncio.run(main())
