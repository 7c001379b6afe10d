"""Discrete-event simulation of one swarm running a plan: pipeline, task pool, links, churn.

Model (seed 000 §3.2 runtime, timed as in §4.1):

* Each step pushes ``d`` micro-batches of ``m`` samples through the stages, forward then
  backward (forward is 1/3 of a layer's FLOPs, backward 2/3). At most ``max_inflight``
  micro-batches are in the pipeline at once; devices run backward tasks before forward ones
  (1F1B priority, seed 001 §3.2).
* In a stage, a micro-batch is cut into chunks by the water-filling shares of ``costs`` over the
  members currently known alive; a server computes its chunk, a client also fetches its input from
  and returns its output to the servers: ``2 alpha + w (F / c + (t_in + t_out) / beta)`` per pass.
* Between stages, activations and gradients cross a FIFO link per direction: serialisation
  ``m t / n * mean(1 / beta)`` occupies the link, latency ``mean(alpha)`` is added on top. With
  whole micro-batches (below) the link is ``n`` lanes instead, each micro-batch on the first free
  one for ``m t * mean(1 / beta)``: the same capacity, and one micro-batch's transfer as long as
  one pair of peers makes it.
* Churn: each unreliable device disconnects during a step with ``disconnect_probability``, at a
  uniform time, and is back at the next step (seed 000 §4.1 Case 4). Its unfinished chunks are
  noticed ``failure_detect_delay`` later; with the task pool they go to the stage's least loaded
  server, without it (SWARM) the micro-batch restarts from stage 0 and the work done is wasted.
* Averaging with delayed parameter updates (seed 000 "Aggregation process") overlaps the next
  step, so a step lasts ``max(pipeline time, averaging time)``; averaging is parameter-server
  style: every member sends and receives ``W_k / |S_k|`` to and from each server.

Runtime variants (``SimulationConfig``; the defaults are the seed's model above):

* ``is_whole_microbatch``: a micro-batch goes whole to one member per stage instead of being cut
  into chunks; the member is the one that would finish it first (queued work plus this task,
  client latency included), and its backward returns to the same member. Stage-0 members inject
  their own micro-batches, ``max_inflight`` each. This is a task pool that clients pull whole
  tasks from, and Murmuration's router (each microbatch to one replica, least loaded first).
  Stage-0 servers own the data: each injects ``max_inflight`` micro-batches of its own, which
  it or a stage-0 client computes.
* ``is_fifo``: a device runs its tasks in arrival order (Murmuration: one compute thread per
  stage, no schedule) instead of backward first.
* ``is_fused_last_stage``: the last stage runs forward and backward as one task.
* ``is_draining=False``: steps do not drain the pipeline (delayed parameter updates with weight
  versions); all ``num_steps * d`` micro-batches flow through one run and the first step is a
  warm-up: the throughput counts the later steps only, each lasting ``max(its time, averaging)``.
  Churn needs the draining model (a device is back at the next step) and is refused here.

``SimulationConfig.murmuration`` sets all four, as ``bench/simulator_check.py`` uses it. With
``is_flushing`` (the runtime's default flush schedule) it drains instead, and a step's averaging
round (the replicas' gradient exchange) follows its drain (``is_averaging_after_drain``):
``bench/simulator_harness.py`` measured which of the two predicts the real swarm.

One cost model with ``planner.costs`` (issue #18): the simulator takes its link figures
(``estimate_link_terms``: means over all servers of both stages, parallel streams, the boundary
codec's compression), the averaging share of the links and the memory check
(``is_within_memory``: a plan that does not fit simulates to throughput 0) from there, and with
whole micro-batches the window is the runtime's (``RuntimeSettings.max_in_flight_per_peer`` per
stage-0 server) unless ``max_inflight`` overrides it. The router of the runtime sends a micro-batch
to any replica of the next stage, so frontal/backward roles do not restrict the links here.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from planner.costs import (
    estimate_averaging_share, estimate_link_terms, fill_workload, is_within_memory, profile_group,
)
from planner.plan import Plan
from planner.snapshot import SwarmSnapshot

FORWARD_FRACTION = 1.0 / 3.0


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """What to simulate.

    Attributes:
        num_steps: training steps to run.
        max_inflight: micro-batches in the pipeline at once; 0 means twice the stage count.
        disconnect_probability: chance that an unreliable device drops during a step.
        failure_detect_delay: seconds before a vanished device's work is noticed.
        is_task_pool: True re-queues lost chunks (seed 000); False restarts the micro-batch (SWARM).
        is_averaging: include averaging: its share of the stage's links and, per step, the part
            of a round beyond the snapshot's averaging period (all of it when the period is 0,
            seed 000's runtime), as ``costs`` models it.
        is_whole_microbatch: route each micro-batch whole to one member per stage; ``max_inflight``
            then counts per stage-0 server (0: the snapshot's ``RuntimeSettings.max_in_flight_per_peer``).
        is_fifo: run each device's tasks in arrival order rather than backward first.
        is_fused_last_stage: the last stage's forward and backward are one task.
        is_draining: the pipeline drains at every step; False for delayed updates (no drain,
            first step a warm-up, needs ``num_steps >= 2`` and no churn).
        message_overhead_flops: device work per message a task receives from or sends to another
            stage (deserialisation, the transport's CPU, bookkeeping), in FLOP-equivalents, so that
            it takes ``message_overhead_flops / flops`` seconds of the device like compute does; a
            task of a middle stage has two such messages, the first stage's forward one (it sends),
            the last stage's fused task two. 0: messages cost no device time.
        is_averaging_after_drain: a step's averaging round starts once its pipeline has drained
            and the step ends with it (Murmuration's flush schedule, whose replicas exchange
            gradients after every batch): a step lasts the pipeline plus the round's part beyond
            the averaging period, not the longer of the two. Needs ``is_draining``.
    """

    num_steps: int = 3
    max_inflight: int = 0
    disconnect_probability: float = 0.0
    failure_detect_delay: float = 2.0
    is_task_pool: bool = True
    is_averaging: bool = True
    is_whole_microbatch: bool = False
    is_fifo: bool = False
    is_fused_last_stage: bool = False
    is_draining: bool = True
    message_overhead_flops: float = 0.0
    is_averaging_after_drain: bool = False

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.max_inflight < 0:
            raise ValueError("num_steps must be >= 1 and max_inflight >= 0")
        if not 0.0 <= self.disconnect_probability <= 1.0:
            raise ValueError("disconnect_probability must lie in [0, 1]")
        if self.failure_detect_delay < 0 or self.message_overhead_flops < 0:
            raise ValueError("failure_detect_delay and message_overhead_flops must be >= 0")
        if not self.is_draining and (self.num_steps < 2 or self.disconnect_probability > 0):
            raise ValueError("is_draining=False needs num_steps >= 2 and no churn")
        if self.is_averaging_after_drain and not self.is_draining:
            raise ValueError("is_averaging_after_drain needs is_draining: a round after a drain needs the drain")

    @classmethod
    def murmuration(cls, *, num_steps: int, max_inflight_per_peer: int = 0,
                    message_overhead_flops: float = 0.0, is_flushing: bool = False) -> SimulationConfig:
        """Murmuration's runtime: whole micro-batches, FIFO compute, fused last stage, no drain;
        ``is_flushing``: its flush schedule (``RunSpec.pipeline_schedule`` "flush", the default):
        each step drains the pipeline, then the replicas exchange gradients.

        ``max_inflight_per_peer`` 0 takes the window from the snapshot's ``RuntimeSettings``.
        """
        return cls(
            num_steps=num_steps, max_inflight=max_inflight_per_peer, is_whole_microbatch=True, is_fifo=True,
            is_fused_last_stage=True, is_draining=is_flushing, message_overhead_flops=message_overhead_flops,
            is_averaging_after_drain=is_flushing,
        )


@dataclass(frozen=True, kw_only=True)
class SimulationResult:
    """Outcome of a simulation.

    Attributes:
        throughput: samples per second over all steps; 0 when the plan does not fit in memory.
        step_delays: seconds per step.
        num_lost_chunks: chunks lost to disconnections.
        num_restarts: micro-batches restarted from stage 0 (no task pool).
        wasted_seconds: device-seconds of compute thrown away: the lost part of interrupted tasks
            and, on a restart, every task the micro-batch had finished.
    """

    throughput: float
    step_delays: tuple[float, ...]
    num_lost_chunks: int
    num_restarts: int
    wasted_seconds: float = 0.0
    is_within_memory: bool = True


@dataclass(frozen=True, kw_only=True, eq=False)
class _StageModel:
    """Per-stage constants the event loop needs."""

    members: np.ndarray  # device indices, servers first
    num_servers: int
    flops_per_sample: float  # forward plus backward
    boundary_bytes: float  # t_in + t_out per sample
    client_latency: np.ndarray  # mean alpha to the servers (0 for servers)
    client_per_byte: np.ndarray  # mean 1 / beta to the servers (0 for servers)
    averaging_delay: float


def _build_stage_models(snapshot: SwarmSnapshot, plan: Plan) -> list[_StageModel]:
    model = snapshot.model
    latency, bandwidth = snapshot.links.latency_delay, 1.0 / snapshot.links.bandwidth
    ratio = snapshot.runtime.boundary_compression_ratio
    stages = []
    for stage in plan.stages:
        servers = snapshot.indices_of(stage.server_ids)
        members = np.concatenate([servers, snapshot.indices_of(stage.client_ids)])
        alpha = latency[np.ix_(members, servers)].mean(axis=1)
        per_byte = bandwidth[np.ix_(members, servers)].mean(axis=1) * ratio
        alpha[: servers.size], per_byte[: servers.size] = 0.0, 0.0
        weight_bytes = sum(model.layer_param_bytes[stage.layer_start:stage.layer_end])
        # the cost model's round (costs.round_per_byte: a butterfly, or the exchange every step)
        group = profile_group(snapshot, servers, snapshot.indices_of(stage.client_ids))
        averaging = weight_bytes * group.averaging_per_byte
        boundary = model.layer_activation_bytes[stage.layer_end - 1]
        boundary += model.layer_activation_bytes[stage.layer_start - 1] if stage.layer_start > 0 else 0.0
        stages.append(_StageModel(
            members=members, num_servers=int(servers.size),
            flops_per_sample=sum(model.layer_flops[stage.layer_start:stage.layer_end]),
            boundary_bytes=boundary, client_latency=alpha, client_per_byte=per_byte,
            averaging_delay=float(averaging),
        ))
    return stages


def _build_links(snapshot: SwarmSnapshot, plan: Plan, *, is_averaging: bool) -> list[tuple[float, ...]]:
    """Per boundary k -> k+1: (forward latency, forward seconds per byte, backward ..., ..., streams).

    ``costs.estimate_link_terms`` between all servers of both stages; background averaging of
    stage k takes its share of the link (``costs.estimate_averaging_share``).
    """
    latency = snapshot.links.latency_delay
    links = []
    for left, right in zip(plan.stages[:-1], plan.stages[1:]):
        senders, receivers = snapshot.indices_of(left.server_ids), snapshot.indices_of(right.server_ids)
        terms = estimate_link_terms(snapshot, senders, receivers)
        share = 0.0
        if is_averaging:
            group = profile_group(snapshot, senders, snapshot.indices_of(left.client_ids))
            share = estimate_averaging_share(
                snapshot.model, group, left.layer_start, left.layer_end, runtime=snapshot.runtime
            )
        forward, backward = np.ix_(senders, receivers), np.ix_(receivers, senders)
        links.append((
            float(latency[forward].mean()), terms.forward_per_byte / (1.0 - share),
            float(latency[backward].mean()), terms.backward_per_byte / (1.0 - share), terms.num_streams,
        ))
    return links


class _StepRun:
    """Event loop of one step (or of the whole run without drains).

    Tasks are ``(mb, generation, stage, direction, samples)``; direction 0 is forward, 1 backward.
    """

    def __init__(
        self, snapshot: SwarmSnapshot, stages: list[_StageModel], links: list, config: SimulationConfig,
        *, num_microbatches: int, layer_ends: list[int],
    ) -> None:
        self.flops = snapshot.flops
        self.model = snapshot.model
        self.runtime = snapshot.runtime
        self.stages, self.links, self.config, self.layer_ends = stages, links, config, layer_ends
        self.time, self.events, self.sequence = 0.0, [], 0
        devices = [int(i) for stage in stages for i in stage.members]
        self.queue: dict[int, list] = {i: [] for i in devices}
        self.busy: dict[int, tuple | None] = {i: None for i in devices}
        self.busy_since: dict[int, float] = {i: 0.0 for i in devices}
        self.epoch = {i: 0 for i in devices}
        self.down: set[int] = set()
        self.known_down: set[int] = set()
        self.detect_time: dict[int, float] = {}
        # per boundary and direction, when each lane is free: whole micro-batches cross one pair of
        # peers each, so a boundary is n lanes at n times the aggregate's seconds per byte (its
        # capacity unchanged, one micro-batch's transfer n times longer); chunks share one aggregate lane
        self.link_free = [[[0.0] * (int(link[4]) if config.is_whole_microbatch else 1) for _ in range(2)]
                          for link in links]
        self.pending: dict[tuple, int] = {}
        self.num_microbatches = num_microbatches
        self.generation = [0] * num_microbatches
        self.owner: dict[int, int] = {}  # whole micro-batches: the stage-0 member that injected it
        self.route: dict[tuple[int, int], int] = {}  # whole micro-batches: (mb, stage) -> member
        self.work_done: dict[tuple[int, int], float] = {}  # (mb, generation) -> device-seconds
        self.done_times: list[float] = []
        self.num_lost = self.num_restarts = 0
        self.wasted_seconds = 0.0
        self.next_microbatch = 0

    def push(self, time: float, kind: str, *payload: object) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (time, self.sequence, kind, payload))

    def run(self, disconnects: list[tuple[float, int]]) -> float:
        """Runs to the last micro-batch; returns the time it finished, in seconds."""
        if self.config.is_whole_microbatch:
            lanes = self.config.max_inflight or self.runtime.max_in_flight_per_peer
            for _ in range(lanes):
                for owner in self.stages[0].members[: self.stages[0].num_servers]:
                    self.inject(int(owner))
        else:
            for _ in range(self.config.max_inflight or 2 * len(self.stages)):
                self.inject(None)
        for time, device in disconnects:
            self.push(time, "disconnect", device)
        while len(self.done_times) < self.num_microbatches:
            self.time, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"on_{kind}")(*payload)
        return self.time

    def inject(self, owner: int | None) -> None:
        if self.next_microbatch >= self.num_microbatches:
            return
        mb = self.next_microbatch
        self.next_microbatch += 1
        if owner is not None:
            self.owner[mb] = owner
        self.start_stage(mb, self.generation[mb], 0, 0)

    def task_delay(self, device: int, task: tuple) -> float:
        mb, _, k, direction, samples = task
        stage = self.stages[k]
        position = int(np.flatnonzero(stage.members == device)[0])
        per_sample = stage.flops_per_sample * self.work_fraction(k, direction) / self.flops[device]
        per_sample += stage.boundary_bytes * stage.client_per_byte[position]
        overhead = self.config.message_overhead_flops * self.num_messages(k, direction) / self.flops[device]
        return 2.0 * stage.client_latency[position] + samples * per_sample + overhead

    def num_messages(self, k: int, direction: int) -> int:
        """Messages a task of stage ``k`` exchanges with other stages: what it receives, what it sends."""
        last = len(self.stages) - 1
        if self.config.is_fused_last_stage and k == last:
            return 0 if direction == 1 else 2 * (k > 0)  # receives the input, sends its gradient back
        if direction == 0:
            return int(k > 0) + int(k < last)
        return int(k < last) + int(k > 0)

    def work_fraction(self, k: int, direction: int) -> float:
        if self.config.is_fused_last_stage and k == len(self.stages) - 1:
            return 1.0 if direction == 0 else 0.0
        return FORWARD_FRACTION if direction == 0 else 1.0 - FORWARD_FRACTION

    def start_stage(self, mb: int, gen: int, k: int, direction: int) -> None:
        if self.config.is_whole_microbatch:
            self.pending[(mb, gen, k, direction)] = 1
            task = (mb, gen, k, direction, float(self.model.microbatch_size))
            if direction == 0:
                self.route[(mb, k)] = self.choose_member(task)
            self.enqueue(self.route[(mb, k)], task)
            return
        stage = self.stages[k]
        alive = np.array([int(i) not in self.known_down for i in stage.members])
        per_sample = stage.flops_per_sample * self.work_fraction(k, direction) / self.flops[stage.members]
        per_sample = np.maximum(per_sample + stage.boundary_bytes * stage.client_per_byte, 1e-30)
        caps = np.where(alive, np.inf, 0.0)
        _, shares = fill_workload(2.0 * stage.client_latency, per_sample, caps, self.model.microbatch_size)
        chunks = [(int(d), float(w)) for d, w in zip(stage.members, shares) if w > 1e-12]
        self.pending[(mb, gen, k, direction)] = len(chunks)
        for device, samples in chunks:
            self.enqueue(device, (mb, gen, k, direction, samples))

    def choose_member(self, task: tuple) -> int:
        """The live member that would finish ``task`` first.

        At stage 0 the candidates are the server that owns the micro-batch and the stage's
        clients: servers own data and inject their own micro-batches, clients pull from the pool.
        """
        mb, k = task[0], task[2]
        stage = self.stages[k]
        candidates = [int(i) for i in stage.members]
        if k == 0 and self.owner.get(mb) not in self.known_down:
            candidates = [self.owner[mb]] + [int(i) for i in stage.members[stage.num_servers:]]
        alive = [d for d in candidates if d not in self.known_down]
        return min(alive, key=lambda d: (self.backlog(d) + self.task_delay(d, task), d))

    def backlog(self, device: int) -> float:
        """Seconds of work ``device`` holds: the rest of its running task and its queue."""
        seconds = sum(self.task_delay(device, task) for _, _, task in self.queue[device])
        if self.busy[device] is not None:
            seconds += max(0.0, self.busy_since[device] + self.task_delay(device, self.busy[device]) - self.time)
        return seconds

    def enqueue(self, device: int, task: tuple) -> None:
        if device in self.down:  # handed to a device that vanished before anyone noticed
            self.push(max(self.time, self.detect_time[device]), "detect", device, [task])
            return
        priority = (0, 0) if self.config.is_fifo else (1 - task[3], task[0])  # backward first, oldest first
        self.sequence += 1
        heapq.heappush(self.queue[device], (priority, self.sequence, task))
        self.try_start(device)

    def try_start(self, device: int) -> None:
        if self.busy[device] is not None or device in self.down or not self.queue[device]:
            return
        _, _, task = heapq.heappop(self.queue[device])
        self.busy[device], self.busy_since[device] = task, self.time
        self.push(self.time + self.task_delay(device, task), "done", device, self.epoch[device], task)

    def on_done(self, device: int, epoch: int, task: tuple) -> None:
        if epoch != self.epoch[device]:
            return
        self.busy[device] = None
        mb, gen, k, direction, _ = task
        if gen == self.generation[mb]:
            self.work_done[(mb, gen)] = self.work_done.get((mb, gen), 0.0) + self.time - self.busy_since[device]
            key = (mb, gen, k, direction)
            self.pending[key] -= 1
            if self.pending[key] == 0:
                self.finish_stage(mb, gen, k, direction)
        else:  # finished work of a micro-batch that was restarted meanwhile
            self.wasted_seconds += self.time - self.busy_since[device]
        self.try_start(device)

    def finish_stage(self, mb: int, gen: int, k: int, direction: int) -> None:
        last = len(self.stages) - 1
        if direction == 0 and k == last:
            if self.config.is_fused_last_stage:
                self.finish_stage(mb, gen, k, 1)
            else:
                self.start_stage(mb, gen, k, 1)
        elif direction == 1 and k == 0:
            self.done_times.append(self.time)
            self.work_done.pop((mb, gen), None)
            self.inject(self.owner.get(mb))
        else:
            boundary = k if direction == 0 else k - 1
            latency, per_byte = self.links[boundary][2 * direction: 2 * direction + 2]
            layer_end = self.layer_ends[boundary]
            num_bytes = self.model.microbatch_size * self.model.layer_activation_bytes[layer_end - 1]
            lanes = self.link_free[boundary][direction]
            lane = min(range(len(lanes)), key=lanes.__getitem__)
            start = max(self.time, lanes[lane])
            lanes[lane] = start + num_bytes * per_byte * len(lanes)
            target = k + 1 if direction == 0 else k - 1
            self.push(lanes[lane] + latency, "arrive", mb, gen, target, direction)

    def on_arrive(self, mb: int, gen: int, k: int, direction: int) -> None:
        if gen == self.generation[mb]:
            self.start_stage(mb, gen, k, direction)

    def on_disconnect(self, device: int) -> None:
        if device in self.down:
            return
        self.down.add(device)
        self.epoch[device] += 1
        lost = [task for _, _, task in self.queue[device]]
        if self.busy[device] is not None:
            lost.append(self.busy[device])
            self.wasted_seconds += self.time - self.busy_since[device]
        self.queue[device], self.busy[device] = [], None
        self.detect_time[device] = self.time + self.config.failure_detect_delay
        self.push(self.detect_time[device], "detect", device, lost)

    def on_detect(self, device: int, lost: list) -> None:
        self.known_down.add(device)
        for task in lost:
            mb, gen, k, _, _ = task
            if gen != self.generation[mb]:
                continue
            self.num_lost += 1
            if self.config.is_task_pool:
                stage = self.stages[k]
                servers = [int(s) for s in stage.members[: stage.num_servers]]
                target = min(servers, key=lambda s: (len(self.queue[s]) + (self.busy[s] is not None), s))
                if self.config.is_whole_microbatch:
                    self.route[(mb, k)] = target  # its backward follows (the seed recomputes there)
                self.enqueue(target, task)
            else:
                self.wasted_seconds += self.work_done.pop((mb, gen), 0.0)
                self.generation[mb] += 1
                self.num_restarts += 1
                self.start_stage(mb, self.generation[mb], 0, 0)


def simulate_plan(
    snapshot: SwarmSnapshot, plan: Plan, config: SimulationConfig, *, rng: np.random.Generator
) -> SimulationResult:
    """Simulates ``config.num_steps`` steps of ``plan`` on ``snapshot``; churn drawn from ``rng``."""
    if not is_within_memory(snapshot, plan):  # also checks that the plan fits the snapshot
        return SimulationResult(
            throughput=0.0, step_delays=(), num_lost_chunks=0, num_restarts=0, is_within_memory=False
        )
    stages = _build_stage_models(snapshot, plan)
    links = _build_links(snapshot, plan, is_averaging=config.is_averaging)
    layer_ends = [s.layer_end for s in plan.stages]
    period = snapshot.runtime.averaging_period  # a round holds the optimizer only past its period
    averaging = max(max(s.averaging_delay - period, 0.0) for s in stages) if config.is_averaging else 0.0
    d = snapshot.model.num_microbatches
    if not config.is_draining:
        run = _StepRun(snapshot, stages, links, config, num_microbatches=d * config.num_steps, layer_ends=layer_ends)
        run.run([])
        ends = [0.0] + [run.done_times[(i + 1) * d - 1] for i in range(config.num_steps)]
        step_delays = [max(b - a, averaging) for a, b in zip(ends[:-1], ends[1:])]
        steady = step_delays[1:]  # the first step fills the pipeline: a warm-up, as on the real swarm
        return SimulationResult(
            throughput=len(steady) * snapshot.model.batch_size / sum(steady), step_delays=tuple(step_delays),
            num_lost_chunks=0, num_restarts=0,
        )
    unreliable = sorted({int(i) for s in stages for i in s.members} & set(snapshot.unreliable_indices()))
    step_delays = []
    num_lost = num_restarts = 0
    wasted = 0.0
    horizon = None
    for _ in range(config.num_steps):
        run = _StepRun(snapshot, stages, links, config, num_microbatches=d, layer_ends=layer_ends)
        disconnects = []
        for device in unreliable:
            if rng.random() < config.disconnect_probability:
                disconnects.append((float(rng.uniform(0.0, horizon if horizon else 1.0)), device))
        pipeline_delay = run.run(disconnects)
        step_delays.append(pipeline_delay + averaging if config.is_averaging_after_drain else max(pipeline_delay, averaging))
        horizon = pipeline_delay
        num_lost += run.num_lost
        num_restarts += run.num_restarts
        wasted += run.wasted_seconds
    samples = config.num_steps * snapshot.model.batch_size
    return SimulationResult(
        throughput=samples / sum(step_delays), step_delays=tuple(step_delays),
        num_lost_chunks=num_lost, num_restarts=num_restarts, wasted_seconds=wasted,
    )
