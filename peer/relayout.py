"""Layer-wise re-planning in a running swarm (seed 001 §3.4): a stage that lost every holder, with no
peer to spare for a rescue, is removed and its layers go to the stages left.

A rescue (``peer.backup``) moves a peer from a stage that keeps another holder. When every stage
left has a single working holder, no rescue is possible, and before this the pipeline waited for a
new volunteer. Now, once such a stage has stayed unheld for ``--replan-after`` seconds (and its last
holders do not answer a ping), every peer of the layout computes the same new layout with
``planner.replanning.replan_layout``: the surviving stages in their order, the layers re-split by
their computing capacity. Peers agree with no message beyond their heartbeats:

* A layout is a version and its block ranges. Every record carries the layout its peer trains under
  (``PeerRecord.layout_version``, ``stage_layers``, ``layout_map``), and each peer's view holds only
  its own layout's peers (``swarm.view``). RPC handlers and averaging keys are namespaced by the
  layout (``RunSpec.namespace``), so peers of two layouts never exchange tensors.
* A peer that re-plans adopts the new layout at once. The others take it from its record
  (``planner.replanning.choose_layout``): the next version, dropping no more stages than they see
  unheld. Two peers that re-planned from different views converge: the layout that kept more stages,
  then the smaller block ranges.
* Moving to the new layout, a peer finishes its in-flight work, keeps serving its old state under
  the old namespace for ``HANDOFF_GRACE`` seconds (:class:`Handoff`), and builds its new stage
  (``swarm.state_pieces.compose_stage_state``) from its own old state, from the old stages' holders (which
  serve theirs the same way), and from the backups of the stages that vanished. A layer nobody has
  (a stage with two holders that both crashed keeps no backup) restarts from the run seed, and the
  peer says so in its metrics.

A joiner trains under the newest layout among the working peers' records (``Peer._join``).

The same machinery carries out a global plan (``peer.plan_adoption``): its proposer moves to the
plan's layout (any number of stages, any split: it grows as well as shrinks) and its record carries
who takes which stage (``layout_assignment``); a follower takes it from that record once its own
view judged it (``LayoutWatch``'s ``judge``), to the stage the assignment names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P

from dht.layouts import STANDBY, Assignment, assigned_stage
from dht.records import PeerRecord, RunSpec
from dht.reputation import Reputation
from peer.backup import (
    CHECK_PERIOD,
    HOLDER_STATES,
    MEMBER_STATES,
    MIN_COMPLETE_READS,
    RescueWatch,
    StageBackup,
    pull_copy,
    serve_backup,
)
from peer.memory_model import layer_memory_bytes, stage_bound_bytes, stage_overhead_bytes
from planner.replanning import Layout, MemoryBudgetError, choose_layout, replan_layout
from planner.stage_choice import StageMember
from replication.server import ReplicationServer
from replication.transfer import TransferError
from swarm.model import layer_flops_per_sample
from swarm.state_pieces import StatePiece, needed_sources
from swarm.view import SwarmView

__all__ = ["Handoff", "LayoutChange", "LayoutWatch", "adopted_layout", "gather_pieces", "joiner_layout",
           "newest_layout_records", "records_under", "replanned_layout", "unheld_stages", "wait_layout_change"]

logger = logging.getLogger(__name__)
HANDOFF_GRACE = 90.0  # seconds a peer serves its old layout's state after it moved on
PULL_PATIENCE = 60.0  # seconds a peer keeps asking an old stage's holders for its state
PULL_RETRY = 2.0


@dataclass(frozen=True, kw_only=True)
class LayoutChange:
    """This peer moves to a new layout.

    Attributes:
        spec: the run spec under the new layout.
        layout_map: per old stage, its new index (-1: it vanished).
        stage: this peer's stage in the new layout.
        reason: "replanned" (this peer computed it), "global_plan" (this peer's global plan,
            ``peer.plan_adoption``), "adopted" (from ``proposer``'s record) or "standby_rescue" (a
            peer standing by takes a stage nobody holds, same layout: ``peer.standby``).
        proposer: the peer whose record it came from (this peer's id when computed here).
        unheld: the old stages this peer saw nobody hold.
        assignment: a global plan's: the stage each planned peer takes (``dht.layouts``).
    """

    spec: RunSpec
    layout_map: tuple[int, ...]
    stage: int
    reason: str
    proposer: str
    unheld: tuple[int, ...]
    assignment: Assignment = ()

    def record_fields(self, peer_id: str) -> dict:
        """What the record of ``peer_id``, under this layout, says of how it came: the map, and the
        assignment when ``peer_id`` proposed it (followers find their stage there)."""
        return {"layout_map": self.layout_map, "layout_assignment": self.assignment if self.proposer == peer_id else ()}


def layout_of(spec: RunSpec) -> Layout:
    return Layout(version=spec.layout_version, stage_layers=spec.stage_layers)


def record_layout(record: PeerRecord, base: RunSpec) -> Layout | None:
    """The layout ``record`` trains under, if it is one of this run's model (else None: ignored)."""
    if record.layout_version == 0:
        return Layout(version=0, stage_layers=base.stage_layers)
    try:
        spec = base.with_layout(record.layout_version, record.stage_layers)
    except ValueError:
        return None
    if len(record.layout_map) > 64 or any(k >= spec.num_stages for k in record.layout_map):
        return None
    return layout_of(spec)


def unheld_stages(view: SwarmView, spec: RunSpec) -> tuple[int, ...]:
    """The stages of ``spec`` that no record of this view holds or loads."""
    held = {r.stage for r in view.records if r.state in MEMBER_STATES}
    return tuple(k for k in range(spec.num_stages) if k not in held)


def new_stage_of(old_spec: RunSpec, new_spec: RunSpec, layout_map: Sequence[int], old_stage: int) -> int:
    """This peer's stage after the change: where ``layout_map`` sends its old stage, or (its stage
    vanished in the proposer's view: that view missed this peer) the new stage holding the middle of
    its old layers."""
    if 0 <= old_stage < len(layout_map) and 0 <= layout_map[old_stage] < new_spec.num_stages:
        return layout_map[old_stage]
    start, end = old_spec.stage_layers[old_stage]
    middle = (start + end - 1) // 2
    return next(k for k, (s, e) in enumerate(new_spec.stage_layers) if s <= middle < e)


def adopted_layout(view: SwarmView, spec: RunSpec, base: RunSpec, *, peer_id: str, stage: int,
                   accepted: Callable[[PeerRecord], bool] = lambda record: False) -> LayoutChange | None:
    """The layout another peer moved to that this one must follow (``choose_layout``), or None. A
    global plan's (a record with a ``layout_assignment``) counts only if ``accepted`` says so; its
    proposer may stand by itself. ``stage`` is ``STANDBY`` for a peer standing by (``peer.standby``):
    a global plan's layout gives it the stage it names (or ``STANDBY`` again), any other layout its
    thinnest stage."""
    current = layout_of(spec)
    unheld = unheld_stages(view, spec)
    alone = not any(r.peer_id != peer_id and r.state in MEMBER_STATES for r in view.records)
    by_layout: dict[Layout, PeerRecord] = {}
    planned: set[Layout] = set()  # the next version's layouts of global plans this peer follows
    for record in sorted(view.all_records, key=lambda r: (not r.layout_assignment, r.peer_id)):  # proposers first
        if record.peer_id == peer_id or not (record.state in MEMBER_STATES
                                             or record.state == "standby" and record.layout_assignment):
            continue
        layout = record_layout(record, base)
        if layout is None or layout == current:
            continue
        if record.layout_assignment and layout.version == current.version + 1:
            if not alone and not accepted(record):  # judge_proposal refuses one with a layout_map too
                continue  # a global plan this peer's own view does not find worth following
            planned.add(layout)
        elif (layout.version == current.version + 1 and not alone
                and not _follows_from(current, layout, record.layout_map, unheld)):
            continue  # a map that drops a stage this peer sees held (or is malformed): not from this swarm's view
        by_layout.setdefault(layout, record)
    if not by_layout:
        return None
    chosen = choose_layout(current, list(by_layout), num_unheld=len(unheld), alone=alone, planned=planned)
    if chosen is None:
        return None
    proposer = by_layout[chosen]
    new_spec = base.with_layout(chosen.version, chosen.stage_layers)
    own_layers = spec.stage_layers[stage] if stage != STANDBY else (0, 0)
    if proposer.layout_assignment:  # a global plan's: the stage it names for this peer (STANDBY: none)
        layout_map, new_stage = (), assigned_stage(proposer.layout_assignment, peer_id)
        if new_stage is None or new_stage >= chosen.num_stages:  # not planned (it joined since): where it is needed
            new_stage = _thinnest_stage(view, base, chosen, own_layers)
    elif stage == STANDBY:  # a re-plan while this peer stood by: it is needed where fewest are
        layout_map, new_stage = (), _thinnest_stage(view, base, chosen, own_layers)
    elif chosen.version == current.version and chosen.num_stages == current.num_stages:
        layout_map, new_stage = tuple(range(current.num_stages)), stage  # a competing re-plan: same numbering
    elif chosen.version == current.version:  # one that kept a stage this peer's re-plan dropped
        layout_map, new_stage = (), _thinnest_stage(view, base, chosen, own_layers)
    else:
        layout_map = proposer.layout_map if chosen.version == current.version + 1 else ()
        new_stage = new_stage_of(spec, new_spec, layout_map, stage)
    return LayoutChange(spec=new_spec, layout_map=tuple(layout_map), reason="adopted", proposer=proposer.peer_id,
                        stage=new_stage, unheld=unheld)


def _thinnest_stage(view: SwarmView, base: RunSpec, layout: Layout, own_layers: tuple[int, int]) -> int:
    """The stage of ``layout`` with the fewest members among the records under it, the one sharing
    most layers with ``own_layers`` first among equals (a peer whose re-plan dropped a stage that was
    not lost joins the others' layout where it is needed)."""
    counts = [0] * layout.num_stages
    for record in records_under(view, base, layout):
        if record.state in MEMBER_STATES and 0 <= record.stage < layout.num_stages:
            counts[record.stage] += 1

    def overlap(k: int) -> int:
        start, end = layout.stage_layers[k]
        return max(0, min(end, own_layers[1]) - max(start, own_layers[0]))

    return min(range(layout.num_stages), key=lambda k: (counts[k], -overlap(k), k))


def _follows_from(current: Layout, layout: Layout, layout_map: Sequence[int], unheld: Sequence[int]) -> bool:
    """Whether ``layout_map`` takes ``current`` to ``layout`` by dropping stages that are unheld here."""
    kept = [k for k in layout_map if k >= 0]
    dropped = [old for old, new in enumerate(layout_map) if new < 0]
    return (len(layout_map) == current.num_stages and kept == list(range(layout.num_stages))
            and bool(dropped) and set(dropped) <= set(unheld))


def joiner_layout(view: SwarmView, base: RunSpec) -> RunSpec:
    """The spec a joiner trains under: the best layout (newest, then smallest ranges) among the
    records of the peers that hold a stage; the published one if none."""
    layouts = {layout for r in view.all_records if r.state in HOLDER_STATES
               and (layout := record_layout(r, base)) is not None}
    if not layouts:
        return base
    best = min(layouts, key=lambda layout: (-layout.version, layout.stage_layers))
    return base.with_layout(best.version, best.stage_layers) if best.version else base


def records_under(view: SwarmView, base: RunSpec, layout: Layout) -> list[PeerRecord]:
    """The records of ``view`` (any layout's) whose peers train or stand by under ``layout``."""
    return [r for r in view.all_records if record_layout(r, base) == layout]


def newest_layout_records(view: SwarmView, base: RunSpec | None) -> tuple[RunSpec | None, list[PeerRecord]]:
    """What an observer (the bootstrap's status page) shows: the spec under the layout joiners would
    take (:func:`joiner_layout`) and the records of its peers."""
    if base is None:
        return None, list(view.all_records)
    spec = joiner_layout(view, base)
    return spec, records_under(view, base, layout_of(spec))


def replanned_layout(
    view: SwarmView, spec: RunSpec, watch: RescueWatch, *, peer_id: str, stage: int, now: float, after: float,
    max_in_flight: int,
) -> LayoutChange | None:
    """The layout this peer re-plans to, once a stage no peer may rescue has been unheld for ``after``
    seconds (``RescueWatch.unrescuable``); None otherwise. The caller pings the stage's last holders first.

    No member gets more layers than the memory its record offers (:func:`offered_memory`; the
    layers' needs by :func:`peer.memory_model.layer_memory_bytes`, with this peer's ``max_in_flight``).

    Raises:
        MemoryBudgetError: no split over the surviving stages fits their members' memory.
    """
    if not watch.unrescuable or min(now - since for since in watch.unrescuable.values()) < after:
        return None
    members = [StageMember(peer_id=r.peer_id, stage=r.stage, flops=r.flops,
                           memory_bytes=offered_memory(r, spec, max_in_flight=max_in_flight))
               for r in view.records if 0 <= r.stage < spec.num_stages and r.state in MEMBER_STATES]
    replan = replan_layout(spec.stage_layers, layer_flops_per_sample(spec), members,
                           layer_bytes=layer_memory_bytes(spec, max_in_flight=max_in_flight),
                           overhead_bytes=stage_overhead_bytes(spec, max_in_flight=max_in_flight))
    if replan is None:
        return None
    new_spec = spec.with_layout(spec.layout_version + 1, replan.stage_layers)
    layout_map = tuple(-1 if k is None else k for k in replan.stage_map)
    return LayoutChange(spec=new_spec, layout_map=layout_map, reason="replanned", proposer=peer_id,
                        stage=new_stage_of(spec, new_spec, layout_map, stage), unheld=unheld_stages(view, spec))


def offered_memory(record: PeerRecord, spec: RunSpec, *, max_in_flight: int) -> int:
    """The memory ``record``'s peer offers a re-planned stage: its ``memory_bytes``, but at least what
    the stage it trains now needs (it holds that stage already, so a smaller claim is wrong, and it
    would only serve to make a re-plan impossible; counted as the re-planner counts a stage's need,
    :func:`peer.memory_model.stage_bound_bytes`); 0 (no limit) when it did not say."""
    if record.memory_bytes <= 0:
        return 0
    return max(record.memory_bytes, stage_bound_bytes(spec, record.stage, max_in_flight=max_in_flight))


class LayoutWatch:
    """What :func:`wait_layout_change` decides at each look, without its waiting: a layout another peer
    moved to (:func:`adopted_layout`), or one this peer re-plans itself (:func:`replanned_layout`, if
    ``replan_after`` > 0, its timer read from ``clock``, the one ``watch`` reads) once its view's reads
    complete and the lost stages' last holders do not answer ``is_answering`` (a ping): a holder
    whose record went missing from this view is not dead. A global plan another peer moved to is
    followed once ``judge`` (its record) returns "" (else the reason, logged once; each proposal is
    judged once, and a refused one again each time this peer's layout has fewer members than at the
    last judgement). A test drives :meth:`check` with a fake clock."""

    def __init__(
        self, view: SwarmView, spec: RunSpec, base: RunSpec, watch: RescueWatch, *, peer_id: str, stage: int,
        replan_after: float, is_answering: Callable[[str], Awaitable[bool]], max_in_flight: int,
        clock: Callable[[], float] = time.monotonic, judge: Callable[[PeerRecord], Awaitable[str]] | None = None,
    ) -> None:
        self.view, self.spec, self.base, self.watch = view, spec, base, watch
        self.peer_id, self.stage, self.replan_after = peer_id, stage, replan_after
        self.is_answering, self.max_in_flight, self.clock, self.judge = is_answering, max_in_flight, clock, judge
        self._skipped: set[int] = set()  # stages whose re-plan a ping called off (logged once)
        self._refused = ""  # the last reason a re-plan was impossible (logged once)
        # global plans judged: proposal -> "" (follow) or why not, and how many members this peer's
        # layout had then (a refusal is judged again once it has fewer: they left to follow it)
        self._verdicts: dict[tuple, tuple[str, int]] = {}

    async def _accepted(self) -> set[str]:
        """The proposers of the next layout's global plans this peer follows."""
        accepted = set()
        staying = sum(r.state in MEMBER_STATES and not self.view.is_gone(r.peer_id) for r in self.view.records)
        for record in self.view.all_records:
            if (self.judge is None or not record.layout_assignment or record.peer_id == self.peer_id
                    or record.layout_version != self.spec.layout_version + 1):
                continue
            key = (record.peer_id, record.layout_version, record.stage_layers, record.layout_assignment)
            before, members = self._verdicts.get(key, (None, 0))
            if before is None or (before and staying < members):
                why = await self.judge(record)
                self._verdicts[key] = (why, staying)
                if why and why != before:
                    logger.info(f"not following {record.peer_id[-6:]}'s global plan (layout v{record.layout_version} "
                                f"{list(record.stage_layers)}): {why}")
            if not self._verdicts[key][0]:
                accepted.add(record.peer_id)
        return accepted

    async def check(self) -> LayoutChange | None:
        """The layout this peer moves to now, if any."""
        accepted = await self._accepted()
        change = adopted_layout(self.view, self.spec, self.base, peer_id=self.peer_id, stage=self.stage,
                                accepted=lambda record: record.peer_id in accepted)
        if change is not None or self.replan_after <= 0 or self.view.complete_reads < MIN_COMPLETE_READS:
            return change
        try:
            change = replanned_layout(self.view, self.spec, self.watch, peer_id=self.peer_id, stage=self.stage,
                                      now=self.clock(), after=self.replan_after, max_in_flight=self.max_in_flight)
        except MemoryBudgetError as e:
            if str(e) != self._refused:
                logger.warning(f"cannot re-plan around the lost stages, waiting for a volunteer: {e}")
            self._refused = str(e)
            return None
        if change is None:
            return None
        holders = [p for k in change.unheld for p in self.watch.last_holders(k)]
        answers = await asyncio.gather(*(self.is_answering(p) for p in holders))
        answering = [p for p, answered in zip(holders, answers, strict=True) if answered]
        if answering:
            if not self._skipped >= set(change.unheld):
                logger.info(f"stages {list(change.unheld)} look unheld, but {answering[0][-6:]} answers a "
                            "ping: not re-planning")
            self._skipped |= set(change.unheld)
            return None
        return change


async def wait_layout_change(
    view: SwarmView, spec: RunSpec, base: RunSpec, watch: RescueWatch, *, peer_id: str, stage: int,
    replan_after: float, is_working: Callable[[], bool], is_answering: Callable[[str], Awaitable[bool]],
    max_in_flight: int, clock: Callable[[], float] = time.monotonic,
    judge: Callable[[PeerRecord], Awaitable[str]] | None = None,
) -> LayoutChange:
    """Returns once this peer (training or paused, ``is_working``) moves to a new layout, looking every
    ``CHECK_PERIOD`` seconds (:class:`LayoutWatch` decides)."""
    layout_watch = LayoutWatch(view, spec, base, watch, peer_id=peer_id, stage=stage, replan_after=replan_after,
                               is_answering=is_answering, max_in_flight=max_in_flight, clock=clock, judge=judge)
    while True:
        await asyncio.sleep(CHECK_PERIOD)
        if is_working() and (change := await layout_watch.check()) is not None:
            return change


class Handoff:
    """Serves this peer's last state of its old stage (and the backup it kept) under the old layout's
    namespace for ``grace`` seconds, so that the peers building their new stages can pull it."""

    def __init__(self, p2p: P2P, spec: RunSpec, stage: int, state: Mapping[str, torch.Tensor], *,
                 backup: StageBackup | None, request_timeout: float, grace: float = HANDOFF_GRACE) -> None:
        served = {k: v for k, v in state.items() if k != "counters.num_steps"}
        version = int(state["counters.num_steps"]) if "counters.num_steps" in state else 0

        async def snapshot() -> tuple[int, dict[str, torch.Tensor]]:
            return version, served

        self.server = ReplicationServer(p2p, run_id=spec.namespace, stage=stage, snapshot_fn=snapshot,
                                        request_timeout=request_timeout,
                                        backup_fn=lambda of_stage: serve_backup(backup, of_stage))
        self.grace = grace
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.server.start()
        self._task = asyncio.create_task(self._expire(), name="handoff")

    async def _expire(self) -> None:
        await asyncio.sleep(self.grace)
        await self.server.shutdown()

    async def shutdown(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await self.server.shutdown()


async def gather_pieces(
    p2p: P2P, old_spec: RunSpec, new_spec: RunSpec, new_stage: int, *, own_stage: int,
    own_state: Mapping[str, torch.Tensor], own_backup: StageBackup | None, watch: RescueWatch,
    vanished: Sequence[int], request_timeout: float, reputation: Reputation | None, patience: float = PULL_PATIENCE,
) -> list[StatePiece]:
    """The old stages' states the new stage needs (``needed_sources``), own first: this peer's own
    state, the backup it kept, else pulled from the old stage's last holders (lowest id first) or,
    for a vanished stage, from the keepers of its newest backup. A source nobody serves is left out
    (its layers keep the run seed's initialisation; the caller reports it)."""
    pieces = []
    for old in needed_sources(old_spec, new_spec, new_stage):
        if old == own_stage:
            pieces.append(StatePiece(spec=old_spec, stage=old, state=own_state, source="own"))
        elif own_backup is not None and own_backup.stage == old:
            pieces.append(StatePiece(spec=old_spec, stage=old, state=own_backup.state, source="backup:self"))
        else:
            piece = await _pull_piece(p2p, old_spec, old, watch, vanished=old in vanished,
                                      request_timeout=request_timeout, reputation=reputation, patience=patience)
            if piece is not None:
                pieces.append(piece)
    pieces.sort(key=lambda p: p.source != "own")
    return pieces


async def _pull_piece(
    p2p: P2P, spec: RunSpec, stage: int, watch: RescueWatch, *, vanished: bool, request_timeout: float,
    reputation: Reputation | None, patience: float,
) -> StatePiece | None:
    """Old ``stage``'s state: from its last holders, else its backup's keepers. For a ``vanished``
    stage the keepers come first and its last holders after them: a stage can vanish from this
    peer's view alone (CI: its holder's record went missing and its pings failed under load, while it
    re-planned to a newer layout itself), and a holder that moved on serves its old state for
    ``HANDOFF_GRACE`` seconds; without it the stage's layers restarted from the run seed."""
    holders = [(p, "holder") for p in sorted(watch.last_holders(stage))]
    copies = watch.last_copies(stage)
    keepers = [(c.peer_id, "backup") for c in copies if c.version == copies[0].version]
    donors = keepers + holders if vanished else holders + keepers
    if not donors:
        logger.warning(f"nobody holds or keeps a backup of old stage {stage}: its layers restart from the run seed")
        return None
    deadline = watch.clock() + patience  # the peer's clock, as the watch reads it
    while True:
        for peer_id, kind in donors:
            try:
                result = await pull_copy(p2p, spec, stage, [peer_id], request_timeout=request_timeout,
                                         reputation=reputation)
            except (TransferError, ValueError) as e:
                logger.info(f"could not pull old stage {stage} from {peer_id[-6:]} ({kind}): {e}")
                continue
            return StatePiece(spec=spec, stage=stage, state=result.state, source=f"{kind}:{peer_id}")
        if watch.clock() > deadline:
            logger.warning(f"no holder of old stage {stage} served it within {patience:.0f} s: "
                           "its layers restart from the run seed")
            return None
        await asyncio.sleep(PULL_RETRY)
