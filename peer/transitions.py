"""What a peer does between two stage sessions: say which transition it makes, and (for a layout
change) build its new stage from pieces of the old layout.

A :class:`~peer.session.StageSession` names the transition; ``peer.lifecycle.Peer`` closes the
session and makes it. The three kinds: a rebalancing move (``planner.stage_choice.StageMove``), a
rescue of a stage that lost its last holder (``planner.backup_plan.Rescue``), a layer-wise re-plan
(``peer.relayout.LayoutChange``).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from dht.layouts import STANDBY
from dht.records import RunSpec
from dht.reputation import Reputation
from peer.backup import RescueWatch, StageBackup
from peer.event_log import EventLog
from peer.relayout import LayoutChange, gather_pieces
from planner.backup_plan import Rescue
from planner.stage_choice import StageMove
from swarm.state_pieces import BadPieceError, compose_stage_state
from swarm.stage import Stage

logger = logging.getLogger(__name__)

Transition = StageMove | Rescue | LayoutChange


def announce_transition(transition: Transition, *, spec: RunSpec, stage: int, metrics: EventLog) -> None:
    """Log and record the start of ``transition`` by the peer serving ``stage`` under ``spec``."""
    if isinstance(transition, StageMove):
        move = transition
        logger.info(f"moving from stage {move.from_stage} to stage {move.to_stage}: the swarm's bottleneck "
                    f"throughput rises {move.gain:.0%} ({move.bottleneck_before:.1f} -> "
                    f"{move.bottleneck_after:.1f} samples/s)")
        metrics.write("moving", from_stage=move.from_stage, to_stage=move.to_stage, gain=move.gain,
                      bottleneck_before=move.bottleneck_before, bottleneck_after=move.bottleneck_after)
    elif isinstance(transition, Rescue):
        rescue = transition
        logger.info(f"stage {rescue.to_stage} has no holder left: moving there from stage {rescue.from_stage} "
                    f"(its backup: {rescue.source}, v{rescue.backup_version})")
        metrics.write("rescuing", stage=rescue.to_stage, from_stage=rescue.from_stage, keeper=rescue.keeper_id,
                      backup_version=rescue.backup_version)
    else:
        change, new = transition, transition.spec
        to = (f"to stage {change.stage} {list(new.stage_layers[change.stage])}" if change.stage != STANDBY
              else "to no stage: the plan leaves it idle, it stands by")
        logger.info(f"stage layout v{spec.layout_version} -> v{new.layout_version} ({change.reason}"
                    f"{'' if change.reason == 'replanned' else ' from ' + change.proposer[-6:]}): "
                    f"{new.num_stages} stages {list(new.stage_layers)}; this peer moves from stage "
                    f"{stage} {list(spec.stage_layers[stage]) if stage != STANDBY else '(none)'} {to}")
        metrics.write("relayout_start", reason=change.reason, proposer=change.proposer,
                      from_version=spec.layout_version, version=new.layout_version,
                      stage_layers=[list(r) for r in new.stage_layers], layout_map=list(change.layout_map),
                      from_stage=stage, stage=change.stage, unheld=list(change.unheld),
                      assignment=[list(pair) for pair in change.assignment])


async def compose_stage(p2p, change: LayoutChange, stage: Stage, *, old_spec: RunSpec, old_index: int,
                        own_state: dict[str, torch.Tensor], backup: StageBackup | None, watch: RescueWatch,
                        request_timeout: float, reputation: Reputation | None, metrics: EventLog) -> dict[str, str]:
    """Build ``stage`` (of ``change``'s layout) from pieces of the old layout
    (``peer.relayout.gather_pieces``) and load it; returns where each part came from."""
    new_spec, new_index = change.spec, stage.index
    vanished = [k for k, new in enumerate(change.layout_map) if new < 0]
    pieces = await gather_pieces(p2p, old_spec, new_spec, new_index, own_stage=old_index, own_state=own_state,
                                 own_backup=backup, watch=watch, vanished=vanished,
                                 request_timeout=request_timeout, reputation=reputation)
    base = await stage.run(stage.state_tensors)
    while True:
        try:
            composed, provenance = await asyncio.to_thread(compose_stage_state, new_spec, new_index, pieces, base=base,
                                                           num_steps=int(own_state["counters.num_steps"]))
            break
        except BadPieceError as e:  # a donor served a malformed state: its layers come from elsewhere
            logger.warning(f"refused a state piece while changing layout: {e}")
            metrics.write("relayout_piece_refused", source=e.source, reason=str(e))
            pieces = [p for p in pieces if p.source != e.source]
    await stage.run(stage.load_state_tensors, composed)
    return provenance


def report_relayout(change: LayoutChange, provenance: dict[str, str], *, from_stage: int, step: int, digest: str,
                    seconds: float, metrics: EventLog) -> None:
    """Log and record a finished layout change: where each part of the new stage came from."""
    new_spec, new_index = change.spec, change.stage
    reseeded = sorted(part for part, source in provenance.items() if source == "seed")
    if reseeded:
        logger.warning(f"no peer had {', '.join(reseeded)} of the lost stage: restarted from the run seed")
    if new_index == STANDBY:
        logger.info(f"now standing by under layout v{new_spec.layout_version}, holding no stage, until a plan names one")
    else:
        logger.info(f"now stage {new_index} of layout v{new_spec.layout_version}, built in {seconds:.2f} s from "
                    f"{', '.join(sorted(set(provenance.values())))}")
    metrics.write("relayout", reason=change.reason, version=new_spec.layout_version, from_stage=from_stage,
                  stage=new_index, stage_layers=[list(r) for r in new_spec.stage_layers], provenance=provenance,
                  reseeded=reseeded, seconds=seconds, digest=digest, step=step)
