"""The global plan, computed in the running swarm from its records (issue #18), and the verdict on it.

Every ``--global-plan-period`` seconds each peer turns its view into the planner's snapshot
(:func:`swarm_snapshot`: the members' bounded FLOP/s, the memory they offer, their roles, and the
link matrix of ``planner.link_view`` from the link figures they publish; peers standing by, which an
earlier plan left idle, are in it too, holding no stage), runs
``planner.global_plan.plan_global`` on it in a process of its own at the lowest CPU priority
(``peer.plan_worker``; deterministic and invariant to renaming, so peers with the same records
compute the same plan), and asks ``planner.adoption.decide`` whether the swarm
should move to it: only for a clear gain whose moves pay back within the horizon.

The peer logs the plan and the verdict when they change and writes a ``global_plan`` event each
time; for swarms of up to ``RECORDED_PEERS`` the event carries the planner's input too (base64 of
``peer.plan_worker.to_wire``), so a run's plan can be computed again offline (the e2e test of the
global plan does). A plan it adopts, it proposes (``peer.plan_adoption``: :meth:`GlobalPlanWatch.run` returns the
layout change, the peer's session carries it out, and the others judge it from its record).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from dht.records import PeerRecord, RunSpec
from peer.backup import MEMBER_STATES
from peer.event_log import EventLog
from peer.memory_model import activation_bytes
from peer.plan_worker import PlanProcess, to_wire
from peer.relayout import LayoutChange, offered_memory
from planner.adoption import Adoption, AdoptionConfig, decide
from planner.global_plan import GlobalPlanConfig
from planner.runtime import RuntimeSettings
from planner.snapshot import Device, ModelProfile, SwarmSnapshot
from swarm.model import layer_flops_per_sample, layer_num_params
from swarm.subspace import microbatch_ratios
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
NO_MEMORY_LIMIT = 1 << 50  # a member that states no memory budget
PLAN_TIMEOUT = 120.0  # seconds a plan may take (at least; the period when longer) before its process is stopped
RECORDED_PEERS = 32  # a global_plan event carries the planner's input for swarms up to this size
MAX_PLANNED_PEERS = 256  # plan_global: about 1.0 s at 256 volunteers, 2.3-2.6 s at 1,000 on one core here (BENCHMARKS.md, 2026-11-28); the link matrix is built on the event loop


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


def planned_records(view: SwarmView, spec: RunSpec) -> list:
    """What the global plan places: this layout's members and the peers standing by under it."""
    return [*layout_members(view, spec), *(r for r in view.records if r.state == "standby")]


def swarm_snapshot(view: SwarmView, spec: RunSpec, *, max_in_flight: int,
                   extra: Sequence[PeerRecord] = ()) -> tuple[SwarmSnapshot, dict[str, int]] | None:
    """The planner's snapshot of the peers of this layout that hold or load a stage or stand by (and
    the ``extra`` records, holding no stage of it: a proposer that left it), and the stage of each
    member (not of the others); None without members. Replicas that exchange gradients every step
    (``replica_sync`` "gradients", the default) are the cost model's blocking averaging (period 0);
    periodic averaging is its background share at ``averaging_period``. Under the flush schedule
    (the default) each step drains the pipeline and its exchange follows (``is_flushing``)."""
    averaging_period = 0.0 if spec.replica_sync == "gradients" else spec.averaging_period
    records = planned_records(view, spec)
    seen = {r.peer_id for r in records}
    records += [dataclasses.replace(r, state="standby", stage=-1) for r in extra if r.peer_id not in seen]
    if not any(r.state in MEMBER_STATES for r in records):
        return None
    ids = [r.peer_id for r in records]
    devices = tuple(Device(peer_id=r.peer_id, flops=max(r.flops, 1.0), is_reliable=r.role == "reliable",
                           memory_bytes=offered_memory(r, spec, max_in_flight=max_in_flight) or NO_MEMORY_LIMIT)
                    for r in records)
    runtime = RuntimeSettings(max_in_flight_per_peer=max_in_flight, averaging_period=averaging_period,
                              boundary_compression_ratio=min(1.0, 1.0 / microbatch_ratios(spec)[0]),
                              is_flushing=spec.pipeline_schedule == "flush")
    model = model_profile(spec, num_stage0_peers=sum(r.stage == 0 for r in records))
    snapshot = SwarmSnapshot(devices=devices, links=view.links().matrix(ids), model=model, runtime=runtime)
    return snapshot, {r.peer_id: r.stage for r in records if r.state in MEMBER_STATES}


class GlobalPlanWatch:
    """Computes the global plan and the verdict on it (the module docstring), every ``period`` seconds.

    :meth:`check` decides once, synchronously (the caller runs it in a thread); :meth:`run` repeats it.
    """

    def __init__(self, view: SwarmView, spec: RunSpec, *, period: float, max_in_flight: int, metrics: EventLog,
                 plan_config: GlobalPlanConfig | None = None, adoption: AdoptionConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, next_check: Callable[[], float] | None = None) -> None:
        self.view, self.spec, self.period, self.max_in_flight = view, spec, period, max_in_flight
        self.next_check = next_check or (lambda: period)  # seconds to the next check (peer.plan_adoption.seconds_to_check)
        self.metrics, self.clock = metrics, clock
        self.plan_config, self.adoption = plan_config or GlobalPlanConfig(), adoption or AdoptionConfig()
        self._last: tuple | str | None = None  # the last plan and verdict logged
        self.planner = PlanProcess()

    def check(self) -> Adoption | None:
        """The global plan of the swarm as this peer sees it now, and the verdict on it; None without
        members, or with more than ``MAX_PLANNED_PEERS`` (the planner's time grows fast with them)."""
        num_members = len(planned_records(self.view, self.spec))
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
        # in a process of its own at the lowest priority (peer/plan_worker.py: in a thread it starved
        # the event loop until neighbours declared this peer down); the time includes its start
        plan = self.planner.plan(snapshot, self.plan_config, timeout=max(PLAN_TIMEOUT, self.period))
        adoption = decide(snapshot, self.spec.stage_layers, stage_of, plan, self.adoption)
        seconds = self.clock() - started
        layers = [[s.layer_start, s.layer_end] for s in plan.stages]
        self.metrics.write("global_plan", stage_layers=layers, peers_per_stage=[len(s.peer_ids) for s in plan.stages],
                           idle=snapshot.num_devices - len(plan.assigned_peer_ids()), current=adoption.current,
                           planned=adoption.planned, moves=len(adoption.moves), move_seconds=adoption.move_seconds,
                           payback_seconds=adoption.payback_seconds, adopt=adoption.adopt, seconds=seconds,
                           **({"snapshot": base64.b64encode(to_wire(snapshot)).decode()}
                              if snapshot.num_devices <= RECORDED_PEERS else {}))
        if (plan, adoption.adopt) != self._last:
            self._last = (plan, adoption.adopt)
            logger.info(f"global plan ({seconds:.1f} s, {snapshot.num_devices} peers): stages {layers} with "
                        f"{[len(s.peer_ids) for s in plan.stages]} peers; {'adopts' if adoption.adopt else 'stays'}: "
                        f"{adoption.reason}")
        return adoption

    async def run(self, stop: asyncio.Event,
                  propose: Callable[[Adoption], tuple[LayoutChange | None, str]] | None = None) -> LayoutChange | None:
        """:meth:`check` when ``next_check`` says (by default every ``period`` seconds, the first after
        one period) until ``stop``; with
        ``propose`` (``peer.plan_adoption.proposed_change``), returns the first layout change it
        makes of a verdict (it logs why not, once per reason)."""
        why_not, checked = "", False
        while not stop.is_set():
            # the first after one period (a run shorter than that never plans), then when next_check says
            wait = self.next_check() if checked else self.period
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, wait))
                return
            except asyncio.TimeoutError:
                pass
            checked = True
            check = asyncio.ensure_future(asyncio.to_thread(self.check))
            stopped = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({check, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
                if not check.done():  # leaving (or cancelled) mid-plan: its process is stopped, its thread ends
                    self.planner.stop()
            try:
                adoption = await check
            except Exception as e:  # a plan is advice: records it cannot use (or a planner bug) never stop training
                if not stop.is_set():
                    logger.warning(f"no global plan this period: {e!r}")
                continue
            if adoption is not None and adoption.adopt and propose is not None and not stop.is_set():
                change, reason = propose(adoption)
                if change is not None:
                    return change
                if reason != why_not:
                    logger.info(f"not proposing the global plan: {reason}")
                why_not = reason
        return None
