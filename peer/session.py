"""One stage at a time: the services a peer runs while it serves one stage, opened and closed together.

A :class:`StageSession` opens, in order, the stage server, the gradient exchange with co-replicas,
the replication server (joiners pull the stage from it), membership notices, the failure detector,
the averager and (on stage 0) the trainer, plus the watches that decide when the peer must go
elsewhere. :meth:`StageSession.serve` runs them until the peer stops or a watch names the peer's
next transition:

- a :class:`~planner.stage_choice.StageMove` (``--rebalance-period``: moving this peer raises the
  swarm's bottleneck throughput by ``--rebalance-min-gain``),
- a :class:`~planner.backup_plan.Rescue` (a stage lost its last holder and this peer is the one to take it),
- a :class:`~peer.relayout.LayoutChange` (the swarm re-plans its layer split without a lost stage,
  or moves to a global plan: this peer's, ``peer.plan_adoption``, or one it follows).

:meth:`StageSession.close` announces the leave, lets in-flight microbatches finish, writes the last
checkpoint and shuts every service down in the reverse order of opening. ``async with`` closes it
however the block ends.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time

import torch

from dht.records import PeerRecord, RunSpec
from peer.backup import RescueWatch
from peer.checkpoint import WriteProgress, checkpoint_path, save_checkpoint
from peer.context import PeerContext, SessionHost
from peer.faults import inject_corrupt_shards, inject_wrong_outputs
from peer.heartbeat import Heartbeat
from peer.membership_events import MembershipEvents
from peer.plan_adoption import judge_proposal, proposed_change, seconds_to_check, turn_members
from peer.plan_watch import GlobalPlanWatch
from peer.profiler import MIB
from peer.rebalance import RebalanceWatch
from peer.relayout import wait_layout_change
from peer.status.snapshot import ServiceCounters
from peer.transitions import Transition
from planner.adoption import AdoptionConfig
from planner.backup_plan import Rescue
from planner.stage_choice import StageMove
from replication.server import ReplicationServer
from swarm.averaging import StageAverager
from swarm.data import TokenSampler, data_seed
from swarm.failure_detector import FailureDetector
from swarm.flow_control import FlowWindow
from swarm.gradient_sync import GradientSync
from swarm.membership import MembershipNotices, membership_handler
from swarm.model import stage_flops_per_sample
from swarm.plausibility import optimizer_steps
from swarm.router import Router
from swarm.spot_check import SpotChecker
from swarm.stage import Stage
from swarm.admission import Admission
from swarm.stage_server import StageServer
from swarm.subspace import stage_boundary_codec
from swarm.task_pool import MicrobatchLedger
from swarm.trainer import Trainer

logger = logging.getLogger(__name__)
LEAVE_TIMEOUT = 10.0
GRADIENT_SYNC_TIMEOUT = 10.0  # seconds a replica waits for a silent co-replica's gradients before stepping without
PAUSE_FILE_PERIOD = 0.5
FIRST_STATUS_AFTER = 1.0  # seconds from the start of training to the first status line (then every --status-period)
# before a rescue, the stage's last holders are pinged this many times, each answer awaited this long:
# generous, as the link to a live holder whose record went missing may be slow (1 Mbit/s in the e2e test)
RESCUE_CHECK_ATTEMPTS = 2
RESCUE_CHECK_TIMEOUT = 2.0

class StageSession:
    """The services of one stage a peer serves; see the module docstring.

    Args:
        ctx: what the peer holds across sessions.
        spec: the run spec under the layout this stage belongs to.
        stage: the stage, its state already loaded.
        host: the peer (its state, memory budget, record).
    """

    def __init__(self, ctx: PeerContext, spec: RunSpec, stage: Stage, host: SessionHost) -> None:
        self.ctx, self.spec, self.stage, self.host = ctx, spec, stage, host
        self.router: Router | None = None  # to the next stage (None on the last)
        self.server: StageServer | None = None
        self.gradient_sync: GradientSync | None = None
        self.replication: ReplicationServer | None = None
        self.notices: MembershipNotices | None = None
        self.detector: FailureDetector | None = None
        self.averager: StageAverager | None = None
        self.trainer: Trainer | None = None
        self.watch: RescueWatch | None = None  # read by a layout change after the session closed
        self.checkpoint_progress: WriteProgress | None = None
        self.events = MembershipEvents(ctx.view, ctx.metrics)
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()  # the session's tasks stop when set
        self._opened = self._closed = False

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> StageSession:
        try:
            await self.open()
        except BaseException:
            await self.close(announce=False)  # what did start stops again
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._closed:
            await self.close(announce=True)

    # --- open, serve, close -------------------------------------------------------------------

    async def open(self) -> None:
        """Start the stage's services (they answer requests from now on)."""
        ctx, spec, stage = self.ctx, self.spec, self.stage
        config = ctx.config
        max_payload = int(config.max_payload_mb * MIB)
        replay = config.recovery == "replay"
        if "wrong_outputs" in ctx.faults:
            inject_wrong_outputs(stage)
        if not stage.is_last:
            self.router = self.events.router = self._open_router(max_payload, replay)
        self.server = StageServer(ctx.p2p, stage, peer_id=ctx.peer_id, router=self.router,
                                  request_timeout=config.request_timeout, max_payload_bytes=max_payload, links=ctx.links,
                                  on_microbatch=self._on_microbatch, on_event=self._on_stage_event,
                                  ledger=MicrobatchLedger() if replay else None, reputation=ctx.reputation,
                                  admission=Admission(ctx.view, stage.index, max_per_second=config.max_forwards_per_peer,
                                                      reputation=ctx.reputation, clock=ctx.clock))
        await self.server.start()
        if spec.replica_sync == "gradients":
            self.gradient_sync = GradientSync(ctx.p2p, ctx.view, stage, peer_id=ctx.peer_id,
                                              timeout=min(config.request_timeout, GRADIENT_SYNC_TIMEOUT),
                                              max_payload_bytes=max_payload, aggregation=config.aggregation,
                                              on_event=self._on_stage_event,
                                              links=ctx.links, striped=config.stripe_calls == "auto", clock=ctx.clock)
            await self.gradient_sync.start()
        self.replication = ReplicationServer(ctx.p2p, run_id=spec.namespace, stage=stage.index,
                                             snapshot_fn=self._serving_snapshot, request_timeout=config.request_timeout,
                                             backup_fn=ctx.keeper.backup_fn,
                                             on_served=self._served)
        if "corrupt_shards" in ctx.faults:
            inject_corrupt_shards(self.replication)
        await self.replication.start()
        events = self.events
        self.notices = events.notices = MembershipNotices(ctx.p2p, ctx.view, run_id=spec.run_id, peer_id=ctx.peer_id,
                                                          on_notice=events.on_notice, on_rumour=events.on_rumour,
                                                          reputation=ctx.reputation, clock=ctx.clock)
        await self.notices.start()
        self.detector = events.detector = FailureDetector(ctx.p2p, ctx.view, peer_id=ctx.peer_id, stage=stage.index,
                                                          handler=membership_handler(spec.run_id),
                                                          on_down=events.peer_down, on_link=events.on_link, links=ctx.links,
                                                          clock=ctx.clock)
        ctx.view.on_change = events.on_view_change
        ctx.view.vouch = self.detector.vouches_for  # a neighbour that answers keeps its place if its record lapses
        self.averager = StageAverager(stage, ctx.dht, ctx.view, client_mode=ctx.role == "unreliable" or config.client_mode,
                                      aggregation=config.aggregation, on_round=self._on_round, reputation=ctx.reputation,
                                      clock=ctx.clock,
                                      # a round's reduce refused (NaN/Inf) or out-voted parts (swarm/robust_allreduce.py)
                                      on_outliers=lambda report: self._on_stage_event("averaging_outliers", **report),
                                      on_discard=lambda at, size, members: self._on_stage_event(
                                          "averaging_dropped", at=at, group_size=size, num_members=members))
        self.detector.busy_since = self.averager.exchanged_since  # no silence verdicts across its own rounds
        self.averager.loaded_from(stage.loaded_from, ctx.clock.dht_time())
        stage.loaded_from = ()  # once: a later session of this replica shares its state with nobody yet
        if stage.is_first:
            self.trainer = self._new_trainer(replay)
        ctx.view.start()
        self._opened = True

    def _open_router(self, max_payload: int, replay: bool) -> Router:
        ctx, spec, config, index = self.ctx, self.spec, self.ctx.config, self.stage.index
        checker = SpotChecker(ctx.p2p, run_id=spec.namespace, fraction=config.spot_check_fraction,
                              tolerance=config.spot_check_tolerance, rng=random.Random(f"spot:{spec.seed}:{ctx.peer_id}"),
                              timeout=config.request_timeout, max_payload_bytes=max_payload,
                              reputation=ctx.reputation, on_event=self._on_stage_event, seq_len=spec.model.seq_len)
        return Router(ctx.p2p, ctx.view, run_id=spec.namespace, next_stage=index + 1,
                      next_stage_flops=stage_flops_per_sample(spec, index + 1),
                      request_timeout=config.request_timeout, max_payload_bytes=max_payload,
                      rng=random.Random(f"{spec.seed}:{ctx.peer_id}"), sticky=replay,
                      max_attempts=3 if replay else 1, reputation=ctx.reputation, spot_checker=checker, clock=ctx.clock,
                      links=ctx.links, codec=stage_boundary_codec(spec), striped=config.stripe_calls == "auto")

    def _new_trainer(self, replay: bool) -> Trainer:
        ctx, spec, config, stage = self.ctx, self.spec, self.ctx.config, self.stage
        sampler = TokenSampler(ctx.tokens, seq_len=spec.model.seq_len, seed=data_seed(spec.seed, ctx.peer_id))
        return Trainer(stage, sampler, self.router, peer_id=ctx.peer_id,
                       max_in_flight=config.max_in_flight, on_microbatch=self._on_microbatch,
                       on_event=self._on_stage_event, sticky=replay, eval_every=config.eval_every,
                       heldout=sampler.heldout_batches(config.eval_sequences, spec.microbatch_size),
                       batch_slots=self.gradient_sync and self.gradient_sync.slots,
                       flow=FlowWindow(max_window=config.max_in_flight, clock=ctx.clock) if config.flow_control == "auto" else None,
                       stage_flops=[stage_flops_per_sample(spec, k) for k in range(spec.num_stages)], clock=ctx.clock)

    async def serve(self, stop: asyncio.Event) -> Transition | None:
        """Train until ``stop`` is set (the peer sets it at ``--run-for`` too); returns the transition a watch
        named, or None. A task that fails raises here."""
        ctx, config, stop_tasks = self.ctx, self.ctx.config, self._stop
        self._spawn("heartbeat", self._heartbeat_loop())
        self._spawn("averaging", self.averager.run(stop_tasks))
        self._spawn("status", self._status_loop())
        self._spawn("failure-detector", self.detector.run(stop_tasks))
        if self.trainer is not None:
            self._spawn("trainer", self.trainer.run(stop_tasks))
        if config.pause_file:
            self._spawn("pause-file", self._pause_file_loop())
        if config.checkpoint_dir:
            self._spawn("checkpoint", self._checkpoint_loop())
        if config.backup_period > 0:
            self._spawn("backup", ctx.keeper.run(stop_tasks))
        watches = []
        if config.global_plan_period > 0:  # the lowest rank: any other transition outranks a proposal
            period = config.global_plan_period
            plans = GlobalPlanWatch(ctx.view, self.spec, period=period, metrics=ctx.metrics,
                                    max_in_flight=config.max_in_flight, clock=ctx.clock,
                                    adoption=AdoptionConfig(min_gain=config.global_plan_min_gain),
                                    next_check=lambda: seconds_to_check(turn_members(ctx.view, ctx.peer_id),
                                                                        ctx.peer_id, ctx.clock.dht_time(), period))
            since = ctx.clock.dht_time()  # this session serves the layout from now on
            propose = None if config.stage >= 0 else lambda adoption: proposed_change(  # a pinned peer never moves
                adoption, ctx.view, self.spec, ctx.base_spec, peer_id=ctx.peer_id, now=ctx.clock.dht_time(),
                period=period, layout_since=since)
            watches.append(self._spawn("global-plan", plans.run(stop_tasks, propose=propose)))
        if config.rebalance_period > 0 and config.stage < 0:  # a peer pinned with --stage stays
            rebalance = RebalanceWatch(ctx.view, self.spec, peer_id=ctx.peer_id, period=config.rebalance_period,
                                       min_gain=config.rebalance_min_gain, on_check=self._rebalance_checked, clock=ctx.clock)
            watches.append(self._spawn("rebalance", rebalance.wait(self.host.is_training, self.host.check_memory)))
        self.watch = RescueWatch(ctx.view, self.spec, peer_id=ctx.peer_id, settle=config.heartbeat_ttl / 2, clock=ctx.clock,
                                 rng=random.Random(f"rescue:{ctx.peer_id}"), pinned=config.stage >= 0)
        watches.append(self._spawn("rescue", self.watch.wait_verified_rescue(self._answers_ping,
                                                                            on_skipped=self._rescue_skipped)))
        watches.append(self._spawn("layout", wait_layout_change(
            ctx.view, self.spec, ctx.base_spec, self.watch, peer_id=ctx.peer_id, stage=self.stage.index,
            replan_after=config.replan_after, is_working=self.host.is_working,
            is_answering=self._answers_ping, max_in_flight=config.max_in_flight, clock=ctx.clock,
            judge=self._judge_plan)))
        await self._wait_stop(stop)
        stop_tasks.set()
        for watch in reversed(watches):  # a layout change outranks a rescue, a rescue a rebalance
            if watch.done() and not watch.cancelled():
                return watch.result()
        return None

    async def _judge_plan(self, record: PeerRecord) -> str:
        """Whether this peer follows the global plan ``record`` proposes ("" if so; ``peer.plan_adoption``)."""
        return await asyncio.to_thread(judge_proposal, record, self.ctx.view, self.spec, self.ctx.base_spec,
                                       max_in_flight=self.ctx.config.max_in_flight, pinned=self.ctx.config.stage >= 0)

    async def close(self, *, announce: bool, keep_state: bool = False) -> dict[str, torch.Tensor] | None:
        """Stop serving the stage: tell the neighbours (``announce``), let in-flight microbatches
        finish, write the last checkpoint, then shut the services down. With ``keep_state``, returns
        the stage's state as it is once the in-flight work is done."""
        self._closed = True
        marks = [time.monotonic()]  # the phases' ends, for the closing line
        if announce and self._opened:
            await self._announce_leave()
        marks.append(time.monotonic())
        self._stop.set()
        self.ctx.view.vouch = lambda peer_id: False
        for task in self._tasks:
            if task.get_name() != "trainer":
                task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=LEAVE_TIMEOUT)  # the trainer finishes its in-flight work
            for task in self._tasks:
                task.cancel()
        marks.append(time.monotonic())
        if self.ctx.config.checkpoint_dir and self._opened:
            try:  # the in-flight work is done: the state is whole
                await self.write_checkpoint()
            except Exception as e:
                logger.warning(f"could not write the last checkpoint: {e!r}")
        kept = None
        if keep_state:
            await self.stage.wait_step_done()
            kept = await self.stage.run(self.stage.state_tensors)
        marks.append(time.monotonic())
        closers = [service.shutdown() for service in (self.replication, self.notices, self.router and self.router.spot_checker)
                   if service is not None]
        if self.server is not None:
            closers.append(self.server.stop(timeout=LEAVE_TIMEOUT))  # no request may reach a stage being shut down
        if self.gradient_sync is not None:
            closers.append(self.gradient_sync.stop())
        # each removes its handlers from the p2p daemon: a stuck daemon must not hang a leave, and the
        # services close side by side, so a leave waits LEAVE_TIMEOUT at most for all of them
        if closers:
            done, pending = await asyncio.wait([asyncio.ensure_future(closer) for closer in closers], timeout=LEAVE_TIMEOUT)
            for task in pending:
                task.cancel()
            if pending:
                logger.warning(f"{len(pending)} service(s) of stage {self.stage.index} did not shut down within {LEAVE_TIMEOUT:.0f} s")
            for task in done:
                if task.exception() is not None:
                    logger.warning(f"a service of stage {self.stage.index} failed to shut down: {task.exception()!r}")
        if self.averager is not None:
            self.averager.shutdown()
        self.stage.shutdown()
        self._tasks = []
        marks.append(time.monotonic())
        phases = ", ".join(f"{name} {b - a:.1f} s" for name, a, b in zip(("notices", "in-flight work", "checkpoint", "services"), marks, marks[1:]))
        logger.info(f"closed stage {self.stage.index} in {marks[-1] - marks[0]:.1f} s ({phases})")
        return kept

    async def _announce_leave(self) -> None:
        self.host.leaving()
        self.server.stop_accepting()  # upstream peers re-send to another replica from now on
        try:
            self.ctx.metrics.write("leave_announced", peers=await self.notices.announce_leave())
        except Exception as e:
            logger.debug(f"could not send leave notices: {e!r}")
        try:
            await asyncio.wait_for(self.host.heartbeat(), timeout=2.0)
        except Exception as e:
            logger.debug(f"could not announce the leave: {e!r}")

    def _spawn(self, name: str, coro) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def _wait_stop(self, stop: asyncio.Event) -> None:
        waiter = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([waiter, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        for task in done:
            if task is not waiter and task.exception() is not None:
                raise task.exception()

    # --- what the peer reads ------------------------------------------------------------------

    def set_paused(self, paused: bool) -> None:
        """Take no new work (in-flight microbatches finish), or take it again."""
        for worker in (self.trainer, self.server):
            if worker is not None:
                worker.is_paused = paused

    @property
    def val_loss(self) -> float:
        return self.trainer.last_val_loss if self.trainer is not None else math.nan

    def counters(self) -> ServiceCounters:
        """The services' counters now, for the peer's snapshot."""
        server, router, trainer, averager, sync = self.server, self.router, self.trainer, self.averager, self.gradient_sync
        checker = router.spot_checker if router is not None else None
        return ServiceCounters(
            held_graphs=self.stage.num_held_graphs,
            requests_in_progress=server.num_active if server is not None else 0,
            in_flight_to_next_stage=sum(router.in_flight.values()) if router is not None else 0,
            averaging_rounds=averager.num_rounds if averager is not None else 0,
            averaging_failures=averager.num_failed_rounds if averager is not None else 0,
            route_failures=router.num_failures if router is not None else 0,
            unrouted=trainer.num_unrouted if trainer is not None else 0,
            refused=sum(s.num_refused for s in (server, self.notices, self.replication) if s is not None),
            spot_checks=dict(checker.num_checks) if checker is not None else {},
            exchanges=sync.num_exchanges if sync is not None else 0,
            exchanges_partial=sync.num_partial if sync is not None else 0,
            exchanges_alone=sync.num_alone if sync is not None else 0,
        )

    # --- the session's loops ------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        config = self.ctx.config
        await Heartbeat(self.host.heartbeat, period=config.heartbeat_period, ttl=config.heartbeat_ttl, clock=self.ctx.clock,
                        rng=random.Random(f"heartbeat:{self.ctx.peer_id}")).run(self._stop)

    async def _status_loop(self) -> None:
        """A log line and a ``status`` event every ``--status-period`` seconds, the first one sooner
        (FIRST_STATUS_AFTER): whoever watches the log or the events learns at once that it trains."""
        view, spec, config = self.ctx.view, self.spec, self.ctx.config
        last_samples, last_time = 0, self.ctx.clock()
        period = min(FIRST_STATUS_AFTER, config.status_period)
        while not self._stop.is_set():
            await asyncio.sleep(period)
            period = config.status_period
            counters, now = self.stage.counters, self.ctx.clock()
            tokens_per_s = (counters.num_samples - last_samples) * spec.model.seq_len / (now - last_time)
            last_samples, last_time = counters.num_samples, now
            per_stage = [len(view.members(k)) for k in range(spec.num_stages)]
            logger.info(f"loss {counters.last_loss:.3f} | {tokens_per_s:,.0f} tok/s | {counters.num_samples} samples "
                        f"| peers per stage {per_stage}")
            sync = self.gradient_sync
            exchanges = {} if sync is None else {"exchanges": sync.num_exchanges, "exchanges_partial": sync.num_partial,
                                                 "exchanges_alone": sync.num_alone, "reconciled": sync.num_reconciled}
            if self.router is not None:
                exchanges["striped_calls"] = self.router.num_striped
            self.ctx.metrics.write("status", stage=self.stage.index, step=self.stage.version, loss=counters.last_loss,
                                   tokens_per_s=tokens_per_s, samples=counters.num_samples, peers_per_stage=per_stage,
                                   **exchanges)

    async def _pause_file_loop(self) -> None:
        """--pause-file: creating the file pauses, deleting it resumes (SIGUSR1 still toggles in between)."""
        existed = False
        while not self._stop.is_set():
            exists = os.path.exists(self.ctx.config.pause_file)
            if exists != existed and exists != self.host.is_paused() and self.host.is_working():
                self.host.toggle_pause()
            existed = exists
            await asyncio.sleep(PAUSE_FILE_PERIOD)

    async def write_checkpoint(self) -> None:
        """This stage's state to ``--checkpoint-dir``, atomically (a crash keeps the previous one)."""
        started, stage, spec = self.ctx.clock(), self.stage, self.spec
        state = await stage.run(stage.state_tensors)
        version = int(state["counters.num_steps"])  # the state's own step: the stage may step while this writes
        path = checkpoint_path(self.ctx.config.checkpoint_dir, spec.namespace, stage.index)
        self.checkpoint_progress = WriteProgress()
        await asyncio.to_thread(save_checkpoint, path, state, spec=spec, stage=stage.index, version=version,
                                progress=self.checkpoint_progress)
        seconds = self.ctx.clock() - started
        logger.info(f"checkpoint of stage {stage.index} step {version} written to {path} in {seconds:.2f} s")
        self.ctx.metrics.write("checkpoint", stage=stage.index, version=version, seconds=seconds,
                               bytes=path.stat().st_size, path=str(path))

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ctx.config.checkpoint_period)
            try:
                await self.write_checkpoint()
            except OSError as e:  # a full or read-only disk must not stop training
                logger.warning(f"could not write a checkpoint: {e}")

    def _rebalance_checked(self, move: StageMove | None) -> None:
        self.ctx.metrics.write("rebalance_checked", stage=self.stage.index, mover=move.peer_id if move else None)

    # --- what the services tell the session ---------------------------------------------------

    async def _serving_snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """What this peer serves to joiners: the state of its last averaging round, which every replica
        holds bit-identical (several donors serve one manifest); before any round, or alone (no round
        refreshes the snapshot; its backup keeper must not copy a stale one), its current state."""
        alone = not [r for r in self.ctx.view.members(self.stage.index) if r.peer_id != self.ctx.peer_id]
        if self.stage.snapshot is not None and not alone:
            version, state = self.stage.snapshot
        else:
            state = await self.stage.run(self.stage.state_tensors)
            version = int(state.pop("counters.num_steps"))  # the version this state has, not a later step
        if self.averager is not None:  # whoever downloads it shares this state with this replica (the pair check)
            self.averager.anchors.serving(version, optimizer_steps(state))
        return version, state

    def _served(self, peer_id: str, version: int) -> None:
        if self.averager is not None:
            self.averager.anchors.served(peer_id, version)

    async def _answers_ping(self, peer_id: str) -> bool:
        """Does ``peer_id`` answer a ping? (asked of a stage's last holders before rescuing it)"""
        for _ in range(RESCUE_CHECK_ATTEMPTS):
            if self.detector is not None and await self.detector.check(peer_id, timeout=RESCUE_CHECK_TIMEOUT):
                return True
        return False

    def _rescue_skipped(self, rescue: Rescue, answering: list[str]) -> None:
        logger.info(f"stage {rescue.to_stage} looks unheld, but its holder {answering[0][-6:]} answers a ping: "
                    "not rescuing it (its record is missing from this peer's view, not the peer)")
        self.ctx.metrics.write("rescue_skipped", stage=rescue.to_stage, from_stage=rescue.from_stage,
                               answering=answering)

    def _on_microbatch(self, event: dict) -> None:
        self.ctx.metrics.write("microbatch", stage=self.stage.index, **event)

    def _on_stage_event(self, event: str, **fields) -> None:
        self.ctx.metrics.write(event, stage=self.stage.index, **fields)

    def _on_round(self, at: float, group_size: int, digest: str) -> None:
        self.host.averaged(at, digest)
        self.ctx.metrics.write("averaged", stage=self.stage.index, at=at, group_size=group_size, digest=digest)

