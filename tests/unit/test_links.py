"""Link figures: the per-peer meter (swarm/links.py), what a record carries (dht/link_figures.py), and
the failure detector's use of them: a slow or congested link is not a dead peer."""

from __future__ import annotations

import asyncio
import time

import pytest

from dht.link_figures import MAX_LINK_FIGURES, LinkFigure, links_from_wire
from dht.records import PeerRecord
from swarm.failure_detector import FailureDetector, PhiAccrual, refusal_kind
from swarm.links import GOODPUT_SAMPLES, MIN_RTT_SAMPLES, MIN_TRANSFER_BYTES, LinkMeter
from swarm.view import SwarmView


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_round_trips_are_smoothed_as_tcp_does_and_the_timeout_follows_a_queue_that_builds():
    clock = Clock()
    meter = LinkMeter(clock=clock)
    assert meter.rtt("b") is None and meter.retransmit_timeout("b") is None
    meter.round_trip("b", 0.16)
    assert meter.rtt("b") == pytest.approx(0.16) and meter.retransmit_timeout("b") == pytest.approx(0.16 + 4 * 0.08)
    for _ in range(30):
        meter.round_trip("b", 0.16)
    idle = meter.retransmit_timeout("b")
    assert idle == pytest.approx(0.16, abs=0.01)  # a steady link: the variance decays
    meter.round_trip("b", 1.2)  # activations queue in front of the pings
    assert meter.retransmit_timeout("b") > 1.2 > idle  # the next deadline already covers that round trip
    meter.round_trip("b", -1.0)
    meter.round_trip("b", 1e6)  # nonsense is ignored
    assert meter.retransmit_timeout("b") > 1.2


def test_the_least_round_trip_stands_for_the_path_once_a_few_were_seen_and_ignores_queues():
    meter = LinkMeter(clock=Clock())
    meter.round_trip("b", 0.5)  # a new connection's first pings are slow
    for _ in range(MIN_RTT_SAMPLES - 2):
        meter.round_trip("b", 0.2)
    assert meter.min_rtt("b") is None  # too few to stand for the path (a loopback peer's first calls were striped)
    meter.round_trip("b", 0.003)
    assert meter.min_rtt("b") == 0.003
    meter.round_trip("b", 2.0)  # a queue: the smoothed figure moves, the path's does not
    assert meter.min_rtt("b") == 0.003 and meter.rtt("b") > 0.2
    assert meter.min_rtt("c") is None


def test_goodput_is_the_median_of_large_transfers_and_small_ones_do_not_count():
    meter = LinkMeter(clock=Clock())
    meter.transfer("b", MIN_TRANSFER_BYTES - 1, 0.001)
    assert meter.goodput("b") is None
    for seconds in (0.2, 0.2, 0.2, 0.0001):  # the last one was already buffered: a burst, not a rate
        meter.transfer("b", 500_000, seconds)
    assert meter.goodput("b") == pytest.approx(2_500_000)
    for _ in range(GOODPUT_SAMPLES):
        meter.transfer("b", 500_000, 0.4)
    assert meter.goodput("b") == pytest.approx(1_250_000)  # only the last few count: the link changed
    meter.rate("c", 0.0)
    assert meter.goodput("c") is None
    meter.rate("c", 3e6)  # a state pull's measured rate of that donor
    assert meter.goodput("c") == 3e6


def test_heard_since_and_bounded_memory():
    clock = Clock()
    meter = LinkMeter(clock=clock, max_peers=3)
    meter.heard("a")
    clock.now += 1
    assert meter.heard_since("a", clock.now - 1) and not meter.heard_since("a", clock.now)
    for peer in ("b", "c", "d"):
        meter.round_trip(peer, 0.05)
    assert not meter.heard_since("a", 0.0), "the least recently heard peer is forgotten first"
    assert meter.rtt("d") is not None


def test_a_bulk_send_counts_while_under_way_and_since_it_ended():
    clock = Clock()
    meter = LinkMeter(clock=clock)
    assert not meter.sent_since("a", 0.0)
    with meter.sending("a"), meter.sending("a"):  # two pushes at once (gradients, then a state)
        clock.now += 5
        assert meter.sent_since("a", clock.now) and not meter.sent_since("b", 0.0)
    clock.now += 1
    assert meter.sent_since("a", clock.now - 1) and not meter.sent_since("a", clock.now)
    with pytest.raises(RuntimeError), meter.sending("a"):
        raise RuntimeError("a push that failed still ends")
    assert not meter.sent_since("a", clock.now + 0.5)


def test_the_summary_is_bounded_rounded_and_round_trips_through_a_record():
    clock = Clock()
    meter = LinkMeter(clock=clock)
    for i in range(MAX_LINK_FIGURES + 4):
        meter.round_trip(f"peer{i:02d}", 0.012345 * (i + 1))
    meter.transfer("peer11", 1_000_000, 0.4)
    figures = meter.summary()
    assert len(figures) == MAX_LINK_FIGURES
    assert {f.peer_id for f in figures} == {f"peer{i:02d}" for i in range(4, MAX_LINK_FIGURES + 4)}  # the latest
    assert next(f for f in figures if f.peer_id == "peer11").mbit_per_s == 20.0
    assert next(f for f in figures if f.peer_id == "peer04").rtt_ms == 61.7
    record = PeerRecord(peer_id="me", role="reliable", state="training", stage=0, flops=1.0, links=figures)
    assert PeerRecord.from_wire(record.to_wire()) == record
    assert "links" not in PeerRecord(peer_id="me", role="reliable", state="training", stage=0, flops=1.0).to_wire()


@pytest.mark.parametrize("wire", [
    [["b", 1.0, None]] * (MAX_LINK_FIGURES + 1),  # too many
    [["b", -1.0, None]], [["b", float("nan"), None]], [["b", 1e9, None]], [["b", 1.0, float("inf")]],
    [["", 1.0, None]], [["b" * 129, 1.0, None]], [["b", True, None]], [["b", 1.0]], ["b"], "b", {"b": 1},
])
def test_a_hostile_records_link_figures_are_refused(wire):
    with pytest.raises(ValueError):
        PeerRecord.from_wire({"peer_id": "me", "role": "reliable", "state": "training", "stage": 0, "flops": 1.0,
                              "links": wire})


def test_capped_figures_stay_valid():
    figure = LinkFigure.capped("b", rtt_ms=1e12, mbit_per_s=-5.0)
    assert links_from_wire([figure.to_wire()]) == (figure,) and figure.mbit_per_s == 0.0


class ScriptedDetector(FailureDetector):
    """A detector whose pings are answered when the test says so (an event per ping)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(None, SwarmView(None, "run"), peer_id="me", stage=0, handler="h",
                         on_down=lambda peer_id, how: self.downs.append(peer_id), **kwargs)
        self.downs: list[str] = []
        self.answers: asyncio.Queue = asyncio.Queue()

    async def _ping_once(self, peer_id: str, timeout: float) -> str:
        try:
            return await asyncio.wait_for(self.answers.get(), timeout)
        except asyncio.TimeoutError:
            return "late"


async def _until(condition, what: str, deadline: float = 5.0) -> None:
    async with asyncio.timeout(deadline):
        while not condition():
            await asyncio.sleep(0.005)


def test_a_ping_answered_after_its_deadline_clears_its_strike_and_stretches_the_next_deadline():
    async def scenario():
        detector = ScriptedDetector()
        detector.monitors["b"] = PhiAccrual()
        ping = asyncio.create_task(detector._ping("b", 0.05))
        await _until(lambda: detector._failed["b"] == 1, "the strike at the deadline")
        await detector.answers.put("answered")  # late, but it came
        await ping
        assert detector._failed["b"] == 0 and not detector.downs
        assert detector.links.retransmit_timeout("b") > 0.05  # the next ping waits at least that long
    asyncio.run(scenario())


def test_a_ping_never_answered_is_two_strikes_and_a_refused_pair_is_too():
    async def scenario():
        detector = ScriptedDetector(acceptable_pause=0.0)
        detector.monitors["b"] = PhiAccrual()
        await detector._ping("b", 0.02)  # nobody answers: a strike at 0.02 s, the second at 0.04 s
        assert detector.downs == ["b"] and "b" not in detector._pinging
        detector.monitors["c"] = PhiAccrual()
        for _ in range(2):
            await detector.answers.put("refused")
            await detector._ping("c", 1.0)
        assert detector.downs == ["b", "c"]
    asyncio.run(scenario())


def test_a_ping_late_by_less_than_the_acceptable_pause_is_no_down_and_a_longer_silence_is():
    """A home link's queue (a stage's averaging round) holds a ping for seconds: past twice its
    deadline it still waits out the acceptable pause before the second strike."""
    async def scenario():
        detector = ScriptedDetector(acceptable_pause=0.3)
        detector.monitors["b"] = PhiAccrual()
        ping = asyncio.create_task(detector._ping("b", 0.02))
        await _until(lambda: detector._failed["b"] == 1, "the strike at the deadline")
        await asyncio.sleep(0.1)  # well past twice the deadline, within the pause
        assert not detector.downs and not ping.done()
        await detector.answers.put("answered")
        await ping
        assert detector._failed["b"] == 0 and not detector.downs
        started = time.monotonic()
        await detector._ping("b", 0.02)  # now nobody answers: down once the pause is out
        assert detector.downs == ["b"] and time.monotonic() - started >= 0.3
    asyncio.run(scenario())


def test_a_silent_ping_is_no_strike_while_other_traffic_of_that_peer_arrives():
    async def scenario():
        detector = ScriptedDetector(acceptable_pause=0.0)
        detector.monitors["b"] = PhiAccrual()
        ping = asyncio.create_task(detector._ping("b", 0.05))
        await _until(lambda: detector.num_pings == 1, "the ping to leave")
        detector.links.heard("b")  # an activation of b's arrived after the ping left
        await ping
        assert detector._failed["b"] == 0 and not detector.downs
    asyncio.run(scenario())


def test_a_silent_ping_is_no_strike_while_this_peer_pushes_to_that_peer():
    """The ping queues behind the push's bytes (CI 2026-11-28: two late pings behind a gradient push
    into a downlink busy with a backup pull declared a live co-replica down)."""
    async def scenario():
        detector = ScriptedDetector(acceptable_pause=0.0)
        detector.monitors["b"] = PhiAccrual()
        with detector.links.sending("b"):
            await detector._ping("b", 0.02)
        assert detector._failed["b"] == 0 and not detector.downs
        await asyncio.sleep(0.01)  # the push ended before this ping left: silence counts again
        await detector._ping("b", 0.02)
        assert detector.downs == ["b"]
    asyncio.run(scenario())


def test_a_peer_nobody_can_dial_is_not_pinged_its_record_tells_instead():
    detector = FailureDetector(None, SwarmView(None, "run"), peer_id="me", stage=0, handler="h", on_down=lambda *a: None)
    detector.view.records = [
        PeerRecord(peer_id=name, role="reliable", state="training", stage=stage, flops=1e9, reachability=kind)
        for name, stage, kind in (("same", 0, "direct"), ("next", 1, "relayed"), ("client", 0, "unreachable"),
                                  ("far", 2, "direct"))]
    assert detector.neighbours() == {"same", "next"}
    # behind a NAT itself, this peer reaches another NATed one only through a relay: not pinged either
    detector.view.records.append(PeerRecord(peer_id="me", role="reliable", state="training", stage=0, flops=1e9,
                                            reachability="relayed"))
    assert detector.neighbours() == {"same"}


def test_no_silence_verdict_while_this_peer_ran_an_averaging_round():
    """A round's megabytes fill this peer's link and its partners': a ping late across it is no strike
    (CI 2026-11-27: a ping to an averaging partner waited over 4 s behind their round)."""
    async def scenario():
        detector = ScriptedDetector(acceptable_pause=0.0)
        round_spans: list[tuple[float, float]] = []
        detector.busy_since = lambda since: any(end >= since for _, end in round_spans)
        detector.monitors["b"] = PhiAccrual()
        ping = asyncio.create_task(detector._ping("b", 0.02))
        await _until(lambda: detector.num_pings == 1, "the ping to leave")
        round_spans.append((time.monotonic(), time.monotonic()))  # a round ran while the ping waited
        await ping
        assert detector._failed["b"] == 0 and not detector.downs
        await asyncio.sleep(0.01)  # after the round: silence counts again
        await detector._ping("b", 0.02)
        assert detector.downs == ["b"]
    asyncio.run(scenario())


def test_a_ping_stuck_on_its_stream_is_answered_by_a_second_one_on_a_fresh_stream():
    """Past the deadline a second ping goes out beside the first (which may be stuck on a connection
    two peers opened to each other at once): its answer clears the strike."""
    class StuckFirst(ScriptedDetector):
        calls = 0

        async def _ping_once(self, peer_id: str, timeout: float) -> str:
            StuckFirst.calls += 1
            if StuckFirst.calls == 1:
                await asyncio.sleep(timeout)  # never answered
                return "late"
            return "answered"

    async def scenario():
        detector = StuckFirst(acceptable_pause=5.0)
        detector.monitors["b"] = PhiAccrual()
        started = time.monotonic()
        await detector._ping("b", 0.05)
        assert StuckFirst.calls == 2 and detector.num_pings == 2
        assert detector._failed["b"] == 0 and not detector.downs
        assert time.monotonic() - started < 5.0  # the answer came, not the end of the pause
    asyncio.run(scenario())


CONNECT_FAILED = "ControlFailure: Connect failed. msg=failed to dial: failed to dial 12D3KooWQ: all dials failed\n"


def test_a_dial_whose_handshake_failed_is_no_strike_and_its_backoff_is_none_either():
    """Two dials crossing in flight meet in one TCP connection and both handshakes fail (a live daemon
    answered): inconclusive, and so are the "dial backoff" refusals libp2p gives for 5 s after it; a
    dial that nothing answered (a crashed peer's port) is refused, and so is its backoff."""
    collided = CONNECT_FAILED + "  * [/ip4/11.0.2.2/tcp/36165] failed to negotiate security protocol: noise: message is too short"
    backoff = CONNECT_FAILED + "  * [/ip4/11.0.2.2/tcp/36165] dial backoff"
    crashed = CONNECT_FAILED + "  * [/ip4/11.0.2.2/tcp/36165] dial tcp4 11.0.2.2:36165: connect: connection refused"
    assert refusal_kind(collided, None) == "inconclusive"
    assert refusal_kind(backoff, "inconclusive") == "inconclusive"
    assert refusal_kind(crashed, "inconclusive") == "refused"
    assert refusal_kind(backoff, "refused") == "refused" and refusal_kind(backoff, None) == "refused"
    assert refusal_kind("PeerUnavailableError: stream reset", None) == "refused"
    two = CONNECT_FAILED + "  * [/ip4/1.2.3.4/tcp/1] dial backoff\n  * [/ip4/5.6.7.8/tcp/2] connect: connection refused"
    assert refusal_kind(two, "inconclusive") == "refused"  # one address was really tried


def test_inconclusive_pings_never_declare_a_peer_down_and_a_refusal_after_them_still_strikes():
    async def scenario():
        detector = ScriptedDetector(acceptable_pause=0.0)
        detector.monitors["b"] = PhiAccrual()
        for _ in range(4):
            await detector.answers.put("inconclusive")
            await detector._ping("b", 1.0)
        assert detector._failed["b"] == 0 and not detector.downs
        for _ in range(2):
            await detector.answers.put("refused")
            await detector._ping("b", 1.0)
        assert detector.downs == ["b"]
    asyncio.run(scenario())
