"""Acting on the global plan (issue #18): the layout change its proposer makes, and whether a follower
takes it.

**The proposer.** The members take turns of ``--global-plan-period`` seconds, in peer-id order, on
the DHT's clock (:func:`proposer_of_turn`): every peer computes the plan once a turn, at a point of
its own, and the peer whose turn it is also at its start (:func:`seconds_to_check`); only the peer whose turn
it is proposes, so peers whose checks fall together do not all move at once, and
only in the first ``1 - TURN_GUARD`` of its turn: a proposal at the very end of one turn and another
at the start of the next, before the first proposer's record reached the second, would both move
(seen in the first e2e run: two peers proposed one second apart across a turn's end). If its own
verdict (``peer.plan_watch``: the plan is more than
``min_gain`` faster than the swarm as it runs, and its moves pay back within the horizon) adopts the
plan, it moves to layout version + 1 with the plan's layer ranges (:func:`proposed_change`). Its
record then carries the plan's assignment (``dht.layouts``: which stage each planned peer takes,
and ``STANDBY`` for each peer of the snapshot the plan leaves idle).
It proposes only when its view's reads complete (``MIN_COMPLETE_READS``), every stage has a holder
(a rescue or a re-plan comes first: the swarm as it runs would score 0), no joiner is choosing a
stage, every member trains under its own layout (no layout change is under way), and no member is
pinned with ``--stage`` (a pinned peer never moves, so the plan could not be carried out), and its
layout has served ``SETTLE_PERIODS`` periods: right after a move the figures of the links the new
layout uses are few or old (pairs that did not talk before are filled with the swarm's typical
link), so the swarm as it runs scores low and the next plan, from those figures, looks better; in a
CI rehearsal the two-region e2e swarm moved three times in 87 s, each plan 1.4-3.8x "faster" than
the last. A peer that never proposes (gone, or hostile) costs the swarm its turns only.

**A follower** takes the proposal from that record (``peer.relayout.adopted_layout``) once its own
view has judged it (:func:`judge_proposal`, once per proposal): the proposed split, with each member
of this peer's view on the stage the assignment names, must run at least ``1 - FOLLOW_TOLERANCE``
as fast as the swarm as it runs under the same cost model, and give every stage a reliable member.
(The proposer, and any follower that moved first, have left this peer's layout when the follower
judges: each counts in the proposed split, on the stage the assignment names, from its record under
the proposed layout, and not in the swarm as it runs; the layers they held are not lost, as they
serve them for the handoff's grace. A refusal is judged again once this peer's own layout has lost a
member since: followers leaving it change what staying behind costs.) It does not plan again: plans take
seconds, and two peers whose views differ in one link figure can plan differently, while judging a
given plan is cheap and tolerant of small differences. A proposal that makes the swarm clearly
slower in this peer's eyes (a liar's, or one computed from a view far from its own) is not
followed, and the peer logs why. A member the assignment does not name (it joined after the plan)
takes the new layout's stage with fewest members.

**Idle peers stand by** (``peer.standby``). A peer the plan leaves idle (the proposer included)
moves to the new layout without a stage: it serves its old state for the handoff's grace, then
holds nothing, trains nothing and keeps a record saying "standby". The next plans place it like any
member (``peer.plan_watch.swarm_snapshot``), and when one names a stage for it, it pulls that
stage's state from its holders, as a joiner does. Before standing by existed, such a peer took the
thinnest stage, so the swarm never ran the plan it had adopted: the next plan idled it again and
was adopted again, every period.

Peers move as for a re-plan: each serves its old state for the handoff's grace and builds its new
stage from the old stages' pieces, or pulls it from a peer that already trains it under the new
layout.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection

from dht.layouts import STANDBY, assigned_stage, make_assignment
from dht.records import PeerRecord, RunSpec
from peer.backup import MEMBER_STATES, MIN_COMPLETE_READS
from peer.plan_watch import planned_records, swarm_snapshot
from peer.relayout import LayoutChange, layout_of, record_layout, records_under, unheld_stages
from planner.adoption import Adoption, layout_plan
from planner.costs import estimate_throughput
from swarm.view import SwarmView

FOLLOW_TOLERANCE = 0.1  # a follower's own estimate of a proposal may be this much below the swarm as it runs
TURN_GUARD = 0.25  # the last fraction of a turn in which its peer does not propose (the module docstring)
SETTLE_PERIODS = 2  # plan periods a layout serves before a peer proposes the next one (the module docstring)
TURN_MARGIN = 0.5  # seconds into its turn a proposer starts planning: DHT clocks differ a little


def proposer_of_turn(member_ids: Collection[str], now: float, period: float) -> str:
    """The member whose turn it is to propose at DHT time ``now``: turns of ``period`` seconds, in
    peer-id order."""
    ordered = sorted(member_ids)
    return ordered[int(now // period) % len(ordered)]


def turn_members(view: SwarmView, peer_id: str) -> set[str]:
    """The peers that take turns to propose, as this peer's view has them."""
    return {r.peer_id for r in view.records if r.state in MEMBER_STATES} | {peer_id}


def seconds_to_check(member_ids: Collection[str], peer_id: str, now: float, period: float) -> float:
    """Seconds from DHT time ``now`` to this peer's next global-plan check: the start of the next turn
    if it is this peer's (plus ``TURN_MARGIN``), else this peer's point of the current or next turn
    (:func:`check_phase`), whichever comes first. Every peer plans once a turn, and the proposer also
    at its turn's start, so its plan is ready early in its turn. Checks ``period`` seconds after the
    last one drifted by the plan's own time (5-21 s on two loaded cores) and fell in the last quarter
    of the peer's turn, or skipped it: in a local e2e run no peer proposed in 180 s (six turns)."""
    start = (now // period + 1) * period
    point = start - period + check_phase(peer_id) * period
    if point <= now:
        point += period
    if proposer_of_turn(member_ids, start + TURN_MARGIN, period) == peer_id:
        return min(start + TURN_MARGIN, point) - now
    return point - now


def check_phase(peer_id: str) -> float:
    """Where in each turn this peer plans, as a fraction of the turn: a point of its own in
    [0.25, 0.75), so the peers' planners (a process each) do not all start at once (when they all
    planned at mid-turn, a CI rehearsal showed several peers' planners starting together)."""
    return 0.25 + 0.5 * zlib.crc32(peer_id.encode()) / 2**32


def proposed_change(adoption: Adoption, view: SwarmView, spec: RunSpec, base: RunSpec, *, peer_id: str,
                    now: float, period: float, layout_since: float = -math.inf) -> tuple[LayoutChange | None, str]:
    """The layout change that carries out ``adoption``'s plan from this peer at DHT time ``now``
    (turns of ``period`` seconds; this peer has served its layout since ``layout_since``), or None
    and why not."""
    if not adoption.adopt:
        return None, adoption.reason
    if now - layout_since < SETTLE_PERIODS * period:
        return None, f"this layout has served {now - layout_since:.0f} s: its links are measured anew first"
    if (turn := proposer_of_turn(turn_members(view, peer_id), now, period)) != peer_id:
        return None, f"it is {turn[-6:]}'s turn to propose"
    if now % period > (1 - TURN_GUARD) * period:
        return None, "its turn to propose ends too soon: a proposal now could cross the next peer's"
    if view.complete_reads < MIN_COMPLETE_READS:
        return None, "this peer's view reads did not complete in time"
    current = layout_of(spec)
    if unheld := unheld_stages(view, spec):
        # the swarm as it runs scores 0, so any plan would pass: a rescue (or a peer standing by, or a
        # re-plan) restores the stage first, and plans compare with a swarm that runs
        return None, f"stage {unheld[0]} has no holder (a rescue or a re-plan comes first)"
    for record in view.all_records:
        if record.state == "joining":
            return None, f"{record.peer_id[-6:]} is choosing its stage"
        if record.state in MEMBER_STATES and record_layout(record, base) != current:
            return None, f"{record.peer_id[-6:]} trains under another layout (a change is under way)"
        if record.state == "standby" and record.layout_version > current.version:
            # a proposer the plan idled stands by under its new layout: it is no member of this
            # one, so the turns moved on, but its proposal is under way (seen in the e2e run)
            return None, f"{record.peer_id[-6:]} stands by under a newer layout (a change is under way)"
        if record.state in MEMBER_STATES and record.pinned:
            return None, f"{record.peer_id[-6:]} is pinned to its stage (--stage) and would not move"
    plan = adoption.plan
    stage_of = {p: k for k, stage in enumerate(plan.stages) for p in stage.peer_ids}
    new_spec = base.with_layout(spec.layout_version + 1, tuple((s.layer_start, s.layer_end) for s in plan.stages))
    idle = {r.peer_id: STANDBY for r in planned_records(view, spec)} | {peer_id: STANDBY}
    return LayoutChange(spec=new_spec, layout_map=(), stage=stage_of.get(peer_id, STANDBY), reason="global_plan",
                        proposer=peer_id, unheld=(), assignment=make_assignment(idle | stage_of)), ""


def judge_proposal(record: PeerRecord, view: SwarmView, spec: RunSpec, base: RunSpec, *, max_in_flight: int,
                   pinned: bool = False) -> str:
    """"" when this peer follows the global plan ``record`` proposes, else one sentence saying why not
    (the module docstring)."""
    if pinned:
        return "this peer is pinned to its stage (--stage)"
    layout = record_layout(record, base)
    if layout is None or layout.version != spec.layout_version + 1 or record.layout_map:
        return "it is not a global plan's layout following this peer's"
    # the proposer left this peer's layout when it moved, and so did each follower that moved before
    # this one: they are in the snapshot as the plan's, so a stage the plan gives them alone is not
    # "unheld" (in a harness run every follower refused for the proposer; later, with the proposer
    # counted, the last followers refused for the followers that had moved first, and stayed behind
    # on a layout with a stage nobody held)
    moved = [r for r in records_under(view, base, layout)
             if r.peer_id != record.peer_id and (r.state in MEMBER_STATES or r.state == "standby")]
    taken = swarm_snapshot(view, spec, max_in_flight=max_in_flight, extra=[record, *moved])
    if taken is None:
        return "this peer's view has no members"
    snapshot, stage_of = taken
    assigned = {d.peer_id: k for d in snapshot.devices
                if (k := assigned_stage(record.layout_assignment, d.peer_id)) is not None and 0 <= k < layout.num_stages}
    proposed = layout_plan(layout.stage_layers, assigned, snapshot)
    if proposed is None:
        return "a stage of it has no reliable member among the peers this peer sees"
    running = layout_plan(spec.stage_layers, stage_of, snapshot)
    try:
        current = estimate_throughput(snapshot, running) if running is not None else 0.0
        planned = estimate_throughput(snapshot, proposed)
    except ValueError as e:  # it does not fit the memory the members offer
        return f"it does not fit: {e}"
    if planned < current * (1 - FOLLOW_TOLERANCE):
        return (f"under this peer's view it runs {planned:.3g} samples/s, below the {current:.3g} of the swarm "
                f"as it runs")
    return ""
