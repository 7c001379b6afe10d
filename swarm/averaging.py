"""In-stage data parallelism: replicas of a stage average their parameters and AdamW moments every period.

Rounds are aligned to the DHT clock: every replica of stage k schedules its round at the next
multiple of ``averaging_period``, so all of them look for a group at the same moment without anyone
coordinating (one that is too late for the next round goes to the next even one, so that replicas
that skip rounds do not settle on alternate ones: :func:`next_round_time`). Matchmaking runs in the
background (hivemind's ``DecentralizedAverager`` with ``require_trigger``) while the stage keeps
training; only at the scheduled time does the stage hold its optimizer steps (forwards and backwards
go on), copy its parameters in, trigger the all-reduce, and copy the average back. After a round
every member of the group holds a bit-identical training state (averaging runs on float64 copies;
see ``__init__``), which the stage keeps as its snapshot for joiners: every replica serves the same
bytes under the same version (the round's time).
Unreliable peers take part in client mode: they send and receive but host no part of the reduce.
Averager keys are ``<namespace>_stage<k>`` (``RunSpec.namespace``: the run id, plus the layout version after a re-plan).

Each reducer combines its part robustly (:mod:`swarm.robust_allreduce`, ``aggregation``): a replica
sending NaN is refused, and by default (``centered_clip``) one replica far from the others is
out-voted. The reducers' reports of refused and out-voted peers reach ``on_outliers``. A pair cannot
out-vote each other, so under a robust aggregation a round that formed with only two replicas while
the stage has a third is dropped (:func:`keeps_round`), and a part that only two senders of a
larger round delivered is the reducer's own copy (:mod:`swarm.robust_allreduce`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
from collections.abc import Callable, Iterable

import hivemind
import torch

from dht.clock import SYSTEM_CLOCK, Clock
from dht.reputation import Reputation
from swarm.plausibility import PairAnchors, drift, initial_parameters, pair_shift, partner_steps_since
from swarm.robust import MIN_ROBUST_ROWS
from swarm.robust_allreduce import Report, RobustAverager
from swarm.stage import Stage
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
PREPARE_AHEAD = 1.0
ACTIVE_ROUNDS = 3  # a replica that averaged within this many periods counts towards keeps_round's stage size


def next_round_time(now: float, period: float, *, lead: float) -> float:
    """The next multiple of ``period`` at least ``lead`` seconds ahead (time to finish matchmaking);
    if that one is too close, the next multiple of twice the period that is far enough.

    A replica that skips a round must not drift to the other parity. A round that found no group
    ends 2 s after its time (the step's timeout), so with a period up to 5 s every failed round
    makes a replica skip the next one: two replicas that each failed once, one round apart (the
    second was still starting), would then try alternate rounds and never meet (seen with a 5 s
    period on a loaded machine, tests/e2e/test_hostile_donor.py). Skipping to even rounds puts every
    replica that skipped on one grid, and one that did not skip joins it at its next failed round.
    """
    at = math.ceil(now / period) * period
    if at - now >= lead:
        return at
    return math.ceil((now + lead) / (2 * period)) * 2 * period


def keeps_round(aggregation: str, group_size: int, num_members: int) -> bool:
    """Whether a round of ``group_size`` replicas, in a stage seen with ``num_members``, is kept.

    Under a robust aggregation a pair cannot out-vote each other: every method gives the mean, so a
    Byzantine replica that got into a pair would hand its partner half its state. A pair is kept
    only when the stage has no third replica to wait for; otherwise its result is dropped and both
    train on from their own states until a round of three or more. ``num_members`` counts the
    replicas that averaged lately (:meth:`StageAverager.active_members`), not every announcement.
    """
    return aggregation == "mean" or group_size >= MIN_ROBUST_ROWS or num_members < MIN_ROBUST_ROWS


def count_active(last_seen: dict[str, float], in_view: set[str], own_id: str, *, since: float,
                 group: Iterable[str] = ()) -> int:
    """Peers of ``in_view`` last seen in a round at ``since`` or later, plus this peer and the members
    of this round's ``group``. The group counts: a pair made of this peer and a newcomer, while a third
    replica averaged with this peer lately, is a pair inside a stage of three (the newcomer has no
    past round yet, and it may be the Byzantine one)."""
    return len({p for p, seen in last_seen.items() if seen >= since and p in in_view} | {own_id} | set(group))


class StageAverager:
    """Runs periodic averaging rounds of one stage's parameters with its other replicas."""

    def __init__(
        self,
        stage: Stage,
        dht: hivemind.DHT,
        view: SwarmView,
        *,
        client_mode: bool,
        matchmaking_time: float = 2.0,
        allreduce_timeout: float = 15.0,
        aggregation: str = "centered_clip",
        on_round: Callable[[float, int, str], None] = lambda at, size, digest: None,
        on_outliers: Callable[[Report], None] = lambda report: None,
        on_discard: Callable[[float, int, int], None] = lambda at, size, members: None,
        reputation: Reputation | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.stage, self.dht, self.view, self.clock = stage, dht, view, clock
        self.period = stage.spec.averaging_period
        self.matchmaking_time, self.allreduce_timeout = matchmaking_time, allreduce_timeout
        self.aggregation = aggregation
        self.on_round, self.on_outliers, self.on_discard = on_round, on_outliers, on_discard
        self.reputation = reputation  # a pair with a banned partner is dropped; a pair's implausible result bans it
        self.num_rounds = self.num_failed_rounds = self.num_discarded_rounds = 0
        self.peer_id = dht.peer_id.to_base58()
        self.last_seen: dict[str, float] = {}  # peer id -> the last round (time) it was in a group with this peer
        self.num_refused_parts = self.num_outvoted_parts = 0  # parts this peer reduced, all rounds
        self._initial: dict[str, torch.Tensor] | None = None  # the run seed's parameters (the plausibility check)
        self.anchors = PairAnchors()  # where each partner's state and this one's last were one (the pair check)
        self._warned_pair = False  # said once that a round of two cannot out-vote
        self._exchange_ended = -math.inf  # monotonic end of the last all-reduce; inf while one runs
        # float64 copies: hivemind applies a round as local + (average - local), which in float32 can
        # differ from the average in the last bit, so replicas would drift apart bit-wise. For float32
        # parameters that sum is exact in float64, and every replica rounds the same float64 average.
        params = [t.detach().cpu().to(torch.float64) for t in stage.averaged_tensors()]
        # hivemind 1.1.12's DecentralizedAverager.run_in_background sets SIGINT to SIG_IGN in the
        # *calling* process, which would make Ctrl+C do nothing; put our handler back afterwards.
        sigint_handler = signal.getsignal(signal.SIGINT)
        try:
            self.averager = self._create_averager(params, client_mode)
        finally:
            signal.signal(signal.SIGINT, sigint_handler)

    def _create_averager(self, params: list[torch.Tensor], client_mode: bool) -> RobustAverager:
        stage, matchmaking_time = self.stage, self.matchmaking_time
        return RobustAverager(
            params, self.dht, aggregation=self.aggregation, start=True, prefix=f"{stage.spec.namespace}_stage{stage.index}",
            target_group_size=None, min_group_size=2, min_matchmaking_time=matchmaking_time,
            request_timeout=min(1.0, matchmaking_time / 2), allreduce_timeout=self.allreduce_timeout,
            client_mode=client_mode, allow_state_sharing=False,
        )

    def loaded_from(self, donors: Iterable[str], now: float) -> None:
        """This replica just loaded the state ``donors`` served (its own step count is theirs then):
        they are its pair anchors, and count as replicas it averaged with at ``now``, so a pair round
        with another newcomer, before any round with them, is dropped rather than kept as the stage's
        only pair (a Byzantine replica beside the donor would otherwise get half this replica's say)."""
        donors = [d for d in donors if d != self.peer_id]
        self.anchors.averaged(donors, self.stage.optimizer_steps)
        for donor in donors:
            self.last_seen[donor] = max(self.last_seen.get(donor, now), now)

    def next_round_time(self, now: float) -> float:
        return next_round_time(now, self.period, lead=self.matchmaking_time + PREPARE_AHEAD)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            at = self.next_round_time(self.clock.dht_time())
            await _sleep_until(at - self.matchmaking_time - PREPARE_AHEAD, stop, clock=self.clock)
            if stop.is_set():
                return
            if len(self.view.members(self.stage.index)) < 2:
                continue  # alone in the stage: nobody to average with this round
            await self.run_round(at, stop)
            self.report_outliers()

    def exchanged_since(self, since: float) -> bool:
        """Whether an all-reduce of this stage ran at some moment after ``since`` (monotonic): its
        megabytes then fill this peer's link, and what else crosses it (a ping) waits behind them."""
        return self._exchange_ended >= since

    def active_members(self, now: float, group: Iterable[str] = ()) -> int:
        """Replicas of this stage that averaged with this peer in the last ``ACTIVE_ROUNDS`` periods
        and are still in the view, this peer and this round's ``group`` included. A peer that only
        announces itself in the stage and never averages is not counted, so it cannot make the others
        drop every pair round."""
        in_view = {r.peer_id for r in self.view.members(self.stage.index)}
        return count_active(self.last_seen, in_view, self.peer_id, since=now - ACTIVE_ROUNDS * self.period,
                            group=group)

    def report_outliers(self) -> None:
        """Pass on what the reducers refused or out-voted (a report may arrive a round late: it
        crosses from the averager's process through a queue)."""
        for report in self.averager.reports():
            self.num_refused_parts += sum(report["refused"].values())
            self.num_outvoted_parts += sum(report["outvoted"].values())
            num_parts = report["num_parts"]
            findings = [f"refused {n}/{num_parts} parts of {peer_id} (NaN/Inf)" for peer_id, n in report["refused"].items()]
            findings += [f"out-voted {peer_id} in {n}/{num_parts} parts" for peer_id, n in report["outvoted"].items()]
            if report.get("short_parts"):
                findings.append(f"{report['short_parts']}/{num_parts} parts had fewer than {MIN_ROBUST_ROWS} copies "
                                "(a sender dropped out): kept this reducer's own")
            logger.warning(f"averaging ({report['aggregation']}) of stage {self.stage.index}: " + "; ".join(findings))
            self.on_outliers(report)

    async def run_round(self, at: float, stop: asyncio.Event, *, num_members: int | None = None) -> bool:
        """One round at ``at``; True if its result was applied. ``num_members`` (tests) fixes the stage
        size :func:`keeps_round` sees; by default it is :meth:`active_members`, counted before this
        round's group enters ``last_seen`` (so this round's members count once, whoever they are)."""
        control = self.averager.step(scheduled_time=at, require_trigger=True, wait=False,
                                     timeout=self.matchmaking_time + PREPARE_AHEAD + 2.0, allow_retries=False)
        await _sleep_until(at, stop, clock=self.clock)
        if stop.is_set() or control.done():  # leaving, or no group was found
            control.cancel()
            self.num_failed_rounds += 1
            return False
        async with self.stage.paused():
            await self.stage.run(self._copy_in)
            control.allow_allreduce()
            self._exchange_ended = math.inf
            try:
                group = await asyncio.wait_for(asyncio.wrap_future(control), timeout=self.allreduce_timeout + 5)
            except Exception as e:
                logger.info(f"averaging round at {at:.0f} failed: {e!r}")
                group = None
            finally:
                self._exchange_ended = self.clock()
            if not group:
                self.num_failed_rounds += 1
                return False
            members = [str(peer_id) for peer_id in group]
            if num_members is None:
                num_members = self.active_members(at, group=members)
            for peer_id in members:
                self.last_seen[peer_id] = at
            if not keeps_round(self.aggregation, len(group), num_members):
                self.num_discarded_rounds += 1
                logger.info(f"averaging round at {at:.0f} of stage {self.stage.index}: dropped its result, a pair of "
                            f"{num_members} replicas ({self.aggregation} cannot out-vote within a pair)")
                self.on_discard(at, len(group), num_members)
                return False
            partner = next((m for m in members if m != self.peer_id), "") if len(group) == 2 else ""
            if partner and self.reputation is not None and self.reputation.is_banned(partner):
                self.num_discarded_rounds += 1
                logger.warning(f"averaging round at {at:.0f} of stage {self.stage.index}: dropped its result, a pair "
                               f"with {partner[-6:]}, which is banned here")
                self.on_discard(at, len(group), num_members)
                return False
            if reason := await self.stage.run(self._implausible_result, partner):
                self._drop_implausible(at, len(group), num_members, partner, reason)
                return False
            digest = await self.stage.run(self._copy_out, at)
            self.anchors.averaged(members, await self.stage.run(lambda: self.stage.optimizer_steps))
        if len(group) == 2 and self.aggregation != "mean" and not self._warned_pair:
            self._warned_pair = True
            logger.warning(f"stage {self.stage.index} averages in a pair: two replicas cannot out-vote each other, so "
                           f"a Byzantine partner keeps half the say unless its push is crude enough for the "
                           f"plausibility check (docs/security.md); a third replica makes rounds robust")
        self.num_rounds += 1
        logger.info(f"averaged stage {self.stage.index} with {len(group)} replicas (round at {at:.0f}, params {digest})")
        self.on_round(at, len(group), digest)
        return True

    def _drop_implausible(self, at: float, group_size: int, num_members: int, partner: str, reason: str) -> None:
        """Drop a round whose result no honest replica could have sent; in a pair the push can only be
        the partner's: beyond the seed bound (which holds for any honest state) it is banned, beyond
        the pair bound (it moved more than it could since their common state) struck, two such rounds
        banning it."""
        if partner and self.reputation is not None:
            strikes = self.reputation.max_strikes
            weight = strikes if "seed bound:" in reason else max(1, strikes // 2)
            self.reputation.strike(partner, f"its averaging round gave an implausible state: {reason}", weight=weight)
        self.num_discarded_rounds += 1
        logger.warning(f"averaging round at {at:.0f} of stage {self.stage.index}: dropped its result, "
                       f"which no honest replica could have sent ({reason}; swarm/plausibility.py)")
        self.on_discard(at, group_size, num_members)

    def shutdown(self) -> None:
        self.averager.shutdown()

    def _copy_in(self) -> None:
        with self.averager.get_tensors() as tensors, torch.no_grad():
            for tensor, live in zip(tensors, self.stage.averaged_tensors(), strict=True):
                tensor.copy_(live.detach().cpu())

    def _implausible_result(self, partner: str = "") -> str:
        """Why the round's result cannot be an average of honest replicas' states (compute thread), or
        "". Two checks: in a pair with a partner whose state came from this replica
        (:class:`PairAnchors`), the round moves this replica farther than its own and the partner's
        steps since then allow ("pair bound: ...", the tighter one, named first); and its parameters
        stand farther from the run seed's initialisation than this replica's AdamW steps allow (any
        round: "seed bound: ..."). A round of two gives each member half the say, so this is what
        keeps an honest replica from taking half of a Byzantine one's pushed state when no third can
        out-vote it."""
        if self._initial is None:
            self._initial = initial_parameters(self.stage.spec, self.stage.index)
        spec, params = self.stage.spec, list(self.stage.model.named_parameters())
        steps, reasons = float(self.stage.optimizer_steps), []
        anchor = self.anchors.anchor(partner) if partner else None
        with self.averager.get_tensors() as tensors:
            result = {f"model.{name}": tensor for (name, _), tensor in zip(params, tensors)}
            if anchor is not None:
                result_steps = max((float(t) for t in tensors[-len(params):]), default=0.0)  # the averaged "step"s
                partner_steps = partner_steps_since(anchor, steps, result_steps)
                fraction, where = pair_shift(result, {f"model.{name}": p for name, p in params}, lr=spec.lr,
                                             weight_decay=spec.weight_decay, own_steps=steps - anchor,
                                             partner_steps=partner_steps)
                if fraction > 1.0:
                    reasons.append(f"pair bound: {where} would move {fraction:.0f}x farther than {steps - anchor:.0f} "
                                   f"steps of this replica and {partner_steps:.0f} of its partner allow since the "
                                   "state they last shared")
            fraction, where = drift(result, self._initial, lr=spec.lr, weight_decay=spec.weight_decay, steps=int(steps))
            if fraction > 1.0:
                reasons.append(f"seed bound: {where} would stand {fraction:.0f}x farther from the run seed's "
                               f"initialisation than {steps:.0f} steps allow")
        return "; ".join(reasons)

    def _copy_out(self, at: float) -> str:
        with self.averager.get_tensors() as tensors, torch.no_grad():
            for tensor, live in zip(tensors, self.stage.averaged_tensors(), strict=True):
                live.copy_(tensor.to(live.device))
        return self.stage.publish_averaged(version=int(at))


async def _sleep_until(deadline: float, stop: asyncio.Event, *, clock: Clock) -> None:
    """Until ``deadline`` on the DHT's clock, or until ``stop`` is set."""
    delay = deadline - clock.dht_time()
    if delay > 0:
        try:
            await asyncio.wait_for(stop.wait(), timeout=delay)
        except asyncio.TimeoutError:
            pass
