"""A swarm's life at internet scale: churn, the live decision rules, and the throughput they give (issue #18).

``planner.simulator`` runs one plan micro-batch by micro-batch; at 10,000 peers for an hour that is
far too slow. This simulator runs at the level of events instead: volunteers arrive and leave
(``offline.internet``'s churn trace), each arrival is placed by the live join rule, peers move by
the live rebalancing rule, a stage nobody holds any more is re-planned away by the live re-planning
rule, and between two events the swarm trains at the rate of its current layout, integrated over
time.

**The rules are the live peer's** (``planner.stage_choice``, ``planner.replanning``):

* join: the stage of largest throughput deficit (``choose_stage``), counting the peers that serve
  and the peers still pulling their state. Kept as running sums per stage here (calling
  ``choose_stage`` on 10,000 members per arrival costs O(n log n) each);
  ``tests/unit/test_lifetime.py`` checks the sums pick what ``choose_stage`` picks at every arrival
  of a small swarm;
* rebalance (mode ``"rebalance"``): every ``rebalance_period_s``, ``choose_move`` on the serving
  peers with ``min_gain``, called as the live peer calls it; the named peer stops serving and pulls
  the new stage's state;
* a stage left with nobody: after ``failure_detect_s``, ``replan_layout`` re-splits the layers over
  the stages still held (the live rescue from a backup keeper is not modelled: the stage is
  re-planned away at once), and the peers whose stage gained layers pull those layers.

Mode ``"even"`` is the bootstrap's even layout with the join rule only. Mode ``"live_global"`` adds
the live global plan rule to it (``planner.offline.live_plan`` says what it models and what not):
every ``global_plan_period`` the swarm plans (``plan_global``) and adopts the plan when
``adoption.decide`` says so, peers the plan leaves idle stand by, and above ``max_planned_peers``
online it does not plan (then it is "even" exactly).

**Pulling state** takes ``stage state bytes / the peer's downlink`` (parameters and the two AdamW
moments; the donors' uplinks are taken as never the bottleneck, which flatters big stages). The
first peer of an empty stage initialises from the run seed at once.

**Throughput** (:func:`fleet_throughput`) is ``planner.costs``' model, term by term, computed
from sums kept per stage and per region instead of per pair, so one evaluation costs
O(stages x regions^2) whatever the swarm's size:

* compute: ``DT_k = m F_k / sum_p f_p`` (whole micro-batches to any replica: ``costs``'
  water-filling with every member a server);
* links: ``costs``' mean ``1 / beta`` over the pairs of two neighbouring stages over
  ``n = min(|S_k|, |S_k+1|)`` streams, with a pair's bandwidth the sender's uplink (exact when no
  receiver's downlink is below a sender's uplink; the internet model's downlinks are 5x the
  uplinks, so only a 10 Mbit/s-up home receiving from a 50+ Mbit/s-up one breaks it), and the
  mean round trip by region pairs plus both ends' access delays;
* window: ``W = max_in_flight x |S_0|`` micro-batches over the round trip (Little's law), whose
  transfers each cross one pair of peers;
* averaging: a stage's round ``AT_k`` (``costs.round_per_byte``), which with every pair at the
  sender's uplink is ``W_k (n - 1) / (the stage's slowest uplink)`` for the gradient exchange every
  step (each replica sends its sum to every other) and ``2 / n`` of that for periodic butterfly
  rounds; its excess over the period (``plan_averaging_period``; 0, the live default, is a gradient exchange every step) is a
  floor of ``excess / d`` per micro-batch while steps overlap, and with a period the round's share of
  the links slows the boundary transfers;
* flush (``is_flushing``, the live default ``--pipeline-schedule flush``): each step drains its
  ``d`` micro-batches and then waits for the slowest stage's excess ``X``:
  ``(max((d - 1) b + R, ceil(d / W) R) + X) / d`` seconds per micro-batch, ``b`` the slowest stage term.

``tests/unit/test_lifetime.py`` checks it equals ``costs.estimate_throughput`` on small swarms
built from the same draws, with and without flushing and averaging.
Memory is not modelled beyond a check that every stage's state fits the smallest device the
internet model draws.

Pure: no clock of its own (``clock``, when given, times the decisions for the bench); the trace
fixes every draw.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from planner.costs import MAX_AVERAGING_SHARE, round_per_byte
from planner.global_plan import GlobalPlanConfig
from planner.offline.internet import MEMORY_GIB, REGIONS, ChurnTrace, region_rtt_seconds
from planner.offline.live_plan import global_plan_step, standby_takes_unheld
from planner.replanning import replan_layout
from planner.snapshot import ModelProfile
from planner.stage_choice import StageMember, choose_move

MODES = ("even", "rebalance", "live_global")
STATE_BYTES_PER_PARAM_BYTE = 3.0  # what a joiner pulls per parameter byte: parameters and two AdamW moments


@dataclass(frozen=True, kw_only=True)
class LifetimeConfig:
    """The runtime's settings the simulation uses (the live defaults)."""

    num_stages: int = 8
    rebalance_period_s: float = 60.0
    min_gain: float = 0.2
    max_in_flight: int = 8  # per stage-0 peer: ``--max-in-flight``'s default (flow control stays at or below it)
    compression_ratio: float = 1.0
    failure_detect_s: float = 10.0
    global_plan_period: float = 300.0  # "live_global": ``--global-plan-period``'s default
    max_planned_peers: int = 256  # "live_global": no plan above this many online (peer.plan_watch.MAX_PLANNED_PEERS)
    plan_min_gain: float = 0.2  # "live_global": planner.adoption.AdoptionConfig's defaults
    plan_horizon_s: float = 1800.0
    plan_averaging_period: float = 0.0  # the stages' averaging period, planned and simulated: 0 is the live default (gradients every step)
    is_flushing: bool = True  # each step drains the pipeline, then the round: ``--pipeline-schedule flush``, the live default
    global_plan: GlobalPlanConfig = field(default_factory=GlobalPlanConfig)


@dataclass
class LifetimeResult:
    """What one simulated lifetime gave."""

    mode: str
    horizon_s: float
    samples: float = 0.0
    joins: int = 0
    leaves: int = 0
    moves: int = 0
    replans: int = 0
    decisions: int = 0
    decision_seconds: float = 0.0  # summed over decisions, when a clock was given
    max_decision_seconds: float = 0.0
    final_stages: int = 0
    final_bounds: dict[str, float] = field(default_factory=dict)  # fleet_bounds at the horizon
    online_min: int = 0  # peers online (serving, pulling state or standing by) after time 0
    online_max: int = 0
    global_plans: int = 0  # "live_global": plans computed and judged
    global_plan_seconds: float = 0.0  # their plan_global + decide time summed, when a clock was given
    max_global_plan_seconds: float = 0.0
    plans_adopted: int = 0
    plan_moves: int = 0  # peers that pulled state to follow an adopted plan
    plans_skipped_too_large: int = 0  # periods with more than max_planned_peers online: no plan
    plans_deferred: int = 0  # periods with a stage unheld or a plan's move still pulling: no proposal
    standby_takeovers: int = 0  # unheld stages a peer standing by took
    standby_max: int = 0  # peers standing by, most at once and at the horizon
    standby_end: int = 0
    last_plan_current: float = 0.0  # the planner's samples/s (its cost model) of the swarm as it ran, last verdict
    last_plan_planned: float = 0.0  # and of the plan

    @property
    def throughput(self) -> float:
        """Mean samples/s over the horizon."""
        return self.samples / self.horizon_s


@dataclass
class _Fleet:
    """Per-stage sums over the peers that serve (not those pulling state)."""

    num_stages: int
    num_regions: int
    count: np.ndarray = field(init=False)
    flops: np.ndarray = field(init=False)
    inverse_uplink: np.ndarray = field(init=False)  # sum of 1 / uplink (s/B), for the pairs' mean 1 / beta
    access: np.ndarray = field(init=False)
    regions: np.ndarray = field(init=False)
    uplinks: list[dict[int, float]] = field(init=False)  # per stage, member -> uplink (the round's slowest)
    _slowest: list[float | None] = field(init=False)  # per stage, the least of uplinks (None: to recompute)

    def __post_init__(self) -> None:
        self.count, self.flops, self.inverse_uplink, self.access = (np.zeros(self.num_stages) for _ in range(4))
        self.regions = np.zeros((self.num_stages, self.num_regions))
        self.uplinks = [{} for _ in range(self.num_stages)]
        self._slowest = [math.inf] * self.num_stages

    def add(self, stage: int, peer: int, trace: ChurnTrace, sign: float = 1.0) -> None:
        v = trace.volunteers
        self.count[stage] += sign
        self.flops[stage] += sign * v.flops[peer]
        self.inverse_uplink[stage] += sign / v.uplink[peer]
        self.access[stage] += sign * v.access_rtt_s[peer]
        self.regions[stage, v.region[peer]] += sign
        uplink, slowest = float(v.uplink[peer]), self._slowest[stage]
        if sign > 0:
            self.uplinks[stage][peer] = uplink
            self._slowest[stage] = None if slowest is None else min(slowest, uplink)
        elif self.uplinks[stage].pop(peer, None) is not None and slowest == uplink:
            self._slowest[stage] = None  # the slowest left: recomputed when next asked

    def slowest_uplink(self, stage: int) -> float:
        """The least uplink among ``stage``'s members (inf with none)."""
        if self._slowest[stage] is None:
            self._slowest[stage] = min(self.uplinks[stage].values(), default=math.inf)
        return self._slowest[stage]

    def averaging_per_byte(self, period: float) -> np.ndarray:
        """Per stage, ``costs.profile_group``'s seconds per parameter byte of a round with every pair
        at the sender's uplink, from ``max_i sum_j 1 / beta_ij = (n - 1) / slowest uplink``
        (``costs.round_per_byte``; 0 for a lone member)."""
        return np.array([round_per_byte((n - 1) / self.slowest_uplink(k), round(n), period) if n >= 1.5 else 0.0
                         for k, n in enumerate(self.count)])


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """What a step costs beyond the pipeline (module docstring): ``param_bytes`` per stage (None: no
    averaging counted), the averaging ``period`` (0: every step), the step's ``num_microbatches``
    ``d`` and whether it drains (``is_flushing``)."""

    param_bytes: np.ndarray | None = None
    period: float = math.inf
    num_microbatches: int = 1
    is_flushing: bool = False


def fleet_bounds(fleet: _Fleet, stage_costs: np.ndarray, boundary_bytes: np.ndarray, region_rtt: np.ndarray,
                 *, microbatch_size: int, max_in_flight: int, step: StepSettings = StepSettings()) -> dict[str, float]:
    """Samples/s each part of ``planner.costs``' model allows the current layout, from per-stage sums
    (module docstring): ``compute`` (the slowest stage's ``m / DT_k``), ``links`` (the slowest
    boundary direction), ``window`` (``W m / R``), ``averaging`` (the largest floor, while steps
    overlap) and, under ``step.is_flushing``, ``flush`` (the drained step's); all 0 while a stage has
    nobody serving. The throughput is the least of them."""
    count, mb = fleet.count, microbatch_size
    if count.min() < 0.5:
        return {"compute": 0.0, "links": 0.0, "window": 0.0}
    excess, share = _averaging_terms(fleet, step)
    floors = np.zeros_like(excess) if step.is_flushing else excess / step.num_microbatches
    compute = mb * stage_costs / fleet.flops  # DT_k: whole micro-batches shared by compute
    links = np.zeros(1)
    round_trip = float((mb * stage_costs * count / fleet.flops).sum())  # on a mean member of every stage
    if fleet.num_stages > 1:  # every boundary k -> k + 1 at once
        streams = np.minimum(count[:-1], count[1:])
        mean_inverse = fleet.inverse_uplink / count
        forward, backward = mean_inverse[:-1] / streams, mean_inverse[1:] / streams  # s/B over n streams
        num_bytes = mb * boundary_bytes / (1.0 - share[:-1])  # the sending stage's round takes its share
        links = np.maximum(forward, backward) * num_bytes
        rtt = (np.einsum("kr,rs,ks->k", fleet.regions[:-1], region_rtt, fleet.regions[1:]) / (count[:-1] * count[1:])
               + fleet.access[:-1] / count[:-1] + fleet.access[1:] / count[1:])
        round_trip += float((rtt + (forward + backward) * streams * num_bytes).sum())  # one pair per micro-batch
    window = max_in_flight * count[0]
    bounds = {"compute": mb / float(compute.max()), "links": mb / float(links.max()) if links.max() > 0 else math.inf,
              "window": float(mb * window / round_trip),
              "averaging": mb / float(floors.max()) if floors.max() > 0 else math.inf}
    if step.is_flushing:
        d, slowest = step.num_microbatches, max(float(compute.max()), float(links.max()), float(floors.max()))
        drained = max((d - 1) * slowest + round_trip, math.ceil(d / window) * round_trip)
        bounds["flush"] = mb * d / (drained + float(excess.max()))
    return bounds


def _averaging_terms(fleet: _Fleet, step: StepSettings) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, how long its round outlasts the period (``max(0, AT_k - P)``) and the share of its
    links the round takes while steps go on (``costs.estimate_averaging_share``; 0 without a period)."""
    if step.param_bytes is None:
        return np.zeros(fleet.num_stages), np.zeros(fleet.num_stages)
    seconds = step.param_bytes * fleet.averaging_per_byte(step.period)
    share = np.minimum(seconds / step.period, MAX_AVERAGING_SHARE) if step.period > 0 else np.zeros(fleet.num_stages)
    return np.maximum(0.0, seconds - step.period), share


def fleet_throughput(fleet: _Fleet, stage_costs: np.ndarray, boundary_bytes: np.ndarray, region_rtt: np.ndarray,
                     *, microbatch_size: int, max_in_flight: int, step: StepSettings = StepSettings()) -> float:
    """Samples/s of the swarm's current layout: ``planner.costs.estimate_throughput`` from per-stage
    sums, the least of :func:`fleet_bounds`."""
    return min(fleet_bounds(fleet, stage_costs, boundary_bytes, region_rtt, microbatch_size=microbatch_size,
                            max_in_flight=max_in_flight, step=step).values())


class _Swarm:
    """The simulated swarm's state: layout, who serves which stage, who pulls state until when."""

    def __init__(self, trace: ChurnTrace, model: ModelProfile, config: LifetimeConfig) -> None:
        self.trace, self.model, self.config = trace, model, config
        self.layers = even_layers(model.num_layers, config.num_stages)
        self.region_rtt = region_rtt_seconds(REGIONS)
        self.serving: dict[int, int] = {}  # peer -> stage
        self.syncing: dict[int, tuple[int, float]] = {}  # peer -> (stage, ready at)
        self.standby: set[int] = set()  # online, serving nothing: a global plan left them idle
        self.check_memory = True  # until a global plan sizes the stages (planner.offline.live_plan)
        self._shape()

    def _shape(self) -> None:
        """Per-stage figures of the current layout, and the sums rebuilt from the peers."""
        model, config = self.model, self.config
        self.stage_costs = np.array([sum(model.layer_flops[a:b]) for a, b in self.layers])
        self.state_bytes = np.array([STATE_BYTES_PER_PARAM_BYTE * sum(model.layer_param_bytes[a:b]) for a, b in self.layers])
        self.boundary_bytes = np.array([model.layer_activation_bytes[b - 1] * config.compression_ratio
                                        for _, b in self.layers[:-1]])
        self.step = StepSettings(param_bytes=self.state_bytes / STATE_BYTES_PER_PARAM_BYTE,
                                 period=config.plan_averaging_period, num_microbatches=model.num_microbatches,
                                 is_flushing=config.is_flushing)
        smallest = min(MEMORY_GIB) * float(1 << 30)
        if self.check_memory and self.state_bytes.max() * (4 / 3) > smallest:  # with gradients: four copies of the parameters
            raise ValueError(f"a stage of {self.state_bytes.max() / 3 / 2**30:.1f} GiB of parameters does not fit "
                             f"a {min(MEMORY_GIB)} GiB device: use more stages")
        self.fleet = _Fleet(len(self.layers), len(REGIONS))
        self.deficit_sums = np.zeros(len(self.layers))  # sum of flops / cost over serving and syncing peers
        self.holders = np.zeros(len(self.layers), dtype=np.int64)  # serving and syncing peers per stage
        for peer, stage in self.serving.items():
            self.fleet.add(stage, peer, self.trace)
        for peer, stage in self._all_stages().items():
            self.deficit_sums[stage] += self.trace.volunteers.flops[peer] / self.stage_costs[stage]
            self.holders[stage] += 1

    def _all_stages(self) -> dict[int, int]:
        return {**self.serving, **{peer: stage for peer, (stage, _) in self.syncing.items()}}

    def bounds(self) -> dict[str, float]:
        return fleet_bounds(self.fleet, self.stage_costs, self.boundary_bytes, self.region_rtt,
                            microbatch_size=self.model.microbatch_size, max_in_flight=self.config.max_in_flight,
                            step=self.step)

    def throughput(self) -> float:
        return min(self.bounds().values())

    def join_stage(self) -> int:
        """``planner.stage_choice.choose_stage`` from the running sums: least deficit sum, lowest index."""
        return int(min(range(len(self.layers)), key=lambda k: (self.deficit_sums[k], k)))

    def place(self, peer: int, stage: int, now: float) -> float | None:
        """Put ``peer`` on ``stage``: serving at once if the stage has nobody, else pulling its state;
        returns when it is ready (None: at once)."""
        self.deficit_sums[stage] += self.trace.volunteers.flops[peer] / self.stage_costs[stage]
        self.holders[stage] += 1
        if self.holders[stage] == 1:
            self.serving[peer] = stage
            self.fleet.add(stage, peer, self.trace)
            return None
        ready = now + float(self.state_bytes[stage] / self.trace.volunteers.downlink[peer])
        self.syncing[peer] = (stage, ready)
        return ready

    def ready(self, peer: int, at: float) -> bool:
        """``peer`` finished pulling (False: it left, moved or was re-planned meanwhile)."""
        entry = self.syncing.get(peer)
        if entry is None or entry[1] != at:
            return False
        del self.syncing[peer]
        self.serving[peer] = entry[0]
        self.fleet.add(entry[0], peer, self.trace)
        return True

    def remove(self, peer: int) -> int | None:
        """``peer`` leaves; returns its stage (None if it had none: standing by, or gone)."""
        self.standby.discard(peer)
        if peer in self.serving:
            stage = self.serving.pop(peer)
            self.fleet.add(stage, peer, self.trace, sign=-1.0)
        elif peer in self.syncing:
            stage = self.syncing.pop(peer)[0]
        else:
            return None
        self.deficit_sums[stage] -= self.trace.volunteers.flops[peer] / self.stage_costs[stage]
        self.holders[stage] -= 1
        return stage

    def members(self, assignment: dict[int, int] | None = None) -> list[StageMember]:
        """The live rules' view of ``assignment`` (peer -> stage; by default the serving peers)."""
        flops = self.trace.volunteers.flops
        return [StageMember(peer_id=f"{peer:06d}", stage=stage, flops=float(flops[peer]))
                for peer, stage in (self.serving if assignment is None else assignment).items()]

    def num_held(self) -> int:
        """Stages somebody serves or pulls."""
        return int(np.count_nonzero(self.holders))

    def replan(self, now: float) -> list[tuple[int, float]]:
        """The live re-planning rule over the stages still held; returns (peer, ready at) of the
        peers that now pull layers their stage gained."""
        everyone = self._all_stages()
        decision = replan_layout(tuple(self.layers), self.model.layer_flops, self.members(everyone))
        if decision is None:
            return []
        gained = [0.0] * len(decision.stage_layers)
        for migration in decision.migrations:
            gained[migration.to_stage] += STATE_BYTES_PER_PARAM_BYTE * self.model.layer_param_bytes[migration.layer]
        self.layers = decision.stage_layers
        remap = {peer: decision.stage_map[stage] for peer, stage in everyone.items()}
        self.serving, self.syncing = {}, {}
        readies = []
        for peer, stage in sorted(remap.items()):
            if gained[stage] > 0:
                ready = now + gained[stage] / float(self.trace.volunteers.downlink[peer])
                self.syncing[peer] = (stage, ready)
                readies.append((peer, ready))
            else:
                self.serving[peer] = stage
        self._shape()
        return readies


def even_layers(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """The bootstrap's even layout (``dht.layouts.even_stage_layers``, which the planner may not import)."""
    bounds = [round(k * num_layers / num_stages) for k in range(num_stages + 1)]
    return tuple((bounds[k], bounds[k + 1]) for k in range(num_stages))


def simulate_lifetime(trace: ChurnTrace, model: ModelProfile, *, mode: str, config: LifetimeConfig | None = None,
                      clock: Callable[[], float] | None = None) -> LifetimeResult:
    """Run ``trace`` through the live rules in ``mode`` ("even", "rebalance" or "live_global"; module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return _Lifetime(trace, model, mode, config or LifetimeConfig(), clock).run()


class _Lifetime:
    """The event loop of :func:`simulate_lifetime`: a heap of (time, sequence, kind, peer)."""

    def __init__(self, trace: ChurnTrace, model: ModelProfile, mode: str, config: LifetimeConfig,
                 clock: Callable[[], float] | None) -> None:
        self.trace, self.config, self.clock = trace, config, clock
        self.swarm = _Swarm(trace, model, config)
        self.result = LifetimeResult(mode=mode, horizon_s=trace.horizon_s, online_min=trace.volunteers.count)
        self.queue: list[tuple[float, int, str, int]] = [(t, i, kind, peer) for i, (t, kind, peer) in enumerate(trace.events())]
        periodic = {"rebalance": config.rebalance_period_s, "live_global": config.global_plan_period}
        if mode in periodic:
            period = periodic[mode]
            self.queue += [(k * period, len(self.queue) + k - 1, mode, -1)
                           for k in range(1, int(trace.horizon_s // period) + 1)]
        self.sequence = len(self.queue)
        heapq.heapify(self.queue)
        self.now, self.replan_pending = 0.0, False
        self.plan_movers: set[int] = set()  # "live_global": the last adopted plan's moving peers

    def run(self) -> LifetimeResult:
        result, swarm, rate = self.result, self.swarm, 0.0
        handlers = {"join": self.on_join, "leave": self.on_leave, "ready": lambda peer: swarm.ready(peer, self.now),
                    "replan": self.on_replan, "rebalance": self.on_rebalance, "live_global": self.on_global_plan}
        while self.queue:
            at, _, kind, peer = heapq.heappop(self.queue)
            if at > self.trace.horizon_s:
                break
            result.samples += float(rate * (at - self.now))
            self.now = at
            handlers[kind](peer)
            rate = swarm.throughput()
            if self.now > 0:  # after the peers present at the start have joined
                online = len(swarm.serving) + len(swarm.syncing) + len(swarm.standby)
                result.online_min, result.online_max = min(result.online_min, online), max(result.online_max, online)
                result.standby_max = max(result.standby_max, len(swarm.standby))
        result.samples += float(rate * (self.trace.horizon_s - self.now))
        result.final_stages = len(swarm.layers)
        result.final_bounds = swarm.bounds()
        result.standby_end = len(swarm.standby)
        return result

    def push(self, at: float, kind: str, peer: int) -> None:
        heapq.heappush(self.queue, (at, self.sequence, kind, peer))
        self.sequence += 1

    def timed(self, decide: Callable[[], object]) -> object:
        """``decide()``, timed by the clock when one was given."""
        if self.clock is None:
            return decide()
        started = self.clock()
        answer = decide()
        seconds = self.clock() - started
        self.result.decisions += 1
        self.result.decision_seconds += seconds
        self.result.max_decision_seconds = max(self.result.max_decision_seconds, seconds)
        return answer

    def on_join(self, peer: int) -> None:
        self.result.joins += 1
        ready = self.swarm.place(peer, self.timed(self.swarm.join_stage), self.now)
        if ready is not None:
            self.push(ready, "ready", peer)

    def on_leave(self, peer: int) -> None:
        self.result.leaves += 1
        swarm = self.swarm
        if swarm.remove(peer) is not None and swarm.num_held() < len(swarm.layers) and not self.replan_pending:
            self.replan_pending = True
            self.push(self.now + self.config.failure_detect_s, "replan", -1)

    def on_replan(self, _: int) -> None:
        self.replan_pending = False
        self.result.standby_takeovers += standby_takes_unheld(self.swarm, self.now)  # none but in "live_global"
        if self.swarm.num_held():
            self.result.replans += len(self.swarm.layers) - self.swarm.num_held()
            for moved, ready in self.swarm.replan(self.now):
                self.push(ready, "ready", moved)

    def on_rebalance(self, _: int) -> None:
        swarm = self.swarm
        move = self.timed(lambda: choose_move(list(swarm.stage_costs), swarm.members(), min_gain=self.config.min_gain))
        if move is not None:
            self.result.moves += 1
            mover = int(move.peer_id)
            swarm.remove(mover)
            self.push(swarm.place(mover, move.to_stage, self.now) or self.now, "ready", mover)

    def on_global_plan(self, _: int) -> None:
        step, result = global_plan_step(self.swarm, self.now, self.plan_movers, self.clock), self.result
        if step.outcome in ("too_large", "deferred"):
            result.plans_skipped_too_large += step.outcome == "too_large"
            result.plans_deferred += step.outcome == "deferred"
            return
        result.global_plans += 1
        result.plans_adopted += step.outcome == "adopted"
        result.plan_moves += len(step.readies)
        result.global_plan_seconds += step.seconds
        result.max_global_plan_seconds = max(result.max_global_plan_seconds, step.seconds)
        result.last_plan_current, result.last_plan_planned = step.current, step.planned
        for moved, ready in step.readies:
            self.push(ready, "ready", moved)
