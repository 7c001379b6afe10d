"""Backups of singly held stages, and rescues of stages that lost their last holder (DESIGN §1 step 7).

Seed 001 §3.4's topology-driven model backup, as three steps every peer runs on its own view of the
swarm (the planner's functions in :mod:`planner.backup_plan` decide; nothing is negotiated):

* :class:`BackupKeeper`: if ``assign_backups`` names this peer the keeper of stage ``k`` (held by
  one peer only), it pulls ``k``'s state from that holder with the replication client, at once and
  then whenever the holder has stepped since, at most every ``--backup-period`` seconds; it keeps
  the copy in memory, advertises it in its record (``backup_stage``, ``backup_version``) and serves
  it through its ``ReplicationServer`` to whoever needs it. It keeps the copy while stage ``k`` is
  unheld (that is when it is needed) and drops it once another peer is the keeper of a held ``k``.
* :class:`RescueWatch`: once a stage has been seen unheld for ``settle`` seconds (and no joiner is
  about to choose it), ``choose_rescues`` names one peer to take it over; that peer's lifecycle
  leaves its own stage and loads the backup (its own copy, or pulled from the keeper). Before it
  moves, it pings the peers it last saw holding that stage (:meth:`RescueWatch.wait_verified_rescue`):
  a view can lose a live holder whose heartbeats did not get through a slow or cut link, and a rescue
  then would start a second copy of the stage from an older backup (found by
  tests/e2e/test_network_faults.py: a peer on a 1 Mbit/s link "rescued" stage 0 from its step-0 copy
  while stage 0's holder trained on).
* a joiner that lands on an unheld stage pulls it from the backup's keeper before it considers a
  checkpoint or the run seed (``Peer._obtain_state``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind.p2p import P2P

from dht.records import PeerRecord, RunSpec
from dht.reputation import Reputation
from peer.config import PeerConfig
from peer.event_log import EventLog
from planner.backup_plan import BackupCopy, Rescue, assign_backups, choose_rescues
from planner.claims import credible_copies
from planner.stage_choice import StageMember
from replication.config import TransferConfig
from replication.layout import StateLayout
from replication.server import SnapshotFn
from replication.transfer import PullResult, TransferError, pull_state
from swarm.model import stage_flops_per_sample, stage_num_params
from swarm.plausibility import implausible
from swarm.stage_state import served_state_template
from swarm.view import SwarmView

__all__ = ["BackupKeeper", "RescueWatch", "StageBackup", "advertised_copies", "pull_copy", "serve_backup", "state_digest"]

logger = logging.getLogger(__name__)

HOLDER_STATES = ("training", "paused")  # peers that hold a stage's live state
MEMBER_STATES = ("training", "paused", "syncing")  # ... or are about to
CHECK_PERIOD = 1.0  # seconds between looks at the view (cheap: no I/O)
RESCUE_GRACE = 60.0  # seconds the named rescuer has to leave its stage and show up on the lost one
MIN_COMPLETE_READS = 3  # view refreshes in a row that beat the DHT timeout before an absence counts
# A refresh waits at least this many times as long as the last pull took, so that backups use at
# most 1 / (1 + BACKOFF_FACTOR) = 20 % of the holder's upload however large the stage or slow the link.
BACKOFF_FACTOR = 4.0


@dataclass(frozen=True)
class StageBackup:
    """The copy of another stage's state this peer keeps.

    Attributes:
        stage: the stage it is a copy of.
        version: the version its holder served (its snapshot's version).
        holder_id / holder_step: the holder it came from, and that holder's optimizer step at the time.
        state: the tensors as ``Stage.state_tensors`` names them (less the local step counter).
        pulled_at: the keeper's clock (``time.monotonic()`` unless injected) when it arrived.
        seconds: how long the pull took.
        digest: ``state_digest`` of its parameters (what ``Stage.params_digest`` gives once loaded).
    """

    stage: int
    version: int
    holder_id: str
    holder_step: int
    state: dict[str, torch.Tensor]
    pulled_at: float
    seconds: float
    digest: str

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """The digest ``Stage.params_digest`` gives for a stage holding ``state`` (its ``model.*`` tensors)."""
    digest = hashlib.blake2b(digest_size=12)
    for name, value in sorted((k[len("model."):], v) for k, v in state.items() if k.startswith("model.")):
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def stage_members(view: SwarmView, num_stages: int, states: tuple[str, ...]) -> list[StageMember]:
    return [StageMember(peer_id=r.peer_id, stage=r.stage, flops=r.flops)
            for k in range(num_stages) for r in view.members(k, states=states)]


def advertised_copies(view: SwarmView, num_stages: int, *, exclude: str = "") -> list[BackupCopy]:
    """The backups working peers (but ``exclude``) advertise that count (``planner.claims.credible_copies``:
    the named keeper's copy of a stage, if it advertises one, whatever version anyone else claims)."""
    copies = [BackupCopy(peer_id=r.peer_id, stage=r.backup_stage, version=r.backup_version)
              for r in view.records if 0 <= r.backup_stage < num_stages and r.state in HOLDER_STATES
              and r.peer_id != exclude]
    return credible_copies(num_stages, stage_members(view, num_stages, HOLDER_STATES), copies)


def serve_backup(backup: StageBackup | None, stage: int) -> SnapshotFn | None:
    """The snapshot function that serves ``backup`` to a request for ``stage`` (None: not a copy of it)."""
    if backup is None or backup.stage != stage:
        return None

    async def snapshot() -> tuple[int, dict[str, torch.Tensor]]:
        return backup.version, backup.state
    return snapshot


async def pull_copy(
    p2p: P2P, spec: RunSpec, stage: int, donors: list[str], *, request_timeout: float,
    reputation: Reputation | None = None,
) -> PullResult:
    """A copy of ``stage``'s state (its holders') or of a backup of it (its keepers'), in memory, from
    ``donors`` under ``spec``'s layout; one donor's manifest is enough (``min_agreeing_donors=1``), and
    only a manifest of exactly the layout ``spec`` implies for ``stage`` is accepted: one that claims
    anything else is refused before anything is allocated, and its donor struck in ``reputation``.

    Raises:
        TransferError, ValueError: as ``pull_state``.
    """
    expected = StateLayout.from_tensors(served_state_template(spec, stage))
    state_bytes = 3 * 4 * stage_num_params(spec, stage)  # float32 parameters and two AdamW moments
    transfer = TransferConfig.for_state(state_bytes, request_timeout=request_timeout, min_agreeing_donors=1)
    with tempfile.TemporaryDirectory(prefix="murmuration-copy-") as store_dir:
        return await pull_state(p2p, donors, run_id=spec.namespace, stage=stage, store_dir=Path(store_dir),
                                config=transfer, reputation=reputation, expected=expected)


class BackupKeeper:
    """Keeps the backup ``planner.backup_plan.assign_backups`` gives this peer, for the peer's whole life
    (across stage moves: a rescuer loads the backup it kept after leaving its own stage).

    :meth:`due` decides at one instant (``now``, by default the injected ``clock``: seconds,
    monotonic); :meth:`run` only repeats :meth:`refresh_once`, jittered by ``rng``, so a test drives
    the decisions with a fake clock, step by step.
    """

    def __init__(self, p2p: P2P, view: SwarmView, spec: RunSpec, *, peer_id: str, config: PeerConfig,
                 metrics: EventLog, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, reputation: Reputation | None = None) -> None:
        self.p2p, self.view, self.spec, self.peer_id = p2p, view, spec, peer_id
        self.config, self.metrics, self.reputation = config, metrics, reputation
        self.clock, self.rng = clock, rng if rng is not None else random.Random()
        self.backup: StageBackup | None = None
        self._failed_at = -float("inf")  # a failed pull waits a period before the next try

    def backup_fn(self, stage: int) -> SnapshotFn | None:
        """``ReplicationServer``'s ``backup_fn``: the snapshot of the backup of ``stage``, if kept."""
        return serve_backup(self.backup, stage)

    def take(self, stage: int) -> StageBackup | None:
        """Hand the backup of ``stage`` over to this peer's own stage (a rescue); None if not kept."""
        backup = self.backup
        if backup is None or backup.stage != stage:
            return None
        self.backup = None
        return backup

    async def run(self, stop: asyncio.Event) -> None:
        """Refresh the backup (if this peer is a keeper) every ``CHECK_PERIOD`` seconds until ``stop``."""
        while not stop.is_set():
            started = self.clock()
            await self.refresh_once()
            elapsed = self.clock() - started
            if elapsed > self.config.backup_period:
                logger.warning(f"a backup refresh took {elapsed:.1f} s, longer than --backup-period")
            await asyncio.sleep(CHECK_PERIOD * self.rng.uniform(0.8, 1.2))

    async def refresh_once(self) -> None:
        """One look at the view: drop a backup nobody needs, pull one that is missing or stale."""
        due = self.due()
        if due is not None:
            await self._pull(*due)

    def refresh_delay(self, backup: StageBackup) -> float:
        """Seconds before ``backup`` may be refreshed: ``--backup-period``, or ``BACKOFF_FACTOR``
        times its pull's duration if longer."""
        return max(self.config.backup_period, BACKOFF_FACTOR * backup.seconds)

    def due(self, now: float | None = None) -> tuple[int, PeerRecord] | None:
        """The stage to back up at ``now`` (default: the clock's reading) and its holder, if any; drops
        a backup this peer no longer keeps (while its stage is unheld, the backup is kept: that is
        when it is needed)."""
        if now is None:
            now = self.clock()
        num_stages = self.spec.num_stages
        standby = [r.peer_id for r in self.view.records if r.state == "standby"]
        duties = assign_backups(num_stages, stage_members(self.view, num_stages, HOLDER_STATES), standby)
        duty = next((d for d in duties.values() if d.keeper_id == self.peer_id), None)
        # dropped once held again (not while a syncing joiner or rescuer may be pulling this very copy)
        if (self.backup is not None and (duty is None or duty.stage != self.backup.stage)
                and self.view.members(self.backup.stage, states=HOLDER_STATES)):
            logger.info(f"dropped the backup of stage {self.backup.stage}: this peer is no longer its keeper")
            self.metrics.write("backup_dropped", of_stage=self.backup.stage, version=self.backup.version)
            self.backup = None
        if self.backup is not None and not self.view.members(self.backup.stage, states=HOLDER_STATES):
            return None  # the only copy of a lost stage: not replaced by another duty until it is held again
        if duty is None:
            return None
        holder = next((r for r in self.view.members(duty.stage, states=HOLDER_STATES) if r.peer_id == duty.holder_id), None)
        current = self.backup
        if holder is None or now - self._failed_at < self.config.backup_period:
            return None
        if current is not None and (current.stage, current.holder_id) == (duty.stage, holder.peer_id) and (
                holder.version <= current.holder_step or now - current.pulled_at < self.refresh_delay(current)):
            return None  # the copy is as new as the holder, or was taken less than a period ago
        return duty.stage, holder

    async def _pull(self, stage: int, holder: PeerRecord) -> None:
        started = self.clock()
        try:
            result = await pull_copy(self.p2p, self.spec, stage, [holder.peer_id],
                                     request_timeout=self.config.request_timeout, reputation=self.reputation)
            _check_identity(self.spec, stage, result.state)
            if reason := await asyncio.to_thread(implausible, result.state, self.spec, stage):
                if self.reputation is not None:  # no honest holder serves it: the seed bound holds for any training
                    self.reputation.strike(holder.peer_id, f"served stage {stage} state no training makes: {reason}",
                                           weight=self.reputation.max_strikes)
                raise ValueError(f"refused its state, which no AdamW training from the run seed makes ({reason})")
        except (TransferError, ValueError) as e:
            self._failed_at = self.clock()
            logger.warning(f"could not back up stage {stage} from {holder.peer_id[-6:]}: {e}; retrying in "
                           f"{self.config.backup_period:.0f} s")
            return
        digest = await asyncio.to_thread(state_digest, result.state)
        pulled_at = self.clock()
        seconds = pulled_at - started
        self.backup = StageBackup(stage=stage, version=result.version, holder_id=holder.peer_id, holder_step=holder.version,
                                  state=result.state, pulled_at=pulled_at, seconds=seconds, digest=digest)
        logger.info(f"backed up stage {stage} v{result.version} from its only holder {holder.peer_id[-6:]} "
                    f"({self.backup.num_bytes / 2**20:.1f} MiB in {seconds:.2f} s)")
        self.metrics.write("backup", of_stage=stage, version=result.version, holder=holder.peer_id,
                           holder_step=holder.version, seconds=seconds, bytes=self.backup.num_bytes, digest=digest)


def _check_identity(spec: RunSpec, stage: int, state: Mapping[str, torch.Tensor]) -> None:
    """A backup must say it is of ``stage`` (the full check runs when a rescuer loads it)."""
    identity = torch.tensor([stage, *spec.stage_layers[stage]], dtype=torch.int64)
    layers = state.get("stage.layers")
    if layers is None or layers.dtype != torch.int64 or layers.shape != identity.shape or not torch.equal(layers, identity):
        raise ValueError(f"the state served as stage {stage} is not of stage {stage}")


class RescueWatch:
    """Names the rescue of a stage nobody holds, once it has stayed unheld for ``settle`` seconds.

    :meth:`check` decides at one instant (``now``, by default the injected ``clock``: seconds,
    monotonic); :meth:`wait_rescue` only repeats it, jittered by ``rng``, so a test drives the
    decision with a fake clock, step by step.

    A peer pinned with ``--stage`` is never named (``choose_rescues``'s ``pinned``): the others read
    it in its record (``PeerRecord.pinned``), and ``pinned`` says it of this peer before its own
    record is in the view.
    """

    def __init__(self, view: SwarmView, spec: RunSpec, *, peer_id: str, settle: float,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 pinned: bool = False) -> None:
        self.view, self.spec, self.peer_id, self.settle, self.pinned = view, spec, peer_id, settle, pinned
        self.clock, self.rng = clock, rng if rng is not None else random.Random()
        self.costs = [stage_flops_per_sample(spec, k) for k in range(spec.num_stages)]
        self._unheld_since: dict[int, float] = {}  # stage -> when first seen unheld
        self._named: dict[int, float] = {}  # stage -> when a rescuer (maybe another peer) was named
        self._holders: dict[int, tuple[str, ...]] = {}  # stage -> the peers last seen holding it
        self._copies: dict[int, tuple[BackupCopy, ...]] = {}  # stage -> the backups of it last advertised
        # stages that lost their holders and that no peer may rescue (each stage left holds one working
        # peer): the stages a layer-wise re-plan removes (peer/relayout.py), with when each was first
        # seen unheld
        self.unrescuable: dict[int, float] = {}

    def last_holders(self, stage: int) -> tuple[str, ...]:
        """The peers this watch last saw holding ``stage`` (none if it never saw it held)."""
        return self._holders.get(stage, ())

    def last_copies(self, stage: int) -> tuple[BackupCopy, ...]:
        """The backups of ``stage`` this watch last saw advertised, newest first (none if never)."""
        return self._copies.get(stage, ())

    async def wait_verified_rescue(
        self, is_answering: Callable[[str], Awaitable[bool]], *,
        on_skipped: Callable[[Rescue, list[str]], None] = lambda rescue, answering: None,
    ) -> Rescue:
        """Like :meth:`wait_rescue`, but a rescue of a stage whose last holders still answer
        ``is_answering`` (a ping) is skipped (``on_skipped``) and the stage watched again: its holder
        is alive, only its record is missing from this peer's view. Once the grace period of the
        skipped rescue is over, it is checked again."""
        while True:
            rescue = await self.wait_rescue()
            holders = self.last_holders(rescue.to_stage)
            answers = await asyncio.gather(*(is_answering(peer_id) for peer_id in holders))
            answering = [peer_id for peer_id, answered in zip(holders, answers) if answered]
            if not answering:
                return rescue
            on_skipped(rescue, answering)

    async def wait_rescue(self) -> Rescue:
        """Returns once this peer is the one to rescue a stage (never otherwise; cancelled on leave)."""
        while True:
            rescue = self.check()
            if rescue is not None:
                return rescue
            await asyncio.sleep(CHECK_PERIOD * self.rng.uniform(0.8, 1.2))

    def check(self, now: float | None = None) -> Rescue | None:
        """This peer's rescue, if the current view calls for one at ``now`` (default: the clock's
        reading); see the module docstring."""
        if now is None:
            now = self.clock()
        num_stages = self.spec.num_stages
        # from the records, peers this peer's failure detector suspects included: a rescue moves state and
        # is not undone, so it waits for the DHT's verdict (the holder's record expired, or says it left).
        # A suspicion may only mean that the link between the two is slow: a peer on a 1 Mbit/s link
        # suspected stage 0's holder (pings queue behind activations on one connection) and "rescued"
        # stage 0 while its holder trained on (tests/e2e/test_network_faults.py)
        members = [StageMember(peer_id=r.peer_id, stage=r.stage, flops=r.flops) for r in self.view.records
                   if 0 <= r.stage < num_stages and r.state in MEMBER_STATES]
        held = {m.stage for m in members}
        for stage in held:
            self._holders[stage] = tuple(sorted(m.peer_id for m in members if m.stage == stage))
        for stage in range(num_stages):
            if stage in held:
                self._unheld_since.pop(stage, None)
                self._named.pop(stage, None)
            elif self.view.complete_reads < MIN_COMPLETE_READS:
                # the view's recent reads waited out DHT timeouts: this peer's own link may be the slow
                # or cut one, and a record it could not read is no evidence; the settle time restarts
                # once reads complete again (a peer on a 1 Mbit/s link restored stage 0 from an old
                # backup while stage 0's holder trained on: tests/e2e/test_network_faults.py in CI)
                self._unheld_since[stage] = now
            else:
                self._unheld_since.setdefault(stage, now)
        copies = advertised_copies(self.view, num_stages)
        for stage in {c.stage for c in copies}:
            self._copies[stage] = tuple(sorted((c for c in copies if c.stage == stage), key=lambda c: (-c.version, c.peer_id)))
        if any(r.state == "joining" for r in self.view.records):
            self.unrescuable = {}
            return None  # a joiner prefers an unheld stage: let it choose first
        paused = {r.peer_id for r in self.view.records if r.state == "paused"}
        pinned = {r.peer_id for r in self.view.records if r.pinned} | ({self.peer_id} if self.pinned else set())
        rescues = choose_rescues(self.costs, members, copies, unmovable=paused, pinned=pinned)
        rescued = {r.to_stage for r in rescues}
        # a stage this watch never saw held is not lost (a swarm still forming): a joiner will fill it
        self.unrescuable = {k: self._unheld_since[k] for k in range(num_stages)
                            if k not in held and k not in rescued and k in self._holders}
        for rescue in rescues:
            named_at = self._named.get(rescue.to_stage)
            if now - self._unheld_since[rescue.to_stage] < self.settle:
                continue  # a view that missed a record for a moment must not move anyone
            if named_at is not None and now - named_at < RESCUE_GRACE:
                continue  # the peer named is leaving its stage (its record says "leaving", or nothing yet)
            self._named[rescue.to_stage] = now
            if rescue.peer_id == self.peer_id:
                return rescue
        return None
