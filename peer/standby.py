"""Standing by: a peer the global plan leaves idle holds no stage until a plan names one for it
(issue #18; ``peer.plan_adoption`` says when a plan leaves a peer idle).

A volunteer whose links or compute would slow the swarm down (a home across an ocean from the rest,
whose every microbatch and averaging round crosses the slow link) helps most by not serving, for
now. It stays in the swarm: its record says "standby" (stage -1), heartbeat after heartbeat, so the
next global plans place it like any member (``peer.plan_watch.swarm_snapshot``). It looks at the
view every ``CHECK_PERIOD`` seconds, as a serving peer's layout watch does (``peer.relayout.LayoutWatch``,
with this peer's own judge of each proposal):

- a global plan of the next layout that names a stage for it: it loads that stage's state from its
  holders, as a joiner does, and trains (:func:`stand_by` returns the change);
- one that leaves it idle again: it stands by under the new layout (and writes a ``relayout`` event
  with stage -1, as its first move to standing by did);
- a layout the swarm moved to otherwise (a re-plan after a lost stage, or a plan it missed): it
  takes that layout's thinnest stage, where it is needed most;
- a stage of its layout that nobody holds for ``settle`` seconds (its view's reads complete, no
  joiner choosing; ``HANDOFF_GRACE`` for a stage the plan names for a peer still on its way from the
  old layout): it takes that stage (:func:`unheld_stage`: the peers standing by, in peer-id
  order, take the lost stages in order, one each), loading it as a rescuer does (the newest backup a
  keeper advertises, else a checkpoint, else the run seed). Without this, a plan that leaves one peer
  serving and the others standing by would end the run when that peer leaves: no member would be
  left to rescue or re-plan.

It pulls no stage to serve while it stands by: a stage's state is pulled when a plan names the
stage (the plan's payback counts that pull as a move). It keeps a backup if ``assign_backups`` names
it a keeper (``peer.backup.BackupKeeper``): a stage held by one peer that no other stage's holder
can keep, as in a one-stage layout. Before, that peer's crash restarted its stage from a checkpoint
or the seed; the peer standing by that takes the stage now loads the copy it kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Protocol

from dht.layouts import STANDBY, assigned_stage
from dht.records import PeerRecord, RunSpec
from peer.config import PeerConfig
from peer.event_log import EventLog
from peer.plan_adoption import judge_proposal
from peer.backup import CHECK_PERIOD, MEMBER_STATES, MIN_COMPLETE_READS, BackupKeeper
from peer.relayout import HANDOFF_GRACE, LayoutChange, LayoutWatch, layout_of, records_under, unheld_stages
from peer.transitions import report_relayout
from swarm.view import SwarmView

logger = logging.getLogger(__name__)


class StandbyHost(Protocol):
    """What standing by reads of the peer (``peer.lifecycle.Peer``)."""

    config: PeerConfig
    view: SwarmView
    spec: RunSpec
    base_spec: RunSpec
    peer_id: str
    keeper: BackupKeeper | None
    metrics: EventLog

    async def heartbeat(self, stage: int | None = None) -> None: ...

    def adopt_layout(self, change: LayoutChange) -> None: ...


def awaited_stages(view: SwarmView, spec: RunSpec, base: RunSpec) -> set[int]:
    """The stages of ``spec``'s layout that a global plan names for a peer still training under an
    older layout: it is on its way (it judges the proposal, then moves, pulling its state)."""
    assignments = {r.layout_assignment for r in records_under(view, base, layout_of(spec)) if r.layout_assignment}
    return {k for assignment in assignments for r in view.all_records
            if r.state in MEMBER_STATES and r.layout_version < spec.layout_version
            and (k := assigned_stage(assignment, r.peer_id)) is not None and 0 <= k < spec.num_stages}


def unheld_stage(view: SwarmView, spec: RunSpec, *, peer_id: str, unheld_since: dict[int, float], now: float,
                 settle: float, awaited: Collection[int] = ()) -> int | None:
    """The stage of ``spec`` this peer, standing by, takes at ``now`` because nobody has held it for
    ``settle`` seconds (``unheld_since``: stage → when this peer first saw it unheld, kept across
    calls), or None. The peers standing by take the lost stages in peer-id order, one each. A stage
    in ``awaited`` (:func:`awaited_stages`) waits ``HANDOFF_GRACE`` instead: in an e2e run the plan's
    proposer, standing by, took the plan's one stage 5 s after its move, from the seed, while the two
    peers the plan named for it were still judging the proposal."""
    unheld = unheld_stages(view, spec)
    for stage in range(spec.num_stages):
        if stage not in unheld or view.complete_reads < MIN_COMPLETE_READS:  # a partial read is no evidence
            unheld_since.pop(stage, None)
        else:
            unheld_since.setdefault(stage, now)
    if any(r.state == "joining" for r in view.all_records):
        return None  # a joiner prefers an unheld stage: let it choose first
    lost = [k for k, since in sorted(unheld_since.items()) if now - since >= (HANDOFF_GRACE if k in awaited else settle)]
    standing = sorted({r.peer_id for r in view.records if r.state == "standby"} | {peer_id})
    rank = standing.index(peer_id)
    return lost[rank] if rank < len(lost) else None


async def stand_by(peer: StandbyHost, stop: asyncio.Event,
                   judge: Callable[[PeerRecord], Awaitable[str]] | None = None,
                   clock: Callable[[], float] = time.monotonic, period: float = CHECK_PERIOD) -> LayoutChange | None:
    """Hold no stage until a layout names one for ``peer``, or a stage of its layout is lost
    (returned; its state is not loaded yet), or until ``stop`` (None). Looks every ``period``
    seconds; heartbeats every ``--heartbeat-period`` with state "standby". ``judge``: "" when
    ``peer`` follows the global plan a record proposes, else why not (default: its own
    ``judge_proposal``, in a thread). A test passes ``clock`` (the settle time of a lost stage) and
    ``period`` 0. Meanwhile it keeps the backup ``peer.keeper`` is named for, if any (the module doc)."""

    async def own_judge(record: PeerRecord) -> str:
        return await asyncio.to_thread(judge_proposal, record, peer.view, peer.spec, peer.base_spec,
                                       max_in_flight=peer.config.max_in_flight)

    keeping = (asyncio.create_task(peer.keeper.run(stop))  # as a session runs it: 0 turns backups off
               if peer.keeper is not None and peer.config.backup_period > 0 else None)
    try:
        return await _stand_by(peer, stop, judge or own_judge, clock, period)
    finally:
        if keeping is not None:
            keeping.cancel()


async def _stand_by(peer: StandbyHost, stop: asyncio.Event, judge: Callable[[PeerRecord], Awaitable[str]],
                    clock: Callable[[], float], period: float) -> LayoutChange | None:
    config, unheld_since = peer.config, {}  # unheld_since: stage -> when first seen unheld (unheld_stage)

    async def never(peer_id: str) -> bool:
        return False  # re-planning is the members' (replan_after 0): nobody is pinged

    watch, beat_at = None, -1.0
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        if watch is None or watch.spec is not peer.spec:
            watch = LayoutWatch(peer.view, peer.spec, peer.base_spec, None, peer_id=peer.peer_id, stage=STANDBY,
                                replan_after=0, is_answering=never, max_in_flight=config.max_in_flight,
                                judge=judge)
        if loop.time() >= beat_at:
            await peer.heartbeat(stage=STANDBY)
            beat_at = loop.time() + config.heartbeat_period
        change = await watch.check()
        if change is not None and change.stage != STANDBY:
            logger.info(f"layout v{change.spec.layout_version} ({change.reason} from {change.proposer[-6:]}) names "
                        f"stage {change.stage} {list(change.spec.stage_layers[change.stage])} for this peer: "
                        f"loading its state from its holders")
            return change
        if change is not None:
            logger.info(f"layout v{change.spec.layout_version} ({change.reason}) leaves this peer idle again")
            peer.adopt_layout(change)
            report_relayout(change, {}, from_stage=STANDBY, step=0, digest="", seconds=0.0, metrics=peer.metrics)
            beat_at = loop.time()  # say so at once
            unheld_since.clear()
            continue
        lost = unheld_stage(peer.view, peer.spec, peer_id=peer.peer_id, unheld_since=unheld_since, now=clock(),
                            settle=config.heartbeat_ttl / 2,  # as a member's rescue watch settles
                            awaited=awaited_stages(peer.view, peer.spec, peer.base_spec))
        if lost is not None:
            logger.info(f"stage {lost} {list(peer.spec.stage_layers[lost])} has no holder: this peer, standing by, "
                        f"takes it")
            return LayoutChange(spec=peer.spec, layout_map=(), stage=lost, reason="standby_rescue",
                                proposer=peer.peer_id, unheld=(lost,))
        try:
            await asyncio.wait_for(stop.wait(), timeout=period)
        except asyncio.TimeoutError:
            pass
    return None
