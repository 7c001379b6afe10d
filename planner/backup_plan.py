"""Topology-driven backups of singly held stages, and who rescues a stage that lost its last holder.

Seed 001 §3.4 ("topology-driven model backup"): a stage held by one peer only is one crash away
from losing its training state, so a peer of the *next* stage in the pipeline keeps a copy of it
(DESIGN §1 step 7). The next stage is the natural keeper: it already talks to that stage on every
microbatch, and it is a different set of machines. The ring wraps (the last stage is backed up on
stage 0) and skips stages nobody holds.

Both functions here are pure and deterministic: every peer evaluates them on the same records and
gets the same answer, so the keeper and the rescuer are agreed on with no message at all.

:func:`assign_backups`. For every stage ``k`` held by exactly one peer, the keeper is the lowest
peer id among the holders of the first held stage after ``k`` (wrapping around). Each held stage
follows exactly one held stage in the ring, so a peer keeps at most one backup. A stage held by
two or more peers needs none: its replicas are each other's backups (the averaging rounds keep
them identical). A stage no other stage's holder can keep (a one-stage layout) is kept by a peer
standing by, if any (``standby``: the global plan left it idle, ``peer.standby``): the i-th such
stage by the i-th of them in peer-id order, the one that takes that stage if it is lost.

:func:`choose_rescues`. A stage nobody holds stops the whole pipeline. For each such stage, in
index order, one peer moves there:

* only a peer whose stage keeps at least one other working holder may move (a rescue never
  empties another stage), and not a peer its user paused (it holds its stage but takes no work,
  so it neither moves nor counts as the holder left behind), nor one pinned to its stage (it
  works there and counts as the holder left behind, but never moves);
* the newest backup is the one to load (several keepers of one stage are a transient: the keeper
  changed while the holder lived); a keeper of it that may move goes first: it loads the copy it
  already has, with no download (then the lower peer id);
* otherwise the peer whose stage keeps the most throughput without it moves (cost model of
  :mod:`planner.stage_choice`: ``T_j = sum f_p / cost_j``), then the slower peer, then the lower
  peer id; it pulls the newest backup from its keeper (the lower peer id of those holding it),
  or, with no backup anywhere, starts the stage from a checkpoint or the run seed like a first
  joiner.

A rescue is not a rebalance: it is not gated by a gain. But a peer pinned with ``--stage`` is never
moved, not even by a rescue: the user chose its stage, and a rescue decided on a view that missed a
record is not undone (issue #15: a peer pinned to stage 0 was moved to stage 1 one second after
stage 1's pinned holder started, before that holder's first record was in the DHT). A stage whose
only candidates are pinned waits for a joiner, or for a layer-wise re-plan (``planner.replanning``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from planner.stage_choice import StageMember, stage_throughputs

__all__ = ["BackupCopy", "BackupDuty", "Rescue", "assign_backups", "choose_rescues"]


@dataclass(frozen=True, kw_only=True)
class BackupDuty:
    """Stage ``stage``'s only holder is ``holder_id``; ``keeper_id`` keeps its backup.

    Attributes:
        stage: the singly held stage.
        holder_id: its only holder (the donor of every backup refresh).
        keeper_id: the peer that keeps the backup; it serves a different stage.
    """

    stage: int
    holder_id: str
    keeper_id: str


@dataclass(frozen=True, kw_only=True)
class BackupCopy:
    """A backup a peer advertises in its record.

    Attributes:
        peer_id: the peer keeping it.
        stage: the stage it is a backup of.
        version: the state version it holds (as its donor served it; larger is newer).
    """

    peer_id: str
    stage: int
    version: int


@dataclass(frozen=True, kw_only=True)
class Rescue:
    """``peer_id`` leaves ``from_stage`` to take over ``to_stage``, which nobody holds.

    Attributes:
        peer_id: the peer that moves.
        from_stage: the stage it serves now (keeps at least one other holder).
        to_stage: the unheld stage.
        keeper_id: the peer whose backup of ``to_stage`` it loads (itself: no download), or None
            when nobody keeps one.
        backup_version: that backup's version (0 without one).
    """

    peer_id: str
    from_stage: int
    to_stage: int
    keeper_id: str | None
    backup_version: int = 0

    @property
    def source(self) -> str:
        """"local-backup" (the rescuer is the keeper), "backup-donor" or "none"."""
        if self.keeper_id is None:
            return "none"
        return "local-backup" if self.keeper_id == self.peer_id else "backup-donor"


def assign_backups(num_stages: int, members: Sequence[StageMember], standby: Sequence[str] = ()) -> dict[int, BackupDuty]:
    """Stage → its backup duty, for every stage held by exactly one peer that a holder of another
    stage, or a peer of ``standby``, can keep (see the module docstring).

    Raises:
        ValueError: ``num_stages < 1``, a member outside the stages, or a peer listed twice.
    """
    holders = _holders_by_stage(num_stages, members)
    spare = sorted(set(standby) - {m.peer_id for m in members})
    spare_duties = 0  # the i-th stage kept on a peer standing by goes to the i-th of them
    duties: dict[int, BackupDuty] = {}
    for stage in range(num_stages):
        if len(holders[stage]) != 1:
            continue
        keepers = next((holders[(stage + step) % num_stages] for step in range(1, num_stages)
                        if holders[(stage + step) % num_stages]), [])
        if not keepers and spare:
            keepers, spare_duties = [spare[spare_duties % len(spare)]], spare_duties + 1
        if keepers:
            duties[stage] = BackupDuty(stage=stage, holder_id=holders[stage][0], keeper_id=keepers[0])
    return duties


def choose_rescues(
    stage_costs: Sequence[float], members: Sequence[StageMember], backups: Sequence[BackupCopy], *,
    unmovable: Collection[str] = (), pinned: Collection[str] = (),
) -> list[Rescue]:
    """One rescue per unheld stage that can be rescued, in stage order (see the module docstring).

    Args:
        stage_costs: FLOPs per sample of each stage.
        members: the peers that hold (or are syncing) a stage.
        backups: the backups peers advertise; those of held stages are ignored.
        unmovable: members that count as holders but may not move (paused peers).
        pinned: members that work on their stage (they count as its working holders) and never
            move (pinned with ``--stage``).

    Returns:
        the rescues; empty when every stage is held or no peer may move.
    """
    holders = _holders_by_stage(len(stage_costs), members)
    by_id = {m.peer_id: m for m in members}
    placed = list(members)
    rescues: list[Rescue] = []
    for stage in range(len(stage_costs)):
        if holders[stage]:
            continue
        copies = sorted((c for c in backups if c.stage == stage), key=lambda c: (-c.version, c.peer_id))
        active = [[p for p in ids if p not in unmovable] for ids in holders]  # a paused peer serves nothing
        movable = {p for ids in active if len(ids) >= 2 for p in ids if p not in pinned}
        own = [c for c in copies if c.peer_id in movable and c.version == copies[0].version]
        if own:
            rescuer, copy = by_id[own[0].peer_id], own[0]
        elif movable:
            totals = stage_throughputs(stage_costs, placed)
            kept = {p: totals[by_id[p].stage] - max(by_id[p].flops, 0.0) / stage_costs[by_id[p].stage] for p in movable}
            rescuer = min((by_id[p] for p in movable), key=lambda m: (-kept[m.peer_id], m.flops, m.peer_id))
            copy = copies[0] if copies else None
        else:
            continue
        rescues.append(Rescue(peer_id=rescuer.peer_id, from_stage=rescuer.stage, to_stage=stage,
                              keeper_id=copy.peer_id if copy else None, backup_version=copy.version if copy else 0))
        holders[rescuer.stage].remove(rescuer.peer_id)
        holders[stage].append(rescuer.peer_id)
        moved = StageMember(peer_id=rescuer.peer_id, stage=stage, flops=rescuer.flops)
        placed = [moved if m.peer_id == rescuer.peer_id else m for m in placed]
        by_id[rescuer.peer_id] = moved
    return rescues


def _holders_by_stage(num_stages: int, members: Sequence[StageMember]) -> list[list[str]]:
    """Sorted peer ids per stage, checked."""
    if num_stages < 1:
        raise ValueError(f"a run has at least one stage, got {num_stages}")
    holders: list[list[str]] = [[] for _ in range(num_stages)]
    seen: set[str] = set()
    for member in members:
        if not 0 <= member.stage < num_stages:
            raise ValueError(f"peer {member.peer_id} claims stage {member.stage} of {num_stages}")
        if member.peer_id in seen:
            raise ValueError(f"peer {member.peer_id} is listed twice")
        seen.add(member.peer_id)
        holders[member.stage].append(member.peer_id)
    return [sorted(ids) for ids in holders]
