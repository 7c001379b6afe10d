"""The joiner's side of state replication: pull one stage's state from several donors at once.

Seed 003 §III over hivemind P2P (the donor side is ``replication/server.py``; the steps, the
wire format and every deviation are in docs/replication.md, "Transfer"):

1. probe every donor, all at once: d_u (t^prop) from an empty probe, b_u (t^trans) from the slope
   to a ``probe_bytes`` probe;
2. agree on the manifest: the largest group of identical manifests wins, the other donors are
   dropped and reported;
3. Alg. 1 (``plan_replication``) chooses s, and the manifest at s is confirmed; a resumed download
   keeps its s;
4. ``ShardStore.open`` keeps the verified shards already on disk;
5. Alg. 2 (``replan``) assigns the missing shards; per donor, one worker set pulls its queue with
   ``max_in_flight_per_donor`` requests in flight. A donor that fails, stalls past its deadline,
   refuses or serves a bad shard is dropped and its shards go through Alg. 2 again over the
   survivors (f_u = when each is free); a donor that runs dry triggers Alg. 2 over every queued
   shard with the rates measured so far;
6. the state is rebuilt from the verified bytes.

With requests pipelined a donor pays d_u once per ``max_in_flight_per_donor`` shards, so the planner
is given d_u / max_in_flight_per_donor ("a transport that pipelines requests should pass a smaller
effective d_u", docs/replication.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch
from hivemind.p2p import P2P

from dht.rpc import PeerUnavailableError, RemoteError, call_peer
from dht.wire import ProtocolError
from replication.assignment import NeighbourLink, SearchConfig, plan_replication, replan
from replication.manifest import Manifest, ManifestError, ManifestLimits, restore_state
from replication.server import (
    MAX_PROBE_BYTES, MAX_REQUEST_SHARD_BYTES, MIN_REQUEST_SHARD_BYTES, manifest_handler, padded_bytes,
    probe_handler, shard_handler, unpack_bytes,
)
from replication.shard_store import MANIFEST_FILE, ShardStore

__all__ = ["PullReport", "PullResult", "TransferConfig", "TransferError", "call_manifest", "call_probe",
           "call_shard", "pull_state"]

logger = logging.getLogger(__name__)

MIN_PER_BYTE_DELAY = 1e-11  # 100 GB/s: a floor so that loopback noise never gives b_u <= 0
_DONOR_FAULTS = (PeerUnavailableError, RemoteError, ProtocolError, ManifestError)


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """How a joiner pulls state (seed 003 §III); composed into the peer's config.

    Attributes:
        search: Alg. 1's bounds on the shard size s; the largest s (16 MiB by default) bounds the
            memory of shards in flight (donors x ``max_in_flight_per_donor`` x s).
        max_in_flight_per_donor: shard requests outstanding per donor; raise on high-latency links.
        rebalance: re-plan the queued shards with measured rates whenever a donor runs dry; turn
            off only to measure the static plan.
        probe_bytes: size of the bandwidth probe (bytes, <= 4 MiB); larger is more accurate.
        num_probe_rounds: probes per donor and size; the fastest is kept (filters scheduler noise).
        request_timeout: seconds for one probe or manifest call.
        shard_timeout_floor: seconds added to every shard deadline (covers jitter, GC, disk).
        shard_timeout_slack: multiplier on a shard's estimated time in its deadline; lower it to
            drop stalling donors sooner, raise it on links whose speed swings.
        min_agreeing_donors: manifests that must be identical before any shard is fetched
            (fewer only when fewer donors answered).
        manifest_limits: caps on what a donor's manifest may make us allocate.
    """

    search: SearchConfig = field(default_factory=lambda: SearchConfig(max_shard_bytes=16 * 1024 * 1024))
    max_in_flight_per_donor: int = 2
    rebalance: bool = True
    probe_bytes: int = 1024 * 1024
    num_probe_rounds: int = 2
    request_timeout: float = 10.0
    shard_timeout_floor: float = 5.0
    shard_timeout_slack: float = 4.0
    min_agreeing_donors: int = 2
    manifest_limits: ManifestLimits = field(default_factory=ManifestLimits)

    def __post_init__(self) -> None:
        for name, high in (("max_in_flight_per_donor", 1 << 10), ("num_probe_rounds", 100),
                           ("min_agreeing_donors", 1 << 10), ("probe_bytes", MAX_PROBE_BYTES)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"{name} must be an int in [1, {high}], got {value!r}")
        for name in ("request_timeout", "shard_timeout_floor", "shard_timeout_slack"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if not isinstance(self.rebalance, bool):
            raise ValueError(f"rebalance must be a bool, got {self.rebalance!r}")
        if not isinstance(self.search, SearchConfig) or not isinstance(self.manifest_limits, ManifestLimits):
            raise ValueError("search must be a SearchConfig and manifest_limits a ManifestLimits")


@dataclass
class PullReport:
    """What happened during one pull (for logs, metrics and tests).

    Attributes:
        links: donor -> (d_u seconds per request, b_u seconds per byte) as probed.
        shard_bytes: the s chosen by Alg. 1; num_shards: K.
        estimated_seconds: Alg. 2's makespan for the shards that were missing at the start.
        seconds: wall time of the whole pull.
        phase_seconds: wall time of each phase: "probe", "manifest" (agreement, plan, store
            opened), "transfer" (the shards), "restore" (re-read, re-verify, rebuild tensors).
        bytes_by_donor / shards_by_donor: verified shard bytes / shards received from each donor.
        failed_donors: donor -> why it was dropped (probe failure, disagreeing manifest, fault).
        num_shard_requests: shard requests sent, failed ones included.
        num_refetched: shards re-assigned to another donor after theirs was dropped.
        num_resumed: shards already on disk (verified) when the pull started.
    """

    links: dict[str, tuple[float, float]] = field(default_factory=dict)
    shard_bytes: int = 0
    num_shards: int = 0
    estimated_seconds: float = 0.0
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    bytes_by_donor: dict[str, int] = field(default_factory=dict)
    shards_by_donor: dict[str, int] = field(default_factory=dict)
    failed_donors: dict[str, str] = field(default_factory=dict)
    num_shard_requests: int = 0
    num_refetched: int = 0
    num_resumed: int = 0


@dataclass(frozen=True)
class PullResult:
    """The pulled state (CPU tensors, bit-identical to the donors'), its version and the report."""

    version: int
    state: dict[str, torch.Tensor]
    report: PullReport


class TransferError(RuntimeError):
    """The pull could not complete (no donor left, or no agreement); ``report`` says what happened."""

    def __init__(self, message: str, report: PullReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class _Request:
    """What every call of one pull shares."""

    p2p: P2P
    run_id: str
    stage: int
    config: TransferConfig


async def call_probe(p2p: P2P, peer_id: str, *, run_id: str, nbytes: int, timeout: float) -> float:
    """Seconds for one probe of ``nbytes`` zero bytes from ``peer_id`` (stream set-up included)."""
    started = time.perf_counter()
    reply, tensors = await call_peer(p2p, peer_id, probe_handler(run_id), {"nbytes": nbytes},
                                     timeout=timeout, max_payload_bytes=padded_bytes(nbytes))
    if reply.get("nbytes") != nbytes:
        raise ProtocolError(f"{peer_id[-6:]} answered a probe of {nbytes} bytes with something else")
    unpack_bytes(tensors, nbytes)
    return time.perf_counter() - started


async def call_manifest(request: _Request, peer_id: str, *, shard_bytes: int, version: int | None) -> Manifest:
    """The donor's manifest at ``shard_bytes`` (of ``version`` if given), checked to be what we asked for."""
    header: dict[str, Any] = {"stage": request.stage, "shard_bytes": shard_bytes}
    if version is not None:
        header["version"] = version
    config = request.config
    reply, _ = await call_peer(request.p2p, peer_id, manifest_handler(request.run_id), header,
                               timeout=config.request_timeout, max_payload_bytes=0)
    manifest = Manifest.from_wire(reply.get("manifest"), limits=config.manifest_limits)
    wanted = (request.run_id, request.stage, shard_bytes)
    if (manifest.run_id, manifest.stage, manifest.shard_bytes) != wanted or version not in (None, manifest.version):
        raise ManifestError(f"{peer_id[-6:]} sent a manifest for something else than {wanted} v{version}")
    return manifest


async def call_shard(request: _Request, peer_id: str, manifest: Manifest, index: int, *, timeout: float) -> memoryview:
    """Shard ``index`` of ``manifest`` from ``peer_id`` (not yet hash-checked)."""
    start, end = manifest.shard_range(index)
    header = {"stage": request.stage, "version": manifest.version, "shard_bytes": manifest.shard_bytes, "index": index}
    reply, tensors = await call_peer(request.p2p, peer_id, shard_handler(request.run_id), header,
                                     timeout=timeout, max_payload_bytes=padded_bytes(end - start))
    if reply.get("index") != index or reply.get("nbytes") != end - start:
        raise ProtocolError(f"{peer_id[-6:]} answered shard {index} with something else")
    return unpack_bytes(tensors, end - start)


async def probe_donors(request: _Request, donors: Sequence[str], report: PullReport) -> dict[str, NeighbourLink]:
    """Seed 003 §III-A's d_u and b_u for each donor that answers; the others go to the report."""
    config = request.config

    async def probe(peer_id: str) -> NeighbourLink | None:
        tiny, big = float("inf"), float("inf")
        try:
            for _ in range(config.num_probe_rounds):
                tiny = min(tiny, await call_probe(request.p2p, peer_id, run_id=request.run_id, nbytes=0,
                                                  timeout=config.request_timeout))
                big = min(big, await call_probe(request.p2p, peer_id, run_id=request.run_id,
                                                nbytes=config.probe_bytes, timeout=config.request_timeout))
        except _DONOR_FAULTS as e:
            _drop(report, peer_id, f"probe failed: {e}")
            return None
        per_byte = max((big - tiny) / config.probe_bytes, MIN_PER_BYTE_DELAY)
        logger.debug(f"replication: {peer_id[-6:]} d={tiny * 1e3:.2f} ms, {1e-6 / per_byte:.1f} MB/s")
        return NeighbourLink(peer_id=peer_id, propagation_delay=tiny, per_byte_delay=per_byte)

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(probe(peer_id)) for peer_id in donors]
    links = {link.peer_id: link for link in (task.result() for task in tasks) if link is not None}
    report.links.update({p: (link.propagation_delay, link.per_byte_delay) for p, link in links.items()})
    return links


def _drop(report: PullReport, peer_id: str, reason: str) -> None:
    report.failed_donors.setdefault(peer_id, reason)
    logger.warning(f"replication: dropping donor {peer_id[-6:]}: {reason}")


async def agree_on_manifest(
    request: _Request, donors: Sequence[str], report: PullReport, *, shard_bytes: int, version: int | None
) -> tuple[list[str], Manifest]:
    """The manifest the largest group of donors agrees on, and that group (seed 003 §III-A's K).

    Raises:
        TransferError: no donor answered, or fewer than ``min_agreeing_donors`` agree although
            that many answered.
    """
    async def fetch(peer_id: str) -> Manifest | None:
        try:
            return await call_manifest(request, peer_id, shard_bytes=shard_bytes, version=version)
        except _DONOR_FAULTS as e:
            _drop(report, peer_id, f"manifest request failed: {e}")
            return None

    async with asyncio.TaskGroup() as group:
        tasks = {peer_id: group.create_task(fetch(peer_id)) for peer_id in donors}
    manifests = {peer_id: task.result() for peer_id, task in tasks.items() if task.result() is not None}
    groups: dict[bytes, list[str]] = {}
    for peer_id, manifest in sorted(manifests.items()):
        groups.setdefault(msgpack.packb(manifest.to_wire()), []).append(peer_id)
    if not groups:
        raise TransferError("no donor sent a usable manifest", report)
    winner = max(groups, key=lambda key: (len(groups[key]), manifests[groups[key][0]].version, key))
    agreeing, manifest = groups[winner], manifests[groups[winner][0]]
    for peer_id in sorted(set(manifests) - set(agreeing)):
        _drop(report, peer_id, f"its manifest (v{manifests[peer_id].version}) disagrees with "
                               f"{len(agreeing)} donor(s) at v{manifest.version}")
    if len(agreeing) < min(request.config.min_agreeing_donors, len(manifests)):
        raise TransferError(f"no {request.config.min_agreeing_donors} donors agree on the manifest", report)
    return agreeing, manifest


async def pull_state(
    p2p: P2P, donors: Sequence[str], *, run_id: str, stage: int, store_dir: Path, config: TransferConfig
) -> PullResult:
    """Pulls stage ``stage``'s state from ``donors`` (seed 003 §III), resuming from ``store_dir``.

    Raises:
        TransferError: the state could not be completed; its ``report`` says which donor failed how.
        ValueError: no donors given.
    """
    report, clock = PullReport(), time.monotonic()
    donors = sorted(set(donors))
    if not donors:
        raise ValueError("pull_state needs at least one donor")
    request = _Request(p2p, run_id, stage, config)
    links = await probe_donors(request, donors, report)
    clock = _lap(report, "probe", clock)
    agreeing, manifest = await agree_and_plan(request, links, report, store_dir=store_dir)
    report.shard_bytes, report.num_shards = manifest.shard_bytes, manifest.num_shards
    store = await asyncio.to_thread(ShardStore.open, store_dir, manifest)
    report.num_resumed = len(store.held_shards())
    clock = _lap(report, "manifest", clock)
    fetcher = _ShardFetcher(request, store, {p: links[p] for p in agreeing}, report)
    await fetcher.run()
    clock = _lap(report, "transfer", clock)
    # Every shard was verified on arrival; a buffer filled in memory needs no second pass over the
    # disk. Shards resumed from disk are read back by assemble(), which re-verifies them.
    data = fetcher.assembled() or await asyncio.to_thread(store.assemble)
    state = await asyncio.to_thread(restore_state, manifest, data, verify=False)
    _lap(report, "restore", clock)
    report.seconds = sum(report.phase_seconds.values())
    logger.info(f"replication: stage {stage} v{manifest.version} pulled, {manifest.total_bytes} bytes in "
                f"{report.seconds:.2f} s from {len(report.bytes_by_donor)} donors, "
                f"{len(report.failed_donors)} dropped, {report.num_resumed} shards resumed")
    return PullResult(manifest.version, state, report)


def _lap(report: PullReport, phase: str, since: float) -> float:
    now = time.monotonic()
    report.phase_seconds[phase] = now - since
    return now


async def agree_and_plan(
    request: _Request, links: dict[str, NeighbourLink], report: PullReport, *, store_dir: Path
) -> tuple[list[str], Manifest]:
    """Steps 2-3: the agreed manifest at the s of Alg. 1 (or of the download being resumed).

    The manifest at s is asked of the ``min_agreeing_donors`` fastest agreeing donors (of all if
    one of those fails or disagrees): the first digests cover every byte, so the other agreeing
    donors hold the same bytes, and are spared a hash pass."""
    config = request.config
    agreeing, first = await agree_on_manifest(request, sorted(links), report,
                                              shard_bytes=config.search.max_shard_bytes, version=None)
    shard_bytes = _read_resumable_shard_bytes(store_dir, first, config.manifest_limits)
    if shard_bytes is None:
        shard_bytes = plan_replication(first.total_bytes, [_pipelined(links[p], config) for p in agreeing],
                                       now=0.0, config=config.search).shard_bytes
    if shard_bytes == first.shard_bytes:
        return agreeing, first
    asked = sorted(agreeing, key=lambda p: (links[p].per_byte_delay, p))[: config.min_agreeing_donors]
    confirmed, manifest = await agree_on_manifest(request, asked, report, shard_bytes=shard_bytes,
                                                  version=first.version)
    if len(confirmed) < len(asked):
        asked = [p for p in agreeing if p not in report.failed_donors]
        confirmed, manifest = await agree_on_manifest(request, asked, report, shard_bytes=shard_bytes,
                                                      version=first.version)
    if (manifest.tensors, manifest.total_bytes) != (first.tensors, first.total_bytes):
        raise TransferError("the manifest changed between shard sizes", report)
    return [p for p in agreeing if p not in report.failed_donors], manifest


def _read_resumable_shard_bytes(store_dir: Path, agreed: Manifest, limits: ManifestLimits) -> int | None:
    """The s of an interrupted download of the same state in ``store_dir`` (a new s would orphan
    every shard held). Not trusted: the donors confirm the manifest at that s, and
    ``ShardStore.open`` re-verifies every shard file against what they confirm."""
    try:
        stored = Manifest.from_wire(msgpack.unpackb((store_dir / MANIFEST_FILE).read_bytes()), limits=limits)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        logger.info(f"replication: ignoring the unreadable manifest in {store_dir}: {e}")
        return None
    same_state = (stored.run_id, stored.stage, stored.version, stored.tensors) == (
        agreed.run_id, agreed.stage, agreed.version, agreed.tensors)
    shard_bytes_ok = MIN_REQUEST_SHARD_BYTES <= stored.shard_bytes <= MAX_REQUEST_SHARD_BYTES
    return stored.shard_bytes if same_state and shard_bytes_ok else None


def _pipelined(link: NeighbourLink, config: TransferConfig) -> NeighbourLink:
    """The link as the planner should see it when requests are pipelined (see the module docstring)."""
    delay = link.propagation_delay / config.max_in_flight_per_donor
    return dataclasses.replace(link, propagation_delay=delay)


class _ShardFetcher:
    """Pulls the missing shards of one store: one worker set per donor, re-planning on faults."""

    def __init__(self, request: _Request, store: ShardStore, links: dict[str, NeighbourLink],
                 report: PullReport) -> None:
        self.request, self.store, self.links, self.report = request, store, links, report
        self.manifest = store.manifest
        self.queues: dict[str, deque[int]] = {peer_id: deque() for peer_id in links}
        self.in_flight: dict[str, dict[int, float]] = {peer_id: {} for peer_id in links}  # index -> sent at
        self.workers: dict[str, set[asyncio.Task]] = {peer_id: set() for peer_id in links}
        self.failed: set[str] = set()
        # The state assembled in memory as verified shards arrive, when none comes from disk.
        self.buffer = bytearray(self.manifest.total_bytes) if not store.held_shards() else None
        self.busy_seconds = dict.fromkeys(links, 0.0)  # worker time per shard slot, summed
        self.num_bytes_done = dict.fromkeys(links, 0)
        self._lock = threading.Lock()
        self._credited: set[int] = set(store.held_shards())  # in ``buffer`` too, when there is one
        self._group: asyncio.TaskGroup | None = None

    async def run(self) -> None:
        missing = self.store.missing_shards()
        started = time.monotonic()
        async with asyncio.TaskGroup() as group:
            self._group = group
            self.report.estimated_seconds = self._assign(missing) - started
        if not self.store.is_complete():
            reasons = "; ".join(f"{p[-6:]}: {why}" for p, why in self.report.failed_donors.items())
            raise TransferError(f"shards missing and no donor left ({reasons})", self.report)

    def _planning_link(self, peer_id: str, now: float) -> NeighbourLink:
        """What Alg. 2 should assume of ``peer_id`` now: measured once it sent two shards, else probed.

        A measured slot (worker time per shard / shards in flight) holds d_u, hence d = 0; f_u is
        when the donor is through what it has queued or in flight, one slot each."""
        if self.num_bytes_done[peer_id] >= 2 * self.manifest.shard_bytes:
            link = NeighbourLink(peer_id=peer_id, propagation_delay=0.0,
                                 per_byte_delay=self.busy_seconds[peer_id] / self.num_bytes_done[peer_id])
        else:
            link = _pipelined(self.links[peer_id], self.request.config)
        slot = link.propagation_delay + self.manifest.shard_bytes * link.per_byte_delay
        # A donor that has kept a request unanswered for T seconds is taken to need T per shard
        # now: a stalled donor attracts no queued shards while its deadline runs.
        slot = max([slot, *(now - sent_at for sent_at in self.in_flight[peer_id].values())])
        num_pending = len(self.queues[peer_id]) + len(self.in_flight[peer_id])
        return dataclasses.replace(link, free_time=now + num_pending * slot)

    def _assign(self, shards: Sequence[int]) -> float:
        """Alg. 2 over the surviving donors, each free once its queue drains; returns the makespan."""
        now, config = time.monotonic(), self.request.config
        survivors = [self._planning_link(p, now) for p in sorted(self.links) if p not in self.failed]
        if not shards or not survivors:
            return now
        plan = replan(shards, survivors, total_bytes=self.manifest.total_bytes,
                      shard_bytes=self.manifest.shard_bytes, now=now)
        for peer_id, indices in plan.shards_by_peer.items():
            self.queues[peer_id].extend(indices)
            while len(self.workers[peer_id]) < min(config.max_in_flight_per_donor, len(self.queues[peer_id])):
                task = self._group.create_task(self._work(peer_id))
                self.workers[peer_id].add(task)
                task.add_done_callback(self.workers[peer_id].discard)
        return plan.makespan

    async def _work(self, peer_id: str) -> None:
        queue, config = self.queues[peer_id], self.request.config
        link = self.links[peer_id]
        deadline = config.shard_timeout_floor + config.shard_timeout_slack * config.max_in_flight_per_donor * (
            link.propagation_delay + self.manifest.shard_bytes * link.per_byte_delay)
        while queue and peer_id not in self.failed:
            index = queue.popleft()
            if index in self.store.held_shards():
                continue
            started = self.in_flight[peer_id][index] = time.monotonic()
            self.report.num_shard_requests += 1
            num_sharing = len(self.in_flight[peer_id])
            try:
                data = await call_shard(self.request, peer_id, self.manifest, index, timeout=deadline)
                await asyncio.to_thread(self._store, peer_id, index, data)
            except _DONOR_FAULTS as e:
                self._fail(peer_id, f"shard {index}: {type(e).__name__}: {e}")
                return
            finally:
                self.in_flight[peer_id].pop(index, None)
            self.busy_seconds[peer_id] += (time.monotonic() - started) / num_sharing
            self.num_bytes_done[peer_id] += len(data)
        self.workers[peer_id].discard(asyncio.current_task())  # so that _rebalance may start another
        if config.rebalance and peer_id not in self.failed:
            self._rebalance()

    def _rebalance(self) -> None:
        """Alg. 2 again over every shard still queued, with the rates measured so far."""
        queued = sorted(index for queue in self.queues.values() for index in queue)
        if queued:
            for queue in self.queues.values():
                queue.clear()
            self._assign(queued)

    def assembled(self) -> bytearray | None:
        """The state buffer if every shard was verified and copied into it (None: use the store).

        A worker cancelled while its thread stores a shard may leave the shard held on disk but
        not yet copied here; the store then has it.
        """
        with self._lock:
            return self.buffer if len(self._credited) == self.manifest.num_shards else None

    def _store(self, peer_id: str, index: int, data: memoryview) -> None:
        """Verifies and writes one shard, then credits its donor (in a thread: hashing and disk).

        Credited here, not in the worker, because a worker cancelled while its thread runs still
        stores the shard; a shard that two donors delivered is credited once.
        """
        self.store.put_shard(index, data)
        if self.buffer is not None:  # distinct shards are disjoint slices: no lock needed
            start, end = self.manifest.shard_range(index)
            memoryview(self.buffer)[start:end] = data
        with self._lock:
            if index in self._credited:
                return
            self._credited.add(index)
            self.report.bytes_by_donor[peer_id] = self.report.bytes_by_donor.get(peer_id, 0) + len(data)
            self.report.shards_by_donor[peer_id] = self.report.shards_by_donor.get(peer_id, 0) + 1

    def _fail(self, peer_id: str, reason: str) -> None:
        """Drops ``peer_id`` and re-plans its unfinished shards onto the survivors (seed 003 §III-B)."""
        if peer_id in self.failed:
            return
        self.failed.add(peer_id)
        _drop(self.report, peer_id, reason)
        orphans = sorted((set(self.queues[peer_id]) | set(self.in_flight[peer_id])) - self.store.held_shards())
        self.queues[peer_id].clear()
        for task in self.workers[peer_id]:
            if task is not asyncio.current_task():
                task.cancel()  # its request would only duplicate a shard now re-planned elsewhere
        self.report.num_refetched += len(orphans)
        self._assign(orphans)
