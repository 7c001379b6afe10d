"""A peer's life: join → measure → negotiate a stage → obtain its state → train (→ move) → leave.

While it trains, a peer checks every ``--rebalance-period`` seconds (unless pinned with
``--stage``) whether moving one peer to the bottleneck stage would raise the swarm's throughput by
``--rebalance-min-gain`` or more (``planner.stage_choice.choose_move``); every peer computes the
same move from the same records, and only the peer it names moves: it leaves its stage like a
leaving peer, pulls the new stage's state from that stage's holders, and trains there. No other
peer reloads anything.

A stage held by a single peer is backed up on a peer of the next stage (``peer.backup``, seed 001
§3.4); when a stage loses its last holder, the peer ``planner.backup.choose_rescues`` names moves
there the same way and loads the backup, whatever ``--rebalance-period`` and ``--stage`` say. When
no peer can be spared for that, the peers re-plan the layout without the stage after
``--replan-after`` seconds (``peer.relayout``): every peer moves to a new stage numbering and
builds its new stage from its own state, its old neighbours' and the lost stage's backup.

The composition root: the only place that wires the DHT, the stage, its server, the router, the
averager and the trainer together (DESIGN §1 steps 1–4, 6 and 9).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import signal
import time
from collections.abc import Sequence

import torch

from dht.node import visible_maddrs
from dht.records import PeerRecord, RunSpec
from dht.registry import declare_peer, dht_time
from dht.reputation import Reputation
from dht.wire import TRAFFIC, UPLOAD_LIMIT
from peer.backup import HOLDER_STATES, BackupKeeper, RescueWatch, StageBackup, advertised_copies, state_digest
from peer.checkpoint import (
    CheckpointError,
    WriteProgress,
    checkpoint_path,
    load_checkpoint,
    newest_checkpoint_layout,
    save_checkpoint,
)
from peer.config import PeerConfig
from peer.errors import UserError
from peer.faults import inject_bad_updates, inject_corrupt_shards, inject_wrong_outputs, read_faults
from peer.join import fetch_spec, negotiate_stage, open_swarm_dht, pull_stage_state, stage_state_bytes
from peer.metrics import MetricsLog
from peer.profiler import (
    available_memory_bytes,
    measure_flops,
    resolve_device,
    stage_memory_bytes,
)
from peer.relayout import (
    Handoff,
    LayoutChange,
    adopted_layout,
    gather_pieces,
    joiner_layout,
    wait_layout_change,
)
from peer.status import (
    SOFTWARE_VERSION,
    StatusHistory,
    SyncProgress,
    local_status,
    sample_peer,
)
from peer.status_server import StatusProtocol
from peer.status_service import open_peer_status
from planner.backup import Rescue
from planner.stage_choice import StageMember, StageMove, choose_move
from replication.report import DisagreementError
from replication.server import ReplicationServer
from replication.transfer import PullResult, TransferError
from swarm.averaging import StageAverager
from swarm.data import DataError, TokenSampler, data_seed, load_corpus
from swarm.failure_detector import FailureDetector
from swarm.gradient_sync import GradientSync
from swarm.membership import MembershipNotices, membership_handler
from swarm.model import stage_flops_per_sample
from swarm.relayout import BadPieceError, compose_stage_state
from swarm.router import Router
from swarm.spot_check import SpotChecker
from swarm.stage import Stage
from swarm.stage_server import StageServer
from swarm.task_pool import MicrobatchLedger
from swarm.trainer import Trainer
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
MIB = 2**20
LEAVE_TIMEOUT = 10.0
GRADIENT_SYNC_TIMEOUT = 10.0  # seconds a replica waits for a silent co-replica's gradients before stepping without
PAUSE_FILE_PERIOD = 0.5
DISAGREEMENT_PATIENCE = 60.0  # seconds a joiner retries holders that serve different states
DISAGREEMENT_RETRY = 2.0
RUMOUR_CHECK_TIMEOUT = 0.5  # seconds a peer waits for a ping answer before it believes a crash rumour
# before a rescue, the stage's last holders are pinged this many times, each answer awaited this long:
# generous, as the link to a live holder whose record went missing may be slow (1 Mbit/s in the e2e test)
RESCUE_CHECK_ATTEMPTS = 2
RESCUE_CHECK_TIMEOUT = 2.0


class Peer:
    """One volunteer peer. ``await peer.run(stop)`` trains until ``stop`` is set, then leaves."""

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self.role = config.resolved_role
        self.metrics = MetricsLog(config.metrics_file)
        self.dht = self.validator = self.p2p = None
        self.spec: RunSpec | None = None  # under the layout this peer trains under (peer.relayout)
        self.base_spec: RunSpec | None = None  # as the run published it
        self.watch: RescueWatch | None = None  # the current stage's; read by a layout change
        self._handoffs: list[Handoff] = []  # old layouts' states this peer still serves
        self.stage: Stage | None = None
        self.view: SwarmView | None = None
        self.server: StageServer | None = None
        self.gradient_sync: GradientSync | None = None
        self.replication: ReplicationServer | None = None
        self.notices: MembershipNotices | None = None
        self.status_protocol: StatusProtocol | None = None  # /murmuration/status/1.0.0 for any libp2p client
        self.averager: StageAverager | None = None
        self.trainer: Trainer | None = None
        self.router: Router | None = None  # to the next stage (None on the last)
        self.detector: FailureDetector | None = None
        self._background_tasks: set[asyncio.Task] = set()
        self.reputation = None if config.ban_strikes == 0 else Reputation(
            max_strikes=config.ban_strikes, ban_seconds=config.ban_seconds,
            on_ban=lambda peer_id, reason: self.metrics.write("banned", peer_id=peer_id, reason=reason))
        self.keeper: BackupKeeper | None = None  # the backup of another stage it may keep, across moves
        self.faults: dict[str, str] = {}  # test-only misbehaviour (peer/faults.py)
        self.peer_id = ""
        self.maddrs: tuple[str, ...] = ()
        self._corpus = b""
        self.state = "joining"
        self.flops = 0.0
        self.announced_at = 0.0
        self.averaged = (0.0, "")
        self._tasks: list[asyncio.Task] = []
        self.started_at = time.monotonic()  # uptime in peer.status
        self.history: StatusHistory | None = None  # recent counters, sampled once a second while training
        self.traffic = TRAFFIC
        self.sync_progress: SyncProgress | None = None
        self.checkpoint_progress: WriteProgress | None = None  # the last (or current) checkpoint write
        self._stage_trained = False  # the current stage has its state and served: it may be checkpointed
        self._layout_map: tuple[int, ...] = ()  # how the current layout derives from the one before
        self.memory_budget = 0  # bytes this peer may use for a stage, set by the first memory check

    def log_prefix(self) -> str:
        stage = f" stage {self.stage.index} step {self.stage.version}" if self.stage else ""
        return f"[peer {self.peer_id[-6:] or '......'}{stage}] "

    async def run(self, stop: asyncio.Event) -> None:
        status = open_peer_status(self)  # health page, /metrics, terminal view: from joining to leaving
        await status.start()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self.toggle_pause)
        try:
            await self._join()
            await self._train(stop)
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
            await self._leave()
            await status.shutdown()

    async def _join(self) -> None:
        config = self.config
        self.faults = read_faults()
        if self.faults:
            logger.warning(f"test-only fault injection: this peer will misbehave ({', '.join(sorted(self.faults))})")
        UPLOAD_LIMIT.configure(config.max_upload_mbps * 1e6 / 8)
        self.dht, self.validator = await open_swarm_dht(config)
        self.peer_id = self.dht.peer_id.to_base58()
        self.maddrs = tuple(visible_maddrs(self.dht)[:4])  # read once: every heartbeat carries them
        logger.info(f"joined the DHT as {self.peer_id} ({self.role}); reachable at {' '.join(self.maddrs)}")
        self.spec = self.base_spec = await fetch_spec(self.dht, config.run_id, timeout=config.join_timeout)
        logger.info(f"run spec: {self.spec.describe()}")
        self.history = StatusHistory(seq_len=self.spec.model.seq_len)
        self._corpus = self._load_corpus()  # before choosing a stage: a data mistake is the user's to fix
        device = resolve_device(config.device)
        self.flops = await asyncio.to_thread(measure_flops, self.spec, device)
        logger.info(f"measured {self.flops / 1e9:.2f} GFLOP/s on {device}")
        self.view = SwarmView(self.dht, self.spec.run_id)
        await self.view.refresh()
        self.spec = joiner_layout(self.view, self.base_spec)  # the newest layout peers train under
        if self.spec.layout_version == 0 and config.checkpoint_dir and not any(
                r.state in HOLDER_STATES for r in self.view.all_records):
            self.spec = newest_checkpoint_layout(config.checkpoint_dir, self.base_spec)  # a swarm restarting
        self.view.set_layout(self.spec.layout_version, self.spec.stage_layers)
        if self.spec.layout_version:
            logger.info(f"the swarm trains under re-planned layout v{self.spec.layout_version}: "
                        f"{self.spec.num_stages} stages {list(self.spec.stage_layers)}")
        self.announced_at = dht_time()
        stage_index = config.stage
        if stage_index >= self.spec.num_stages:
            raise UserError(f"--stage {stage_index} does not exist: run {self.spec.run_id} has {self.spec.num_stages} stages (0-{self.spec.num_stages - 1}).")
        snapshot = []  # the view the stage was negotiated on (none for a peer pinned with --stage)
        if stage_index < 0:
            await self._heartbeat_once(stage=-1)
            stage_index, snapshot = await negotiate_stage(self.view, self.spec, self.peer_id,
                                                          settle_delay=config.settle_delay, timeout=config.join_timeout)
        self.metrics.write("joined", peer_id=self.peer_id, stage=stage_index, flops=self.flops,
                           snapshot=[r.to_wire(with_binding=False) for r in snapshot])
        self._check_memory(stage_index, device)
        self.stage = self._new_stage(stage_index, device)
        self.state = "syncing"
        logger.info(f"chose stage {stage_index} of {self.spec.num_stages} (layers {list(self.spec.stage_layers[stage_index])})")
        await self._heartbeat_once()
        self.p2p = await self.dht.replicate_p2p()
        self.status_protocol = StatusProtocol(self.p2p, lambda: local_status(self))
        await self.status_protocol.start()
        self.keeper = BackupKeeper(self.p2p, self.view, self.spec, peer_id=self.peer_id, config=config, metrics=self.metrics)
        await self._obtain_state(seen=snapshot)

    def _new_stage(self, stage_index: int, device: torch.device) -> Stage:
        stage = Stage(self.spec, stage_index, device=device)
        if "scale_updates" in self.faults or "nan_updates" in self.faults:
            scale = float(self.faults.get("scale_updates") or 1)
            inject_bad_updates(stage, scale=scale, nan="nan_updates" in self.faults)
        return stage

    def toggle_pause(self) -> None:
        """SIGUSR1: stop taking new work without leaving the swarm, or resume.

        A paused peer keeps its stage, its state and its DHT record (state "paused", so routers and
        averaging pass it by); its in-flight microbatches finish. Resuming continues where it stopped.
        """
        if self.state not in ("training", "paused"):
            logger.warning(f"cannot pause or resume while {self.state}: only a training peer pauses")
            return
        pause = self.state == "training"
        self.state = "paused" if pause else "training"
        for worker in (self.trainer, self.server):
            if worker is not None:
                worker.is_paused = pause
        self.metrics.write("paused" if pause else "resumed", stage=self.stage.index, step=self.stage.version)
        logger.info("paused: taking no new work, keeping the stage and its state; send SIGUSR1 again to resume"
                    if pause else "resumed")

    async def _pause_file_loop(self, stop: asyncio.Event) -> None:
        """--pause-file: creating the file pauses, deleting it resumes (SIGUSR1 still toggles in between)."""
        existed = False
        while not stop.is_set():
            exists = os.path.exists(self.config.pause_file)
            if exists != existed and exists != (self.state == "paused") and self.state in ("training", "paused"):
                self.toggle_pause()
            existed = exists
            await asyncio.sleep(PAUSE_FILE_PERIOD)

    def _check_memory(self, stage_index: int, device: torch.device) -> None:
        needed = stage_memory_bytes(self.spec, stage_index, max_in_flight=self.config.max_in_flight)
        budget = self.config.max_memory_mb * MIB if self.config.max_memory_mb else available_memory_bytes(device)
        if not self.memory_budget:  # before this peer held a stage: what it offers re-plans (records)
            self.memory_budget = int(budget)
        if needed > budget:
            source = "--max-memory-mb allows" if self.config.max_memory_mb else f"{device} has available"
            raise UserError(
                f"Stage {stage_index} needs about {needed / MIB:.0f} MiB but this peer's budget ({source}) is "
                f"{budget / MIB:.0f} MiB; raise --max-memory-mb, free memory, or lower --max-in-flight.", exit_code=3)

    async def _obtain_state(self, seen: Sequence[PeerRecord] = ()) -> str:
        """Load the stage's state; returns where it came from: "holders", "local-backup",
        "backup-donor", "checkpoint" or "seed". The holders are this read's, plus those of ``seen``
        (the join's snapshot, seconds old) that this read lacks and nobody said left: a heartbeat
        late on a busy machine lets a live holder's record lapse for a moment (CI: a joiner pulled
        from one of two live holders). A holder that is really gone fails its probe and is skipped."""
        await self.view.refresh()
        holders = [r for r in self.view.members(self.stage.index) if r.peer_id != self.peer_id]
        listed = {r.peer_id for r in holders} | {self.peer_id}
        holders += [r for r in seen if r.stage == self.stage.index and r.state == "training"
                    and r.peer_id not in listed and not self.view.is_gone(r.peer_id)]
        if not holders:
            restored = await self._restore_backup()
            if restored is not None:
                return restored
            if await self._resume_from_checkpoint():
                return "checkpoint"
            logger.info(f"first peer of stage {self.stage.index}: initialised from the run seed {self.spec.seed}")
            return "seed"
        self.sync_progress = SyncProgress(total_bytes=stage_state_bytes(self.stage), traffic=self.traffic)
        deadline = time.monotonic() + DISAGREEMENT_PATIENCE
        while True:
            try:
                result = await pull_stage_state(self.p2p, self.stage, holders, config=self.config,
                                                reputation=self.reputation)
                break
            except DisagreementError:
                # holders that serve different versions (one just alone, one between averaging rounds)
                # agree again within a round: wait for it rather than trust a single donor or give up
                if time.monotonic() > deadline:
                    raise
                logger.info(f"the holders of stage {self.stage.index} disagree on its state; asking again shortly")
                await asyncio.sleep(DISAGREEMENT_RETRY)
                await self.view.refresh()
                holders = [r for r in self.view.members(self.stage.index) if r.peer_id != self.peer_id] or holders
        self.sync_progress.finish()
        await self._downloaded(result)
        return "holders"

    async def _downloaded(self, result: PullResult) -> None:
        digest = await self.stage.run(self.stage.params_digest)  # what was loaded, for tests and reports
        self.metrics.write("state_download", version=result.version, seconds=result.report.seconds,
                           bytes_by_donor=result.report.bytes_by_donor, failed_donors=result.report.failed_donors,
                           donor=max(result.report.bytes_by_donor, key=result.report.bytes_by_donor.get),
                           digest=digest)

    async def _restore_backup(self) -> str | None:
        """A stage nobody holds comes back from its backup: the one this peer keeps ("local-backup"),
        else pulled from the peers that advertise one ("backup-donor"; the newest wins); None if
        there is none (or it does not load)."""
        stage, started = self.stage, time.monotonic()
        backup = self.keeper.take(stage.index) if self.keeper is not None else None
        if backup is not None:
            try:
                await stage.run(stage.load_state_tensors, backup.state)
            except ValueError as e:
                logger.warning(f"the backup of stage {stage.index} this peer kept does not load: {e}")
            else:
                self._backup_loaded("local-backup", backup.version, backup.digest, started)
                return "local-backup"
        # the copies that count (a syncing keeper serves nothing yet; a copy claimed by any but the
        # named keeper only counts without the keeper's), newest first: older copies would outvote it
        copies = [c for c in advertised_copies(self.view, self.spec.num_stages, exclude=self.peer_id)
                  if c.stage == stage.index]
        if not copies:
            return None
        newest = max(c.version for c in copies)
        chosen = {c.peer_id for c in copies if c.version == newest}
        keepers = [r for r in self.view.records if r.peer_id in chosen]
        self.sync_progress = SyncProgress(total_bytes=stage_state_bytes(stage), traffic=self.traffic)
        try:
            result = await pull_stage_state(self.p2p, stage, keepers, config=self.config, min_agreeing_donors=1,
                                            reputation=self.reputation)
        except (TransferError, ValueError) as e:
            logger.warning(f"could not pull the backup of stage {stage.index} from its keepers: {e}")
            return None
        finally:
            self.sync_progress.finish()
        await self._downloaded(result)
        self._backup_loaded("backup-donor", result.version, await asyncio.to_thread(state_digest, result.state), started)
        return "backup-donor"

    def _backup_loaded(self, source: str, version: int, digest: str, started: float) -> None:
        seconds = time.monotonic() - started
        logger.info(f"stage {self.stage.index} restored from its backup v{version} ({source}) in {seconds:.2f} s")
        self.metrics.write("backup_restored", stage=self.stage.index, source=source, version=version, digest=digest,
                           seconds=seconds)

    async def _resume_from_checkpoint(self) -> bool:
        """The first peer of a stage loads ``--checkpoint-dir``'s checkpoint of it, if there is one."""
        if not self.config.checkpoint_dir:
            return False
        path = checkpoint_path(self.config.checkpoint_dir, self.spec.namespace, self.stage.index)
        try:
            version, state = await asyncio.to_thread(load_checkpoint, path, spec=self.spec, stage=self.stage.index)
        except FileNotFoundError:
            return False
        except CheckpointError as e:
            raise UserError(f"{e}.") from e
        await self.stage.run(self.stage.load_state_tensors, state)
        logger.info(f"first peer of stage {self.stage.index}: resumed from {path} (step {version})")
        self.metrics.write("checkpoint_loaded", stage=self.stage.index, version=version, path=str(path))
        return True

    async def _write_checkpoint(self) -> None:
        """This stage's state to ``--checkpoint-dir``, atomically (a crash keeps the previous one)."""
        started, stage = time.monotonic(), self.stage
        state = await stage.run(stage.state_tensors)
        version = int(state["counters.num_steps"])  # the state's own step: the stage may step while this writes
        path = checkpoint_path(self.config.checkpoint_dir, self.spec.namespace, stage.index)
        self.checkpoint_progress = WriteProgress()
        await asyncio.to_thread(save_checkpoint, path, state, spec=self.spec, stage=stage.index, version=version,
                                progress=self.checkpoint_progress)
        seconds = time.monotonic() - started
        logger.info(f"checkpoint of stage {stage.index} step {version} written to {path} in {seconds:.2f} s")
        self.metrics.write("checkpoint", stage=stage.index, version=version, seconds=seconds,
                           bytes=path.stat().st_size, path=str(path))

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.checkpoint_period)
            try:
                await self._write_checkpoint()
            except OSError as e:  # a full or read-only disk must not stop training
                logger.warning(f"could not write a checkpoint: {e}")

    async def _train(self, stop: asyncio.Event) -> None:
        """Serve the stage until ``stop`` (or ``--run-for``); move to another stage when told to."""
        while True:
            move = await self._serve_stage(stop)
            if move is None:
                return
            if isinstance(move, Rescue):
                await self._rescue(move)
            elif isinstance(move, LayoutChange):
                await self._relayout(move)
            else:
                await self._move(move)

    async def _serve_stage(self, stop: asyncio.Event) -> StageMove | Rescue | LayoutChange | None:
        """Start the stage's services and serve until ``stop``; returns a move this peer must make."""
        config, spec, stage = self.config, self.spec, self.stage
        max_payload = int(config.max_payload_mb * MIB)
        router = None
        replay = config.recovery == "replay"
        if "wrong_outputs" in self.faults:
            inject_wrong_outputs(stage)
        if not stage.is_last:
            checker = SpotChecker(self.p2p, run_id=spec.namespace, fraction=config.spot_check_fraction,
                                  tolerance=config.spot_check_tolerance, rng=random.Random(f"spot:{spec.seed}:{self.peer_id}"),
                                  timeout=config.request_timeout, max_payload_bytes=max_payload,
                                  reputation=self.reputation, on_event=self._on_stage_event)
            router = Router(self.p2p, self.view, run_id=spec.namespace, next_stage=stage.index + 1,
                            next_stage_flops=stage_flops_per_sample(spec, stage.index + 1),
                            request_timeout=config.request_timeout, max_payload_bytes=max_payload,
                            rng=random.Random(f"{spec.seed}:{self.peer_id}"), sticky=replay,
                            max_attempts=3 if replay else 1, reputation=self.reputation, spot_checker=checker)
        self.router = router
        self.server = StageServer(self.p2p, stage, peer_id=self.peer_id, router=router,
                                  request_timeout=config.request_timeout, max_payload_bytes=max_payload,
                                  on_microbatch=self._on_microbatch, on_event=self._on_stage_event,
                                  ledger=MicrobatchLedger() if replay else None, reputation=self.reputation)
        await self.server.start()
        self.gradient_sync = None
        if spec.replica_sync == "gradients":
            self.gradient_sync = GradientSync(self.p2p, self.view, stage, peer_id=self.peer_id,
                                              timeout=min(config.request_timeout, GRADIENT_SYNC_TIMEOUT),
                                              max_payload_bytes=max_payload, aggregation=config.aggregation,
                                              on_event=self._on_stage_event)
            await self.gradient_sync.start()
        self.replication = ReplicationServer(self.p2p, run_id=spec.namespace, stage=stage.index,
                                             snapshot_fn=self._serving_snapshot, request_timeout=config.request_timeout,
                                             backup_fn=self.keeper.backup_fn)
        if "corrupt_shards" in self.faults:
            inject_corrupt_shards(self.replication)
        await self.replication.start()
        self.notices = MembershipNotices(self.p2p, self.view, run_id=spec.run_id, peer_id=self.peer_id,
                                         on_notice=self._on_notice, on_rumour=self._on_rumour,
                                         reputation=self.reputation)
        await self.notices.start()
        self.detector = FailureDetector(self.p2p, self.view, peer_id=self.peer_id, stage=stage.index,
                                        handler=membership_handler(spec.run_id), on_down=self._peer_down,
                                        on_link=self._on_link)
        self.view.on_change = self._on_view_change
        self.averager = StageAverager(stage, self.dht, self.view, client_mode=self.role == "unreliable" or config.client_mode,
                                      aggregation=config.aggregation, on_round=self._on_round, on_outliers=self._on_outliers,
                                      on_discard=self._on_discard)
        self.view.start()
        self.state = "training"
        self._stage_trained = True
        await self._heartbeat_once()
        logger.info("training")
        train_stop = asyncio.Event()
        self._tasks = [asyncio.create_task(coro, name=name) for name, coro in (
            ("heartbeat", self._heartbeat_loop(train_stop)),
            ("averaging", self.averager.run(train_stop)),
            ("status", self._status_loop(train_stop)),
            ("history", self._history_loop(train_stop)),
            ("failure-detector", self.detector.run(train_stop)),
        )]
        if stage.is_first:
            sampler = self._make_sampler()
            self.trainer = Trainer(stage, sampler, router, peer_id=self.peer_id,
                                   max_in_flight=config.max_in_flight, on_microbatch=self._on_microbatch,
                                   on_event=self._on_stage_event, sticky=replay, eval_every=config.eval_every,
                                   heldout=sampler.heldout_batches(config.eval_sequences, spec.microbatch_size),
                                   batch_share=self.gradient_sync and self.gradient_sync.share,
                                   stage_flops=[stage_flops_per_sample(spec, k) for k in range(spec.num_stages)])
            self._tasks.append(asyncio.create_task(self.trainer.run(train_stop), name="trainer"))
        if config.pause_file:  # after the trainer exists, so a pause reaches it
            self._tasks.append(asyncio.create_task(self._pause_file_loop(train_stop), name="pause-file"))
        if config.checkpoint_dir:
            self._tasks.append(asyncio.create_task(self._checkpoint_loop(), name="checkpoint"))
        rebalance = None
        if config.rebalance_period > 0 and config.stage < 0:  # a peer pinned with --stage stays
            rebalance = asyncio.create_task(self._rebalance_loop(), name="rebalance")
            self._tasks.append(rebalance)
        if config.backup_period > 0:
            self._tasks.append(asyncio.create_task(self.keeper.run(train_stop), name="backup"))
        watch = self.watch = RescueWatch(self.view, spec, peer_id=self.peer_id, settle=config.heartbeat_ttl / 2)
        rescue = asyncio.create_task(watch.wait_verified_rescue(self._answers_ping, on_skipped=self._rescue_skipped),
                                     name="rescue")
        layout = asyncio.create_task(wait_layout_change(
            self.view, spec, self.base_spec, watch, peer_id=self.peer_id, stage=stage.index,
            replan_after=config.replan_after, is_working=lambda: self.state in HOLDER_STATES,
            is_answering=self._answers_ping, max_in_flight=config.max_in_flight), name="layout")
        self._tasks += [rescue, layout]
        await self._wait_stop(stop)
        train_stop.set()
        for change in (layout, rescue, rebalance):
            if change is not None and change.done() and not change.cancelled():
                return change.result()
        return None

    async def _relayout(self, change: LayoutChange) -> None:
        """Move to ``change``'s layout: finish the in-flight work, serve the old state for a while
        (``Handoff``), and build the new stage from the old stages' states (``peer.relayout``)."""
        started = time.monotonic()
        old_spec, old_index, watch, device = self.spec, self.stage.index, self.watch, self.stage.device
        new_spec, new_index = change.spec, change.stage
        logger.info(f"stage layout v{old_spec.layout_version} -> v{new_spec.layout_version} ({change.reason}"
                    f"{'' if change.reason == 'replanned' else ' from ' + change.proposer[-6:]}): "
                    f"{new_spec.num_stages} stages {list(new_spec.stage_layers)}; this peer moves from stage "
                    f"{old_index} {list(old_spec.stage_layers[old_index])} to stage {new_index} "
                    f"{list(new_spec.stage_layers[new_index])}")
        self.metrics.write("relayout_start", reason=change.reason, proposer=change.proposer,
                           from_version=old_spec.layout_version, version=new_spec.layout_version,
                           stage_layers=[list(r) for r in new_spec.stage_layers], layout_map=list(change.layout_map),
                           from_stage=old_index, stage=new_index, unheld=list(change.unheld))
        self.state = "leaving"
        own_state = await self._release_stage(announce=True, keep_state=True)
        backup = self.keeper.backup if self.keeper is not None else None
        handoff = Handoff(self.p2p, old_spec, old_index, own_state, backup=backup,
                          request_timeout=self.config.request_timeout)
        await handoff.start()
        self._handoffs.append(handoff)
        self.spec = new_spec
        self.view.set_layout(new_spec.layout_version, new_spec.stage_layers)
        if self.keeper is not None:
            self.keeper.spec, self.keeper.backup = new_spec, None  # the old layout's copy: served by the handoff
        self._layout_map = change.layout_map
        self.averaged = (0.0, "")  # the old stage's last round: nothing to compare with under the new layout
        self.announced_at = dht_time()
        self._check_memory(new_index, device)
        self.stage, self._stage_trained = self._new_stage(new_index, device), False
        self.state = "syncing"
        await self._heartbeat_once()
        await self.view.refresh()
        if self.view.members(new_index):
            # the stage already trains under the new layout (a replica that moved first, or this peer
            # was cut off while the swarm moved on): its holders' state is the one to take, as a joiner would
            provenance = {"stage": await self._obtain_state()}
        else:
            provenance = await self._compose_stage(change, old_spec, old_index, own_state, backup, watch)
        digest = await self.stage.run(self.stage.params_digest)
        seconds = time.monotonic() - started
        reseeded = sorted(part for part, source in provenance.items() if source == "seed")
        if reseeded:
            logger.warning(f"no peer had {', '.join(reseeded)} of the lost stage: restarted from the run seed")
        logger.info(f"now stage {new_index} of layout v{new_spec.layout_version}, built in {seconds:.2f} s from "
                    f"{', '.join(sorted(set(provenance.values())))}")
        self.metrics.write("relayout", reason=change.reason, version=new_spec.layout_version, from_stage=old_index,
                           stage=new_index, stage_layers=[list(r) for r in new_spec.stage_layers],
                           provenance=provenance, reseeded=reseeded, seconds=seconds, digest=digest,
                           step=self.stage.version)

    async def _compose_stage(self, change: LayoutChange, old_spec: RunSpec, old_index: int,
                             own_state: dict[str, torch.Tensor], backup: StageBackup | None,
                             watch: RescueWatch) -> dict[str, str]:
        """Build the new stage from pieces of the old layout (``peer.relayout.gather_pieces``) and load
        it; returns where each part came from."""
        new_spec, new_index = self.spec, self.stage.index
        vanished = [k for k, new in enumerate(change.layout_map) if new < 0]
        pieces = await gather_pieces(self.p2p, old_spec, new_spec, new_index, own_stage=old_index, own_state=own_state,
                                     own_backup=backup, watch=watch, vanished=vanished,
                                     request_timeout=self.config.request_timeout, reputation=self.reputation)
        base = await self.stage.run(self.stage.state_tensors)
        while True:
            try:
                composed, provenance = await asyncio.to_thread(compose_stage_state, new_spec, new_index, pieces, base=base,
                                                               num_steps=int(own_state["counters.num_steps"]))
                break
            except BadPieceError as e:  # a donor served a malformed state: its layers come from elsewhere
                logger.warning(f"refused a state piece while changing layout: {e}")
                self.metrics.write("relayout_piece_refused", source=e.source, reason=str(e))
                pieces = [p for p in pieces if p.source != e.source]
        await self.stage.run(self.stage.load_state_tensors, composed)
        return provenance

    async def _rebalance_loop(self) -> StageMove:
        """Returns once this peer is the one to move (never otherwise; cancelled on leave)."""
        config, spec = self.config, self.spec
        costs = [stage_flops_per_sample(spec, k) for k in range(spec.num_stages)]
        arrived = time.monotonic()
        while True:
            await asyncio.sleep(config.rebalance_period)
            if self.state != "training" or time.monotonic() - arrived < 2 * config.rebalance_period:
                continue  # settle first: a peer that just arrived must not be moved on stale rates
            records = self.view.records
            if any(r.state == "joining" for r in records):
                continue  # joiners are filling deficits themselves; decide once they have
            members = [StageMember(peer_id=r.peer_id, stage=r.stage, flops=r.flops)
                       for k in range(spec.num_stages) for r in self.view.members(k, states=("training", "syncing"))]
            move = choose_move(costs, members, min_gain=config.rebalance_min_gain)
            if move is None or move.peer_id != self.peer_id:
                continue
            try:
                self._check_memory(move.to_stage, self.stage.device)
            except UserError as e:
                logger.info(f"not moving to stage {move.to_stage}: {e}")
                continue
            return move

    async def _move(self, move: StageMove) -> None:
        """Leave the current stage as a leaving peer would, then obtain and join ``move.to_stage``."""
        logger.info(f"moving from stage {move.from_stage} to stage {move.to_stage}: the swarm's bottleneck "
                    f"throughput rises {move.gain:.0%} ({move.bottleneck_before:.1f} -> {move.bottleneck_after:.1f} samples/s)")
        self.metrics.write("moving", from_stage=move.from_stage, to_stage=move.to_stage, gain=move.gain,
                           bottleneck_before=move.bottleneck_before, bottleneck_after=move.bottleneck_after)
        await self._switch_stage(move.to_stage)
        self.metrics.write("moved", stage=move.to_stage, step=self.stage.version)

    async def _switch_stage(self, to_stage: int) -> str:
        """Leave the current stage as a leaving peer would, then obtain ``to_stage``'s state
        (``_obtain_state``'s answer: where it came from)."""
        device = self.stage.device
        self.state = "leaving"
        await self._release_stage(announce=True)
        self.announced_at = dht_time()  # a newer record: peers that saw the leave notice see it again
        self.stage, self._stage_trained = self._new_stage(to_stage, device), False
        self.state = "syncing"
        await self._heartbeat_once()
        return await self._obtain_state()

    async def _answers_ping(self, peer_id: str) -> bool:
        """Does ``peer_id`` answer a ping? (asked of a stage's last holders before rescuing it)"""
        for _ in range(RESCUE_CHECK_ATTEMPTS):
            if self.detector is not None and await self.detector.check(peer_id, timeout=RESCUE_CHECK_TIMEOUT):
                return True
        return False

    def _rescue_skipped(self, rescue: Rescue, answering: list[str]) -> None:
        logger.info(f"stage {rescue.to_stage} looks unheld, but its holder {answering[0][-6:]} answers a ping: "
                    "not rescuing it (its record is missing from this peer's view, not the peer)")
        self.metrics.write("rescue_skipped", stage=rescue.to_stage, from_stage=rescue.from_stage, answering=answering)

    async def _rescue(self, rescue: Rescue) -> None:
        """Leave the current stage and take over ``rescue.to_stage``, which lost its last holder."""
        logger.info(f"stage {rescue.to_stage} has no holder left: moving there from stage {rescue.from_stage} "
                    f"(its backup: {rescue.source}, v{rescue.backup_version})")
        self.metrics.write("rescuing", stage=rescue.to_stage, from_stage=rescue.from_stage, keeper=rescue.keeper_id,
                           backup_version=rescue.backup_version)
        restored = await self._switch_stage(rescue.to_stage)
        digest = await self.stage.run(self.stage.params_digest)
        self.metrics.write("rescue", stage=rescue.to_stage, from_stage=rescue.from_stage, source=restored,
                           planned_source=rescue.source, digest=digest, step=self.stage.version)

    def _load_corpus(self) -> bytes:
        try:
            return load_corpus(self.spec.dataset, self.config.data)
        except DataError as e:
            raise UserError(f"Cannot load the training data: {e}.") from e

    def _make_sampler(self) -> TokenSampler:
        return TokenSampler(self._corpus, seq_len=self.spec.model.seq_len, seed=data_seed(self.spec.seed, self.peer_id))

    async def _wait_stop(self, stop: asyncio.Event) -> None:
        timeout = self.config.run_for or None
        waiter = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([waiter, *self._tasks], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        for task in done:
            if task is not waiter and task.exception() is not None:
                raise task.exception()

    async def _leave(self) -> None:
        """Announce the leave, let in-flight microbatches finish, then release everything."""
        announce = self.stage is not None and self.dht is not None
        if announce:
            self.state = "leaving"
            logger.info("leaving")
        await self._release_stage(announce=announce)
        for handoff in self._handoffs:
            await handoff.shutdown()
        if self.status_protocol is not None:
            await self.status_protocol.shutdown()
        if self.view is not None:
            await self.view.shutdown()
        if self.dht is not None:
            self.dht.shutdown()
        self.metrics.close()

    async def _release_stage(self, *, announce: bool, keep_state: bool = False) -> dict[str, torch.Tensor] | None:
        """Stop serving the current stage: tell the neighbours, let in-flight microbatches finish,
        then shut the stage's services down (the DHT, the view and the status stay). With
        ``keep_state``, returns the stage's state as it is once the in-flight work is done."""
        if announce:
            if self.server is not None:
                self.server.stop_accepting()  # upstream peers re-send to another replica from now on
            if self.notices is not None:
                try:
                    self.metrics.write("leave_announced", peers=await self.notices.announce_leave())
                except Exception as e:
                    logger.debug(f"could not send leave notices: {e!r}")
            try:
                await asyncio.wait_for(self._heartbeat_once(), timeout=2.0)
            except Exception as e:
                logger.debug(f"could not announce the leave: {e!r}")
        for task in self._tasks:
            if task.get_name() != "trainer":
                task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=LEAVE_TIMEOUT)  # the trainer finishes its in-flight work
            for task in self._tasks:
                task.cancel()
        if self.config.checkpoint_dir and self.stage is not None and self._stage_trained:
            try:  # the in-flight work is done: the state is whole (a stage still syncing is not written)
                await self._write_checkpoint()
            except Exception as e:
                logger.warning(f"could not write the last checkpoint: {e!r}")
        kept = None
        if keep_state and self.stage is not None:
            await self.stage.wait_step_done()
            kept = await self.stage.run(self.stage.state_tensors)
        for service in (self.replication, self.notices, self.router and self.router.spot_checker):
            if service is not None:
                await service.shutdown()
        if self.server is not None:
            await self.server.stop(timeout=LEAVE_TIMEOUT)  # no request may reach a stage being shut down
        if self.gradient_sync is not None:
            await self.gradient_sync.stop()
            self.gradient_sync = None
        for closer in (self.averager and self.averager.shutdown, self.stage and self.stage.shutdown):
            if closer:
                closer()
        self._tasks, self.trainer, self.server, self.replication, self.notices, self.averager = [], None, None, None, None, None
        self.router = self.detector = None
        return kept

    def _record(self, stage: int | None = None) -> PeerRecord:
        counters = self.stage.counters if self.stage else None
        backup = self.keeper.backup if self.keeper else None
        return PeerRecord(
            peer_id=self.peer_id, role=self.role, state=self.state,
            stage=stage if stage is not None else self.stage.index, flops=self.flops,
            samples_per_s=counters.samples_per_s if counters else 0.0,
            num_samples=counters.num_samples if counters else 0,
            version=self.stage.version if self.stage else 0,
            loss=counters.last_loss if counters else math.nan, announced_at=self.announced_at,
            val_loss=self.trainer.last_val_loss if self.trainer is not None else math.nan,
            backup_stage=backup.stage if backup else -1, backup_version=backup.version if backup else 0,
            maddrs=self.maddrs, params_digest=self.averaged[1], averaged_at=self.averaged[0],
            software_version=SOFTWARE_VERSION, bytes_sent=self.traffic.bytes_sent,
            bytes_received=self.traffic.bytes_received,
            layout_version=self.spec.layout_version if self.spec else 0,
            stage_layers=self.spec.stage_layers if self.spec and self.spec.layout_version else (),
            layout_map=self._layout_map if self.spec and self.spec.layout_version else (),
            memory_bytes=self.memory_budget,
        )

    async def _heartbeat_once(self, stage: int | None = None) -> None:
        await declare_peer(self.dht, self.validator, self.config.run_id, self._record(stage), ttl=self.config.heartbeat_ttl)

    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                await asyncio.wait_for(self._heartbeat_once(), timeout=self.config.heartbeat_ttl / 2)
            except Exception as e:
                logger.warning(f"heartbeat failed: {e!r}")
            elapsed = time.monotonic() - started
            if elapsed > self.config.heartbeat_period:
                logger.warning(f"heartbeat took {elapsed:.2f}s, longer than its {self.config.heartbeat_period}s period")
            await asyncio.sleep(self.config.heartbeat_period * random.uniform(0.8, 1.2))

    async def _status_loop(self, stop: asyncio.Event) -> None:
        last_samples, last_time = 0, time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(self.config.status_period)
            counters, now = self.stage.counters, time.monotonic()
            tokens_per_s = (counters.num_samples - last_samples) * self.spec.model.seq_len / (now - last_time)
            last_samples, last_time = counters.num_samples, now
            per_stage = [len(self.view.members(k)) for k in range(self.spec.num_stages)]
            logger.info(f"loss {counters.last_loss:.3f} | {tokens_per_s:,.0f} tok/s | {counters.num_samples} samples "
                        f"| peers per stage {per_stage}")
            sync = self.gradient_sync
            exchanges = {} if sync is None else {"exchanges": sync.num_exchanges, "exchanges_partial": sync.num_partial,
                                                 "exchanges_alone": sync.num_alone}
            self.metrics.write("status", stage=self.stage.index, step=self.stage.version, loss=counters.last_loss,
                               tokens_per_s=tokens_per_s, samples=counters.num_samples, peers_per_stage=per_stage,
                               **exchanges)

    async def _history_loop(self, stop: asyncio.Event) -> None:
        """Sample the counters once a second: the recent rates and plots of peer.status read them."""
        while not stop.is_set():
            self.history.record(sample_peer(self))
            await asyncio.sleep(1.0)

    async def _serving_snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """What this peer serves to joiners: the state of its last averaging round, which every replica
        of the stage holds bit-identical (so several donors serve one manifest); before any round, or
        alone in its stage (no round refreshes the snapshot then; its backup keeper must not copy a
        stale one), its current state."""
        alone = not [r for r in self.view.members(self.stage.index) if r.peer_id != self.peer_id]
        if self.stage.snapshot is not None and not alone:
            return self.stage.snapshot
        state = await self.stage.run(self.stage.state_tensors)
        return int(state.pop("counters.num_steps")), state  # the version this state has, not a later step

    def _on_microbatch(self, event: dict) -> None:
        self.metrics.write("microbatch", stage=self.stage.index, **event)

    def _on_stage_event(self, event: str, **fields) -> None:
        self.metrics.write(event, stage=self.stage.index, **fields)

    def _on_notice(self, notice: dict) -> None:
        self.metrics.write("notice", **notice)
        if notice.get("kind") == "leave":
            self._peer_down(notice["peer_id"], "notice")

    def _peer_down(self, peer_id: str, how: str) -> None:
        """``peer_id`` is gone (scale-in, seed 003 §IV): send it nothing new (see swarm/router.py) and,
        if this peer's own detector found out, tell the others."""
        started = time.perf_counter()  # the detector or the notice already marked it departed in the view
        if self.router is not None:
            self.router.peer_down(peer_id)
        handle_ms = (time.perf_counter() - started) * 1e3  # the local handling, no network I/O
        self.metrics.write("peer_down", peer_id=peer_id, how=how, handle_ms=handle_ms)
        self.metrics.write("primitive", kind="scale_in", peer_id=peer_id, how=how, handle_ms=handle_ms)
        if how == "detector" and self.notices is not None:
            self._background(self.notices.gossip_failure(peer_id), "gossip")

    def _on_view_change(self, kind: str, record: PeerRecord) -> None:
        """Seed 003 §IV scale-out / scale-in as a view refresh sees them (a peer starts or stops
        training at a stage). The router and the detector read the view, so handling is bookkeeping:
        a peer back at work is no longer avoided."""
        started = time.perf_counter()
        if kind == "scale_out" and self.router is not None and record.stage == self.router.next_stage:
            self.router.link_up(record.peer_id)
        self.metrics.write("primitive", kind=kind, peer_id=record.peer_id, stage=record.stage, how="view",
                           handle_ms=(time.perf_counter() - started) * 1e3)

    def _on_link(self, kind: str, peer_id: str) -> None:
        """Seed 003 §IV disconnect-link / connect-link: a neighbour missed a ping (route around it for
        now, without declaring it down) or answers again (route to it again)."""
        started = time.perf_counter()
        if self.router is not None:
            if kind == "disconnect_link":
                self.router.link_down(peer_id)
            else:
                self.router.link_up(peer_id)
        self.metrics.write("primitive", kind=kind, peer_id=peer_id, handle_ms=(time.perf_counter() - started) * 1e3)

    def _on_rumour(self, peer_id: str, sender: str) -> None:
        """Another peer says ``peer_id`` crashed: believe it only if it does not answer us either."""
        detector = self.detector
        if detector is None or peer_id in detector.down or not any(r.peer_id == peer_id for r in self.view.records):
            return

        async def verify() -> None:
            if not await detector.check(peer_id, timeout=RUMOUR_CHECK_TIMEOUT):
                detector.declare_down(peer_id, "gossip")
            else:
                logger.info(f"{sender[-6:]} said {peer_id[-6:]} failed, but it answers us")
        self._background(verify(), "verify-rumour")

    def _background(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background_tasks.add(task)
        task.add_done_callback(self._background_tasks.discard)

    def _on_round(self, at: float, group_size: int, digest: str) -> None:
        self.averaged = (at, digest)
        self.metrics.write("averaged", stage=self.stage.index, at=at, group_size=group_size, digest=digest)

    def _on_discard(self, at: float, group_size: int, num_members: int) -> None:
        self.metrics.write("averaging_dropped", stage=self.stage.index, at=at, group_size=group_size,
                           num_members=num_members)

    def _on_outliers(self, report: dict) -> None:
        """A round's reduce refused (NaN/Inf) or out-voted parts of some replicas (swarm/robust_allreduce.py)."""
        self.metrics.write("averaging_outliers", stage=self.stage.index, **report)
