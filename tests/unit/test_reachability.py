"""Reachability (docs/nat.md): the dial-back verdict, what it makes of a peer, and what a relayed peer costs a stage."""

from __future__ import annotations

import asyncio
import itertools
import math
import random

import pytest

from dht.reachability import DialBackServer, check_ports, listen_ports, observed_address, relay_maddrs
from dht.records import PeerRecord
from dht.relays import RelaySlots, SlotsFull
from dht.rpc import Declined
from peer.config import PeerConfig
import peer.reachability
from peer.reachability import (
    Reach,
    announced_at,
    as_client,
    ask_checkers,
    connection_kind,
    describe,
    neighbours,
    node_config,
    public_peers,
    should_check,
)
from planner.reachability import DialBack, Verdict, classify, judge, relay_slots_for, serving_throughput
from planner.stage_choice import Joiner, StageMember, assign_joiners, choose_move, choose_stage, stage_throughputs
from tests.unit.fake_clock import FakeClock

BOOT_ID = "12D3KooWFhaiMviy3ziS2qv7CchDD159ETRVeu1DJYGVVuJB8t7n"
BOOT = f"/ip4/11.0.1.2/tcp/4000/p2p/{BOOT_ID}"


# --- the verdict -------------------------------------------------------------------------------

@pytest.mark.parametrize("answers, reachable", [
    ([True, True, True], True), ([True, False], True), ([False, False, True], False), ([None, False], False),
    ([None, None], None), ([], None), ([True, None, None], True),
])
def test_reachable_when_at_least_half_of_the_answers_say_so(answers, reachable):
    verdict = judge([DialBack(reachable=a) for a in answers], listen_ports=[4000])
    assert verdict.reachable is reachable
    assert verdict.num_answers == sum(a is not None for a in answers)


@pytest.mark.parametrize("seen, mapping", [
    (["1.2.3.4:4000", "1.2.3.4:4000"], "kept"),  # one mapping for every checker
    (["1.2.3.4:5555", "1.2.3.4:5555"], "kept"),  # remapped, but the same for all: hole punching works
    (["1.2.3.4:4000"], "kept"),  # one checker, the listening port kept
    (["1.2.3.4:5555"], "unknown"),  # one checker saw another port: cannot tell
    (["1.2.3.4:5555", "1.2.3.4:6666"], "changed"),  # a symmetric NAT
    ([], "unknown"),
])
def test_the_mapping_is_what_the_checkers_saw(seen, mapping):
    verdict = judge([DialBack(reachable=False, observed=s) for s in seen], listen_ports=[4000])
    assert verdict.mapping == mapping
    assert verdict.observed == (seen[0] if seen else "")


def verdict(reachable: bool | None, mapping: str = "kept") -> Verdict:
    return Verdict(reachable=reachable, observed="1.2.3.4:4000", mapping=mapping, num_answers=3,
                   num_reachable=3 if reachable else 0)


@pytest.mark.parametrize("reachable, mapping, relays, client, kind", [
    (True, "kept", 0, False, "direct"),
    (None, "unknown", 0, False, "direct"),  # nobody could check: Petals' default
    (False, "kept", 1, False, "relayed"),
    (False, "unknown", 2, False, "relayed"),
    (False, "kept", 0, False, "unreachable"),  # no relay slot
    (False, "changed", 2, False, "unreachable"),  # a symmetric NAT: no hole punching, whatever the relays
    (True, "kept", 0, True, "unreachable"),  # --client-mode
])
def test_classify(reachable, mapping, relays, client, kind):
    assert classify(verdict(reachable, mapping), num_relays=relays, client_mode=client)[0] == kind


# --- what a relayed peer adds to a stage -----------------------------------------------------

def test_a_relayed_peer_pays_its_relay_delay_only_where_it_is_dialled():
    plain = serving_throughput(2e9, 1e9, stage=1)
    assert plain == 2.0
    assert serving_throughput(2e9, 1e9, stage=0, reachability="relayed", microbatch_size=4, relay_delay=0.5) == plain
    assert serving_throughput(2e9, 1e9, stage=1, reachability="direct", microbatch_size=4, relay_delay=0.5) == plain
    # 4 samples take 2 s of compute, plus 0.5 s of relay: 4 / 2.5
    assert serving_throughput(2e9, 1e9, stage=1, reachability="relayed", microbatch_size=4, relay_delay=0.5) == 1.6
    assert serving_throughput(0.0, 1e9, stage=1, reachability="relayed", relay_delay=0.5) == 0.0
    with pytest.raises(ValueError):
        serving_throughput(1e9, 0.0, stage=0)


def test_relay_slots_are_a_quarter_of_the_upload_budget_at_most():
    assert relay_slots_for(0.0, slots=8, per_slot_mbps=0.28) == 8  # no budget given
    assert relay_slots_for(2.0, slots=8, per_slot_mbps=0.28) == 1  # 0.5 Mbit/s for relaying
    assert relay_slots_for(100.0, slots=8, per_slot_mbps=0.28) == 8
    with pytest.raises(ValueError):
        relay_slots_for(1.0, slots=-1, per_slot_mbps=0.28)


def old_assign(costs, members, joiners):
    """The stage choice before reachability: each joiner on choose_stage's stage (the oracle)."""
    placed, out = list(members), {}
    for joiner in sorted(joiners, key=lambda j: (j.announced_at, j.peer_id)):
        out[joiner.peer_id] = choose_stage(costs, placed)
        placed.append(StageMember(peer_id=joiner.peer_id, stage=out[joiner.peer_id], flops=joiner.flops))
    return out


def test_direct_joiners_are_placed_as_before_reachability_existed():
    rng = random.Random(15)
    for _ in range(300):
        costs = [rng.choice([1.0, 2.0, 3.0]) for _ in range(rng.randint(1, 4))]
        members = [StageMember(peer_id=f"m{i}", stage=rng.randrange(len(costs)), flops=rng.choice([0.0, 1.0, 2.0, 5.0]))
                   for i in range(rng.randint(0, 5))]
        joiners = [Joiner(peer_id=f"j{i}", flops=rng.choice([1.0, 2.0, 4.0]), announced_at=rng.random())
                   for i in range(rng.randint(1, 4))]
        assert assign_joiners(costs, members, joiners, microbatch_size=4, relay_delay=0.1) == old_assign(costs, members, joiners)


def test_an_unreachable_joiner_takes_stage_0_whatever_the_deficits():
    members = [StageMember(peer_id="a", stage=0, flops=10.0)]  # stage 1 is empty: the deficit
    joiners = [Joiner(peer_id="u", flops=1.0, announced_at=0.0, reachability="unreachable"),
               Joiner(peer_id="d", flops=1.0, announced_at=1.0)]
    assert assign_joiners([1.0, 1.0], members, joiners) == {"u": 0, "d": 1}


def test_a_relayed_member_counts_less_where_it_is_dialled_so_joiners_fill_its_stage():
    relayed = StageMember(peer_id="r", stage=1, flops=1.0, reachability="relayed")
    direct = StageMember(peer_id="d", stage=0, flops=1.0)
    plain = stage_throughputs([1.0, 1.0], [relayed, direct])
    assert plain == [1.0, 1.0]  # no relay delay given: as before
    costed = stage_throughputs([1.0, 1.0], [relayed, direct], microbatch_size=1, relay_delay=0.5)
    assert costed[0] == 1.0 and math.isclose(costed[1], 1 / 1.5)
    joiner = Joiner(peer_id="j", flops=1.0, announced_at=0.0)
    assert assign_joiners([1.0, 1.0], [relayed, direct], [joiner]) == {"j": 0}  # a tie: the lower stage
    assert assign_joiners([1.0, 1.0], [relayed, direct], [joiner], relay_delay=0.5) == {"j": 1}


def test_an_unreachable_member_is_never_moved():
    members = [StageMember(peer_id=p, stage=0, flops=4.0, reachability="unreachable") for p in "abc"]
    members.append(StageMember(peer_id="z", stage=1, flops=1.0))
    assert choose_move([1.0, 1.0], members, min_gain=0.1) is None
    members[0] = StageMember(peer_id="a", stage=0, flops=4.0)
    move = choose_move([1.0, 1.0], members, min_gain=0.1)
    assert move is not None and move.peer_id == "a" and move.to_stage == 1


# --- the record ---------------------------------------------------------------------------------

def record(**fields) -> PeerRecord:
    return PeerRecord(peer_id="QmPeer", role="reliable", state="training", stage=0, flops=1.0, **fields)


def test_reachability_is_on_the_wire_only_when_it_is_not_direct():
    assert "reachability" not in record().to_wire()  # records of older peers read as before
    assert PeerRecord.from_wire(record().to_wire()).reachability == "direct"
    wire = record(reachability="relayed").to_wire()
    assert wire["reachability"] == "relayed" and PeerRecord.from_wire(wire).reachability == "relayed"
    for bad in ("public", "", 1, None):
        with pytest.raises(ValueError, match="reachability"):
            PeerRecord.from_wire({**record().to_wire(), "reachability": bad})


# --- the dial-back protocol's bounds ------------------------------------------------------------

def test_the_checker_sees_the_callers_address_unless_relayed():
    assert observed_address("/ip4/11.0.3.2/tcp/4000") == ("ip4", "11.0.3.2")
    assert observed_address("/ip6/::1/tcp/4000") == ("ip6", "::1")
    assert observed_address("/ip4/11.0.1.2/tcp/4000/p2p/QmRelay/p2p-circuit") is None
    assert observed_address("/ip4/11.0.1.2/udp/4000/quic") is None
    assert observed_address("garbage") is None


@pytest.mark.parametrize("ports", [[], [0], [70000], ["80"], [True], [1, 2, 3, 4, 5], "4000", None, [4000.0]])
def test_a_request_names_a_few_tcp_ports_and_nothing_else(ports):
    with pytest.raises(ValueError):
        check_ports(ports)


def test_ports_and_relay_addresses_of_a_node():
    maddrs = ["/ip4/192.168.3.2/tcp/4000/p2p/QmMe", "/ip4/11.0.1.2/tcp/5000/p2p/QmRelay/p2p-circuit/p2p/QmMe"]
    assert check_ports([4000, 4000, 80]) == [80, 4000]
    assert listen_ports(maddrs) == [4000]
    assert relay_maddrs(maddrs) == maddrs[1:]


def test_the_checker_rate_limits_per_asker_overall_and_at_once():
    clock = FakeClock()
    server = DialBackServer(None, max_per_minute=3, per_peer_period=10.0, max_concurrent=1, clock=clock)
    server._admit("a")
    with pytest.raises(Declined, match="checked you"):
        server._admit("a")
    server._admit("b")
    server._running = 1
    with pytest.raises(Declined, match="busy: checking"):
        server._admit("c")
    server._running = 0
    server._admit("c")
    with pytest.raises(Declined, match="this minute"):
        server._admit("d")
    clock.advance(60.0)
    server._admit("a")
    assert server.num_declined == 3


def test_relay_slots_are_bounded_renewed_and_freed_when_not_renewed():
    clock = FakeClock()
    slots = RelaySlots(None, slots=2, lease=60.0, clock=clock)
    assert slots.grant("a") == 60.0 and slots.grant("b") == 60.0
    with pytest.raises(SlotsFull):
        slots.grant("c")
    clock.advance(40.0)
    slots.grant("a")  # renewed: a's lease now ends at 100
    clock.advance(30.0)  # b's ended at 60
    assert slots.holders() == ["a"]
    slots.grant("c")
    with pytest.raises(SlotsFull):
        slots.grant("d")
    assert slots.num_refused == 2


# --- the peer's side ---------------------------------------------------------------------------

def peer_config(**fields) -> PeerConfig:
    return PeerConfig(bootstrap=(BOOT,), host_maddrs=("/ip4/0.0.0.0/tcp/0",), **fields)


def test_the_check_runs_unless_on_loopback_asked_not_to_or_in_client_mode():
    assert should_check(peer_config())
    assert not should_check(peer_config(reachability="direct"))
    assert not should_check(peer_config(client_mode=True))
    assert not should_check(PeerConfig(bootstrap=(BOOT,), host_maddrs=("/ip4/127.0.0.1/tcp/0",)))


def test_askers_ask_the_bootstraps_first_then_direct_peers_in_an_order_of_their_own():
    records = [PeerRecord(peer_id=p, role="reliable", state="training", stage=0, flops=1.0,
                          reachability="relayed" if p == "n" else "direct") for p in "abcdn"]
    first = public_peers(peer_config(), records, own_id="a")
    assert first[0] == BOOT_ID and set(first[1:]) == {"b", "c", "d"}
    orders = {tuple(public_peers(peer_config(), records, own_id=own)[1:]) for own in ("x", "y", "z", "w", "v")}
    assert len(orders) > 1  # spread: not every asker asks the same peer first


def test_neighbours_and_connections():
    records = [PeerRecord(peer_id=f"p{s}{i}", role="reliable", state=state, stage=s, flops=1.0)
               for s, i, state in itertools.product(range(4), range(2), ["training"])]
    assert [r.peer_id for r in neighbours(records, "p10", 1)] == ["p00", "p01", "p11", "p20", "p21"]
    assert connection_kind(None) is None and connection_kind([]) is None
    assert connection_kind(["/ip4/11.0.1.2/tcp/1/p2p/QmR/p2p-circuit"]) == "relayed"
    assert connection_kind(["/ip4/11.0.1.2/tcp/1/p2p/QmR/p2p-circuit", "/ip4/11.0.3.2/tcp/4000"]) == "direct"


def test_the_one_line_and_what_each_reachability_makes_of_the_peer():
    maddrs = ["/ip4/192.168.3.2/tcp/4000/p2p/QmMe", "/ip4/11.0.1.2/tcp/5000/p2p/QmRelay/p2p-circuit/p2p/QmMe"]
    assert describe(Reach(kind="direct", why=""), maddrs[:1]) == f"reachable at {maddrs[0]}"
    relayed = Reach(kind="relayed", why="", relays=(BOOT,), verdict=verdict(False))
    assert describe(relayed, maddrs).startswith(f"behind NAT: reachable through relay {maddrs[1]} (its NAT keeps one mapping")
    lonely = Reach(kind="unreachable", why="no relay")
    assert describe(lonely, maddrs[:1]) == ("not reachable: will train as a client of stage 0 and average in client "
                                            "mode (no relay)")
    client = as_client(peer_config(stage=1, role="reliable"))
    assert (client.stage, client.client_mode, client.resolved_role) == (0, True, "unreliable")
    assert node_config(peer_config(), reach=lonely).client_mode
    assert node_config(peer_config(), reach=relayed).relays == relayed.relays
    assert node_config(peer_config(), reach=Reach(kind="direct", why="")).relays == ()
    assert node_config(peer_config()).daemon_reachability == "private"
    assert node_config(PeerConfig(bootstrap=(BOOT,), host_maddrs=("/ip4/127.0.0.1/tcp/0",))).daemon_reachability is None


def test_only_a_node_dialled_at_its_own_address_dials_out_from_fresh_ports():
    """dht.node: from its listening port a node's dials can collide with a neighbour's; behind a NAT
    it must keep that port (hole punching, a full cone's mapping), and so must the probe."""
    public = Reach(kind="direct", why="", verdict=verdict(True), own_ips=("1.2.3.4",))
    full_cone = Reach(kind="direct", why="", verdict=verdict(True), own_ips=("192.168.5.2",))
    relayed = Reach(kind="relayed", why="", relays=(BOOT,), verdict=verdict(False))
    fresh = {name: not node_config(peer_config(), reach=reach).reuse_port
             for name, reach in (("public", public), ("not checked", Reach(kind="direct", why="not checked")),
                                 ("full cone", full_cone), ("relayed", relayed),
                                 ("unreachable", Reach(kind="unreachable", why="")), ("probe", None))}
    assert fresh == {"public": True, "not checked": True, "full cone": False, "relayed": False,
                     "unreachable": False, "probe": False}


def test_a_peer_dialled_back_through_its_nat_announces_the_nats_address():
    behind = Reach(kind="direct", why="", verdict=verdict(True), own_ips=("192.168.5.2",))
    assert behind.forwarded_ip == "1.2.3.4"  # a full-cone NAT, a port forward: it must say where to dial
    assert Reach(kind="direct", why="", verdict=verdict(True), own_ips=("1.2.3.4",)).forwarded_ip is None
    assert Reach(kind="relayed", why="", verdict=verdict(False), own_ips=("192.168.5.2",)).forwarded_ip is None
    assert Reach(kind="direct", why="not checked").forwarded_ip is None
    fixed = announced_at(PeerConfig(bootstrap=(BOOT,), host_maddrs=("/ip4/0.0.0.0/tcp/31337",)), "1.2.3.4")
    assert fixed.announce_maddrs == ("/ip4/1.2.3.4/tcp/31337",) and fixed.host_maddrs == ("/ip4/0.0.0.0/tcp/31337",)
    chosen = announced_at(peer_config(), "1.2.3.4")
    port = int(chosen.host_maddrs[0].rsplit("/", 1)[1])
    assert port > 0 and chosen.announce_maddrs == (f"/ip4/1.2.3.4/tcp/{port}",)


def test_a_checker_that_cannot_check_is_replaced_by_the_next(monkeypatch):
    asked = []

    async def answer(_p2p, checker: str, *, ports):
        asked.append(checker)
        return DialBack(reachable=None if checker in "ac" else False)  # a and c are busy

    monkeypatch.setattr(peer.reachability, "call_dial_back", answer)
    answers = asyncio.run(ask_checkers(None, list("abcdefg"), ports=[4000]))
    assert asked == list("abcde") and sum(a.reachable is not None for a in answers) == 3
    asked.clear()
    assert len(asyncio.run(ask_checkers(None, list("ac"), ports=[4000]))) == 2 and asked == ["a", "c"]
