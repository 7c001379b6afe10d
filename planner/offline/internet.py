"""An internet of volunteers for the swarm-lifetime simulator (issue #18): regions, home links, GPUs, churn.

Every figure below is a stated assumption; where one rests on a source, the source is named. The
model is meant to be replaced piece by piece as measurements arrive (the link figures peers
publish, ``planner.link_view``), not to be right to the millisecond.

**Regions.** Nine metropolitan areas stand for where volunteers live (:data:`REGIONS`: a centroid
and a share of the volunteers). The shares are an assumption (more in North America, Europe and
East Asia, where most gaming PCs are), not data.

**Round trips.** Between two peers in regions ``r`` and ``s``::

    rtt = 2 * great_circle_km(r, s) * ROUTE_STRETCH / FIBRE_KM_PER_MS + access_p + access_q

Light in fibre covers about 200 km per millisecond (2/3 of c). Internet paths are longer than great
circles and pass routers: Bozkurt et al., "Why is the Internet so slow?!" (PAM 2017), measured
round trips about 3x the c-in-vacuum bound at the median, so :data:`ROUTE_STRETCH` = 1.5 over fibre
speed (2.25x c) is on the optimistic side of that. Inside a region peers are ``INTRA_REGION_KM``
apart. Each home adds its access delay (DSL/cable/fibre last mile), drawn once per peer between
:data:`ACCESS_RTT_MS`. New York to London comes out at about 85 ms plus access, to Tokyo about
160 ms plus access: the mission brief's 20–150 ms for most pairs, more across the Pacific.

**Bandwidth.** Home uplinks log-uniform on 10–100 Mbit/s (the mission brief's home links);
downlinks :data:`DOWNLINK_RATIO` times the uplink, at most 1 Gbit/s (asymmetric cable and DSL, an
assumption). A transfer from ``p`` to ``q`` runs at ``min(up_p, down_q)``: the core is never the
bottleneck (an assumption that flatters far links).

**Devices.** Sustained training FLOP/s log-uniform on 10–80 TFLOP/s (an RTX 3060 to an RTX 4090
at roughly 40 % of their dense bf16 peak, an assumption); memory 8, 12, 16 or 24 GiB.

**Churn.** Volunteers stay for a log-normal time with a median of :data:`SESSION_MEDIAN_S` (2 h)
and shape :data:`SESSION_SIGMA` (heavy-tailed, as volunteer-computing availability traces are:
Javadi et al., "Discovering statistical models of availability in large distributed systems",
MASCOTS 2009, fit Weibull and log-normal laws; the median here is an assumption). Arrivals are
Poisson at ``n / mean session``, so ``n`` peers stay online on average; the ``n`` peers present
at time 0 start fresh sessions.

Pure: every draw takes a ``numpy.random.Generator``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.runtime import RuntimeSettings
from planner.snapshot import Device, LinkMatrix, ModelProfile, SwarmSnapshot

FIBRE_KM_PER_MS = 200.0
ROUTE_STRETCH = 1.5
INTRA_REGION_KM = 400.0
ACCESS_RTT_MS = (5.0, 20.0)
UPLINK_MBIT = (10.0, 100.0)
DOWNLINK_RATIO = 5.0
MAX_DOWNLINK_MBIT = 1000.0
FLOPS_RANGE = (10e12, 80e12)
MEMORY_GIB = (8, 12, 16, 24)
MEMORY_WEIGHTS = (0.25, 0.35, 0.25, 0.15)
SESSION_MEDIAN_S = 2 * 3600.0
SESSION_SIGMA = 1.0
EARTH_RADIUS_KM = 6371.0


@dataclass(frozen=True)
class Region:
    name: str
    latitude: float
    longitude: float
    share: float


REGIONS = (
    Region("us-east", 40.7, -74.0, 0.16), Region("us-west", 37.8, -122.4, 0.12),
    Region("brazil", -23.5, -46.6, 0.07), Region("uk", 51.5, -0.1, 0.12), Region("poland", 52.2, 21.0, 0.12),
    Region("india", 19.1, 72.9, 0.08), Region("japan", 35.7, 139.7, 0.12), Region("singapore", 1.35, 103.8, 0.13),
    Region("australia", -33.9, 151.2, 0.08),
)


def great_circle_km(a: Region, b: Region) -> float:
    """Haversine distance between two regions' centroids."""
    phi1, phi2 = math.radians(a.latitude), math.radians(b.latitude)
    dphi, dlam = phi2 - phi1, math.radians(b.longitude - a.longitude)
    h = math.sin(dphi / 2) ** 2 + math.cos(phi1) * math.cos(phi2) * math.sin(dlam / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(h))


def region_rtt_seconds(regions: tuple[Region, ...] = REGIONS) -> np.ndarray:
    """(R, R) round trips between region centroids, seconds, access delays not included."""
    size = len(regions)
    rtt = np.empty((size, size))
    for i, a in enumerate(regions):
        for j, b in enumerate(regions):
            km = INTRA_REGION_KM if i == j else great_circle_km(a, b)
            rtt[i, j] = 2 * km * ROUTE_STRETCH / FIBRE_KM_PER_MS / 1000
    return rtt


@dataclass(frozen=True)
class Volunteers:
    """``n`` volunteers' draws, one array entry per peer (index = peer number)."""

    region: np.ndarray  # index into the regions
    access_rtt_s: np.ndarray
    uplink: np.ndarray  # bytes/s
    downlink: np.ndarray  # bytes/s
    flops: np.ndarray
    memory_bytes: np.ndarray
    session_s: np.ndarray

    @property
    def count(self) -> int:
        return len(self.region)


def draw_volunteers(rng: np.random.Generator, count: int, regions: tuple[Region, ...] = REGIONS) -> Volunteers:
    """``count`` volunteers drawn from the module's distributions."""
    shares = np.array([r.share for r in regions])
    uplink_mbit = np.exp(rng.uniform(*np.log(UPLINK_MBIT), count))
    return Volunteers(
        region=rng.choice(len(regions), size=count, p=shares / shares.sum()),
        access_rtt_s=rng.uniform(*ACCESS_RTT_MS, count) / 1000,
        uplink=uplink_mbit * 1e6 / 8,
        downlink=np.minimum(uplink_mbit * DOWNLINK_RATIO, MAX_DOWNLINK_MBIT) * 1e6 / 8,
        flops=np.exp(rng.uniform(*np.log(FLOPS_RANGE), count)),
        memory_bytes=rng.choice(MEMORY_GIB, size=count, p=MEMORY_WEIGHTS) * float(1 << 30),
        session_s=SESSION_MEDIAN_S * np.exp(SESSION_SIGMA * rng.standard_normal(count)),
    )


@dataclass(frozen=True)
class ChurnTrace:
    """Who is online when: peer ``i`` of ``volunteers`` arrives at ``arrive_s[i]`` and leaves at
    ``arrive_s[i] + session_s[i]`` (which may lie past the horizon)."""

    volunteers: Volunteers
    arrive_s: np.ndarray
    horizon_s: float

    def events(self) -> list[tuple[float, str, int]]:
        """(time, "join" | "leave", peer) in time order, within the horizon; joins first at a tie."""
        leave = self.arrive_s + self.volunteers.session_s
        events = [(float(t), "join", i) for i, t in enumerate(self.arrive_s) if t <= self.horizon_s]
        events += [(float(t), "leave", i) for i, t in enumerate(leave) if t <= self.horizon_s]
        return sorted(events, key=lambda e: (e[0], e[1] != "join", e[2]))


def churn_trace(rng: np.random.Generator, online: int, horizon_s: float) -> ChurnTrace:
    """``online`` peers at time 0, and Poisson arrivals that keep about that many online until ``horizon_s``."""
    mean_session = SESSION_MEDIAN_S * math.exp(SESSION_SIGMA ** 2 / 2)
    rate = online / mean_session
    later = int(rng.poisson(rate * horizon_s))
    arrivals = np.concatenate([np.zeros(online), np.sort(rng.uniform(0.0, horizon_s, later))])
    return ChurnTrace(volunteers=draw_volunteers(rng, online + later), arrive_s=arrivals, horizon_s=horizon_s)


def volunteer_snapshot(volunteers: Volunteers, model: ModelProfile, *, runtime: RuntimeSettings | None = None,
                       regions: tuple[Region, ...] = REGIONS, peers: np.ndarray | None = None,
                       peer_ids: list[str] | None = None) -> SwarmSnapshot:
    """The planner's snapshot of ``volunteers`` (all online, all reliable): one-way latency half the
    round trip above, and the rate of ``p`` to ``q`` ``min(up_p, down_q)``. Peer ids are ``v00000``…
    unless ``peer_ids`` names them. ``peers``: only the volunteers at these indices (in this order)."""
    if peers is not None:
        volunteers = Volunteers(**{name: getattr(volunteers, name)[peers] for name in Volunteers.__dataclass_fields__})
    rtt = region_rtt_seconds(regions)[np.ix_(volunteers.region, volunteers.region)]
    rtt = rtt + volunteers.access_rtt_s[:, None] + volunteers.access_rtt_s[None, :]
    bandwidth = np.minimum(volunteers.uplink[:, None], volunteers.downlink[None, :])
    ids = peer_ids if peer_ids is not None else [f"v{i:05d}" for i in range(volunteers.count)]
    devices = tuple(Device(peer_id=ids[i], flops=float(volunteers.flops[i]), is_reliable=True,
                           memory_bytes=int(volunteers.memory_bytes[i])) for i in range(volunteers.count))
    return SwarmSnapshot(devices=devices, links=LinkMatrix(latency_delay=rtt / 2, bandwidth=bandwidth), model=model,
                         runtime=runtime or RuntimeSettings())
