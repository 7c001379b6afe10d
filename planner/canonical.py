"""A relabelling-invariant order of a snapshot's devices, so plans do not depend on peer ids.

``SwarmSnapshot`` sorts devices by peer id, which makes a planner deterministic for one naming but
not for another: every tie broken by index, every round-robin and every random draw then depends
on the names. Issue #18 asks that renaming peers changes the plan only by the renaming. Planners
therefore work on a *canonical* snapshot: devices ordered by a colour that depends only on what
they are and how they are linked, renamed ``c000000``, ``c000001``, ...; the plan found there is
mapped back to the real ids.

The colour is Weisfeiler-Lehman refinement (1-WL) on the complete graph with links as edge labels:
start from a hash of (FLOP/s, memory, role), then repeatedly hash each device's colour with the
multiset of (latency and bandwidth both ways, neighbour's colour). A multiset is hashed as the sum
of its elements' 64-bit hashes (wrapping), which is order-free and vectorises. Devices that 1-WL
cannot tell apart (exact twins: same figures, same links to the same kinds of devices) keep their
peer-id order; swapping twins swaps only what is interchangeable, so the plan's worth is the same.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from planner.plan import Plan, Stage
from planner.snapshot import Device, LinkMatrix, SwarmSnapshot

NUM_ROUNDS = 3
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic), in place on one new
    array (the swarm's n x n edge labels are mixed several times per colouring)."""
    z = values + _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _MIX_1
    z ^= z >> np.uint64(27)
    z *= _MIX_2
    z ^= z >> np.uint64(31)
    return z


def _bits(values: np.ndarray) -> np.ndarray:
    """The exact bits of float64 values as uint64 (0.0 and -0.0 merged)."""
    return (np.asarray(values, dtype=np.float64) + 0.0).view(np.uint64)


def colour_devices(snapshot: SwarmSnapshot, *, num_rounds: int = NUM_ROUNDS) -> np.ndarray:
    """1-WL colour of every device (uint64), invariant under renaming (module doc)."""
    with np.errstate(over="ignore"):
        colour = _mix(_bits(snapshot.flops))
        colour = _mix(colour ^ _bits(snapshot.memory_bytes))
        reliable = np.array([d.is_reliable for d in snapshot.devices], dtype=np.uint64)
        colour = _mix(colour ^ reliable)
        links = snapshot.links
        edge = _mix(_bits(links.latency_delay))
        edge = _mix(edge ^ _bits(np.where(np.isfinite(links.bandwidth), links.bandwidth, 0.0)))
        edge = _mix(edge ^ _bits(links.latency_delay.T))
        edge = _mix(edge ^ _bits(np.where(np.isfinite(links.bandwidth.T), links.bandwidth.T, 0.0)))
        for _ in range(num_rounds):
            contribution = _mix(edge ^ colour[None, :])
            # the sum wraps modulo 2^64, so removing the diagonal after summing is exact
            neighbours = contribution.sum(axis=1, dtype=np.uint64) - np.diagonal(contribution)
            colour = _mix(colour ^ _mix(neighbours))
    return colour


def canonicalize(snapshot: SwarmSnapshot) -> tuple[SwarmSnapshot, tuple[str, ...]]:
    """The canonical snapshot and, for each canonical device in order, its real peer id."""
    colour = colour_devices(snapshot)
    order = np.array(sorted(range(snapshot.num_devices), key=lambda i: (int(colour[i]), i)), dtype=np.int64)
    names = tuple(snapshot.devices[i].peer_id for i in order)
    devices = tuple(
        Device(peer_id=f"c{position:06d}", flops=snapshot.devices[i].flops,
               memory_bytes=snapshot.devices[i].memory_bytes, is_reliable=snapshot.devices[i].is_reliable)
        for position, i in enumerate(order.tolist())
    )
    index = np.ix_(order, order)
    links = LinkMatrix(latency_delay=snapshot.links.latency_delay[index], bandwidth=snapshot.links.bandwidth[index])
    canonical = SwarmSnapshot(devices=devices, links=links, model=snapshot.model, runtime=snapshot.runtime)
    return canonical, names


def rename_plan(plan: Plan, names: dict[str, str]) -> Plan:
    """``plan`` with every peer id replaced by ``names[peer_id]``."""
    def rename(ids: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(names[p] for p in ids)

    return Plan(stages=tuple(
        Stage(layer_start=s.layer_start, layer_end=s.layer_end, server_ids=rename(s.server_ids),
              client_ids=rename(s.client_ids), frontal_ids=rename(s.frontal_ids), backward_ids=rename(s.backward_ids))
        for s in plan.stages
    ))


def plan_canonically(
    snapshot: SwarmSnapshot, planner: Callable[[SwarmSnapshot], Plan], *, is_canonical: bool = False
) -> Plan:
    """Runs ``planner(canonical snapshot) -> Plan`` and maps its plan back to the real peer ids.

    ``is_canonical`` says ``snapshot`` is already a canonical snapshot (``canonicalize``'s first
    result, as a planner running inside ``plan_canonically`` holds): its colours are those of the
    devices it was made from, already in order, so its canonical form is itself with every name
    its own, and the colouring (O(n^2) per call) is skipped.
    """
    if is_canonical:
        return planner(snapshot)
    canonical, names = canonicalize(snapshot)
    plan = planner(canonical)
    return rename_plan(plan, {device.peer_id: name for device, name in zip(canonical.devices, names)})
