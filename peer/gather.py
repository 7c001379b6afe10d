"""The newest state of every stage of a live swarm, gathered into one process: what
``python -m peer.export --bootstrap`` writes to a Hugging Face folder, and what the samples on the
health pages are written by (``peer.model_sample``).

Each stage is pulled as a joiner pulls it (``peer.join.pull_stage_state``: shards from all its
holders at once, checked against their manifest and against the run seed), under the layout the
swarm trains under now, without joining the pipeline; the tokenizer comes from the swarm as a
joiner's does. A stage with no live holder cannot be gathered: the error says which.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P

from dht.records import RunSpec
from peer.backup import HOLDER_STATES
from peer.config import PeerConfig
from peer.errors import UserError
from peer.join import bootstrap_peer_ids, pull_stage_state
from peer.relayout import joiner_layout
from peer.training_data import obtain_tokenizer
from replication.transfer import TransferError
from swarm.stage import Stage
from swarm.tokenizer import Tokenizer
from swarm.view import SwarmView

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatheredModel:
    """A whole model: the spec it was trained under, each stage's parameters (named as
    ``StageModel.state_dict()``) and optimizer step, and the run's tokenizer."""

    spec: RunSpec
    parameters: dict[int, dict[str, torch.Tensor]]
    steps: dict[int, int]
    tokenizer: Tokenizer

    @property
    def num_parameters(self) -> int:
        return sum(t.numel() for stage in self.parameters.values() for t in stage.values())


@dataclass(frozen=True)
class OwnStage:
    """The stage a gathering peer holds itself: no need to pull it."""

    layout_version: int
    index: int
    version: int
    state: dict[str, torch.Tensor]


def stage_parameters(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors of a stage's state (``Stage.state_tensors`` names: ``model.<name>``)."""
    return {name.removeprefix("model."): t for name, t in state.items() if name.startswith("model.")}


async def gather_model(p2p: P2P, base_spec: RunSpec, view: SwarmView, *, config: PeerConfig, peer_id: str,
                       own: OwnStage | None = None, tokenizer: Tokenizer | None = None) -> GatheredModel:
    """Every stage's newest state from its live holders (``own``: this peer's stage, taken as it
    holds it if it is of the layout gathered); ``UserError`` if a stage has no holder or none could
    serve it."""
    await view.refresh()
    spec = joiner_layout(view, base_spec)
    parameters, steps = {}, {}
    for index in range(spec.num_stages):
        if own is not None and (own.layout_version, own.index) == (spec.layout_version, index):
            steps[index], parameters[index] = own.version, stage_parameters(own.state)
            continue
        holders = [r for r in view.all_records if r.state in HOLDER_STATES and r.stage == index
                   and r.layout_version == spec.layout_version and r.peer_id != peer_id]
        if not holders:
            raise UserError(f"Stage {index} of run {spec.run_id} has no live holder to gather it from: wait until "
                            f"every stage is served, or export the peers' checkpoints (--checkpoint-dir).")
        stage = Stage(spec, index, device=torch.device("cpu"))
        try:
            result = await pull_stage_state(p2p, stage, holders, config=config, min_agreeing_donors=1, load=False)
        except TransferError as e:
            raise UserError(f"Cannot gather stage {index} from its {len(holders)} holder(s): {e}.") from e
        finally:
            stage.shutdown()
        steps[index], parameters[index] = result.version, stage_parameters(result.state)
    if tokenizer is None:
        tokenizer = await obtain_tokenizer(p2p, spec, view, peer_id=peer_id, own_file=config.tokenizer,
                                           bootstraps=bootstrap_peer_ids(config.bootstrap), timeout=config.join_timeout)
    return GatheredModel(spec=spec, parameters=parameters, steps=steps, tokenizer=tokenizer)
