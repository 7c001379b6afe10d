"""The joiner's side of state replication: pull one stage's state from several donors at once.

Seed 003 §III over hivemind P2P (the donor side is ``replication/server.py``; the steps, the
wire format and every deviation are in docs/replication.md, "Transfer"):

1. at once, for every donor: probe d_u (an empty probe) and b_u (the slope to a ``probe_bytes``
   probe), and ask for the manifest, hashed at the piece size p (``piece_size_for``);
2. agree on the manifest: the largest group of identical manifests wins, the other donors are
   dropped and reported;
3. ``ShardStore.open`` keeps the verified pieces already on disk (a resumed download);
4. Alg. 1 (``plan_replication``) chooses s, a multiple of p, over the missing bytes: one request
   fetches up to s / p consecutive pieces, each verified against its own digest, so no second
   manifest (and no second hash pass on the donors) is needed;
5. Alg. 2 assigns the requests; ``PieceFetcher`` carries the plan out, re-planning on measured rates
   and on faults, and ends with the end game (``replication/fetcher.py``);
6. the state is rebuilt from the verified bytes, sharing the buffer they arrived in.

If the donors evicted the version being pulled before every piece came (a lone holder that steps
while it serves a slow link, issue #15; its pins, ``replication/pins.py``, normally prevent it), the
pull goes back to step 2 with the newest manifest of those donors, keeping the pieces it still has,
at most ``max_version_replans`` times (``_replan_version``).

With requests pipelined a donor pays d_u once per ``max_in_flight_per_donor`` requests, so the
planner is given d_u / ``max_in_flight_per_donor`` ("a transport that pipelines requests should
pass a smaller effective d_u", docs/replication.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch
from hivemind.p2p import P2P

from dht.clock import SYSTEM_CLOCK
from dht.reputation import Reputation
from replication.assignment import NeighbourLink, plan_replication
from replication.client import DONOR_FAULTS, Session, call_manifest, call_probe
from replication.config import TransferConfig
from replication.fetcher import CORRUPT_PIECE_STRIKES, PieceFetcher, split_runs
from replication.layout import StateLayout
from replication.manifest import Manifest, ManifestError, restore_state
from replication.pull_report import DisagreementError, PullReport, StaleVersionError, TransferError, drop_donor
from replication.shard_store import ShardStore

__all__ = ["PullReport", "PullResult", "TransferConfig", "TransferError", "agree_on_manifest", "probe_donors",
           "pull_state"]

logger = logging.getLogger(__name__)

MIN_PER_BYTE_DELAY = 1e-11  # 100 GB/s: a floor so that loopback noise never gives b_u <= 0
# s is capped so that an even split would give every donor at least this many requests. Probes are
# short and often off by 2x on a busy host (a 1 MiB probe lasts 20 ms on a 400 Mbit/s link); with
# several requests per donor the rates measured on the first ones correct the plan, and the end game
# can copy a late one, whereas one huge request per donor can be neither moved nor copied cheaply.
MIN_RUNS_PER_DONOR = 16
# An honest donor builds its manifest with build_manifest from the stage the run spec describes, so
# one that does not parse, is of something else or of another layout is proof of lying, as a
# corrupt piece is: it weighs as much.
REFUSED_MANIFEST_STRIKES = CORRUPT_PIECE_STRIKES


@dataclass(frozen=True)
class PullResult:
    """The pulled state (CPU tensors, bit-identical to the donors'), its version and the report."""

    version: int
    state: dict[str, torch.Tensor]
    report: PullReport


async def probe_donors(session: Session, donors: Sequence[str], report: PullReport) -> dict[str, NeighbourLink]:
    """Seed 003 §III-A's d_u and b_u for each donor that answers; the others go to the report."""
    config = session.config

    async def probe(peer_id: str) -> NeighbourLink | None:
        tiny, big = float("inf"), float("inf")
        try:
            for _ in range(config.num_probe_rounds):
                tiny = min(tiny, await call_probe(session.p2p, peer_id, run_id=session.run_id, nbytes=0,
                                                  timeout=config.request_timeout, clock=session.clock))
                big = min(big, await call_probe(session.p2p, peer_id, run_id=session.run_id,
                                                nbytes=config.probe_bytes, timeout=config.request_timeout,
                                                clock=session.clock))
        except DONOR_FAULTS as e:
            drop_donor(report, peer_id, f"probe failed: {e}")
            return None
        per_byte = max((big - tiny) / config.probe_bytes, MIN_PER_BYTE_DELAY)
        logger.debug(f"replication: {peer_id[-6:]} d={tiny * 1e3:.2f} ms, {1e-6 / per_byte:.1f} MB/s")
        return NeighbourLink(peer_id=peer_id, propagation_delay=tiny, per_byte_delay=per_byte)

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(probe(peer_id)) for peer_id in donors]
    links = {link.peer_id: link for link in (task.result() for task in tasks) if link is not None}
    report.links.update({p: (link.propagation_delay, link.per_byte_delay) for p, link in links.items()})
    return links


async def agree_on_manifest(
    session: Session, donors: Sequence[str], report: PullReport, *, version: int | None = None
) -> tuple[list[str], Manifest]:
    """The manifest the largest group of donors agrees on, and that group (seed 003 §III-A's K).

    A donor whose manifest is refused (malformed, of something else, or not of ``session.expected``)
    is dropped and struck ``REFUSED_MANIFEST_STRIKES`` times in ``session.reputation``: nothing was
    allocated for it.

    Raises:
        TransferError: no donor answered, or fewer than ``min_agreeing_donors`` agree although
            that many answered.
    """
    config = session.config

    async def fetch(peer_id: str) -> Manifest | None:
        try:
            return await call_manifest(session, peer_id, piece_bytes=config.piece_bytes, version=version)
        except ManifestError as e:
            drop_donor(report, peer_id, f"manifest refused: {e}")
            if session.reputation is not None:
                session.reputation.strike(peer_id, f"sent a refused manifest: {e}", weight=REFUSED_MANIFEST_STRIKES)
            return None
        except DONOR_FAULTS as e:
            drop_donor(report, peer_id, f"manifest request failed: {e}")
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
        drop_donor(report, peer_id, f"its manifest (v{manifests[peer_id].version}) disagrees with "
                                    f"{len(agreeing)} donor(s) at v{manifest.version}")
    if len(agreeing) < min(config.min_agreeing_donors, len(manifests)):
        raise DisagreementError(f"no {config.min_agreeing_donors} donors agree on the manifest", report)
    return agreeing, manifest


async def pull_state(
    p2p: P2P, donors: Sequence[str], *, run_id: str, stage: int, store_dir: Path, config: TransferConfig,
    reputation: Reputation | None = None, expected: StateLayout | None = None, clock: Callable[[], float] = SYSTEM_CLOCK,
) -> PullResult:
    """Pulls stage ``stage``'s state from ``donors`` (seed 003 §III), resuming from ``store_dir``.

    ``expected``: the layout the run spec implies (``swarm.stage_state.served_state_template``); a
    manifest of any other is refused before anything is sized from it. None (``config.manifest_limits``
    only) is for synthetic states in tests and benchmarks. With ``reputation``, banned donors are not
    asked, one whose manifest is refused is struck ``REFUSED_MANIFEST_STRIKES`` times, and one that sends
    a piece that does not match the agreed manifest ``CORRUPT_PIECE_STRIKES`` times (``fetcher.py``).

    Raises:
        TransferError: the state could not be completed; its ``report`` says which donor failed how.
        ValueError: no donors given.
    """
    report, since = PullReport(), clock()
    donors = _unbanned(donors, reputation, report)
    session = Session(p2p, run_id, stage, config, reputation, expected, clock=clock)
    links, (agreeing, manifest) = await asyncio.gather(
        probe_donors(session, donors, report), agree_on_manifest(session, donors, report))
    while True:
        usable = {peer_id: links[peer_id] for peer_id in agreeing if peer_id in links}
        if not usable:
            raise TransferError("no donor both answered the probes and agreed on the manifest", report)
        report.donors = sorted(usable)
        since = _lap(report, "probe", since, clock=clock)
        try:
            store, fetcher, since = await _fetch_pieces(session, store_dir, manifest, usable, report, since)
            break
        except StaleVersionError as e:
            since = clock()  # the failed attempt's plan and transfer are lapped already
            agreeing, manifest = await _replan_version(session, manifest, e, report)
    # Every piece was verified on arrival; a buffer filled in memory needs no second pass over the
    # disk, and the tensors share it. Pieces resumed from disk are read back by assemble(), which
    # re-verifies them.
    data = fetcher.assembled()
    if data is None:
        data = await asyncio.to_thread(store.assemble)
    state = await asyncio.to_thread(restore_state, manifest, data, verify=False, share=True)
    _lap(report, "restore", since, clock=clock)
    report.seconds = sum(report.phase_seconds.values())
    logger.info(f"replication: stage {stage} v{manifest.version} pulled, {manifest.total_bytes} bytes in "
                f"{report.seconds:.2f} s from {len(report.bytes_by_donor)} donors, "
                f"{len(report.failed_donors)} dropped, {report.num_resumed} pieces resumed")
    return PullResult(manifest.version, state, report)


def _unbanned(donors: Sequence[str], reputation: Reputation | None, report: PullReport) -> list[str]:
    """``donors``, sorted, less those ``reputation`` bans (reported).

    Raises:
        ValueError: no donors given.
        TransferError: every donor is banned.
    """
    donors = sorted(set(donors))
    if not donors:
        raise ValueError("pull_state needs at least one donor")
    if reputation is not None:
        for peer_id in [d for d in donors if reputation.is_banned(d)]:
            drop_donor(report, peer_id, "banned here for misbehaviour")
            donors.remove(peer_id)
        if not donors:
            raise TransferError("every donor is banned here", report)
    return donors


async def _fetch_pieces(session: Session, store_dir: Path, manifest: Manifest, usable: dict[str, NeighbourLink],
                        report: PullReport, since: float) -> tuple[ShardStore, PieceFetcher, float]:
    """Steps 3-5 of the module docstring for ``manifest``: the store, the fetcher that filled it, when its last lap ended.

    Raises:
        StaleVersionError: the donors evicted ``manifest``'s version before every piece came.
        TransferError: pieces are missing and no donor is left.
    """
    config = session.config
    store = await asyncio.to_thread(ShardStore.open, store_dir, manifest)
    missing = store.missing_shards()
    report.num_resumed, report.num_shards = len(store.held_shards()), manifest.num_shards
    report.piece_bytes = manifest.shard_bytes
    piece_sizes = [end - start for start, end in map(manifest.shard_range, range(manifest.num_shards))]
    report.shard_bytes = shard_bytes = _plan_shard_bytes(
        sum(piece_sizes[i] for i in missing), manifest.shard_bytes, list(usable.values()), config)
    runs = split_runs(missing, piece_sizes, shard_bytes // manifest.shard_bytes)
    since = _lap(report, "plan", since, clock=session.clock)
    fetcher = PieceFetcher(session, store, usable, report, runs)
    try:
        await fetcher.run()
    finally:
        since = _lap(report, "transfer", since, clock=session.clock)
    return store, fetcher, since


async def _replan_version(session: Session, stale: Manifest, error: StaleVersionError,
                          report: PullReport) -> tuple[list[str], Manifest]:
    """Issue #15's fallback: the donors stepped on and evicted the version being pulled (the pins of
    ``replication/pins.py`` were taken, or lapsed on a slow link). Ask those donors for their newest
    manifest and pull again; ``ShardStore.open`` keeps every piece whose bytes the new manifest still
    has. At most ``config.max_version_replans`` times.

    Raises:
        TransferError: the donors moved on that many times, one sentence saying so.
    """
    config = session.config
    if report.num_version_replans >= config.max_version_replans:
        raise TransferError(f"the donors of stage {session.stage} evicted the version being pulled "
                            f"{report.num_version_replans + 1} times in a row (they step faster than this "
                            f"link downloads their state)", report) from error
    report.num_version_replans += 1
    for peer_id in error.donors:  # asked again: their earlier refusal is no longer why they are out
        report.failed_donors.pop(peer_id, None)
    logger.info(f"replication: stage {session.stage} v{stale.version} was evicted by its donors "
                f"({', '.join(p[-6:] for p in error.donors)}) during the pull; pulling their newest version "
                f"(re-plan {report.num_version_replans} of at most {config.max_version_replans})")
    return await agree_on_manifest(session, error.donors, report)


def _lap(report: PullReport, phase: str, since: float, *, clock: Callable[[], float]) -> float:
    """Adds the time since ``since`` to ``phase`` (a re-planned pull goes through the phases again)."""
    now = clock()
    report.phase_seconds[phase] = report.phase_seconds.get(phase, 0.0) + now - since
    return now


def _plan_shard_bytes(missing_bytes: int, piece_bytes: int, links: list[NeighbourLink],
                      config: TransferConfig) -> int:
    """Alg. 1's s over the missing bytes, a multiple of the piece size p, and at most a
    ``MIN_RUNS_PER_DONOR``-th of an even share (see the constant)."""
    even_share = missing_bytes // max(len(links), 1)
    high = min(config.search.max_shard_bytes, even_share // MIN_RUNS_PER_DONOR) // piece_bytes * piece_bytes
    high = max(high, piece_bytes)
    search = dataclasses.replace(
        config.search, shard_align_bytes=piece_bytes,
        min_shard_bytes=min(max(config.search.min_shard_bytes, piece_bytes), high), max_shard_bytes=high)
    if missing_bytes == 0:
        return piece_bytes
    pipelined = [_pipelined(link, config) for link in links]
    return plan_replication(missing_bytes, pipelined, now=0.0, config=search).shard_bytes


def _pipelined(link: NeighbourLink, config: TransferConfig) -> NeighbourLink:
    """The link as the planner should see it when requests are pipelined (see the module docstring)."""
    return dataclasses.replace(link, propagation_delay=link.propagation_delay / config.max_in_flight_per_donor)
