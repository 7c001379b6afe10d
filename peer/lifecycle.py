"""A peer's life: join → measure → negotiate a stage → obtain its state → train (→ move) → leave.

While it trains, a peer checks every ``--rebalance-period`` seconds whether moving one peer to the
bottleneck stage would raise the swarm's throughput by ``--rebalance-min-gain`` or more
(``planner.stage_choice.choose_move``); every peer computes the same move from the same records,
and only the peer it names moves: it leaves its stage like a leaving peer, pulls the new stage's
state from its holders, and trains there. No other peer reloads anything.

A stage held by a single peer is backed up on a peer of the next stage (``peer.backup``, seed 001
§3.4); when a stage loses its last holder, the peer ``planner.backup_plan.choose_rescues`` names moves
there the same way and loads the backup, whatever ``--rebalance-period`` says (never a peer pinned
with ``--stage``). When no peer can spare it, the peers re-plan the layout without the stage after
``--replan-after`` seconds (``peer.relayout``): every peer moves to a new stage numbering and
builds its new stage from its own state, its old neighbours' and the lost stage's backup.

The composition root (DESIGN §1 steps 1–4, 6 and 9): :meth:`Peer.run` reads top to bottom:
join → loop (open a :class:`~peer.session.StageSession`, serve, make the transition it names) →
leave. The session wires one stage's services together; :mod:`peer.state_sources` says where a
stage's state comes from; the peer publishes a :class:`~peer.status.snapshot.PeerSnapshot` about once
a second, which is all its windows (page, terminal, ``/metrics``, status protocol) read.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import torch

from dht.layouts import STANDBY
from dht.records import PeerRecord, RunSpec
from dht.clock import SYSTEM_CLOCK, Clock
from dht.registry import declare_peer
from dht.reputation import Reputation
from dht.wire import TRAFFIC, UPLOAD_LIMIT
from peer.backup import HOLDER_STATES, BackupKeeper, RescueWatch
from peer.checkpoint import newest_checkpoint_layout
from peer.config import PeerConfig
from peer.entry import stop_or_after
from peer.errors import UserError
from peer.event_log import EventLog
from peer.faults import inject_bad_updates, inject_slow_device, read_faults
from peer.join import bootstrap_peer_ids, fetch_spec, negotiate_stage
from peer.profiler import measure_flops, resolve_device, stage_memory_budget
from peer.reachability import join_swarm
from peer.model_sample import SampleLoop, gather_for_peer
from peer.relayout import Handoff, LayoutChange, joiner_layout
from peer.standby import stand_by
from peer.context import PeerContext
from peer.session import StageSession
from peer.state_sources import StateLoader
from peer.self_report import peer_record, peer_snapshot
from peer.status.local import StatusHistory, local_status, sample_of
from peer.status.protocol import StatusProtocol
from peer.status.service import StatusSource, open_status
from peer.status.snapshot import PeerState
from peer.training_data import TrainingData, load_run_corpus
from peer.transitions import announce_transition, compose_stage, report_relayout
from planner.backup_plan import Rescue
from planner.stage_choice import StageMove
from swarm.stage import Stage
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
SNAPSHOT_PERIOD = 1.0  # seconds between the snapshots the peer's windows read


class Peer:
    """One volunteer peer. ``await peer.run(stop)`` trains until ``stop`` is set, then leaves."""

    def __init__(self, config: PeerConfig, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config, self.clock = config, clock
        self.role = config.resolved_role
        self.metrics = EventLog(config.metrics_file)
        self.state = PeerState.JOINING
        self.dht = self.validator = self.p2p = self.node = None
        self.ctx: PeerContext | None = None  # from the join on: what every stage session shares
        self.spec: RunSpec | None = None  # under the layout this peer trains under (peer.relayout)
        self.base_spec: RunSpec | None = None  # as the run published it
        self.view: SwarmView | None = None
        self.stage: Stage | None = None  # None while it stands by (peer.standby)
        self.device: torch.device | None = None  # where its stages compute, from the join on
        self.session: StageSession | None = None  # the services of the stage it serves, while it serves it
        self.loader: StateLoader | None = None
        self.keeper: BackupKeeper | None = None  # the backup of another stage it may keep, across moves
        self.status_protocol: StatusProtocol | None = None  # /murmuration/status/1.0.0 for any libp2p client
        self.data: TrainingData | None = None  # the run's tokenizer and data, from the join on
        self._handoffs: list[Handoff] = []  # old layouts' states this peer still serves
        self.reputation = None if config.ban_strikes == 0 else Reputation(
            max_strikes=config.ban_strikes, ban_seconds=config.ban_seconds,
            on_ban=lambda peer_id, reason: self.metrics.write("banned", peer_id=peer_id, reason=reason))
        self.faults: dict[str, str] = {}  # test-only misbehaviour (peer/faults.py)
        self.peer_id = ""
        self.maddrs: tuple[str, ...] = ()
        self.flops = 0.0
        self.announced_at = 0.0
        self.averaged_round = (0.0, "")  # the stage's last averaging round: when, and the digest it reached
        self.started_at = time.monotonic()
        self.history: StatusHistory | None = None  # recent counters: the rates and plots of the windows
        self.checkpoint_progress = None  # the last (or current) checkpoint write's, across sessions
        self.layout_change: LayoutChange | None = None  # how the current layout derives from the one before
        self.memory_budget = 0  # bytes this peer may use for a stage, set by the first memory check
        self.snapshot = peer_snapshot(self)  # what its windows show (peer.status)
        self.samples = SampleLoop(lambda: gather_for_peer(self), period=config.sample_period)  # --sample-period

    def log_prefix(self) -> str:
        stage = f" stage {self.stage.index} step {self.stage.version}" if self.stage else ""
        return f"[peer {self.peer_id[-6:] or '......'}{stage}] "

    async def run(self, stop: asyncio.Event) -> None:
        config = self.config
        source = StatusSource(run_id=config.run_id, spec=lambda: self.spec,
                              records=lambda: list(self.view.records) if self.view is not None else [],
                              snapshot=lambda: self.snapshot, history=lambda: self.history, sample=self.samples.document)
        status = open_status(source, host=config.status_host, port=config.status_port, quiet=config.quiet,
                             terminal_view=config.terminal_view, verbose=config.verbose, view_period=config.status_period)
        await status.start()  # health page, /metrics, terminal view: from joining to leaving
        tasks = (asyncio.create_task(self._snapshot_loop(), name="snapshot"),
                 asyncio.create_task(self.samples.run(stop, lambda: self.spec if self.is_training() else None), name="samples"))
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self.toggle_pause)
        try:
            await self._join()
            await self._train(stop)
        finally:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)
            await self._leave()
            for task in tasks:
                task.cancel()
            await status.shutdown()

    # --- join ---------------------------------------------------------------------------------

    async def _join(self) -> None:
        config = self.config
        self.faults = read_faults()
        if self.faults:
            logger.warning(f"test-only fault injection: this peer will misbehave ({', '.join(sorted(self.faults))})")
        UPLOAD_LIMIT.configure(config.max_upload_mbps * 1e6 / 8)
        self.node = await join_swarm(config)  # a dial-back check decides how others reach it (peer.reachability)
        self.dht, self.validator, self.maddrs, config = self.node.dht, self.node.validator, self.node.maddrs, self.node.config
        self.config, self.role, self.peer_id = config, config.resolved_role, self.dht.peer_id.to_base58()
        self.spec = self.base_spec = await fetch_spec(self.dht, config.run_id, timeout=config.join_timeout,
                                                      owner=config.run_owner, bootstraps=bootstrap_peer_ids(config.bootstrap))
        logger.info(f"run spec: {self.spec.describe()}")
        self.history = StatusHistory(seq_len=self.spec.model.seq_len)
        corpus = load_run_corpus(self.spec, config)  # before choosing a stage: a data mistake is the user's to fix
        self.device = device = resolve_device(config.device)
        self.flops = await asyncio.to_thread(measure_flops, self.spec, device)
        logger.info(f"measured {self.flops / 1e9:.2f} GFLOP/s on {device}")
        self.view = SwarmView(self.dht, self.spec.run_id, clock=self.clock)
        await self.view.refresh()
        self.p2p = await self.dht.replicate_p2p()  # the run's tokenizer may come from the swarm
        await self.node.serve(self.p2p, self.view, lambda: self.stage.index if self.stage else -1, metrics=self.metrics)
        self.data = await TrainingData.open(self.p2p, self.spec, self.view, corpus, config=config, peer_id=self.peer_id)
        self.spec = self._layout_to_join()
        self.announced_at = self.clock.dht_time()
        stage_index, snapshot = await self._choose_stage()
        self.metrics.write("joined", peer_id=self.peer_id, stage=stage_index, flops=self.flops,
                           snapshot=[r.to_wire(with_binding=False) for r in snapshot])
        self.check_memory(stage_index)
        self.stage = self._new_stage(stage_index, device)
        self._set_state(PeerState.SYNCING)
        logger.info(f"chose stage {stage_index} of {self.spec.num_stages} (layers {list(self.spec.stage_layers[stage_index])})")
        await self.heartbeat()
        self.status_protocol = StatusProtocol(self.p2p, lambda: local_status(self.snapshot, self.history))
        await self.status_protocol.start()
        self.keeper = BackupKeeper(self.p2p, self.view, self.spec, peer_id=self.peer_id, config=config,
                                   metrics=self.metrics, reputation=self.reputation)
        self.ctx = PeerContext(config=config, role=self.role, peer_id=self.peer_id, dht=self.dht, p2p=self.p2p,
                               view=self.view, base_spec=self.base_spec, keeper=self.keeper, metrics=self.metrics,
                               reputation=self.reputation, faults=self.faults, tokens=self.data.tokens,
                               clock=self.clock)
        if "slow_device" in self.faults:
            inject_slow_device(self)
        self.loader = StateLoader(self.p2p, self.view, peer_id=self.peer_id, config=config, keeper=self.keeper,
                                  metrics=self.metrics, reputation=self.reputation, traffic=TRAFFIC, links=self.ctx.links)
        await self.loader.load(self.stage, self.spec, seen=snapshot)

    def _layout_to_join(self) -> RunSpec:
        """The newest layout peers train under; a swarm restarting from checkpoints takes theirs."""
        spec = joiner_layout(self.view, self.base_spec)
        if spec.layout_version == 0 and self.config.checkpoint_dir and not any(
                r.state in HOLDER_STATES for r in self.view.all_records):
            spec = newest_checkpoint_layout(self.config.checkpoint_dir, self.base_spec)
        self.view.set_layout(spec.layout_version, spec.stage_layers)
        if spec.layout_version:
            logger.info(f"the swarm trains under re-planned layout v{spec.layout_version}: "
                        f"{spec.num_stages} stages {list(spec.stage_layers)}")
        return spec

    async def _choose_stage(self) -> tuple[int, list[PeerRecord]]:
        """``--stage``/``--first-stage``, or the stage negotiated from the records (and the records read)."""
        stage_index, spec = self.config.start_stage, self.spec
        if stage_index >= spec.num_stages:
            raise UserError(f"stage {stage_index} does not exist: run {spec.run_id} has {spec.num_stages} stages (0-{spec.num_stages - 1}).")
        if stage_index >= 0:
            return stage_index, []
        await self.heartbeat(stage=-1)
        return await negotiate_stage(self.view, spec, self.peer_id, settle_delay=self.config.settle_delay,
                                     timeout=self.config.join_timeout)

    def _new_stage(self, stage_index: int, device: torch.device) -> Stage:
        stage = Stage(self.spec, stage_index, device=device, checkpoint_activations=self.config.activation_checkpointing)
        if "scale_updates" in self.faults or "nan_updates" in self.faults:
            scale = float(self.faults.get("scale_updates") or 1)
            inject_bad_updates(stage, scale=scale, nan="nan_updates" in self.faults)
        return stage

    # --- train: one session per stage, and the transitions between them -----------------------

    async def _train(self, stop: asyncio.Event) -> None:
        """Serve the stage until ``stop`` or ``--run-for`` (counted from here, across stages and standing
        by: a session's own timer restarted at every move); move to another stage when told to."""
        async with stop_or_after(stop, self.config.run_for) as leave:
            await self._train_until(leave)

    async def _train_until(self, stop: asyncio.Event) -> None:
        while True:
            session = self.session = StageSession(self.ctx, self.spec, self.stage, host=self)
            async with session:  # however the block ends, the session announces the leave and closes
                self._set_state(PeerState.TRAINING)
                await self.heartbeat()
                logger.info("training")
                transition = await session.serve(stop)
                if transition is None:
                    logger.info("leaving")
                    return
                started = time.monotonic()
                announce_transition(transition, spec=self.spec, stage=self.stage.index, metrics=self.metrics)
                kept = await session.close(announce=True, keep_state=isinstance(transition, LayoutChange))
            self.checkpoint_progress = session.checkpoint_progress
            if isinstance(transition, LayoutChange):
                await self._relayout(transition, kept, session.watch, started)
            else:
                await self._switch_stage(transition)
            if self.stage is None and not await self._leave_standby(stop):  # the global plan left it idle
                return

    async def _switch_stage(self, transition: StageMove | Rescue) -> None:
        """The session closed as a leaving peer's would: obtain ``transition.to_stage``'s state."""
        self.announced_at = self.clock.dht_time()  # a newer record: peers that saw the leave notice see it again
        await self._enter_stage(transition.to_stage)
        source = await self.loader.load(self.stage, self.spec)
        if isinstance(transition, StageMove):
            self.metrics.write("moved", stage=transition.to_stage, step=self.stage.version)
            return
        digest = await self.stage.run(self.stage.params_digest)
        self.metrics.write("rescue", stage=transition.to_stage, from_stage=transition.from_stage, source=source,
                           planned_source=transition.source, digest=digest, step=self.stage.version)

    async def _enter_stage(self, stage_index: int) -> None:
        """A new, empty stage replica to load state into (this peer syncing)."""
        self.stage = self._new_stage(stage_index, self.device)
        self._set_state(PeerState.SYNCING)
        await self.heartbeat()

    async def _relayout(self, change: LayoutChange, own_state: dict[str, torch.Tensor], watch: RescueWatch,
                        started: float) -> None:
        """Move to ``change``'s layout: serve the old state a while (``Handoff``), build the new stage (``peer.relayout``)."""
        old_spec, old_index = self.spec, self.stage.index
        new_spec, new_index = change.spec, change.stage
        backup = self.keeper.backup
        if old_spec.namespace != new_spec.namespace:  # a same-version rival shares it: its handlers would clash
            handoff = Handoff(self.p2p, old_spec, old_index, own_state, backup=backup,
                              request_timeout=self.config.request_timeout)
            await handoff.start()
            self._handoffs.append(handoff)
        self.adopt_layout(change)
        if new_index == STANDBY:  # the plan leaves this peer idle (peer.standby)
            self.stage.shutdown()
            self.stage = None
            self._set_state(PeerState.STANDBY)
            report_relayout(change, {}, from_stage=old_index, step=0, digest="", seconds=time.monotonic() - started,
                            metrics=self.metrics)
            return
        self.check_memory(new_index)
        await self._enter_stage(new_index)
        await self.view.refresh()
        if self.view.members(new_index):
            # the stage already trains under the new layout (a replica that moved first, or this peer
            # was cut off while the swarm moved on): its holders' state is the one to take, as a joiner would
            provenance = {"stage": await self.loader.load(self.stage, self.spec)}
        else:
            provenance = await compose_stage(self.p2p, change, self.stage, old_spec=old_spec, old_index=old_index,
                                             own_state=own_state, backup=backup, watch=watch, metrics=self.metrics,
                                             request_timeout=self.config.request_timeout, reputation=self.reputation)
        digest = await self.stage.run(self.stage.params_digest)
        report_relayout(change, provenance, from_stage=old_index, step=self.stage.version, digest=digest,
                        seconds=time.monotonic() - started, metrics=self.metrics)

    def adopt_layout(self, change: LayoutChange) -> None:
        """Train (or stand by) under ``change``'s layout from now on."""
        if change.spec is not self.spec:  # the old layout's copy: served by the handoff (a rescue keeps its own)
            self.keeper.spec, self.keeper.backup = change.spec, None
        self.spec = change.spec
        self.view.set_layout(self.spec.layout_version, self.spec.stage_layers)
        self.layout_change = change
        self.averaged_round = (0.0, "")  # the old stage's last round: nothing to compare with under the new layout
        self.announced_at = self.clock.dht_time()

    async def _leave_standby(self, stop: asyncio.Event) -> bool:
        """Stand by until a layout names a stage for this peer, then load it from its holders (False: stopped)."""
        started_at = time.monotonic()
        change = await stand_by(self, stop)
        if change is None:
            return False
        started = time.monotonic()
        self.adopt_layout(change)
        self.check_memory(change.stage)
        await self._enter_stage(change.stage)
        source = await self.loader.load(self.stage, self.spec)
        report_relayout(change, {"stage": source}, from_stage=STANDBY, step=self.stage.version, seconds=time.monotonic() - started,
                        digest=await self.stage.run(self.stage.params_digest), metrics=self.metrics)
        self.metrics.write("standby_end", stage=change.stage, seconds=started - started_at)
        return True

    # --- leave --------------------------------------------------------------------------------

    async def _leave(self) -> None:
        """Release what outlives the sessions (a session closes itself). A peer that never served
        (it failed while joining or syncing) still says it leaves."""
        standby, started = self.state is PeerState.STANDBY, time.monotonic()
        if (self.stage is not None or standby) and self.dht is not None and (self.session is None or self.session.stage is not self.stage):
            self.leaving()
            try:
                await asyncio.wait_for(self.heartbeat(stage=STANDBY if standby else None), timeout=2.0)
            except Exception as e:
                logger.debug(f"could not announce the leave: {e!r}")
            if self.stage is not None:
                self.stage.shutdown()
        for handoff in self._handoffs:
            await handoff.shutdown()
        if self.status_protocol is not None:
            await self.status_protocol.shutdown()
        if self.data is not None:
            await self.data.shutdown()
        if self.view is not None:
            await self.view.shutdown()
        if self.node is not None:
            await self.node.shutdown()  # its services, then the DHT node
        logger.info(f"left: {time.monotonic() - started:.1f} s to release the node")
        self.metrics.close()

    # --- what a session asks of the peer (peer.session.SessionHost) ----------------------------

    def is_working(self) -> bool:
        return self.state in (PeerState.TRAINING, PeerState.PAUSED)

    def is_training(self) -> bool:
        return self.state is PeerState.TRAINING

    def is_paused(self) -> bool:
        return self.state is PeerState.PAUSED

    def leaving(self) -> None:
        self._set_state(PeerState.LEAVING)

    def averaged(self, at: float, digest: str) -> None:
        self.averaged_round = (at, digest)

    def check_memory(self, stage_index: int) -> None:
        budget = stage_memory_budget(self.spec, stage_index, max_in_flight=self.config.max_in_flight, max_memory_mb=self.config.max_memory_mb,
                                     device=self.device, checkpoint_activations=self.config.activation_checkpointing)
        self.memory_budget = self.memory_budget or budget  # before this peer held a stage: what it offers re-plans

    def toggle_pause(self) -> None:
        """SIGUSR1: stop taking new work without leaving the swarm, or resume.

        A paused peer keeps its stage, its state and its DHT record (state "paused", so routers and
        averaging pass it by); its in-flight microbatches finish. Resuming continues where it stopped.
        """
        if not self.is_working() or self.session is None:
            logger.warning(f"cannot pause or resume while {self.state}: only a training peer pauses")
            return
        pause = self.is_training()
        self._set_state(PeerState.PAUSED if pause else PeerState.TRAINING)
        self.session.set_paused(pause)
        self.metrics.write("paused" if pause else "resumed", stage=self.stage.index, step=self.stage.version)
        logger.info("paused: taking no new work, keeping the stage and its state; send SIGUSR1 again to resume"
                    if pause else "resumed")

    async def heartbeat(self, stage: int | None = None) -> None:
        await declare_peer(self.dht, self.validator, self.config.run_id, peer_record(self, stage), ttl=self.config.heartbeat_ttl)

    # --- what the peer shows: its DHT record and its snapshot ---------------------------------

    def _set_state(self, state: PeerState) -> None:
        self.state = state
        self.snapshot = peer_snapshot(self)  # the windows see a change of state at once

    async def _snapshot_loop(self) -> None:
        while True:
            self.snapshot = peer_snapshot(self)
            if self.history is not None:
                self.history.record(sample_of(self.snapshot))
            await asyncio.sleep(SNAPSHOT_PERIOD)
