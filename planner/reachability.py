"""Whether others can dial a peer, and what that changes about where it may serve (pure).

A peer finds out by itself (``peer.reachability``): a few peers each dial it back from a fresh
libp2p node, at the address its connection to them came from (``dht.reachability``), and say
whether that worked and which address and port they saw. :func:`judge` turns their answers into a
:class:`Verdict`; :func:`classify` turns the verdict and the relay slots the peer obtained into its
reachability, one of :data:`REACHABILITIES`:

    direct       others dial it (a public address, a port forward, a full-cone NAT)
    relayed      behind a NAT that keeps one mapping for every destination, with a slot on a public
                 peer's relay: others reach it through the relay, and a direct connection follows by
                 hole punching (libp2p's DCUtR) or because it dials the public peers it works with
    unreachable  nobody can dial it (no relay slot, or a NAT that maps every connection to a new port,
                 which defeats hole punching): it trains as a client of stage 0, which only ever dials
                 out, and averages in client mode

The verdict rule is Petals' (``check_direct_reachability``): reachable when at least half of the
peers that answered could dial it back; unknown when none answered. The mapping test is the one
libp2p's hole punching depends on: every checker must have seen the same source address and port
("changed" if not: a symmetric NAT). One checker alone tells only when it saw the port the peer
listens on (libp2p dials out from its listening port, so a NAT that kept it keeps one mapping).

Cost model of a relayed peer (:func:`serving_throughput`): a peer of stage ``k >= 1`` is dialled by
the stage before it; when that peer holds no direct connection yet, the microbatch waits for the relay
and the hole punch, about one more round trip through a third host. We charge it ``relay_delay``
seconds per microbatch of ``b`` samples on top of its compute, ``b * cost_k / f``:

    T = b / (b * cost_k / f + relay_delay)   samples/s      (T = f / cost_k when relay_delay is 0)

Stage 0 is never dialled by the pipeline (it sends and reads the answers on its own streams), so a
relayed peer serves it at full speed: stage choice leans relayed peers towards stage 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REACHABILITIES = ("direct", "relayed", "unreachable")
MAPPINGS = ("kept", "changed", "unknown")  # what the checkers saw of the peer's NAT mapping
RELAY_DELAY = 0.1  # seconds: one extra round trip through a relay on home links (20-150 ms)


@dataclass(frozen=True, kw_only=True)
class DialBack:
    """One checker's answer.

    Attributes:
        reachable: it dialled the peer back (True), could not (False), or could not check (None:
            busy, relayed connection, no answer).
        observed: the ``ip:port`` its connection from the peer came from ("" if not known).
    """

    reachable: bool | None
    observed: str = ""


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What the checkers' answers say together.

    Attributes:
        reachable: True/False by the half rule, None if nobody could check.
        observed: the ``ip:port`` most checkers saw ("" if none saw one).
        mapping: "kept" (one mapping for every checker: hole punching can work), "changed"
            (different addresses for different checkers: it cannot) or "unknown".
        num_answers / num_reachable: checkers that answered, and of those, dialled back.
    """

    reachable: bool | None
    observed: str
    mapping: str
    num_answers: int
    num_reachable: int


def judge(answers: Sequence[DialBack], *, listen_ports: Sequence[int]) -> Verdict:
    """The verdict of ``answers`` for a peer listening on ``listen_ports``."""
    answered = [a for a in answers if a.reachable is not None]
    num_reachable = sum(1 for a in answered if a.reachable)
    reachable = None if not answered else 2 * num_reachable >= len(answered)
    seen = sorted(a.observed for a in answers if a.observed)
    observed = max(sorted(set(seen)), key=seen.count) if seen else ""
    if len(set(seen)) > 1:
        mapping = "changed"  # one mapping per destination: a symmetric NAT
    elif len(seen) > 1 or (seen and _port(observed) in set(listen_ports)):
        mapping = "kept"
    else:
        mapping = "unknown"  # nobody saw it, or one checker saw another port (a NAT that remaps ports)
    return Verdict(reachable=reachable, observed=observed, mapping=mapping, num_answers=len(answered),
                   num_reachable=num_reachable)


def classify(verdict: Verdict, *, num_relays: int, client_mode: bool = False) -> tuple[str, str]:
    """The peer's reachability and why, in words for its log line.

    Args:
        verdict: the dial-back check's.
        num_relays: relay slots it obtained on public peers.
        client_mode: the user asked for client mode (``--client-mode``): unreachable whatever the check.
    """
    if client_mode:
        return "unreachable", "--client-mode"
    if verdict.reachable is None:
        return "direct", "no peer could check (assumed reachable, as Petals does)"
    if verdict.reachable:
        return "direct", f"{verdict.num_reachable} of {verdict.num_answers} peers dialled it back"
    if verdict.mapping == "changed":
        return "unreachable", (f"its NAT gives connections other ports ({verdict.observed}), so neither "
                               "dial-backs nor hole punching reach it")
    if num_relays == 0:
        return "unreachable", "behind a NAT and no public peer has a free relay slot"
    return "relayed", f"{verdict.num_answers - verdict.num_reachable} peers could not dial it back"


def serving_throughput(flops: float, stage_cost: float, *, stage: int, reachability: str = "direct",
                       microbatch_size: int = 1, relay_delay: float = 0.0) -> float:
    """Samples/s a peer of ``flops`` FLOP/s adds to ``stage`` (module docstring's cost model)."""
    if stage_cost <= 0:
        raise ValueError(f"a stage costs a positive number of FLOPs per sample, got {stage_cost}")
    flops = max(flops, 0.0)
    if reachability != "relayed" or stage == 0 or relay_delay <= 0 or flops == 0:
        return flops / stage_cost
    b = max(microbatch_size, 1)
    return b / (b * stage_cost / flops + relay_delay)


def relay_slots_for(upload_mbps: float, *, slots: int, per_slot_mbps: float) -> int:
    """Relay slots a public peer offers: ``slots``, but at most a quarter of its upload budget
    (``upload_mbps``; 0 means no budget) at ``per_slot_mbps`` each."""
    if slots < 0 or per_slot_mbps <= 0:
        raise ValueError("slots must be >= 0 and per_slot_mbps positive")
    if upload_mbps <= 0:
        return slots
    return min(slots, int(upload_mbps / 4 / per_slot_mbps))


def _port(address: str) -> int:
    try:
        return int(address.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return -1
