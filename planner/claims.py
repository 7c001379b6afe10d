"""Bounds on what peers claim about themselves, by what the other peers claim (issue #7).

A peer record is signed and bound to its peer id (``dht.identity``), but its figures are still the
peer's own word, and some of them steer everybody else: FLOP/s places joiners and moves peers
(``stage_choice``, ``backup``), samples/s weights the router's choice of the next hop, a backup's
version picks the copy a lost stage is rescued from. One liar must not be able to take over such a
decision by claiming a huge number. So every such figure is read through a bound set by the
others' figures:

* a rate (FLOP/s swarm-wide; samples/s and the router's throughput within a stage) is capped at
  ``max_ratio`` times the *lower median* of the positive claims of its group
  (:func:`cap_to_median`). With ``n`` peers of which fewer than half lie, the lower median is an
  honest peer's figure or lies between honest figures, so a liar weighs at most ``max_ratio`` honest
  medians: with two peers, at most ``max_ratio / (max_ratio + 1)`` of the router's picks instead
  of all of them. The price: a genuinely faster device is also capped there (a GPU among CPUs is
  counted as ``max_ratio`` CPUs), which misplaces it a little but never hurts correctness.
* a backup copy of a lost stage is taken from the peer the backup rule names as its keeper
  (:func:`credible_copies`), whatever version others claim to hold; only when that keeper
  advertises no copy do the other copies count (newest first, as before).

A group of a single peer has no one else to be bounded by and is left as it claims. Sybils (one
party running many bound identities) are outside what a median can bound.

Pure: no clock, no I/O; every peer computing this on the same records gets the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.backup_plan import BackupCopy, assign_backups
from planner.stage_choice import StageMember

MAX_CLAIM_RATIO = 4.0  # a rate counts at most this many times its group's median; raise for swarms of very mixed devices


def lower_median(values: Sequence[float]) -> float:
    """The lower median (``sorted(values)[(n - 1) // 2]``): with two values, the smaller one.

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("the median of no values")
    return sorted(values)[(len(values) - 1) // 2]


def cap_to_median(values: Sequence[float], *, max_ratio: float = MAX_CLAIM_RATIO) -> list[float]:
    """``values`` with each capped at ``max_ratio`` times the lower median of the positive ones
    (the zeros of peers that have not measured yet do not drag the median down). Fewer than two
    positive values: unchanged."""
    if max_ratio < 1:
        raise ValueError(f"max_ratio must be at least 1, got {max_ratio}")
    positive = [v for v in values if v > 0]
    if len(positive) < 2:
        return list(values)
    cap = max_ratio * lower_median(positive)
    return [min(v, cap) for v in values]


def credible_copies(num_stages: int, members: Sequence[StageMember], copies: Sequence[BackupCopy]) -> list[BackupCopy]:
    """The backup copies to rescue from: for each stage, only the copies of the peer that
    :func:`planner.backup_plan.assign_backups` names its keeper when the stage has a single holder
    (the first peer of the next held stage), if it advertises one; else all of them.

    ``members`` are the current holders. A stage that lost its last holder is computed as if it
    still had one, so the keeper is the one every peer named while it was held (as long as the next
    stage's membership did not change meanwhile; if it did, all copies count again).
    """
    credible = []
    for stage in sorted({c.stage for c in copies if 0 <= c.stage < num_stages}):
        of_stage = [c for c in copies if c.stage == stage]
        keeper = _expected_keeper(num_stages, members, stage)
        kept = [c for c in of_stage if c.peer_id == keeper]
        credible.extend(kept or of_stage)
    return credible


def _expected_keeper(num_stages: int, members: Sequence[StageMember], stage: int) -> str | None:
    others = [m for m in members if m.stage != stage]
    ghost = StageMember(peer_id="\0ghost", stage=stage, flops=0.0)  # sorts before any peer id
    duty = assign_backups(num_stages, [*others, ghost]).get(stage)
    return duty.keeper_id if duty is not None else None
