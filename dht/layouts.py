"""Stage layouts on the wire: layer ranges (the bootstrap's even split, and the check that ranges
tile the model), and a global plan's assignment.

The assignment is what the proposer of a global plan's layout puts in its record (issue #18): the
stage of the new layout each planned peer takes, and :data:`STANDBY` for each peer the plan leaves
idle (it stands by: ``peer.standby``).

A peer is named by the last :data:`TAG_CHARS` characters of its id (a tag): 256 peers fit in about
4 KB of the record instead of 14 KB. Two tags of a swarm coincide with odds of about 256² / 58¹² (base58
ids); a key ground to collide with a chosen peer's tag costs about 58¹² tries. A follower finds its own
stage by its tag; a tag it cannot place is no harm (it takes the stage with fewest members).

:func:`assignment_from_wire` treats its input as hostile, like every ``from_wire`` of ``dht.records``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_STAGES = 64
MAX_ASSIGNED = 256  # peers a plan names (peer.plan_watch.MAX_PLANNED_PEERS)
TAG_CHARS = 12
STANDBY = -1  # the "stage" of a peer the plan leaves idle

Assignment = tuple[tuple[str, int], ...]


def peer_tag(peer_id: str) -> str:
    return peer_id[-TAG_CHARS:]


def make_assignment(stage_of: Mapping[str, int]) -> Assignment:
    """``stage_of`` (peer id → stage) as a record carries it: (tag, stage) pairs in tag order."""
    return assignment_from_wire(sorted((peer_tag(p), k) for p, k in stage_of.items()), max_stages=MAX_STAGES)


def assignment_from_wire(value: Any, *, max_stages: int) -> Assignment:
    """At most :data:`MAX_ASSIGNED` (tag, stage) pairs with distinct tags of 1-:data:`TAG_CHARS`
    characters and stages in ``[0, max_stages)`` or :data:`STANDBY`, as a tuple of tuples.

    Raises:
        ValueError: anything else (the reason).
    """
    if not isinstance(value, (list, tuple)) or len(value) > MAX_ASSIGNED:
        raise ValueError(f"layout_assignment must be a list of at most {MAX_ASSIGNED} pairs")
    pairs = []
    for pair in value:
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], str)
                or not 1 <= len(pair[0]) <= TAG_CHARS or not isinstance(pair[1], int) or isinstance(pair[1], bool)
                or not STANDBY <= pair[1] < max_stages):
            raise ValueError(f"layout_assignment pairs must be (a tag of 1-{TAG_CHARS} characters, a stage "
                             f"in [{STANDBY}, {max_stages})), got {pair!r:.60}")
        pairs.append((pair[0], pair[1]))
    if len({tag for tag, _ in pairs}) != len(pairs):
        raise ValueError("layout_assignment names a peer twice")
    return tuple(pairs)


def assigned_stage(assignment: Assignment, peer_id: str) -> int | None:
    """The stage ``assignment`` gives ``peer_id`` (:data:`STANDBY`: none, it stands by), or None
    when it names no such peer."""
    tag = peer_tag(peer_id)
    return next((k for t, k in assignment if t == tag), None)


def even_stage_layers(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Split ``num_layers`` blocks into ``num_stages`` contiguous ranges, sizes differing by at most 1."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"need 1 <= num_stages ({num_stages}) <= num_layers ({num_layers})")
    bounds = [round(k * num_layers / num_stages) for k in range(num_stages + 1)]
    return tuple((bounds[k], bounds[k + 1]) for k in range(num_stages))


def check_stage_layers(stage_layers: Any, num_layers: int | None) -> None:
    """Ranges that tile ``[0, num_layers)`` in order (any end up to 2**20 when ``num_layers`` is None)."""
    if not isinstance(stage_layers, (tuple, list)) or not stage_layers or len(stage_layers) > MAX_STAGES:
        raise ValueError(f"a run has 1-{MAX_STAGES} stages")
    num_layers = num_layers if num_layers is not None else stage_layers[-1][1] if (
        isinstance(stage_layers[-1], (tuple, list)) and len(stage_layers[-1]) == 2
        and isinstance(stage_layers[-1][1], int) and 0 < stage_layers[-1][1] <= 1 << 20) else -1
    if num_layers < 0:
        raise ValueError(f"stage layer ranges must end at a layer in [1, 2**20], got {list(stage_layers)}")
    expected_start = 0
    for k, layer_range in enumerate(stage_layers):
        if (not isinstance(layer_range, (tuple, list)) or len(layer_range) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in layer_range)):
            raise ValueError(f"stage {k} layer range must be two integers, got {layer_range!r}")
        start, end = layer_range
        if start != expected_start or end <= start:
            raise ValueError(f"stage layer ranges must tile [0, {num_layers}) in order, got {list(stage_layers)}")
        expected_start = end
    if expected_start != num_layers:
        raise ValueError(f"stage layer ranges must cover all {num_layers} layers, got {list(stage_layers)}")
