"""Prometheus metrics of a peer (or a bootstrap) on ``/metrics``, through ``prometheus_client``.

A scrape reads the peer's newest snapshot (:mod:`peer.status.snapshot`, at most about a second old):
:func:`peer.status.local.local_status` plus the counters of its stage's services, plus the swarm's
stage map from the DHT records. Each peer gets its own
``CollectorRegistry``, never the process-global one, so several peers in one process (tests) do not
clash.

Names follow Prometheus conventions: ``murmuration_`` prefix, ``_total`` counters, base units
(seconds, bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
)
from prometheus_client.registry import Collector

from dht.rpc import REQUEST_OUTCOMES
from peer.status.local import StatusHistory, local_status
from peer.status.snapshot import PeerSnapshot, PeerState, ServiceCounters
from swarm.spot_check import OUTCOMES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=math.nan if value is None else float(value))


def _counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value or 0))


class PeerCollector(Collector):
    """The peer's own figures: throughput, queues, traffic, averaging, failures, bans.

    Args:
        snapshot: the peer's newest :class:`PeerSnapshot`.
        history: its recent counters (the rates), or None.
    """

    def __init__(self, snapshot: Callable[[], PeerSnapshot], history: Callable[[], StatusHistory | None] = lambda: None) -> None:
        self.snapshot = snapshot
        self.history = history

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot()
        status = local_status(snapshot, self.history())
        yield InfoMetricFamily("murmuration_peer", "who this peer is", value={
            "peer_id": status["peer_id"] or "", "run_id": status["run_id"], "role": status["role"],
            "software_version": status["software_version"]})
        yield StateSetMetricFamily("murmuration_peer_state", "the peer's lifecycle state",
                                   value={state.value: state is snapshot.state for state in PeerState})
        yield _gauge("murmuration_stage", "stage this peer serves (-1 while joining)", status["stage"])
        yield _gauge("murmuration_tokens_per_second", "tokens/s this peer processed, recent window", status["tokens_per_s"])
        yield _gauge("murmuration_samples_per_second", "samples/s, recent window", status["samples_per_s"])
        yield _gauge("murmuration_microbatches_per_second", "microbatches/s, recent window", status["microbatches_per_s"])
        yield _gauge("murmuration_loss", "most recent loss, nats/token (NaN before any)", status["loss"])
        yield _gauge("murmuration_val_loss", "most recent held-out loss, nats/token (NaN before any; stage 0)",
                     status["val_loss"])
        yield _gauge("murmuration_uptime_seconds", "seconds since the peer started", status["uptime_s"])
        yield _gauge("murmuration_flops", "measured compute, FLOP/s", status["flops"])
        yield _counter("murmuration_optimizer_steps", "optimizer steps of this stage replica", status["step"])
        yield _counter("murmuration_samples", "samples this peer processed", status["num_samples"])
        yield _counter("murmuration_microbatches", "microbatches this peer processed", status["num_microbatches"])
        yield _counter("murmuration_sent_bytes", "bytes of pipeline and state messages sent", status["bytes_sent"])
        yield _counter("murmuration_received_bytes", "bytes of pipeline and state messages received", status["bytes_received"])
        yield from _services(snapshot.services)
        yield _requests()
        yield _counter("murmuration_bans", "peers this peer has banned for misbehaviour (dht/reputation.py)", snapshot.bans)
        yield _counter("murmuration_strikes", "misbehaviours of other peers this peer has counted (dht/reputation.py)",
                       snapshot.strikes)


def _services(counters: ServiceCounters) -> Iterator[Metric]:
    yield _gauge("murmuration_held_graphs", "microbatches whose forward ran here and await their backward",
                 counters.held_graphs)
    yield _gauge("murmuration_requests_in_progress", "forward requests this peer is serving now",
                 counters.requests_in_progress)
    yield _gauge("murmuration_in_flight_to_next_stage", "microbatches sent to the next stage, not yet answered",
                 counters.in_flight_to_next_stage)
    yield _counter("murmuration_averaging_rounds", "in-stage averaging rounds completed", counters.averaging_rounds)
    yield _counter("murmuration_averaging_failures", "in-stage averaging rounds that failed", counters.averaging_failures)
    failures = CounterMetricFamily("murmuration_failures", "failures by kind: route (a send to the next stage "
                                   "failed), unrouted (no peer took a microbatch), refused (bad requests received)",
                                   labels=["kind"])
    failures.add_metric(["route"], float(counters.route_failures))
    failures.add_metric(["unrouted"], float(counters.unrouted))
    failures.add_metric(["refused"], float(counters.refused))
    yield failures
    checks = CounterMetricFamily("murmuration_spot_checks", "spot checks of the next stage's answers, by outcome: "
                                 "match, mismatch (a strike against the replicas), skipped (no comparable "
                                 "second answer) (swarm/spot_check.py)", labels=["outcome"])
    for outcome in OUTCOMES:
        checks.add_metric([outcome], float(counters.spot_checks.get(outcome, 0)))
    yield checks
    exchanges = CounterMetricFamily("murmuration_gradient_exchanges", "gradient exchanges with the stage's co-replicas "
                                    "(swarm/gradient_sync.py), by outcome: whole, partial (a co-replica missing), "
                                    "alone (stepped without any)", labels=["outcome"])
    exchanges.add_metric(["whole"], float(counters.exchanges - counters.exchanges_partial - counters.exchanges_alone))
    exchanges.add_metric(["partial"], float(counters.exchanges_partial))
    exchanges.add_metric(["alone"], float(counters.exchanges_alone))
    yield exchanges


def _requests() -> CounterMetricFamily:
    family = CounterMetricFamily("murmuration_rpc_requests", "requests this peer's handlers served, by handler "
                                 "and outcome: ok, refused (bad input, reason logged), declined (leaving, paused), "
                                 "abandoned (the caller stalled or hung up mid-request), error (a bug of ours)",
                                 labels=["handler", "outcome"])
    for (handler, outcome), count in sorted(REQUEST_OUTCOMES.items()):
        family.add_metric([handler, outcome], float(count))
    return family


class SwarmCollector(Collector):
    """The swarm as seen from here: peers and throughput per stage, the bottleneck."""

    def __init__(self, swarm_status: Callable[[], dict[str, Any]]) -> None:
        self.swarm_status = swarm_status

    def collect(self) -> Iterator[Metric]:
        doc = self.swarm_status()
        peers = GaugeMetricFamily("murmuration_swarm_stage_peers", "peers per stage", labels=["stage"])
        measured = GaugeMetricFamily("murmuration_swarm_stage_tokens_per_second",
                                     "measured tokens/s of a stage's training peers", labels=["stage"])
        capacity = GaugeMetricFamily("murmuration_swarm_stage_capacity_tokens_per_second",
                                     "a stage's capacity: members' FLOP/s over its FLOPs per token", labels=["stage"])
        for stage in doc["stages"]:
            label = [str(stage["stage"])]
            peers.add_metric(label, stage["num_peers"])
            measured.add_metric(label, stage["tokens_per_s"])
            capacity.add_metric(label, stage["capacity_tokens_per_s"])
        yield from (peers, measured, capacity)
        yield _gauge("murmuration_swarm_bottleneck_stage", "stage of least capacity", doc["bottleneck"])
        yield _gauge("murmuration_swarm_peers", "live peer records of the run", doc["totals"]["num_peers"])
        yield _gauge("murmuration_swarm_tokens_per_second", "the swarm's training tokens/s (last stage)",
                     doc["totals"]["tokens_per_s"])
        yield _gauge("murmuration_swarm_loss", "mean recent loss of the last stage", doc["totals"]["loss"])


class HTTPCollector(Collector):
    """The status server's own requests, bad ones included."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        yield _counter("murmuration_status_http_requests", "requests to the status port", self.server.num_requests)
        yield _counter("murmuration_status_http_bad_requests", "malformed or refused requests to the status port",
                       self.server.num_bad_requests)


def make_registry(*collectors: Collector) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one) holding ``collectors``."""
    registry = CollectorRegistry(auto_describe=True)
    for collector in collectors:
        registry.register(collector)
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The text exposition format of everything in ``registry``."""
    return generate_latest(registry)
