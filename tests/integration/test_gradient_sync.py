"""A swarm-wide batch over real hivemind P2P: two replicas of a stage add up their gradients every
batch, hold bit-identical weights after every step, and take the steps one process takes on the
same microbatches; a co-replica that stops answering does not hold the other's step back."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from dht.records import ModelSpec, PeerRecord, RunSpec
from dht.registry import declare_peer
from dht.wire import TRAFFIC
from swarm.data import TokenSampler, load_corpus
from dht.rpc import RemoteError, call_peer
from swarm.gradient_sync import GradientSync, gradients_handler
from swarm.model import StageModel, next_token_loss
from swarm.stage import GRAD_CLIP_NORM, Stage
from swarm.trainer import Trainer
from swarm.view import SwarmView

SPEC = RunSpec(run_id="gsync", model=ModelSpec(d_model=32, num_layers=2, num_heads=2, seq_len=16),
               stage_layers=((0, 2),), microbatch_size=4, target_batch_size=16, lr=3e-3)
PER_BATCH = SPEC.target_batch_size // SPEC.microbatch_size
NUM_BATCHES = 4
CPU = torch.device("cpu")
TIMEOUT = 10.0


def sampler(seed: int) -> TokenSampler:
    return TokenSampler(load_corpus(SPEC.dataset).text(), seq_len=SPEC.model.seq_len, seed=seed)


async def open_replica(dht, validator, seed: int, spec: RunSpec = SPEC) -> tuple[Trainer, GradientSync]:
    """A replica of the single stage (it owns data and computes the loss), with its gradient sync."""
    peer_id = dht.peer_id.to_base58()
    assert await declare_peer(dht, validator, SPEC.run_id, PeerRecord(peer_id=peer_id, role="reliable",
                                                                      state="training", stage=0, flops=1e9), ttl=60)
    view = SwarmView(dht, SPEC.run_id)
    stage = Stage(spec, 0, device=CPU)
    sync = GradientSync(await dht.replicate_p2p(), view, stage, peer_id=peer_id, timeout=TIMEOUT,
                        max_payload_bytes=1 << 24)
    await sync.start()
    return Trainer(stage, sampler(seed), None, peer_id=peer_id, max_in_flight=2, batch_slots=sync.slots), sync


async def wait_views(replicas, num_members: int) -> None:
    async with asyncio.timeout(30):
        while True:
            for _, sync in replicas:
                await sync.view.refresh()
            if all(len(sync.view.members(0)) == num_members for _, sync in replicas):
                return
            await asyncio.sleep(0.1)


async def train_batch(trainer: Trainer) -> list[torch.Tensor]:
    """This replica's share of one batch, then the batch's close; the inputs it drew."""
    drawn = []
    assert trainer.begin_batch(PER_BATCH) == PER_BATCH // 2
    while (task := trainer.next_task()) is not None:
        drawn.append((task.inputs, task.targets))
        await trainer.run_task(task)
    await trainer.stage.close_batch()
    return drawn


def one_process_step(model: StageModel, optimizer: torch.optim.Optimizer, microbatches) -> None:
    for inputs, targets in microbatches:
        (next_token_loss(model(inputs), targets) / len(microbatches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_replicas_step_as_one_process_on_the_swarm_batch(dht_nodes):
    _, (dht1, v1), (dht2, v2) = dht_nodes
    reference = StageModel(SPEC, 0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=SPEC.lr, weight_decay=SPEC.weight_decay)

    async def main() -> list[Trainer]:
        replicas = [await open_replica(dht1, v1, seed=1), await open_replica(dht2, v2, seed=2)]
        await wait_views(replicas, 2)
        data = sampler(0)
        for batch in range(NUM_BATCHES):
            drawn = await asyncio.wait_for(asyncio.gather(*(train_batch(t) for t, _ in replicas)), 60)
            # the replicas drew the batch's positions between them, each once: the batch one process
            # draws on the run's seed (swarm.data.TokenSampler.sample_slot)
            whole = [data.sample_slot(SPEC.microbatch_size, seed=SPEC.seed, batch=batch, slot=k, slots=PER_BATCH)
                     for k in range(PER_BATCH)]
            assert sorted(x[0].tolist() for part in drawn for x in part) == sorted(x[0].tolist() for x in whole)
            one_process_step(reference, optimizer, whole)
            digests = [await t.stage.run(t.stage.params_digest) for t, _ in replicas]
            assert digests[0] == digests[1], f"replicas differ after batch {batch}"
            assert [t.stage.version for t, _ in replicas] == [batch + 1] * 2
        assert all(sync.num_partial == 0 and sync.num_exchanges == NUM_BATCHES for _, sync in replicas)
        for _, sync in replicas:
            await sync.stop()
        return [t for t, _ in replicas]

    trainers = asyncio.run(main())
    # the same function (the key bias of attention gets noise-sized gradients, which AdamW turns into
    # lr-sized steps whose sign depends on the order floats were added in; the outputs do not see it)
    inputs, _ = sampler(9).sample(8)
    with torch.no_grad():
        torch.testing.assert_close(trainers[0].stage.model(inputs), reference(inputs), rtol=1e-3, atol=1e-4)
        assert not torch.allclose(StageModel(SPEC, 0)(inputs), reference(inputs), rtol=1e-3, atol=1e-4)


def test_replicas_exchanging_int8_gradients_hold_one_state_and_stay_near_one_process(dht_nodes):
    """--gradient-codec int8: the replicas still hold bit-identical weights after every step (each
    adds the decoded contributions, its own too), their contributions take 3.76x fewer bytes, and
    with error feedback the model stays close to one process's on the same batches."""
    _, (dht1, v1), (dht2, v2) = dht_nodes
    spec = dataclasses.replace(SPEC, gradient_codec="int8")
    reference = StageModel(SPEC, 0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=SPEC.lr, weight_decay=SPEC.weight_decay)

    async def main() -> Trainer:
        replicas = [await open_replica(dht1, v1, seed=1, spec=spec), await open_replica(dht2, v2, seed=2, spec=spec)]
        await wait_views(replicas, 2)
        data = sampler(0)
        sent = TRAFFIC.bytes_sent
        for batch in range(NUM_BATCHES):
            await asyncio.wait_for(asyncio.gather(*(train_batch(t) for t, _ in replicas)), 60)
            one_process_step(reference, optimizer, [data.sample_slot(SPEC.microbatch_size, seed=SPEC.seed, batch=batch,
                                                                     slot=k, slots=PER_BATCH) for k in range(PER_BATCH)])
            digests = [await t.stage.run(t.stage.params_digest) for t, _ in replicas]
            assert digests[0] == digests[1], f"replicas differ after batch {batch}"
        num_params = replicas[0][1].num_params
        # both replicas' pushes (one process here): int8 values and a scale per 64, plus headers
        assert TRAFFIC.bytes_sent - sent < 2 * NUM_BATCHES * (num_params * 1.0625 + 4096) < 2 * NUM_BATCHES * num_params * 4
        assert all(sync.num_partial == 0 for _, sync in replicas)
        for _, sync in replicas:
            await sync.stop()
        return replicas[0][0]

    trainer = asyncio.run(main())
    inputs, _ = sampler(9).sample(8)
    with torch.no_grad():
        torch.testing.assert_close(trainer.stage.model(inputs), reference(inputs), rtol=2e-2, atol=2e-2)
        assert not torch.allclose(StageModel(SPEC, 0)(inputs), reference(inputs), rtol=2e-2, atol=2e-2)


def test_a_silent_co_replica_does_not_hold_the_step_back(dht_nodes):
    _, (dht1, v1), (dht2, v2) = dht_nodes

    async def main() -> None:
        replicas = [await open_replica(dht1, v1, seed=1), await open_replica(dht2, v2, seed=2)]
        await wait_views(replicas, 2)
        (alive, alive_sync), (_, silent_sync) = replicas
        await silent_sync.stop()  # its handler is gone: a push to it fails at once
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(train_batch(alive), 60)
        assert alive.stage.version == 1 and alive_sync.num_partial == 1
        assert asyncio.get_running_loop().time() - started < TIMEOUT  # it did not wait out the deadline
        await alive_sync.stop()

    asyncio.run(main())


def test_a_replica_behind_jumps_to_the_batch_its_co_replica_sends(dht_nodes):
    _, (dht1, v1), (dht2, v2) = dht_nodes

    async def main() -> None:
        (ahead, ahead_sync), (behind, behind_sync) = [await open_replica(dht1, v1, seed=1),
                                                      await open_replica(dht2, v2, seed=2)]
        await wait_views([(ahead, ahead_sync), (behind, behind_sync)], 2)
        ahead.stage.counters.num_steps = 7  # as a joiner finds its co-replicas several batches on
        await asyncio.wait_for(asyncio.gather(train_batch(ahead), _train_after_news(behind, 7)), 60)
        assert ahead.stage.version == behind.stage.version == 8
        assert ahead_sync.num_partial == behind_sync.num_partial == 0
        for sync in (ahead_sync, behind_sync):
            await sync.stop()

    asyncio.run(main())


async def _train_after_news(trainer: Trainer, batch: int) -> None:
    """A replica at batch 0 trains its share once its co-replica's gradients of ``batch`` arrived."""
    async with asyncio.timeout(30):
        while trainer.stage.version < batch:
            await asyncio.sleep(0.01)
    await train_batch(trainer)


def test_replicas_that_computed_on_different_weights_hold_one_state_after_the_batch(dht_nodes):
    """A joiner whose pulled state is a step old: after the next batch it holds its co-replica's
    state, bit for bit (parameters and AdamW moments), and both go on in step."""
    _, (dht1, v1), (dht2, v2) = dht_nodes

    async def main() -> None:
        (holder, holder_sync), (joiner, joiner_sync) = replicas = [await open_replica(dht1, v1, seed=1),
                                                                   await open_replica(dht2, v2, seed=2)]
        await wait_views(replicas, 2)
        await train_batch(holder)  # alone for a batch (the joiner's handler is not asked: it was not a member yet)
        holder.stage.counters.num_steps = joiner.stage.counters.num_steps = 1
        states = [await t.stage.run(t.stage.flat_state) for t in (holder, joiner)]
        assert not torch.equal(*states) and holder.stage.optimizer_steps == joiner.stage.optimizer_steps + 1
        for batch in (1, 2):
            await asyncio.wait_for(asyncio.gather(train_batch(holder), train_batch(joiner)), 60)
            states = [await t.stage.run(t.stage.flat_state) for t in (holder, joiner)]
            assert torch.equal(*states), f"the replicas differ after batch {batch}"
        assert joiner_sync.num_reconciled == 1 and holder_sync.num_reconciled == 0  # the older state took the newer
        for sync in (holder_sync, joiner_sync):
            await sync.stop()

    asyncio.run(main())


TWO_STAGES = RunSpec(run_id="gsync2", model=ModelSpec(d_model=32, num_layers=2, num_heads=2, seq_len=16),
                     stage_layers=((0, 1), (1, 2)), microbatch_size=4, target_batch_size=16)


async def open_stage_replica(dht, validator, stage_index: int) -> GradientSync:
    peer_id = dht.peer_id.to_base58()
    assert await declare_peer(dht, validator, TWO_STAGES.run_id, PeerRecord(
        peer_id=peer_id, role="reliable", state="training", stage=stage_index, flops=1e9), ttl=60)
    sync = GradientSync(await dht.replicate_p2p(), SwarmView(dht, TWO_STAGES.run_id), Stage(TWO_STAGES, stage_index, device=CPU),
                        peer_id=peer_id, timeout=TIMEOUT, max_payload_bytes=1 << 24)
    await sync.start()
    return sync


def test_the_next_stage_closes_a_batch_once_every_replica_before_it_closes_it(dht_nodes):
    """Stage 0's replica starts its exchange of batch 0 and says so to stage 1, which closes batch 0 at
    once (its exchange overlaps stage 0's) instead of waiting for the first microbatch of batch 1; a
    notice from a peer that is not a replica of stage 0 is declined and closes nothing."""
    (dht0, _), (dht1, v1), (dht2, v2) = dht_nodes

    async def main() -> None:
        first, last = await open_stage_replica(dht1, v1, 0), await open_stage_replica(dht2, v2, 1)
        outsider = await dht0.replicate_p2p()
        async with asyncio.timeout(30):
            while not (first.view.members(1) and last.view.members(0)):
                await asyncio.gather(first.view.refresh(), last.view.refresh())
                await asyncio.sleep(0.1)
        with pytest.raises(RemoteError, match="not a replica of stage 0"):
            await call_peer(outsider, last.peer_id, gradients_handler(TWO_STAGES.namespace, 1),
                            {"batch": 0, "kind": "closing"}, timeout=TIMEOUT, max_payload_bytes=1 << 20)
        assert first.stage.version == 0 and last.stage.version == 0
        await first.stage.close_batch()
        async with asyncio.timeout(30):
            while last.stage.version < 1:
                await asyncio.sleep(0.05)
        assert first.stage.version == last.stage.version == 1 and last.num_exchanges == 1
        for sync in (first, last):
            await sync.stop()

    asyncio.run(main())
