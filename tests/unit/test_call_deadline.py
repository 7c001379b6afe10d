"""The forward call's adaptive deadline and the hop weights' measured latency: a slow but answering peer
gets its own deadline and a smaller share of the calls; a hung one does not get a longer deadline.
And the router's cooldowns on a FakeClock: a failed peer or a down link is avoided until its deadline."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
import torch

from dht.records import PeerRecord
from dht.rpc import PeerUnavailableError
from swarm.router import (
    LATENCY_TOLERANCE,
    MIN_CALL_TIMEOUT,
    MIN_LATENCY_FACTOR,
    OWN_MARGIN,
    PROBE_FACTOR,
    SLOW_PEER_RATIO,
    NoPeerAvailableError,
    Router,
    hop_weights,
    latency_factors,
)
from swarm.view import SwarmView
from tests.unit.fake_clock import FakeClock

REQUEST_TIMEOUT = 60.0


def router() -> Router:
    # the deadline arithmetic touches neither the transport nor the view
    return Router(None, None, run_id="r", next_stage=1, next_stage_flops=1.0, request_timeout=REQUEST_TIMEOUT,
                  max_payload_bytes=1 << 20, rng=random.Random(0))


def warmed() -> Router:
    r = router()
    for _ in range(40):
        r._record_answer("fast", 0.2)
    assert r.call_timeout() == MIN_CALL_TIMEOUT  # 8 x 0.2 s is below the floor
    return r


def test_the_request_timeout_holds_until_twenty_calls_were_measured():
    r = router()
    for _ in range(19):
        r._record_answer("fast", 0.2)
    assert r.call_timeout() == r.call_timeout("fast") == REQUEST_TIMEOUT
    r._record_answer("fast", 0.2)
    assert r.call_timeout() == MIN_CALL_TIMEOUT


def test_after_a_timeout_the_next_call_to_that_peer_waits_longer_and_an_answer_sets_its_own_deadline():
    r = warmed()
    assert r.call_timeout("slow") == MIN_CALL_TIMEOUT
    r._record_timeout("slow", MIN_CALL_TIMEOUT)
    assert r.call_timeout("slow") == PROBE_FACTOR * MIN_CALL_TIMEOUT
    assert r.call_timeout("fast") == r.call_timeout() == MIN_CALL_TIMEOUT  # nobody else waits longer
    r._record_answer("slow", 8.5)  # an activation each way at 1 Mbit/s
    assert r.call_timeout("slow") == OWN_MARGIN * 8.5
    assert r.call_timeout() == MIN_CALL_TIMEOUT  # a call slower than the common deadline stays out of it
    for _ in range(10):
        r._record_answer("slow", 40.0)
    assert r.call_timeout("slow") == REQUEST_TIMEOUT  # never beyond the request timeout


def test_a_peer_that_never_answers_keeps_a_bounded_deadline():
    r = warmed()
    for _ in range(10):
        r._record_timeout("hung", MIN_CALL_TIMEOUT)
    assert r.call_timeout("hung") == PROBE_FACTOR * MIN_CALL_TIMEOUT  # it does not grow with each timeout


def test_own_deadlines_follow_the_recent_calls():
    r = warmed()
    r._record_answer("slow", 9.0)
    for _ in range(25):
        r._record_answer("slow", 1.0)  # the link is back: the slow call ages out
    assert r.call_timeout("slow") == r.call_timeout() < OWN_MARGIN * 9.0


def test_a_peer_much_slower_than_the_fastest_gets_a_smaller_share():
    assert latency_factors([None, None]) == [1.0, 1.0]
    assert latency_factors([0.3, 0.5, None]) == [1.0, 1.0, 1.0]  # within the tolerance: jitter moves nothing
    factors = latency_factors([0.3, 8.5])  # a replica behind a 1 Mbit/s link
    assert factors[0] == 1.0 and factors[1] == pytest.approx(LATENCY_TOLERANCE * 0.3 / 8.5)
    assert latency_factors([0.1, 1e6])[1] == MIN_LATENCY_FACTOR  # still called now and then, so measured again


def test_the_router_learns_a_slow_peer_from_its_answers_and_timeouts():
    r = warmed()
    r._record_answer("slow", 8.5)
    r._record_timeout("slow", 10.0)
    assert r.latency["slow"] == pytest.approx(0.7 * 8.5 + 0.3 * 10.0)
    assert r.latency["fast"] == pytest.approx(0.2)
    candidates = [PeerRecord(peer_id=p, role="reliable", state="training", stage=1, flops=1e9) for p in ("fast", "slow")]
    fast, slow = hop_weights(candidates, Counter(), 1e9, r.latency)
    assert slow / fast == pytest.approx(LATENCY_TOLERANCE * 0.2 / r.latency["slow"])


def test_a_peer_far_slower_than_the_fastest_gets_one_call_at_a_time():
    candidates = [PeerRecord(peer_id=p, role="reliable", state="training", stage=1, flops=1e9)
                  for p in ("fast", "slow", "jittery")]
    latency = {"fast": 0.3, "slow": 0.3 * SLOW_PEER_RATIO * 2, "jittery": 0.3 * SLOW_PEER_RATIO / 2}
    idle = hop_weights(candidates, Counter(), 1e9, latency)
    assert idle[1] > 0, "an idle slow peer is still called (and measured)"
    busy = hop_weights(candidates, Counter({"slow": 1, "jittery": 1}), 1e9, latency)
    assert busy[1] == 0 and busy[0] > 0, "a slow peer with a call out gets no second one"
    assert busy[2] > 0, "a peer a few times slower (a busy CPU) is only weighted down"
    alone = hop_weights(candidates[1:2], Counter({"slow": 3}), 1e9, latency)
    assert alone[0] > 0, "the only candidate of a stage takes what comes"


def test_a_reserved_path_is_counted_while_out_and_released_even_on_failure():
    r = router()
    with r.reserved_path(["b", "c"]):
        with r.reserved_path(["b", "d"]):
            assert r.path_in_flight == {"b": 2, "c": 1, "d": 1}
    assert not r.path_in_flight
    with pytest.raises(RuntimeError), r.reserved_path(["b"]):
        raise RuntimeError("the call failed")
    assert not r.path_in_flight


def test_a_link_down_is_avoided_until_it_is_up_again():
    r = router()
    r.link_down("b")
    assert r.failed_until["b"] > 0
    r.link_up("b")
    r.link_up("never-seen")  # nothing to forget: no error
    assert "b" not in r.failed_until


COOLDOWN = 10.0


def routing(clock: FakeClock, *next_stage_peers: str) -> Router:
    """A router to stage 1 whose view holds ``next_stage_peers`` there, on ``clock``."""
    view = SwarmView(None, "r")
    view.records = [PeerRecord(peer_id=p, role="reliable", state="training", stage=1, flops=1e9) for p in next_stage_peers]
    return Router(None, view, run_id="r", next_stage=1, next_stage_flops=1.0, request_timeout=REQUEST_TIMEOUT,
                  max_payload_bytes=1 << 20, rng=random.Random(0), failure_cooldown=COOLDOWN, clock=clock)


def fake_call(clock: FakeClock, seconds: float, *, fails: bool = False):
    """A stand-in for ``swarm.router.call_peer`` that takes ``seconds`` on ``clock``, then answers or fails."""
    async def call(p2p, peer_id, handler, header, tensors=(), *, timeout, max_payload_bytes, stripes=1):
        clock.advance(seconds)
        if fails:
            raise PeerUnavailableError(f"{peer_id} hung up")
        return {"ok": True}, [torch.zeros(1)]
    return call


def test_a_peer_that_failed_a_call_is_avoided_until_its_cooldown_passed(monkeypatch):
    clock = FakeClock(100.0)
    monkeypatch.setattr("swarm.router.call_peer", fake_call(clock, 2.0, fails=True))
    r = routing(clock, "b")
    with pytest.raises(NoPeerAvailableError):
        asyncio.run(r.forward({"mb_id": "m1"}, [torch.zeros(1)]))
    assert r.failed_until == {"b": 102.0 + COOLDOWN}, "the cooldown starts when the call failed"
    clock.advance(COOLDOWN - 0.5)
    assert r.choose(set()) is None and r._next_target("m2", "b", set()) is None
    clock.advance(0.5)
    assert r.choose(set()).peer_id == "b" and r._next_target("m2", "b", set()) == "b"


def test_a_call_is_timed_on_the_routers_clock(monkeypatch):
    clock = FakeClock(100.0)
    monkeypatch.setattr("swarm.router.call_peer", fake_call(clock, 2.5))
    r = routing(clock, "b")
    reply, _ = asyncio.run(r.forward({"mb_id": "m1"}, [torch.zeros(1)]))
    assert reply == {"ok": True}
    assert r.latency == {"b": 2.5} and list(r._own_durations["b"]) == [2.5]


def test_a_link_down_is_routed_around_for_the_cooldown_or_until_it_is_up():
    clock = FakeClock(100.0)
    r = routing(clock, "b", "c")
    r.link_down("b")
    assert {r.choose(set()).peer_id for _ in range(50)} == {"c"}
    assert r.plan_path([1.0, 1.0]) == ["c"]
    r.link_up("b")
    assert {r.choose(set()).peer_id for _ in range(50)} == {"b", "c"}, "up again: at once"
    r.link_down("c")
    clock.advance(COOLDOWN - 0.5)
    assert {r.choose(set()).peer_id for _ in range(50)} == {"b"}
    clock.advance(0.5)
    assert {r.choose(set()).peer_id for _ in range(50)} == {"b", "c"}, "the cooldown is over without a link_up"
