"""The joiner's transfer settings: one frozen config shared by ``transfer``, ``client`` and ``fetcher``.

It lives apart from ``replication/transfer.py`` so that the modules that read it (``client.Session``
carries it into every call, ``fetcher`` paces its requests by it) need not import the module that
drives them; the replication modules then import one another in one direction only
(``tests/unit/test_import_rule.py`` checks there is no cycle).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replication.assignment import SearchConfig
from replication.manifest import ManifestLimits
from replication.server import MAX_PROBE_BYTES, MAX_REQUEST_SHARD_BYTES, MIN_REQUEST_SHARD_BYTES

__all__ = ["TransferConfig", "piece_bytes_of"]

MIN_PIECE_BYTES = 64 * 1024
MAX_PIECE_BYTES = 1024 * 1024
PIECES_PER_STATE = 64  # a small stage still spreads over several holders
# for_state caps a manifest at this many times the state its caller expects (plus MANIFEST_SLACK_BYTES):
# a caller's estimate may leave out small tensors (0-d step counters, the stage's identity), and a
# pull that knows the exact layout caps it at exactly that (replication/layout.py).
MANIFEST_SLACK_FACTOR = 2
MANIFEST_SLACK_BYTES = 1024 * 1024


def piece_bytes_of(state_bytes: int) -> int:
    """About 1/64 of ``state_bytes``, a power of two between 64 KiB and 1 MiB, so that a small
    stage still spreads over several holders."""
    piece = MIN_PIECE_BYTES
    while piece < MAX_PIECE_BYTES and piece * PIECES_PER_STATE < state_bytes:
        piece *= 2
    return piece


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """How a joiner pulls state (seed 003 §III). A peer builds one per pull with :meth:`for_state`.

    Attributes:
        piece_bytes: the smallest piece size p the state is hashed at (donors double it for very
            large states, see ``piece_size_for``); s is a multiple of p, and p is what a resumed
            download keeps.
        search: Alg. 1's bounds on the shard size s; the largest s (16 MiB by default) bounds the
            memory of shards in flight (donors x ``max_in_flight_per_donor`` x s).
        max_in_flight_per_donor: shard requests outstanding per donor (the donor sends them in
            turn, so the next one is ready when the current one is through).
        rebalance: re-plan the queued shards whenever a donor's measured rate drifts from the
            plan or a donor runs dry; turn off only to measure the static plan.
        endgame: let a donor with nothing left fetch a copy of a run in flight elsewhere when it
            would finish it sooner; turn off only to measure the static plan.
        probe_bytes: size of the bandwidth probe (bytes, <= 4 MiB); larger is more accurate.
        num_probe_rounds: probes per donor and size; the fastest is kept (filters scheduler noise).
        request_timeout: seconds for one probe or manifest call.
        shard_timeout_floor: seconds added to every shard deadline (covers jitter, GC, disk).
        shard_timeout_slack: multiplier on a shard's estimated time in its deadline; lower it to
            drop stalling donors sooner, raise it on links whose speed swings.
        min_agreeing_donors: manifests that must be identical before any shard is fetched
            (fewer only when fewer donors answered).
        manifest_limits: caps on what a donor's manifest may make us allocate (a pull with an
            expected layout replaces the byte and tensor caps with exactly that layout's).
        max_version_replans: times a pull starts over on the donors' newest manifest after they
            evicted the version it was pulling (``replication/transfer.py``); 0 gives up at once.
            Each costs at most one more download of what changed; raise it only for donors that
            step much faster than the link downloads their state.
    """

    piece_bytes: int = 1024 * 1024
    search: SearchConfig = field(default_factory=lambda: SearchConfig(max_shard_bytes=16 * 1024 * 1024))
    max_in_flight_per_donor: int = 2
    rebalance: bool = True
    endgame: bool = True
    probe_bytes: int = 256 * 1024
    num_probe_rounds: int = 1
    request_timeout: float = 10.0
    shard_timeout_floor: float = 5.0
    shard_timeout_slack: float = 4.0
    min_agreeing_donors: int = 2
    manifest_limits: ManifestLimits = field(default_factory=ManifestLimits)
    max_version_replans: int = 3

    def __post_init__(self) -> None:
        for name, high in (("max_in_flight_per_donor", 1 << 10), ("num_probe_rounds", 100),
                           ("min_agreeing_donors", 1 << 10), ("probe_bytes", MAX_PROBE_BYTES)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"{name} must be an int in [1, {high}], got {value!r}")
        for name in ("request_timeout", "shard_timeout_floor", "shard_timeout_slack"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        for name in ("rebalance", "endgame"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.piece_bytes, bool) or not isinstance(self.piece_bytes, int) or not (
                MIN_REQUEST_SHARD_BYTES <= self.piece_bytes <= MAX_REQUEST_SHARD_BYTES):
            raise ValueError(f"piece_bytes must be an int in [{MIN_REQUEST_SHARD_BYTES}, "
                             f"{MAX_REQUEST_SHARD_BYTES}], got {self.piece_bytes!r}")
        if isinstance(self.max_version_replans, bool) or not isinstance(self.max_version_replans, int) or not (
                0 <= self.max_version_replans <= 100):
            raise ValueError(f"max_version_replans must be an int in [0, 100], got {self.max_version_replans!r}")
        if not isinstance(self.search, SearchConfig) or not isinstance(self.manifest_limits, ManifestLimits):
            raise ValueError("search must be a SearchConfig and manifest_limits a ManifestLimits")

    @classmethod
    def for_state(cls, state_bytes: int, *, request_timeout: float, min_agreeing_donors: int) -> TransferConfig:
        """The config a peer pulls a state of about ``state_bytes`` with: the defaults, hashed at
        ``piece_bytes_of(state_bytes)``, so every puller of the same state asks for the same piece
        size and its donors hash each version once; a manifest may claim at most
        ``MANIFEST_SLACK_FACTOR`` times ``state_bytes`` (plus ``MANIFEST_SLACK_BYTES``).

        Raises:
            ValueError: as the constructor (``min_agreeing_donors`` < 1, ``request_timeout`` <= 0).
        """
        cap = MANIFEST_SLACK_FACTOR * max(state_bytes, 0) + MANIFEST_SLACK_BYTES
        return cls(piece_bytes=piece_bytes_of(state_bytes), request_timeout=request_timeout,
                   min_agreeing_donors=min_agreeing_donors, manifest_limits=ManifestLimits(max_total_bytes=cap))
