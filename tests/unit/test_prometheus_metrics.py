"""peer.status.prometheus: the /metrics text parses, carries the peer's real counters, per-peer registries."""

from __future__ import annotations

import types
from prometheus_client.parser import text_string_to_metric_families

from peer.status.prometheus import HTTPCollector, PeerCollector, SwarmCollector, make_registry, render_metrics
from peer.status.local import StatusHistory, StatusSample
from peer.status.snapshot import PeerSnapshot, PeerState, ServiceCounters
from tests.unit.test_status import make_peer, make_snapshot
from tests.unit.test_terminal_view import make_doc


def samples(registry) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape as (name, sorted labels) -> value, parsed by prometheus_client's own parser."""
    text = render_metrics(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def training_peer() -> tuple[PeerSnapshot, StatusHistory]:
    """A training peer's snapshot (its services' counters in it) and its recent counters."""
    history = StatusHistory(seq_len=64)
    history.record(StatusSample(t=10.0, num_samples=0, num_microbatches=0, loss=3.0, bytes_sent=0, bytes_received=0))
    history.record(StatusSample(t=12.0, num_samples=32, num_microbatches=2, loss=3.0, bytes_sent=0, bytes_received=0))
    services = ServiceCounters(in_flight_to_next_stage=3, route_failures=2, requests_in_progress=1, refused=4,
                               unrouted=1, averaging_rounds=5, averaging_failures=1, exchanges=9,
                               exchanges_partial=2, exchanges_alone=1)
    snapshot = make_snapshot(state=PeerState.TRAINING, activity="training stage 0", stage=0, num_stages=2,
                             num_samples=16, num_microbatches=1, val_loss=2.75, services=services)
    return snapshot, history


def collector(snapshot: PeerSnapshot, history: StatusHistory | None = None) -> PeerCollector:
    return PeerCollector(lambda: snapshot, lambda: history)


def test_peer_metrics_parse_and_carry_its_counters():
    got = samples(make_registry(collector(*training_peer())))
    assert got[("murmuration_tokens_per_second", ())] == 16.0 * 64
    assert got[("murmuration_samples_total", ())] == 16.0
    assert got[("murmuration_val_loss", ())] == 2.75
    assert got[("murmuration_sent_bytes_total", ())] == 1000.0 and got[("murmuration_received_bytes_total", ())] == 2000.0
    assert got[("murmuration_in_flight_to_next_stage", ())] == 3.0
    assert got[("murmuration_requests_in_progress", ())] == 1.0
    assert got[("murmuration_averaging_rounds_total", ())] == 5.0
    assert got[("murmuration_averaging_failures_total", ())] == 1.0
    assert got[("murmuration_failures_total", (("kind", "route"),))] == 2.0
    assert got[("murmuration_failures_total", (("kind", "unrouted"),))] == 1.0
    assert got[("murmuration_failures_total", (("kind", "refused"),))] == 4.0
    assert got[("murmuration_gradient_exchanges_total", (("outcome", "whole"),))] == 6.0
    assert got[("murmuration_gradient_exchanges_total", (("outcome", "partial"),))] == 2.0
    assert got[("murmuration_gradient_exchanges_total", (("outcome", "alone"),))] == 1.0
    assert got[("murmuration_bans_total", ())] == 0.0
    assert got[("murmuration_peer_state", (("murmuration_peer_state", "training"),))] == 1.0
    assert got[("murmuration_peer_state", (("murmuration_peer_state", "joining"),))] == 0.0
    info = next(k for k in got if k[0] == "murmuration_peer_info")
    assert ("peer_id", "QmPeerABCDEF") in info[1] and ("role", "unreliable") in info[1]


def test_a_joining_peer_scrapes_without_error():
    got = samples(make_registry(collector(make_snapshot())))
    assert got[("murmuration_stage", ())] == -1.0 and got[("murmuration_held_graphs", ())] == 0.0
    assert got[("murmuration_in_flight_to_next_stage", ())] == 0.0


def test_a_real_peer_is_scraped_from_its_own_snapshot():
    peer = make_peer()
    got = samples(make_registry(PeerCollector(lambda: peer.snapshot, lambda: peer.history)))
    assert got[("murmuration_peer_state", (("murmuration_peer_state", "joining"),))] == 1.0
    assert got[("murmuration_stage", ())] == -1.0


def test_swarm_metrics_per_stage():
    doc = make_doc()
    got = samples(make_registry(SwarmCollector(lambda: doc)))
    assert got[("murmuration_swarm_stage_peers", (("stage", "0"),))] == 2.0
    assert got[("murmuration_swarm_stage_peers", (("stage", "1"),))] == 1.0
    assert got[("murmuration_swarm_bottleneck_stage", ())] == 1.0
    assert got[("murmuration_swarm_peers", ())] == 3.0


def test_two_peers_in_one_process_have_registries_of_their_own():
    first, second = make_snapshot(), make_snapshot(peer_id="QmSecond")
    server = types.SimpleNamespace(num_requests=7, num_bad_requests=2)
    a = samples(make_registry(collector(first), HTTPCollector(server)))
    b = samples(make_registry(collector(second)))  # the same metric names again: no clash
    assert any(("peer_id", "QmPeerABCDEF") in k[1] for k in a) and any(("peer_id", "QmSecond") in k[1] for k in b)
    assert a[("murmuration_status_http_bad_requests_total", ())] == 2.0


def test_requests_are_counted_by_handler_and_outcome():
    from dht.rpc import REQUEST_OUTCOMES

    REQUEST_OUTCOMES["replication probe", "refused"] += 7
    try:
        got = samples(make_registry(collector(*training_peer())))
    finally:
        REQUEST_OUTCOMES["replication probe", "refused"] -= 7
    key = ("murmuration_rpc_requests_total", (("handler", "replication probe"), ("outcome", "refused")))
    assert got[key] >= 7.0
