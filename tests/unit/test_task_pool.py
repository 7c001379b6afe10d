"""The task pool, the microbatch ledger and the stand-in order, without a network."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest
import torch

from dht.rpc import Declined
from swarm.router import substitute_order
from swarm.task_pool import MicrobatchLedger, Task, TaskPool


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def task(mb_id: str) -> Task:
    return Task(mb_id, torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64))


def test_the_pool_replays_in_order_after_a_growing_backoff_and_loses_nothing():
    clock = Clock()
    pool = TaskPool(clock=clock, base_backoff=1.0, max_backoff=4.0)
    a, b = task("a"), task("b")
    pool.put_back(a, "stage 1 down")
    pool.put_back(b, "stage 1 down")
    assert pool.take_ready() is None and pool.next_ready_in() == 1.0
    clock.now = 1.0
    assert pool.take_ready() is a and a.attempt == 1 and a.last_error == "stage 1 down"
    pool.put_back(a, "again")
    assert pool.take_ready() is b
    assert pool.take_ready() is None and pool.next_ready_in() == 2.0  # the second failure waits twice as long
    clock.now = 3.0
    assert pool.take_ready() is a and len(pool) == 0 and pool.num_replays == 3
    assert [pool.backoff(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 4.0, 4.0]


def test_the_ledger_bounds_its_answers_by_bytes_and_age_and_remembers_counted_ids():
    clock = Clock()
    ledger = MicrobatchLedger(cache_bytes=1000, cache_ttl=10.0, max_ids=3, clock=clock)

    async def main():
        for i in range(4):
            ledger.begin(f"m{i}")
            ledger.finish(f"m{i}", {"ok": True, "route": []}, [torch.zeros(100)])  # 400 bytes each
            ledger.count(f"m{i}")
        assert ledger.answer("m0") is None and ledger.answer("m1") is None  # evicted by bytes
        assert ledger.answer("m3").tensors[0].numel() == 100
        clock.now = 11.0
        assert ledger.answer("m3") is None  # expired
        assert not ledger.was_counted("m0") and all(ledger.was_counted(f"m{i}") for i in (1, 2, 3))

        ledger.begin("x")
        with pytest.raises(ValueError):
            ledger.begin("x")
        waiting = ledger.running("x")
        ledger.fail("x", asyncio.CancelledError())
        with pytest.raises(Declined):  # who waited gets a refusal, never a cancellation of its own
            await waiting
        assert ledger.running("x") is None

    asyncio.run(main())


def test_stand_ins_are_ordered_alike_by_every_peer_and_spread_over_replicas():
    peers = [f"peer{i}" for i in range(4)]
    for mb_id in ("a:1", "b:7"):
        orders = {tuple(substitute_order(mb_id, list(p))) for p in itertools.permutations(peers)}
        assert len(orders) == 1  # whatever order a peer lists the replicas in
        order = orders.pop()
        assert sorted(order) == peers
        assert list(substitute_order(mb_id, [p for p in peers if p != order[0]])) == list(order[1:])
    firsts = Counter(substitute_order(f"mb{i}", peers)[0] for i in range(4000))
    assert set(firsts) == set(peers) and min(firsts.values()) > 800  # about 1000 each


def test_phi_accrual_suspects_a_silent_peer_sooner_on_a_steady_link_than_on_a_jittery_one():
    from swarm.failure_detector import PhiAccrual

    steady, jittery = PhiAccrual(min_std=0.01), PhiAccrual(min_std=0.01)
    for i in range(50):
        steady.heartbeat(i * 0.3)
        jittery.heartbeat(sum(0.3 + (0.25 if k % 2 else -0.25) for k in range(i)))
    assert steady.phi(steady.last + 0.3) < 1.0  # on time: no suspicion
    assert steady.phi(steady.last + 1.0) > 8.0  # 0.7 s late on a steady 0.3 s rhythm: down
    assert jittery.phi(jittery.last + 1.0) < 8.0  # the same silence on a jittery link: not yet
    for detector in (steady, jittery):
        timeout = detector.timeout(8.0)
        assert detector.phi(detector.last + timeout * 0.99) < 8.0 <= detector.phi(detector.last + timeout * 1.01)
    assert steady.timeout(8.0) < jittery.timeout(8.0)


def test_the_failure_detector_vouches_only_for_a_neighbour_that_answered_lately_and_is_not_down():
    from swarm.failure_detector import VOUCH_WINDOW, FailureDetector, PhiAccrual
    from swarm.view import SwarmView

    detector = FailureDetector(None, SwarmView(None, "run"), peer_id="me", stage=0, handler="h",
                               on_down=lambda peer_id, how: None)
    detector.monitors["b"] = PhiAccrual()
    assert not detector.vouches_for("b", now=10.0)  # monitored, never answered yet
    detector.monitors["b"].heartbeat(10.0)
    assert detector.vouches_for("b", now=10.0 + VOUCH_WINDOW)
    assert not detector.vouches_for("b", now=10.0 + VOUCH_WINDOW + 0.1)
    assert not detector.vouches_for("unknown", now=10.0)
    detector.declare_down("b", "detector")
    assert not detector.vouches_for("b", now=10.0)
