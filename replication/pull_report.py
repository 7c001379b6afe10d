"""What one pull did (``PullReport``), and how it fails (``TransferError``): shared by the modules
of the joiner's side (``transfer``, ``fetcher``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["DisagreementError", "PullReport", "StaleVersionError", "TransferError", "drop_donor"]

logger = logging.getLogger(__name__)


@dataclass
class PullReport:
    """What happened during one pull (for logs, metrics and tests).

    Attributes:
        links: donor -> (d_u seconds per request, b_u seconds per byte) as probed.
        piece_bytes: p, the size the manifest was hashed at; num_shards: its number of pieces.
        shard_bytes: the s chosen by Alg. 1 (a multiple of p): the size of one request.
        estimated_seconds: Alg. 2's makespan for the pieces that were missing at the start.
        seconds: wall time of the whole pull.
        phase_seconds: wall time of each phase: "probe" (probes and manifests, at once),
            "plan" (agreement, Alg. 1, store opened), "transfer" (the pieces), "restore" (rebuild
            the tensors).
        bytes_by_donor / shards_by_donor: verified bytes / pieces received from each donor.
        failed_donors: donor -> why it was dropped (probe failure, disagreeing manifest, fault).
        donors: the donors that answered the probes and agreed on the manifest; the first plan
            gives each of them at least one run (``replication.fetcher.give_each_a_run``).
        num_shard_requests: requests sent, failed, cancelled and end-game copies included.
        num_refetched: pieces re-planned onto another donor after theirs was dropped.
        num_resumed: pieces already on disk (verified) when the pull started.
        num_replans: times Alg. 2 ran (the first plan included).
        num_duplicated: end-game copies requested of a run already in flight elsewhere.
        num_version_replans: times the pull started over on a newer manifest because its donors
            had evicted the version it was pulling (``StaleVersionError``); the byte and piece
            counts above add up every attempt.
        measured_per_byte: donor -> b_u as measured during the transfer (its service seconds per
            byte, d_u included), for the donors that sent something.
    """

    links: dict[str, tuple[float, float]] = field(default_factory=dict)
    piece_bytes: int = 0
    shard_bytes: int = 0
    num_shards: int = 0
    estimated_seconds: float = 0.0
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    bytes_by_donor: dict[str, int] = field(default_factory=dict)
    shards_by_donor: dict[str, int] = field(default_factory=dict)
    failed_donors: dict[str, str] = field(default_factory=dict)
    donors: list[str] = field(default_factory=list)
    num_shard_requests: int = 0
    num_refetched: int = 0
    num_resumed: int = 0
    num_replans: int = 0
    num_duplicated: int = 0
    num_version_replans: int = 0
    measured_per_byte: dict[str, float] = field(default_factory=dict)


class TransferError(RuntimeError):
    """The pull could not complete (no donor left, or no agreement); ``report`` says what happened."""

    def __init__(self, message: str, report: PullReport) -> None:
        super().__init__(message)
        self.report = report


class DisagreementError(TransferError):
    """Fewer donors than required served the same manifest (they hold different versions)."""


class StaleVersionError(TransferError):
    """Pieces are missing and no donor is left, and ``donors`` were dropped only because they no longer
    hold the manifest's version (they evicted it while stepping on): a pull on their newest manifest may
    succeed (``replication/transfer.py`` re-plans it)."""

    def __init__(self, message: str, report: PullReport, donors: list[str]) -> None:
        super().__init__(message, report)
        self.donors = donors


def drop_donor(report: PullReport, peer_id: str, reason: str) -> None:
    """Records (once) and logs why ``peer_id`` is no longer used by this pull."""
    report.failed_donors.setdefault(peer_id, reason)
    logger.warning(f"replication: dropping donor {peer_id[-6:]}: {reason}")
