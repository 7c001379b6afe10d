"""Turns ordered device groups and layer boundaries into a Plan, with FS/BS roles.

Frontal/backward server assignment follows seed 000 §3.3.3: a server becomes a frontal server
(FS) when its mean delay to the previous stage's servers is smaller than its mean delay to the
next stage's servers, a backward server (BS) otherwise; both sides need one server, so when a
side is empty the slowest server of the other side moves over. A lone server plays both roles.
The delay of an edge is ``alpha_ij + alpha_ji + t / beta_ij + t / beta_ji`` (seed 000 §3.3.3)
with ``t`` the activation bytes of one micro-batch.
"""

from __future__ import annotations

import numpy as np

from planner.plan import Plan, Stage
from planner.snapshot import SwarmSnapshot


def build_edge_delays(snapshot: SwarmSnapshot, num_bytes: float) -> np.ndarray:
    """Symmetric edge delay matrix of seed 000 §3.3.3 for a transfer of ``num_bytes``."""
    edges = num_bytes / snapshot.links.bandwidth
    edges += snapshot.links.latency_delay
    edges += edges.T.copy()  # the copy keeps the in-place add from reading what it wrote
    np.fill_diagonal(edges, 0.0)
    return edges


def typical_transfer_bytes(snapshot: SwarmSnapshot) -> float:
    """Activation bytes of one micro-batch at a typical stage boundary (the median layer output)."""
    model = snapshot.model
    return float(model.microbatch_size * np.median(model.layer_activation_bytes))


def assign_server_roles(
    edges: np.ndarray, flops: np.ndarray, servers: np.ndarray, previous: np.ndarray | None,
    following: np.ndarray | None,
) -> tuple[list[int], list[int]]:
    """Splits ``servers`` into (frontal, backward) device indices (seed 000 §3.3.3)."""
    if servers.size == 1:
        return [int(servers[0])], [int(servers[0])]
    # each server's mean delay to either side, every row at once (a loop of row means was a fifth of
    # a 1,000-peer global plan's time)
    far = np.full(servers.size, np.inf)
    to_previous = edges[np.ix_(servers, previous)].mean(axis=1) if previous is not None else far
    to_following = edges[np.ix_(servers, following)].mean(axis=1) if following is not None else far
    closer_to_previous = (to_previous < to_following).tolist()
    frontal: list[int] = [s for s, closer in zip(servers.tolist(), closer_to_previous) if closer]
    backward: list[int] = [s for s, closer in zip(servers.tolist(), closer_to_previous) if not closer]
    if not frontal:
        slowest = min(backward, key=lambda s: (flops[s], s))
        backward.remove(slowest)
        frontal.append(slowest)
    elif not backward:
        slowest = min(frontal, key=lambda s: (flops[s], s))
        frontal.remove(slowest)
        backward.append(slowest)
    return frontal, backward


def assemble_plan(
    snapshot: SwarmSnapshot, groups: list[tuple[np.ndarray, np.ndarray]], bounds: tuple[int, ...],
    *, edges: np.ndarray | None = None,
) -> Plan:
    """Builds the Plan for ordered ``(servers, clients)`` index groups and layer ``bounds``.

    ``edges`` may pass ``build_edge_delays(snapshot, typical_transfer_bytes(snapshot))`` when the
    caller already holds it (it is O(n^2) to build).
    """
    if len(groups) != len(bounds):
        raise ValueError("one boundary per group is required")
    if edges is None:
        edges = build_edge_delays(snapshot, typical_transfer_bytes(snapshot))
    names = [device.peer_id for device in snapshot.devices]
    stages = []
    start = 0
    for k, (servers, clients) in enumerate(groups):
        previous = groups[k - 1][0] if k > 0 else None
        following = groups[k + 1][0] if k + 1 < len(groups) else None
        frontal, backward = assign_server_roles(edges, snapshot.flops, servers, previous, following)
        stages.append(Stage(
            layer_start=start, layer_end=bounds[k],
            server_ids=tuple(names[i] for i in servers), client_ids=tuple(names[i] for i in clients),
            frontal_ids=tuple(names[i] for i in frontal), backward_ids=tuple(names[i] for i in backward),
        ))
        start = bounds[k]
    return Plan(stages=tuple(stages))


def plan_groups(snapshot: SwarmSnapshot, plan: Plan) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ``(servers, clients)`` index groups of ``plan``, in stage order."""
    return [
        (np.sort(snapshot.indices_of(s.server_ids)), np.sort(snapshot.indices_of(s.client_ids)))
        for s in plan.stages
    ]
