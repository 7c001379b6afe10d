"""peer.state_sources: a stage's state comes from the first source that has it, in ``SOURCES`` order
(over a real DHT with no holders in it, so the sources after ``holders`` are asked)."""

from __future__ import annotations

import asyncio

import torch

from dht.records import ModelSpec, RunSpec
from peer.backup import BackupKeeper, StageBackup, state_digest
from peer.checkpoint import checkpoint_path, save_checkpoint
from peer.config import PeerConfig
from peer.event_log import EventLog
from peer.state_sources import SOURCES, StateLoader
from swarm.stage import Stage
from swarm.view import SwarmView

SPEC = RunSpec(run_id="sources", model=ModelSpec(d_model=32, num_layers=2, num_heads=2, seq_len=16),
               stage_layers=((0, 1), (1, 2)), microbatch_size=4, target_batch_size=8)
CPU = torch.device("cpu")
PARAM = "model.blocks.0.qkv.weight"  # one parameter of stage 1, compared source by source


def trained_state(stage_index: int, *, scale: float) -> dict[str, torch.Tensor]:
    """A stage state unlike the seed's (every parameter scaled), as ``Stage.state_tensors`` names it,
    with as many optimizer steps as such a move takes (a state no AdamW training could reach is not
    loaded: swarm/plausibility.py)."""
    stage = Stage(SPEC, stage_index, device=CPU)
    try:
        state = asyncio.run(stage.run(stage.state_tensors))
    finally:
        stage.shutdown()
    steps = torch.tensor(0.0 if scale == 1.0 else 1000.0)
    return {name: t * scale if name.startswith("model.") else steps if name.endswith(".step") else t
            for name, t in state.items()}


def load(dht, tmp_path, *, checkpoint: bool, backup: StageBackup | None) -> tuple[str, dict[str, torch.Tensor]]:
    config = PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",), run_id=SPEC.run_id,
                        checkpoint_dir=str(tmp_path) if checkpoint else None)

    async def main() -> tuple[str, dict[str, torch.Tensor]]:
        p2p, peer_id, metrics = await dht.replicate_p2p(), dht.peer_id.to_base58(), EventLog(None)
        view = SwarmView(dht, SPEC.run_id)
        keeper = BackupKeeper(p2p, view, SPEC, peer_id=peer_id, config=config, metrics=metrics)
        keeper.backup = backup
        loader = StateLoader(p2p, view, peer_id=peer_id, config=config, keeper=keeper, metrics=metrics,
                             reputation=None, traffic=None)
        stage = Stage(SPEC, 1, device=CPU)
        try:
            source = await loader.load(stage, SPEC)
            return source, await stage.run(stage.state_tensors)
        finally:
            stage.shutdown()
            await view.shutdown()

    return asyncio.run(main())


def test_sources_are_asked_in_order(dht_nodes, tmp_path):
    assert SOURCES == ("holders", "local-backup", "backup-donor", "checkpoint", "seed")
    (dht, _), *_ = dht_nodes
    seed_state = trained_state(1, scale=1.0)
    source, state = load(dht, tmp_path, checkpoint=True, backup=None)  # the directory holds no checkpoint yet
    assert source == "seed" and torch.equal(state[PARAM], seed_state[PARAM])

    saved = trained_state(1, scale=2.0)
    save_checkpoint(checkpoint_path(tmp_path, SPEC.namespace, 1), saved, spec=SPEC, stage=1, version=7)
    source, state = load(dht, tmp_path, checkpoint=True, backup=None)
    assert source == "checkpoint" and torch.equal(state[PARAM], saved[PARAM])

    kept = trained_state(1, scale=3.0)
    kept.pop("counters.num_steps", None)
    backup = StageBackup(stage=1, version=9, holder_id="QmGone", holder_step=9, state=kept, pulled_at=0.0,
                         seconds=0.1, digest=state_digest(kept))
    source, state = load(dht, tmp_path, checkpoint=True, backup=backup)  # a kept backup outranks the checkpoint
    assert source == "local-backup" and torch.equal(state[PARAM], kept[PARAM])

    other = StageBackup(stage=0, version=9, holder_id="QmGone", holder_step=9, state=kept, pulled_at=0.0,
                        seconds=0.1, digest="")
    source, _ = load(dht, tmp_path, checkpoint=False, backup=other)  # a backup of another stage is no source
    assert source == "seed"
