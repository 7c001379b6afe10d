"""Joining a run: reach the swarm's DHT, find its spec, negotiate a stage, and obtain that stage's state.

Each policy step is the house pattern: read a snapshot from the DHT (I/O), call a pure planner
function, apply the result (I/O).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P

from dht.node import BootstrapError, DHTNodeConfig, open_dht
from dht.records import PROTOCOL_VERSION, PeerRecord, RunSpec
from dht.reputation import Reputation
from dht.registry import PublishedSpec, fetch_run_ids, fetch_run_specs
from peer.config import PeerConfig
from peer.errors import UserError
from planner.reachability import RELAY_DELAY
from planner.stage_choice import Joiner, StageMember, assign_joiners
from replication.config import TransferConfig
from replication.layout import StateLayout
from replication.pull_report import TransferError
from replication.transfer import PullResult, pull_state
from swarm.model import stage_flops_per_sample
from swarm.plausibility import implausible
from swarm.stage import Stage
from swarm.stage_state import served_state_template
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
SPEC_POLL_PERIOD = 0.5
CONFIRM_PERIOD = 0.5  # seconds between the two reads a joiner's stage choice must agree on
OWNER_GRACE = 10.0  # seconds a peer with no --run-owner waits for its bootstrap's spec before trusting a lone publisher


def dht_node_config(config: PeerConfig, *, is_visitor: bool = False) -> DHTNodeConfig:
    """The DHT node a peer runs, from its config (``--bootstrap``, ``--host-maddrs``, ...).

    A visitor (``--dry-run``) runs in client mode with a fresh identity: a node that others must
    not route through once it is gone, and that cannot clash with this machine's real peer running
    under ``--identity-path``.

    Raises:
        UserError: an address is not a multiaddr.
    """
    try:
        return DHTNodeConfig(initial_peers=config.bootstrap, host_maddrs=config.host_maddrs,
                             announce_maddrs=config.announce_maddrs,
                             identity_path=None if is_visitor else config.identity_path,
                             client_mode=True if is_visitor else config.client_mode, start_timeout=config.join_timeout)
    except ValueError as e:
        raise UserError(f"{e}; copy the bootstrap's address as run_bootstrap.py prints it.") from e


async def open_swarm_dht(config: PeerConfig, *, is_visitor: bool = False) -> tuple[hivemind.DHT, RSASignatureValidator]:
    """Start the peer's DHT node (:func:`dht_node_config`) and join the swarm through ``--bootstrap``.

    Raises:
        UserError: an address is not a multiaddr, or no bootstrap answered within ``--join-timeout``.
    """
    node_config = dht_node_config(config, is_visitor=is_visitor)
    try:
        return await asyncio.to_thread(open_dht, node_config)
    except BootstrapError as e:
        raise UserError(f"Cannot reach the swarm: {e}; check that the bootstrap is running and its multiaddr is right.") from e


def bootstrap_peer_ids(maddrs: Iterable[str]) -> set[str]:
    """The peer ids named by ``/p2p/<id>`` at the end of the ``--bootstrap`` multiaddrs."""
    return {maddr.rsplit("/p2p/", 1)[1] for maddr in maddrs if "/p2p/" in maddr}


class SpecChooser:
    """Which of the specs published under a run id a joiner trusts: the run's owner's (docs/security.md).

    Anyone can publish a well-signed spec under any run id, so a peer trusts one owner key:
    - the one pinned with ``--run-owner`` (the bootstrap prints it in its join line);
    - else the key that a bootstrap it dialled (``/p2p/<id>`` in ``--bootstrap``) bound to itself;
    - else, after ``grace`` seconds (on ``clock``) with no such spec, the key of the only publisher
      (trusted on first use); several publishers and nothing to decide between them is the user's
      to settle with ``--run-owner``.
    Every other publisher's spec is refused and named in the log, once per key.
    """

    def __init__(self, run_id: str, *, owner: str | None = None, bootstraps: Iterable[str] = (),
                 grace: float = OWNER_GRACE, clock: Callable[[], float] = time.monotonic) -> None:
        self.run_id, self.owner, self.bootstraps = run_id, owner, set(bootstraps)
        self.grace, self.clock = grace, clock
        self.started = clock()
        self.refused: set[str] = set()  # the owners of specs refused (and logged) so far
        self.trusted: PublishedSpec | None = None

    def choose(self, published: list[PublishedSpec]) -> PublishedSpec | None:
        """The trusted spec among ``published``, or None to read again later.

        Raises:
            UserError: several keys publish the run and neither a pin nor a dialled bootstrap decides.
        """
        if self.owner:
            chosen, why = [p for p in published if p.owner == self.owner], "pinned with --run-owner"
        else:
            chosen = [p for p in published if p.bootstrap in self.bootstraps]
            why = f"the key of bootstrap {chosen[0].bootstrap}" if chosen else ""
            if not chosen and published and self.clock() - self.started >= self.grace:
                chosen, why = published, "the only key that publishes it, trusted on first use"
            if len({p.owner for p in chosen}) > 1:
                raise UserError(f"{len({p.owner for p in chosen})} keys publish run '{self.run_id}' "
                                f"({', '.join(sorted({p.owner for p in chosen}))}) and nothing tells which owns it; "
                                f"pin the owner with --run-owner <key> as its bootstrap's join line prints it.")
        if not chosen:
            return None
        pick = chosen[0]
        for other in published:
            if other.owner != pick.owner and other.owner not in self.refused:
                self.refused.add(other.owner)
                by = f" (bootstrap {other.bootstrap})" if other.bootstrap else ""
                logger.warning(f"refused a run spec for '{self.run_id}' published by key {other.owner}{by}: "
                               f"the run's owner is key {pick.owner}")
        if self.trusted is None:
            pin = "" if self.owner else f"; pin it with --run-owner {pick.owner}"
            logger.info(f"run '{self.run_id}' is owned by key {pick.owner} ({why}){pin}")
        self.trusted = pick
        return pick


async def fetch_spec(dht: hivemind.DHT, run_id: str, *, timeout: float, owner: str | None = None,
                     bootstraps: Iterable[str] = (), clock: Callable[[], float] = time.monotonic) -> RunSpec:
    """The run's spec, as its owner published it (:class:`SpecChooser`), polled until ``timeout`` (on ``clock``).

    Raises:
        UserError: nobody in this swarm serves ``run_id``, or not under the owner key pinned, or
            several keys do and nothing tells which owns it.
    """
    deadline = clock() + timeout
    chooser = SpecChooser(run_id, owner=owner, bootstraps=bootstraps, grace=min(OWNER_GRACE, timeout / 2), clock=clock)
    while True:
        published = await fetch_run_specs(dht, run_id)
        chosen = chooser.choose(published)
        if chosen is not None:
            if chosen.spec.protocol_version != PROTOCOL_VERSION:
                raise UserError(f"Run '{run_id}' speaks Murmuration protocol {chosen.spec.protocol_version} and this "
                                f"peer speaks {PROTOCOL_VERSION}; install the Murmuration version the run's bootstrap runs.")
            return chosen.spec
        if clock() >= deadline:
            break
        await asyncio.sleep(SPEC_POLL_PERIOD)
    if published and owner:
        keys = ", ".join(sorted({p.owner for p in published}))
        raise UserError(f"Run '{run_id}' is not published by the owner key {owner} you pinned (only by {keys}); "
                        f"check --run-owner against the bootstrap's join line.")
    known = await fetch_run_ids(dht)
    seen = f"runs it serves: {', '.join(known)}" if known else "it lists no runs yet"
    raise UserError(f"No run named '{run_id}' is served by this swarm ({seen}); check --run-id or the bootstrap address.")


def stage_costs(spec: RunSpec) -> list[float]:
    return [stage_flops_per_sample(spec, k) for k in range(spec.num_stages)]


def choose_stage_from_view(spec: RunSpec, records: list[PeerRecord], peer_id: str) -> int:
    """Apply :func:`planner.stage_choice.assign_joiners` to the current records; this peer's stage
    (a relayed peer's relay delay counted, ``planner.reachability``)."""
    members = [StageMember(peer_id=r.peer_id, stage=r.stage, flops=r.flops, reachability=r.reachability)
               for r in records if r.state in ("syncing", "training") and 0 <= r.stage < spec.num_stages
               and r.peer_id != peer_id]
    joiners = [Joiner(peer_id=r.peer_id, flops=r.flops, announced_at=r.announced_at, reachability=r.reachability)
               for r in records if r.state == "joining"]
    if peer_id not in {j.peer_id for j in joiners}:
        raise RuntimeError("this peer's own join intent is not visible in the DHT yet")
    return assign_joiners(stage_costs(spec), members, joiners, microbatch_size=spec.microbatch_size,
                          relay_delay=RELAY_DELAY)[peer_id]


class StageConfirmation:
    """When a joiner's stage choice stands (:func:`negotiate_stage`), one read at a time: two reads in
    a row that each finished within ``SLOW_READ`` (``SwarmView.complete_reads``) give the same stage,
    or ``timeout`` seconds have passed on ``clock`` (seconds, monotonic) since it was made."""

    def __init__(self, *, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.deadline = clock() + timeout
        self.previous: int | None = None  # the last read's choice, if that read was complete

    def is_expired(self) -> bool:
        return self.clock() >= self.deadline

    def confirms(self, stage: int, complete_reads: int) -> bool:
        """Whether ``stage``, this read's choice, stands (``complete_reads``: the view's count after it)."""
        if (complete_reads >= 2 and stage == self.previous) or self.is_expired():
            return True
        self.previous = stage if complete_reads else None
        return False


async def negotiate_stage(
    view: SwarmView, spec: RunSpec, peer_id: str, *, settle_delay: float, timeout: float,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[int, list[PeerRecord]]:
    """Wait ``settle_delay`` for concurrent joiners to announce, then choose like all of them would.

    The choice is taken from two reads in a row, :data:`CONFIRM_PERIOD` apart, that each finished
    within ``SLOW_READ`` (``SwarmView.complete_reads``) and give this peer the same stage: on a busy
    machine one read can miss a concurrent joiner's intent (a read that waits out a DHT timeout),
    and two joiners that each missed the other can pile onto one stage (CI: 1 and 3 on two stages).
    At the deadline the last choice stands (:class:`StageConfirmation`, on ``clock``).

    Returns:
        the chosen stage and the snapshot of records it was chosen from.
    """
    await asyncio.sleep(settle_delay)
    confirmation = StageConfirmation(timeout=timeout, clock=clock)
    while True:
        records = await view.refresh()
        try:
            stage = choose_stage_from_view(spec, records, peer_id)
        except RuntimeError:
            if confirmation.is_expired():
                raise
            await asyncio.sleep(0.2)
            continue
        if confirmation.confirms(stage, view.complete_reads):
            return stage, records
        await asyncio.sleep(CONFIRM_PERIOD)


class ImplausibleStateError(TransferError):
    """The state the donors agreed on cannot come from AdamW training from the run seed
    (``swarm.plausibility``): refused before loading, its donors banned (no honest state fails it)."""


def stage_state_bytes(stage: Stage) -> int:
    """Bytes a joiner downloads for ``stage``: its tensors plus AdamW's two moments per parameter."""
    model = stage.model
    return sum(t.numel() * t.element_size() for t in model.state_dict().values()) + 2 * sum(
        p.numel() * p.element_size() for p in model.parameters())


async def pull_stage_state(p2p: P2P, stage: Stage, holders: list[PeerRecord], *, config: PeerConfig,
                           min_agreeing_donors: int = 2, reputation: Reputation | None = None,
                           load: bool = True) -> PullResult:
    """Pull the stage's state from all its current holders at once and load it (DESIGN §1 step 5;
    ``load`` false: only pull and check it).

    Shards are spread over the holders by seed 003's greedy LPT rule, verified against a manifest
    ``min_agreeing_donors`` of the holders agree on (fewer if fewer answer), and re-planned onto
    the others if a holder fails; with ``--state-cache`` an interrupted join resumes from the
    shards it already has. The keepers of a stage's backups may hold different versions: pulled
    from with ``min_agreeing_donors=1``, the newest wins. Only a manifest of exactly the layout the run
    spec implies for the stage is accepted (``swarm.stage_state.served_state_template``): a holder that
    offers any other is refused before anything is allocated for it. A holder whose manifest is refused,
    or that serves a piece that does not match its digest, is struck in ``reputation`` (banned holders
    are not asked). A state that cannot come from training from the run seed (``swarm.plausibility``)
    is not loaded, and its donors are banned (no honest state fails that check).

    Raises:
        ImplausibleStateError: the donors agreed on an implausible state.
        TransferError: no holder could serve the state.
    """
    expected = StateLayout.from_tensors(served_state_template(stage.spec, stage.index))
    transfer = TransferConfig.for_state(stage_state_bytes(stage), request_timeout=config.request_timeout,
                                        min_agreeing_donors=min(min_agreeing_donors, len(holders)))
    with _state_dir(config, stage) as store_dir:
        result = await pull_state(p2p, [r.peer_id for r in holders], run_id=stage.spec.namespace,
                                  stage=stage.index, store_dir=store_dir, config=transfer, reputation=reputation,
                                  expected=expected)
    if reason := await asyncio.to_thread(implausible, result.state, stage.spec, stage.index):
        for donor in result.report.donors:  # each served the pieces of the manifest they agreed on
            if reputation is not None:
                reputation.strike(donor, f"served an implausible state: {reason}", weight=reputation.max_strikes)
        raise ImplausibleStateError(f"the state {', '.join(d[-6:] for d in result.report.donors)} served cannot come "
                                    f"from training: {reason}", result.report)
    if load:
        await stage.run(stage.load_state_tensors, result.state)
    return result


@contextlib.contextmanager
def _state_dir(config: PeerConfig, stage: Stage) -> Iterator[Path]:
    """``--state-cache``/<run>/stage<k> (kept, so a restarted join resumes), else a temporary folder."""
    if config.state_cache:
        path = Path(config.state_cache).expanduser() / stage.spec.namespace / f"stage{stage.index}"
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="murmuration-state-") as tmp:
        yield Path(tmp)
