"""Where a stage's state comes from, in one place: :meth:`StateLoader.load` tries ``SOURCES`` in order.

1. ``holders``: the stage's live holders (a joiner, a mover, a rescuer whose stage came back): pulled
   in shards from several of them at once (``peer.join.pull_stage_state``), their agreement checked.
2. ``local-backup``: the backup of the stage this peer keeps itself (``peer.backup.BackupKeeper``).
3. ``backup-donor``: the newest backup other peers advertise, pulled from them.
4. ``checkpoint``: ``--checkpoint-dir``'s checkpoint of the stage (a swarm that stopped and restarts).
5. ``seed``: the run seed's initial state, which the stage already holds: the stage's first peer.

A source that has nothing returns False and the next one is asked; a source that has the state but
fails to deliver it raises (a joiner must not silently start from the seed while holders train): a
pull from the holders that fails for good (a link too slow or cut; holders that evicted the version
being pulled more often than ``replication/transfer.py`` re-plans) ends the peer with one sentence,
a ``UserError``, never a traceback (issue #15).
Holders whose state cannot come from training from the run seed (``swarm.plausibility``) are
refused and struck; if every holder is, the joiner says so and starts from the seed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from dht.records import PeerRecord, RunSpec
from dht.reputation import Reputation
from peer.backup import BackupKeeper, advertised_copies, state_digest
from peer.checkpoint import CheckpointError, checkpoint_path, load_checkpoint
from peer.config import PeerConfig
from peer.errors import UserError
from peer.event_log import EventLog
from peer.join import ImplausibleStateError, pull_stage_state, stage_state_bytes
from peer.status.local import SyncProgress
from replication.pull_report import DisagreementError, PullReport
from replication.transfer import PullResult, TransferError
from swarm.links import LinkMeter
from swarm.plausibility import implausible, state_drift
from swarm.stage import Stage
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
SOURCES = ("holders", "local-backup", "backup-donor", "checkpoint", "seed")
DISAGREEMENT_PATIENCE = 20.0  # seconds a joiner retries holders that serve different states (then takes one alone)
DISAGREEMENT_RETRY = 2.0
# a pull none of whose holders answered is tried again: on a slow link a first dial can time out, and
# libp2p then refuses to dial that address again for a few seconds ("dial backoff", 5 s at first)
UNREACHABLE_RETRIES = 3
UNREACHABLE_RETRY = 6.0


class StateLoader:
    """Loads a stage's state into a new :class:`Stage` from the first source that has it.

    Args:
        p2p, view: the peer's libp2p handle and swarm view.
        peer_id: this peer's.
        config: the peer's config (transfer settings, ``--checkpoint-dir``).
        keeper: the backup keeper (a backup this peer keeps), or None.
        metrics: the event log (``state_download``, ``backup_restored``, ``checkpoint_loaded``).
        reputation: strikes for donors that serve bad shards, or None.
        traffic: the peer's byte counters (the download's progress bar).
        clock: monotonic seconds (the disagreement patience, the restore time).
    """

    def __init__(self, p2p, view: SwarmView, *, peer_id: str, config: PeerConfig, keeper: BackupKeeper | None,
                 metrics: EventLog, reputation: Reputation | None, traffic,
                 clock: Callable[[], float] = time.monotonic, links: LinkMeter | None = None) -> None:
        self.p2p, self.view, self.peer_id, self.config = p2p, view, peer_id, config
        self.keeper, self.metrics, self.reputation, self.traffic = keeper, metrics, reputation, traffic
        self.clock = clock
        self.links = links if links is not None else LinkMeter()  # a pull's probes and rates feed the link figures
        self.progress: SyncProgress | None = None  # the last (or current) download's
        self.refused: set[str] = set()  # holders whose state was implausible (swarm/plausibility.py)

    async def load(self, stage: Stage, spec: RunSpec, seen: Sequence[PeerRecord] = ()) -> str:
        """Load ``stage``'s state; returns the source it came from (one of ``SOURCES``). ``seen``:
        records of the stage's holders this peer saw moments ago (the join's snapshot)."""
        sources = ((self._from_holders, "holders"), (self._from_local_backup, "local-backup"),
                   (self._from_backup_donors, "backup-donor"), (self._from_checkpoint, "checkpoint"))
        await self.view.refresh()
        for source, name in sources:
            try:
                if await source(stage, spec, seen):
                    return name
            except TransferError as e:  # only the holders' pull raises it; the backup sources fall through
                raise UserError(f"Could not download stage {stage.index}'s state from its holders ({e}); check this "
                                f"machine's network link, or raise --request-timeout on a slow one, and start the "
                                f"peer again.") from e
        if self.refused:
            logger.warning(f"stage {stage.index}: its holders ({', '.join(sorted(p[-6:] for p in self.refused))}) "
                           f"served only states no training from the run seed makes; initialised from the run "
                           f"seed {spec.seed}, and this peer's averaging rounds will not take their states either")
        else:
            logger.info(f"first peer of stage {stage.index}: initialised from the run seed {spec.seed}")
        return "seed"

    async def _from_holders(self, stage: Stage, spec: RunSpec, seen: Sequence[PeerRecord]) -> bool:
        """The holders are this view's, plus those of ``seen`` that it lacks and nobody said left: a
        heartbeat late on a busy machine lets a live holder's record lapse for a moment (CI: a
        joiner pulled from one of two live holders). A holder that is really gone fails its probe. A
        holder whose record says nobody can dial it (a client of stage 0 behind a NAT) is no donor."""
        holders = self._live_holders(stage, seen)
        if not holders:
            return False
        self.progress = SyncProgress(total_bytes=stage_state_bytes(stage), traffic=self.traffic)
        # honest holders agree again after the next averaging round
        deadline = self.clock() + min(DISAGREEMENT_PATIENCE, 2 * spec.averaging_period + 2)
        retries = UNREACHABLE_RETRIES
        while True:
            try:
                result = await pull_stage_state(self.p2p, stage, holders, config=self.config,
                                                reputation=self.reputation)
                break
            except ImplausibleStateError as e:
                holders = self._refuse(stage, holders, e)
            except DisagreementError:
                # holders that serve different versions (one just alone, one between averaging rounds)
                # agree again within a round: wait for it; then take the first holder whose state alone
                # is plausible (a Byzantine holder beside one honest one disagrees for good)
                if self.clock() > deadline:
                    result = await self._from_one_holder(stage, holders)
                    break
                logger.info(f"the holders of stage {stage.index} disagree on its state; asking again shortly")
                await asyncio.sleep(DISAGREEMENT_RETRY)
                await self.view.refresh()
                # the same patience with a lapsed record as above (CI: asked again, a joiner pulled from
                # only one of two live holders because the other's heartbeat was late)
                holders = self._live_holders(stage, [*seen, *holders]) or holders
            except TransferError as e:
                if (retries := retries - 1) < 0:
                    raise
                logger.info(f"could not pull stage {stage.index} from its holders ({e}); trying again in "
                            f"{UNREACHABLE_RETRY:.0f}s")
                await asyncio.sleep(UNREACHABLE_RETRY)
                await self.view.refresh()
            if not holders:
                return False  # every holder served a state no training makes: the next source, else the seed
        self.progress.finish()
        await self._downloaded(stage, result)
        return True

    def _live_holders(self, stage: Stage, seen: Sequence[PeerRecord]) -> list[PeerRecord]:
        """The view's holders of ``stage`` plus those of ``seen`` it lacks and nobody said left; none
        refused, none that nobody can dial."""
        holders = [r for r in self.view.members(stage.index) if r.peer_id != self.peer_id]
        listed = {r.peer_id for r in holders} | {self.peer_id}
        lapsed = {r.peer_id: r for r in seen if r.stage == stage.index and r.state == "training"
                  and r.peer_id not in listed and not self.view.is_gone(r.peer_id)}
        return [r for r in holders + list(lapsed.values())
                if r.reachability != "unreachable" and r.peer_id not in self.refused]

    async def _from_one_holder(self, stage: Stage, holders: list[PeerRecord]) -> PullResult:
        """Of the states ``holders`` serve each on its own, the one that moved least per step from the
        run seed (``swarm.plausibility.state_drift``), loaded: holders that still disagree after the
        patience may include one pushing its state, and of two copies that is the honest pick.

        Raises:
            TransferError: none served a plausible state.
        """
        errors, candidates, dropped = [], [], {}
        for holder in sorted(holders, key=lambda r: r.peer_id):
            try:
                result = await pull_stage_state(self.p2p, stage, [holder], config=self.config,
                                                min_agreeing_donors=1, reputation=self.reputation, load=False)
                candidates.append((await asyncio.to_thread(state_drift, result.state, stage.spec, stage.index),
                                   holder.peer_id, result))
            except ImplausibleStateError as e:
                self._refuse(stage, [holder], e)
                errors.append(str(e))
                dropped[holder.peer_id] = str(e)
            except TransferError as e:
                errors.append(f"{holder.peer_id[-6:]}: {e}")
                dropped.update(e.report.failed_donors)
        if not candidates:
            raise TransferError(f"no holder of stage {stage.index} served a usable state alone: {'; '.join(errors)}",
                                PullReport())
        drift, chosen, result = min(candidates)
        for peer_id, why in dropped.items():  # the download's report names every holder dropped on the way
            result.report.failed_donors.setdefault(peer_id, why)
        logger.warning(f"the holders of stage {stage.index} kept disagreeing: took {chosen[-6:]}'s state alone, the "
                       f"one that moved least from the run seed per step ({drift:.2f} of the AdamW bound; "
                       f"{len(candidates)} compared)")
        await stage.run(stage.load_state_tensors, result.state)
        return result

    def _refuse(self, stage: Stage, holders: list[PeerRecord], error: ImplausibleStateError) -> list[PeerRecord]:
        """Note the donors of an implausible state; the holders left to ask."""
        self.refused.update(error.report.donors)
        logger.warning(f"refused the state of stage {stage.index}: {error}")
        self.metrics.write("state_refused", stage=stage.index, donors=error.report.donors, reason=str(error))
        return [r for r in holders if r.peer_id not in self.refused]

    async def _from_local_backup(self, stage: Stage, spec: RunSpec, seen: Sequence[PeerRecord]) -> bool:
        started = self.clock()
        backup = self.keeper.take(stage.index) if self.keeper is not None else None
        if backup is None:
            return False
        if reason := await asyncio.to_thread(implausible, backup.state, spec, stage.index):
            logger.warning(f"the backup of stage {stage.index} this peer kept cannot come from training: {reason}")
            return False
        try:
            await stage.run(stage.load_state_tensors, backup.state)
        except ValueError as e:
            logger.warning(f"the backup of stage {stage.index} this peer kept does not load: {e}")
            return False
        self._backup_loaded(stage, "local-backup", backup.version, backup.digest, started)
        return True

    async def _from_backup_donors(self, stage: Stage, spec: RunSpec, seen: Sequence[PeerRecord]) -> bool:
        """The copies that count (a syncing keeper serves nothing yet; a copy claimed by any but the
        named keeper only counts without the keeper's), newest first: older copies would outvote it."""
        started = self.clock()
        copies = [c for c in advertised_copies(self.view, spec.num_stages, exclude=self.peer_id)
                  if c.stage == stage.index]
        if not copies:
            return False
        newest = max(c.version for c in copies)
        chosen = {c.peer_id for c in copies if c.version == newest}
        keepers = [r for r in self.view.records if r.peer_id in chosen]
        self.progress = SyncProgress(total_bytes=stage_state_bytes(stage), traffic=self.traffic)
        try:
            result = await pull_stage_state(self.p2p, stage, keepers, config=self.config, min_agreeing_donors=1,
                                            reputation=self.reputation)
        except (TransferError, ValueError) as e:
            logger.warning(f"could not pull the backup of stage {stage.index} from its keepers: {e}")
            return False
        finally:
            self.progress.finish()
        await self._downloaded(stage, result)
        digest = await asyncio.to_thread(state_digest, result.state)
        self._backup_loaded(stage, "backup-donor", result.version, digest, started)
        return True

    async def _from_checkpoint(self, stage: Stage, spec: RunSpec, seen: Sequence[PeerRecord]) -> bool:
        if not self.config.checkpoint_dir:
            return False
        path = checkpoint_path(self.config.checkpoint_dir, spec.namespace, stage.index)
        try:
            version, state = await asyncio.to_thread(load_checkpoint, path, spec=spec, stage=stage.index)
        except FileNotFoundError:
            return False
        except CheckpointError as e:
            raise UserError(f"{e}.") from e
        await stage.run(stage.load_state_tensors, state)
        logger.info(f"first peer of stage {stage.index}: resumed from {path} (step {version})")
        self.metrics.write("checkpoint_loaded", stage=stage.index, version=version, path=str(path))
        return True

    async def _downloaded(self, stage: Stage, result: PullResult) -> None:
        digest = await stage.run(stage.params_digest)  # what was loaded, for tests and reports
        report = result.report
        stage.loaded_from = tuple(report.donors)
        for donor, (request_seconds, _) in report.links.items():
            self.links.round_trip(donor, request_seconds)
        for donor, per_byte in report.measured_per_byte.items():
            if per_byte > 0:
                self.links.rate(donor, 1 / per_byte)
        self.metrics.write("state_download", version=result.version, seconds=report.seconds,
                           bytes_by_donor=report.bytes_by_donor, failed_donors=report.failed_donors,
                           donors=report.donors, num_duplicated=report.num_duplicated,
                           donor=max(report.bytes_by_donor, key=report.bytes_by_donor.get), digest=digest)

    def _backup_loaded(self, stage: Stage, source: str, version: int, digest: str, started: float) -> None:
        seconds = self.clock() - started
        logger.info(f"stage {stage.index} restored from its backup v{version} ({source}) in {seconds:.2f} s")
        self.metrics.write("backup_restored", stage=stage.index, source=source, version=version, digest=digest,
                           seconds=seconds)
