"""The global plan, computed in the running swarm from its records (issue #18), and the verdict on it.

Every ``--global-plan-period`` seconds each peer turns its view into the planner's snapshot
(:func:`swarm_snapshot`: the members' bounded FLOP/s, the memory they offer, their roles, and the
link matrix of ``planner.link_view`` from the link figures they publish), runs
``planner.global_plan.plan_global`` on it (deterministic and invariant to renaming, so peers with
the same records compute the same plan), and asks ``planner.adoption.decide`` whether the swarm
should move to it: only for a clear gain whose moves pay back within the horizon.

**What this does not do yet**: act on the verdict. The peer logs the plan and the verdict when they
change and writes a ``global_plan`` event each time; the swarm still moves by join choice,
rebalancing, rescues and re-planning (``peer.rebalance``, ``peer.backup``, ``peer.relayout``).
Moving to an adopted plan through the layout versions is the next step of issue #18.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from dht.records import RunSpec
from peer.backup import MEMBER_STATES
from peer.event_log import EventLog
from peer.memory_model import activation_bytes
from peer.relayout import offered_memory
from planner.adoption import Adoption, AdoptionConfig, decide
from planner.global_plan import GlobalPlanConfig, plan_global
from planner.runtime import RuntimeSettings
from planner.snapshot import Device, ModelProfile, SwarmSnapshot
from swarm.model import layer_flops_per_sample, layer_num_params
from swarm.subspace import microbatch_ratios
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
NO_MEMORY_LIMIT = 1 << 50  # a member that states no memory budget
MAX_PLANNED_PEERS = 256  # plan_global: 3.7 s at 256 volunteers, 10.2 s at 1,000 on one quiet core here (BENCHMARKS.md)


def model_profile(spec: RunSpec, *, num_stage0_peers: int) -> ModelProfile:
    """The run's model as the planner sees it: per block, its FLOPs per sample, its float32
    parameters (the optimizer holds gradients and two moments beside them) and its output per sample.
    A step is a batch of ``target_batch_size`` samples for the whole swarm (``replica_sync``
    "gradients") or for each stage-0 replica ("periodic")."""
    model = spec.model
    per_batch = max(1, spec.target_batch_size // spec.microbatch_size)
    per_step = per_batch if spec.replica_sync == "gradients" else per_batch * max(1, num_stage0_peers)
    return ModelProfile(
        layer_flops=layer_flops_per_sample(spec),
        layer_param_bytes=tuple(4.0 * n for n in layer_num_params(spec)),
        layer_activation_bytes=(float(activation_bytes(spec) * model.seq_len * model.d_model),) * model.num_layers,
        microbatch_size=spec.microbatch_size, num_microbatches=per_step,
        optimizer_bytes_per_param_byte=3.0,
    )


def layout_members(view: SwarmView, spec: RunSpec) -> list:
    """The records of this layout's peers that hold or load a stage."""
    return [r for r in view.records if r.state in MEMBER_STATES and 0 <= r.stage < spec.num_stages]


def swarm_snapshot(view: SwarmView, spec: RunSpec, *, max_in_flight: int) -> tuple[SwarmSnapshot, dict[str, int]] | None:
    """The planner's snapshot of the peers of this layout that hold or load a stage, and each one's
    stage; None without members. Replicas that exchange gradients every step (``replica_sync``
    "gradients", the default) are the cost model's blocking averaging (period 0); periodic averaging
    is its background share at ``averaging_period``."""
    averaging_period = 0.0 if spec.replica_sync == "gradients" else spec.averaging_period
    records = layout_members(view, spec)
    if not records:
        return None
    ids = [r.peer_id for r in records]
    devices = tuple(Device(peer_id=r.peer_id, flops=max(r.flops, 1.0), is_reliable=r.role == "reliable",
                           memory_bytes=offered_memory(r, spec, max_in_flight=max_in_flight) or NO_MEMORY_LIMIT)
                    for r in records)
    runtime = RuntimeSettings(max_in_flight_per_peer=max_in_flight, averaging_period=averaging_period,
                              boundary_compression_ratio=min(1.0, 1.0 / microbatch_ratios(spec)[0]))
    model = model_profile(spec, num_stage0_peers=sum(r.stage == 0 for r in records))
    snapshot = SwarmSnapshot(devices=devices, links=view.links().matrix(ids), model=model, runtime=runtime)
    return snapshot, {r.peer_id: r.stage for r in records}


class GlobalPlanWatch:
    """Computes the global plan and the verdict on it (the module docstring), every ``period`` seconds.

    :meth:`check` decides once, synchronously (the caller runs it in a thread); :meth:`run` repeats it.
    """

    def __init__(self, view: SwarmView, spec: RunSpec, *, period: float, max_in_flight: int, metrics: EventLog,
                 plan_config: GlobalPlanConfig | None = None, adoption: AdoptionConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.view, self.spec, self.period, self.max_in_flight = view, spec, period, max_in_flight
        self.metrics, self.clock = metrics, clock
        self.plan_config, self.adoption = plan_config or GlobalPlanConfig(), adoption or AdoptionConfig()
        self._last: tuple | str | None = None  # the last plan and verdict logged

    def check(self) -> Adoption | None:
        """The global plan of the swarm as this peer sees it now, and the verdict on it; None without
        members, or with more than ``MAX_PLANNED_PEERS`` (the planner's time grows fast with them)."""
        num_members = len(layout_members(self.view, self.spec))
        if num_members > MAX_PLANNED_PEERS:  # checked before the snapshot: its link matrix alone is n² pairs
            if self._last != "too large":
                logger.info(f"no global plan: {num_members} peers are more than the {MAX_PLANNED_PEERS} "
                            "the planner handles in a period")
            self._last = "too large"
            return None
        taken = swarm_snapshot(self.view, self.spec, max_in_flight=self.max_in_flight)
        if taken is None:
            return None
        snapshot, stage_of = taken
        started = self.clock()
        plan = plan_global(snapshot, self.plan_config)
        adoption = decide(snapshot, self.spec.stage_layers, stage_of, plan, self.adoption)
        seconds = self.clock() - started
        layers = [[s.layer_start, s.layer_end] for s in plan.stages]
        self.metrics.write("global_plan", stage_layers=layers, peers_per_stage=[len(s.peer_ids) for s in plan.stages],
                           idle=snapshot.num_devices - len(plan.assigned_peer_ids()), current=adoption.current,
                           planned=adoption.planned, moves=len(adoption.moves), move_seconds=adoption.move_seconds,
                           payback_seconds=adoption.payback_seconds, adopt=adoption.adopt, seconds=seconds)
        if (plan, adoption.adopt) != self._last:
            self._last = (plan, adoption.adopt)
            logger.info(f"global plan ({seconds:.1f} s, {snapshot.num_devices} peers): stages {layers} with "
                        f"{[len(s.peer_ids) for s in plan.stages]} peers; {'would adopt' if adoption.adopt else 'stays'}: "
                        f"{adoption.reason} (not acted on yet)")
        return adoption

    async def run(self, stop: asyncio.Event) -> None:
        """:meth:`check` every ``period`` seconds (the first after one period) until ``stop``."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.period)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await asyncio.to_thread(self.check)
            except Exception as e:  # a plan is advice: records it cannot use (or a planner bug) never stop training
                logger.warning(f"no global plan this period: {e!r}")
