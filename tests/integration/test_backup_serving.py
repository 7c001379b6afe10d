"""A keeper serves the backup it holds of another stage next to its own, over real hivemind P2P.

Node 0 is the puller (a rescuer or a joiner of the lost stage), node 1 the keeper: it serves its
own stage 1 and a backup of stage 0 through one ``ReplicationServer`` (seed 001 §3.4). Last, a
keeper that copies a holder's state refuses one no AdamW training makes (swarm/plausibility.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from dht.records import ModelSpec, PeerRecord, RunSpec
from dht.reputation import Reputation
from dht.rpc import RemoteError, call_peer
from peer.backup import BackupKeeper
from peer.config import PeerConfig
from peer.event_log import EventLog
from replication.config import TransferConfig
from replication.server import ReplicationServer, manifest_handler, shard_handler
from replication.transfer import TransferError, pull_state
from swarm.stage import Stage
from swarm.view import SwarmView
from tests.conftest import open_dht_nodes

RUN, OWN, BACKED_UP = "backuptest", 1, 0
CONFIG = TransferConfig(piece_bytes=64 * 1024, min_agreeing_donors=1, request_timeout=10.0)
pytestmark = pytest.mark.timeout(60)


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.w": torch.randn(300, 256, generator=g), "optim.w.exp_avg": torch.randn(300, 256, generator=g),
            "stage.layers": torch.tensor([seed, 0, 2])}


OWN_STATE, BACKUP_STATE = make_state(1), make_state(0)


@pytest.fixture
def nodes() -> Iterator[list]:
    with open_dht_nodes(2) as nodes:
        yield nodes


def test_a_keeper_serves_its_backup_and_its_own_stage_and_refuses_other_stages(nodes, tmp_path):
    (puller, _), (keeper, _) = nodes
    keeper_id = keeper.peer_id.to_base58()
    backups = {BACKED_UP: (41, BACKUP_STATE)}

    async def own_snapshot():
        return 7, OWN_STATE

    def backup_fn(stage: int):
        if stage not in backups:
            return None

        async def snapshot():
            return backups[stage]
        return snapshot

    async def main():
        served = []  # (caller, version) of the keeper's own stage's pieces: the pair check's anchors
        server = ReplicationServer(await keeper.replicate_p2p(), run_id=RUN, stage=OWN, snapshot_fn=own_snapshot,
                                   backup_fn=backup_fn, on_served=lambda peer_id, version: served.append((peer_id, version)))
        p2p = await puller.replicate_p2p()
        async with server:
            pulled = await pull_state(p2p, [keeper_id], run_id=RUN, stage=BACKED_UP, store_dir=tmp_path / "b",
                                      config=CONFIG)
            assert pulled.version == 41 and all(torch.equal(pulled.state[k], v) for k, v in BACKUP_STATE.items())
            assert served == []  # a backup's pieces are not the keeper's own state
            own = await pull_state(p2p, [keeper_id], run_id=RUN, stage=OWN, store_dir=tmp_path / "o", config=CONFIG)
            assert own.version == 7 and all(torch.equal(own.state[k], v) for k, v in OWN_STATE.items())
            assert served and set(served) == {(puller.peer_id.to_base58(), 7)}, served
            assert server.cached_shard_sizes(41, stage=BACKED_UP) and server.cached_shard_sizes(7)
            assert server.cached_shard_sizes(41) == ()  # version 41 is not of the keeper's own stage

            header = {"shard_bytes": 65536}
            for stage in (2, -1, True, "0", [0], 2**40):
                with pytest.raises(RemoteError, match="keeps no backup"):
                    await call_peer(p2p, keeper_id, manifest_handler(RUN), {**header, "stage": stage}, timeout=10,
                                    max_payload_bytes=0)
            with pytest.raises(RemoteError, match="not held"):  # a version of the backup it never served
                await call_peer(p2p, keeper_id, shard_handler(RUN), {**header, "stage": BACKED_UP, "version": 7,
                                                                     "index": 0}, timeout=10, max_payload_bytes=1 << 20)

            del backups[BACKED_UP]  # the keeper dropped its backup: refused, and its cached bytes freed
            with pytest.raises(TransferError):
                await pull_state(p2p, [keeper_id], run_id=RUN, stage=BACKED_UP, store_dir=tmp_path / "b2",
                                 config=CONFIG)
            assert server.cached_shard_sizes(41, stage=BACKED_UP) == ()
            assert server.num_refused == 6 + 1 + 1  # the hostile stages, the unknown version, the dropped backup
            again = await pull_state(p2p, [keeper_id], run_id=RUN, stage=OWN, store_dir=tmp_path / "o2", config=CONFIG)
            assert again.version == 7  # and it keeps serving its own stage

    asyncio.run(main())


SPEC = RunSpec(run_id=RUN, model=ModelSpec(d_model=32, num_layers=2, num_heads=2, seq_len=16),
               stage_layers=((0, 1), (1, 2)), microbatch_size=4, target_batch_size=8)


@pytest.mark.parametrize("pushed", [False, True])
def test_a_keeper_refuses_a_holders_state_that_no_training_makes_and_bans_the_holder(nodes, pushed):
    # the keeper copies a lone holder's state: a Byzantine holder's pushed state is refused then, not
    # only when a rescuer would restore it
    (keeper_node, _), (holder_node, _) = nodes
    holder_id = holder_node.peer_id.to_base58()
    stage = Stage(SPEC, 1, device=torch.device("cpu"))
    try:
        state = asyncio.run(stage.run(stage.state_tensors))
    finally:
        stage.shutdown()
    del state["counters.num_steps"]
    if pushed:  # every weight 1.5 times the seed's, at step 0: beyond what two AdamW steps can move
        state = {k: v * 1.5 if k.startswith("model.") else v for k, v in state.items()}

    async def snapshot():
        return 3, state

    async def main():
        reputation = Reputation()
        config = PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",), run_id=RUN, backup_period=5.0)
        p2p = await keeper_node.replicate_p2p()
        view = SwarmView(keeper_node, SPEC.run_id)
        keeper = BackupKeeper(p2p, view, SPEC, peer_id=keeper_node.peer_id.to_base58(), config=config,
                              metrics=EventLog(None), reputation=reputation)
        holder = PeerRecord(peer_id=holder_id, role="reliable", state="training", stage=1, flops=1e9, version=3)
        try:
            async with ReplicationServer(await holder_node.replicate_p2p(), run_id=SPEC.namespace, stage=1,
                                         snapshot_fn=snapshot):
                await keeper._pull(1, holder)
        finally:
            await view.shutdown()
        return keeper.backup, reputation

    backup, reputation = asyncio.run(main())
    if pushed:
        assert backup is None and reputation.is_banned(holder_id)
    else:
        assert backup is not None and backup.stage == 1 and backup.holder_id == holder_id
        assert not reputation.num_strikes_of(holder_id)
