"""Pulls the missing pieces of one manifest from several donors at once (seed 003 §III-B, online).

The manifest is hashed once, at a fixed piece size p; Alg. 1 chose a shard size s = k·p, and a
request ("run") asks one donor for up to k consecutive pieces, each checked against its digest on
arrival. Alg. 2 assigns the runs to donors; this module carries the plan out and keeps it right:

* **Measured rates.** A donor sends the runs of one joiner one after another (``server.py``), so
  each run's service time is ``done - max(sent, previous done)`` and a donor's b_u is its service
  time per byte (d_u included), measured from its first run on; until then, the probe's.
* **Every donor is measured.** The first plan gives each donor at least one run
  (:func:`give_each_a_run`): a probe taken while a donor's host was busy must not keep it out.
* **Re-planning** (``TransferConfig.rebalance``): whenever a donor's measured rate moves by more
  than ``_REPLAN_DRIFT`` from what the last plan assumed, or a donor has nothing queued while others
  do, Alg. 2 runs again over every queued run, with f_u = when each donor is through what it has
  in flight.
* **Faults** (seed 003 §III-B): a donor that fails, stalls past its deadline, refuses or sends a
  piece that does not match is dropped; its queued and in-flight runs go through Alg. 2 over the
  survivors; its other requests are cancelled. A piece that does not match is also struck
  (``CORRUPT_PIECE_STRIKES``) in the session's reputation, so repeated corruption bans the donor.
* **End game** (``TransferConfig.endgame``): a donor with nothing left to fetch takes a copy of a
  run still in flight elsewhere when it would finish it sooner; the first verified copy wins and
  the other request is cancelled. This removes the tail left by a run that is large for its donor.
* **A version that moved on** (issue #15): a donor that evicted the manifest's version declines
  with ``VERSION_GONE`` and is dropped like a failed one; if no donor is left, the pull ends in
  ``StaleVersionError`` (not a plain ``TransferError``), naming those donors, and
  ``replication/transfer.py`` re-plans it on their newest manifest.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from replication.assignment import NeighbourLink, assign_shards_greedy
from dht.rpc import RemoteError
from replication.client import DONOR_FAULTS, Session, call_pieces
from replication.manifest import ManifestError, is_shard_valid
from replication.pull_report import PullReport, StaleVersionError, TransferError, drop_donor
from replication.server import VERSION_GONE
from replication.shard_store import ShardStore

__all__ = ["CORRUPT_PIECE_STRIKES", "CorruptPieceError", "PieceFetcher", "Run", "give_each_a_run", "split_runs"]

logger = logging.getLogger(__name__)

_REPLAN_DRIFT = 0.2  # re-plan when a donor's measured rate moved this much since the last plan
_IDLE_RECHECK_SECONDS = 0.05  # an idle worker re-checks the end game this often (estimates age)
# A piece that does not match the digest its donor agreed to is proof that the donor lies (or that
# its memory or disk is broken): it weighs this many strikes (dht/reputation.py), once per pull, so
# with the default 8 strikes two pulls it corrupts within the window ban it, while a single bit flip
# on an honest donor does not.
CORRUPT_PIECE_STRIKES = 4


class CorruptPieceError(ManifestError):
    """A donor sent a piece whose bytes do not match the manifest's digest."""


@dataclass(frozen=True)
class Run:
    """Pieces ``first`` .. ``first + count - 1``: one request, ``nbytes`` long."""

    first: int
    count: int
    nbytes: int


def split_runs(missing: Sequence[int], piece_sizes: Sequence[int], pieces_per_run: int) -> list[Run]:
    """The missing pieces (sorted) as runs of at most ``pieces_per_run`` consecutive pieces."""
    runs: list[Run] = []
    for piece in missing:
        last = runs[-1] if runs else None
        if last is not None and last.first + last.count == piece and last.count < pieces_per_run:
            runs[-1] = Run(last.first, last.count + 1, last.nbytes + piece_sizes[piece])
        else:
            runs.append(Run(piece, 1, piece_sizes[piece]))
    return runs


@dataclass
class _Donor:
    """The joiner's view of one donor during a pull."""

    probed: NeighbourLink
    slots: int
    min_measured_bytes: int
    queue: deque[int] = field(default_factory=deque)  # run ids, in sending order
    in_flight: dict[int, float] = field(default_factory=dict)  # run id -> sent at, in sending order
    workers: set[asyncio.Task] = field(default_factory=set)
    service_seconds: float = 0.0
    bytes_done: int = 0
    last_done: float = 0.0
    planned_per_byte: float = 0.0  # what the last plan assumed
    failed: bool = False
    moved_on: bool = False  # it failed because it no longer holds the manifest's version

    def measured(self) -> bool:
        """Whether enough came back to trust the measured rate: a full piece at least (a run of a
        few bytes, the state's tail, lasts about d_u and says nothing about b_u)."""
        return self.bytes_done >= self.min_measured_bytes

    def per_byte(self) -> float:
        """b_u (with d_u folded in) as measured, or as probed before that."""
        if self.measured():
            return self.service_seconds / self.bytes_done
        return self.probed.per_byte_delay

    def request_delay(self) -> float:
        """d_u as the planner should see it: in the measured b_u once measured; else the probe's,
        shared by the requests in flight (they are pipelined)."""
        return 0.0 if self.measured() else self.probed.propagation_delay / self.slots


class PieceFetcher:
    """Fetches ``runs`` into ``store`` (and into one in-memory buffer when the store started empty)."""

    def __init__(self, session: Session, store: ShardStore, links: dict[str, NeighbourLink],
                 report: PullReport, runs: Sequence[Run]) -> None:
        self.session, self.store, self.report = session, store, report
        self.manifest = store.manifest
        config = session.config
        self.donors = {peer: _Donor(link, config.max_in_flight_per_donor, self.manifest.shard_bytes)
                       for peer, link in sorted(links.items())}
        self.runs = {run.first: run for run in runs}
        self.done: set[int] = set()
        self.fetches: dict[int, dict[str, asyncio.Future]] = {}  # run id -> donor -> its request
        # Not zero-filled (torch.empty): every byte is written by a verified piece before use.
        self.buffer = None if store.held_shards() else memoryview(
            torch.empty(self.manifest.total_bytes, dtype=torch.uint8).numpy())
        self._changed = asyncio.Event()
        self._lock = threading.Lock()
        self._credited: set[int] = set(store.held_shards())
        self._group: asyncio.TaskGroup | None = None

    async def run(self) -> None:
        started = self.session.clock()
        async with asyncio.TaskGroup() as group:
            self._group = group
            self.report.estimated_seconds = self._assign(sorted(self.runs)) - started
        self.report.measured_per_byte = {peer: donor.per_byte() for peer, donor in self.donors.items()
                                         if donor.measured()}
        if len(self.done) < len(self.runs):
            reasons = "; ".join(f"{p[-6:]}: {why}" for p, why in self.report.failed_donors.items())
            moved_on = sorted(peer for peer, donor in self.donors.items() if donor.moved_on)
            if moved_on:
                raise StaleVersionError(f"pieces missing and no donor left ({reasons})", self.report, moved_on)
            raise TransferError(f"pieces missing and no donor left ({reasons})", self.report)

    def assembled(self) -> memoryview | None:
        """The state buffer if every piece was verified and copied into it (None: use the store)."""
        with self._lock:
            return self.buffer if len(self._credited) == self.manifest.num_shards else None

    # ---- planning -----------------------------------------------------------------------------

    def _planning_link(self, peer: str, donor: _Donor, now: float) -> NeighbourLink:
        """Alg. 2's view of ``donor`` now: its rate, and f_u = when its in-flight runs are through."""
        per_byte, delay = donor.per_byte(), donor.request_delay()
        free = self._drain_times(donor, now)[-1] if donor.in_flight else now
        return NeighbourLink(peer_id=peer, propagation_delay=delay, per_byte_delay=per_byte, free_time=free)

    def _drain_times(self, donor: _Donor, now: float) -> list[float]:
        """Expected finish of each run in flight at ``donor``, in sending order.

        Runs are served in turn. One that is overdue is assumed to take as long again as it has
        taken so far, and its donor's rate to be that slow (a stalling donor attracts no work)."""
        per_byte, delay = donor.per_byte(), donor.request_delay()
        times, clock = [], donor.last_done
        for run_id, sent in donor.in_flight.items():
            begin = max(clock, sent)
            expected = begin + delay + self.runs[run_id].nbytes * per_byte
            if expected < now and not times:
                expected = now + (now - begin)
                per_byte = max(per_byte, (2 * (now - begin)) / max(self.runs[run_id].nbytes, 1))
            clock = max(expected, now) if not times else expected
            times.append(clock)
        return times

    def _assign(self, run_ids: Sequence[int]) -> float:
        """Alg. 2 over ``run_ids`` and the live donors; queues them and starts workers. Returns
        the plan's makespan."""
        now = self.session.clock()
        live = {peer: donor for peer, donor in self.donors.items() if not donor.failed}
        if not run_ids or not live:
            return now
        links = [self._planning_link(peer, donor, now) for peer, donor in live.items()]
        plan = assign_shards_greedy({run_id: self.runs[run_id].nbytes for run_id in run_ids}, links, now=now)
        shards_by_peer = {peer: list(assigned) for peer, assigned in plan.shards_by_peer.items()}
        if not self.report.num_replans:
            give_each_a_run(shards_by_peer, list(live))
        for link in links:
            live[link.peer_id].planned_per_byte = link.per_byte_delay
        for peer, assigned in shards_by_peer.items():
            donor = live[peer]
            donor.queue.extend(assigned)
            self._start_workers(peer, donor)
        self.report.num_replans += 1
        return plan.makespan

    def _start_workers(self, peer: str, donor: _Donor) -> None:
        while len(donor.workers) < min(donor.slots, len(donor.queue)):
            task = self._group.create_task(self._work(peer, donor))
            donor.workers.add(task)
            task.add_done_callback(donor.workers.discard)

    def _replan_queued(self) -> None:
        """Alg. 2 again over every run still queued, with the rates measured so far."""
        queued = sorted(run_id for donor in self.donors.values() for run_id in donor.queue)
        for donor in self.donors.values():
            donor.queue.clear()
        self._assign(queued)

    def _drifted(self, donor: _Donor) -> bool:
        planned = donor.planned_per_byte
        return planned > 0 and abs(donor.per_byte() - planned) > _REPLAN_DRIFT * planned

    # ---- fetching -------------------------------------------------------------------------------

    async def _work(self, peer: str, donor: _Donor) -> None:
        config = self.session.config
        while not donor.failed and len(self.done) < len(self.runs):
            run_id = self._next_run(peer, donor)
            if run_id is None:
                if not config.endgame or not self._anything_in_flight_elsewhere(peer):
                    return
                self._changed.clear()
                try:  # wait for a completion or a fault, or for the estimates to age
                    await asyncio.wait_for(self._changed.wait(), _IDLE_RECHECK_SECONDS)
                except TimeoutError:
                    pass
                continue
            await self._fetch(peer, donor, run_id)

    def _next_run(self, peer: str, donor: _Donor) -> int | None:
        """The next run for ``donor``: its queue; else, when re-planning, others' queued runs; else
        (end game) a copy of a run in flight elsewhere that it would finish sooner."""
        config = self.session.config
        while donor.queue:
            run_id = donor.queue.popleft()
            if run_id not in self.done and run_id not in self.fetches:
                return run_id
        if config.rebalance and any(d.queue for d in self.donors.values() if not d.failed):
            self._replan_queued()
            while donor.queue:
                run_id = donor.queue.popleft()
                if run_id not in self.done and run_id not in self.fetches:
                    return run_id
        return self._endgame_pick(peer, donor) if config.endgame else None

    def _anything_in_flight_elsewhere(self, peer: str) -> bool:
        return any(p != peer and d.in_flight and not d.failed for p, d in self.donors.items()) or any(
            d.queue for p, d in self.donors.items() if p != peer and not d.failed)

    def _endgame_pick(self, peer: str, donor: _Donor) -> int | None:
        now = self.session.clock()
        mine = self._planning_link(peer, donor, now)
        best, best_gain = None, 0.0
        for other_peer, other in self.donors.items():
            if other_peer == peer or other.failed or not other.in_flight:
                continue
            for run_id, finish in zip(other.in_flight, self._drain_times(other, now)):
                if run_id in self.done or len(self.fetches.get(run_id, {})) != 1:
                    continue
                my_finish = mine.free_time + mine.propagation_delay + self.runs[run_id].nbytes * mine.per_byte_delay
                if finish - my_finish > best_gain:
                    best, best_gain = run_id, finish - my_finish
        if best is not None:
            self.report.num_duplicated += 1
            logger.debug(f"replication: end game, {peer[-6:]} also fetches run {best} "
                         f"({best_gain * 1e3:.0f} ms sooner than expected)")
        return best

    async def _fetch(self, peer: str, donor: _Donor, run_id: int) -> None:
        run, config = self.runs[run_id], self.session.config
        ahead = len(donor.in_flight)
        sent = self.session.clock()
        donor.in_flight[run_id] = sent
        deadline = config.shard_timeout_floor + config.shard_timeout_slack * (1 + ahead) * (
            donor.probed.propagation_delay + run.nbytes * max(donor.per_byte(), donor.probed.per_byte_delay))
        request = asyncio.ensure_future(call_pieces(self.session, peer, self.manifest, run.first, run.count,
                                                    timeout=deadline))
        self.fetches.setdefault(run_id, {})[peer] = request
        self.report.num_shard_requests += 1
        try:
            await asyncio.wait([request])
            if request.cancelled():  # another donor's copy won
                return
            data = request.result()
            await asyncio.to_thread(self._store, peer, run, data)
        except DONOR_FAULTS as e:
            reason = f"pieces {run.first}+{run.count}: {type(e).__name__}: {e}"
            if isinstance(e, CorruptPieceError) and self.session.reputation is not None and not donor.failed:
                # once per pull: its other runs in flight are the same offence, not more evidence
                self.session.reputation.strike(peer, f"served corrupted state: {reason}", weight=CORRUPT_PIECE_STRIKES)
            if isinstance(e, RemoteError) and e.code == VERSION_GONE and not donor.failed:
                donor.moved_on = True
            self._fail(peer, reason)
            return
        finally:
            donor.in_flight.pop(run_id, None)
            fetchers = self.fetches.get(run_id, {})
            if fetchers.get(peer) is request:
                del fetchers[peer]
                if not fetchers:
                    self.fetches.pop(run_id, None)
            if not request.done():
                request.cancel()
        now = self.session.clock()
        donor.service_seconds += now - max(sent, donor.last_done)
        donor.bytes_done += run.nbytes
        donor.last_done = now
        self._complete(run_id)
        if config.rebalance and self._drifted(donor):
            self._replan_queued()

    def _complete(self, run_id: int) -> None:
        self.done.add(run_id)
        for request in self.fetches.pop(run_id, {}).values():
            request.cancel()  # the end game's other copy, if any
        self._changed.set()

    def _store(self, peer: str, run: Run, data: memoryview) -> None:
        """Verifies every piece of ``run``, then writes them (in a thread: hashing and disk) and
        credits its donor. One piece that does not match rejects the whole run (its donor lied);
        a piece two donors delivered is credited once."""
        base = self.manifest.shard_range(run.first)[0]
        chunks = []
        for piece in range(run.first, run.first + run.count):
            start, end = self.manifest.shard_range(piece)
            chunk = data[start - base : end - base]
            if not is_shard_valid(self.manifest, piece, chunk):
                raise CorruptPieceError(f"piece {piece} does not match the manifest")
            chunks.append((piece, start, end, chunk))
        for piece, start, end, chunk in chunks:
            self.store.put_shard(piece, chunk, verified=True)
            if self.buffer is not None:  # distinct pieces are disjoint slices: no lock needed
                self.buffer[start:end] = chunk
            with self._lock:
                if piece in self._credited:
                    continue
                self._credited.add(piece)
                self.report.bytes_by_donor[peer] = self.report.bytes_by_donor.get(peer, 0) + end - start
                self.report.shards_by_donor[peer] = self.report.shards_by_donor.get(peer, 0) + 1

    def _fail(self, peer: str, reason: str) -> None:
        """Drops ``peer`` and re-plans its unfinished runs onto the survivors (seed 003 §III-B)."""
        donor = self.donors[peer]
        if donor.failed:
            return
        donor.failed = True
        drop_donor(self.report, peer, reason)
        mine = set(donor.queue) | set(donor.in_flight)
        donor.queue.clear()
        for run_id in list(donor.in_flight):
            request = self.fetches.get(run_id, {}).pop(peer, None)
            if request is not None:
                request.cancel()
            if not self.fetches.get(run_id):
                self.fetches.pop(run_id, None)
        orphans = sorted(run_id for run_id in mine if run_id not in self.done and run_id not in self.fetches)
        self.report.num_refetched += sum(self.runs[run_id].count for run_id in orphans)
        self._assign(orphans)
        self._changed.set()


def give_each_a_run(shards_by_peer: dict[str, list[int]], donors: Sequence[str]) -> None:
    """The first plan's fix-up: a donor the plan gave nothing gets the last run of the donor with
    the most, while that one keeps at least one. A donor's rate is otherwise only its probe's, and
    one probe taken while its host was busy (a CPU hog on each core beside five peers) can make it
    look too slow for any run: it would never serve, so never be measured. With one run it is
    measured, re-planning uses what it really does, and the end game copies its run elsewhere if it
    is as slow as the probe said."""
    for peer in donors:
        if shards_by_peer.get(peer):
            continue
        richest = max(sorted(shards_by_peer), key=lambda p: len(shards_by_peer[p]), default=None)
        if richest is None or len(shards_by_peer[richest]) < 2:
            return
        shards_by_peer[peer] = [shards_by_peer[richest].pop()]
