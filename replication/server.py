"""The donor's side of state replication: manifests, shards and link probes over hivemind P2P.

Seed 003 §III: a joiner pulls its stage's state w from several neighbours at once, each sending
the shards the joiner's plan (Alg. 1 + Alg. 2) assigns to it. A donor answers three RPCs, each a
binary-stream handler namespaced by run (``<run_id>.manifest``, ``.shard``, ``.probe``):

* ``rpc_manifest`` {"stage", "shard_bytes", "version"?} -> {"ok", "manifest": Manifest.to_wire()},
  hashed at the piece size ``piece_size_for(state bytes, shard_bytes)`` (``shard_bytes`` doubled
  until the manifest has at most ``MAX_PIECES`` digests), the same on every donor.
  Without "version" it snapshots the state now (``snapshot_fn``); with it, it re-describes a
  version it still holds at another shard size, so a joiner can pin the version it verified.
* ``rpc_shard`` {"stage", "version", "shard_bytes", "index", "count"?} -> {"ok", "index", "nbytes"} +
  the bytes of shards ``index`` .. ``index + count - 1`` (``count`` defaults to 1), one contiguous
  byte range. The shards of one caller leave one after another (a lock per caller), so the joiner
  can time each one and knows its donor's rate.
* ``rpc_probe`` {"nbytes": n <= 4 MiB} -> n zero bytes: the joiner measures d_u (t^prop, a tiny
  probe) and b_u (t^trans, the slope to a 1-4 MiB probe) per neighbour.

The state bytes of a version are copied once (``build_manifest``) and kept for the last
``max_cached`` versions, so the donor keeps serving a frozen version while it trains on. All
replicas of a stage hold bit-identical state after an averaging round, so every donor builds the
same manifest for the same (version, shard_bytes) and the joiner can compare them.

A version a caller is still pulling is pinned beyond those (``replication/pins.py``: a lone holder
that steps during a slow pull froze newer versions for other callers and evicted the joiner's, issue
#15). A request for a version this donor evicted is declined with ``VERSION_GONE``
(``VersionGoneError``), not refused as bad input: the joiner re-plans its pull on the newest version
(``replication/transfer.py``). A version it never held is refused.

A peer that keeps the backup of another stage (``planner.backup_plan``, seed 001 §3.4) serves it through
the same three RPCs: every request names its stage, and ``backup_fn(stage)`` gives the snapshot of
the backup this peer holds of that stage (None: it holds none, and the request is refused). Each
stage has its own cache of frozen versions.

Every request is validated (``ProtocolError``/``ValueError``, never ``assert``); a bad one is
refused with a logged reason and the donor keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch
from hivemind.p2p import P2P

from dht.rpc import Declined, serve_request
from dht.wire import ProtocolError
from replication.assignment import count_shards
from replication.manifest import Manifest, build_manifest, hash_shard, piece_size_for
from replication.pins import VersionPins

__all__ = [
    "MAX_PROBE_BYTES", "MAX_REQUEST_SHARD_BYTES", "MIN_REQUEST_SHARD_BYTES", "VERSION_GONE", "BackupFn",
    "ReplicationServer", "SnapshotFn", "VersionGoneError", "manifest_handler", "pack_bytes", "padded_bytes",
    "probe_handler", "require_int", "shard_handler", "unpack_bytes",
]

logger = logging.getLogger(__name__)

SnapshotFn = Callable[[], Awaitable[tuple[int, Mapping[str, torch.Tensor]]]]
BackupFn = Callable[[int], SnapshotFn | None]
MAX_PROBE_BYTES = 4 * 1024 * 1024
MIN_REQUEST_SHARD_BYTES = 4096  # below this, hashing every shard is a cheap CPU attack
MAX_REQUEST_SHARD_BYTES = 1 << 30
MAX_REQUEST_SHARDS = 1 << 20
_MAX_MANIFESTS_PER_VERSION = 4
_EVICTED_REMEMBERED = 64  # evicted versions per stage told apart from versions never held
PIN_TIMEOUT_FACTOR = 2.0  # a pin lasts this many request timeouts after its caller's last request
VERSION_GONE = "version_gone"  # the refusal code of VersionGoneError
WIRE_WORD_BYTES = 8
_ZEROS = torch.zeros(MAX_PROBE_BYTES // WIRE_WORD_BYTES, dtype=torch.int64)


def manifest_handler(run_id: str) -> str:
    return f"{run_id}.manifest"


def shard_handler(run_id: str) -> str:
    return f"{run_id}.shard"


def probe_handler(run_id: str) -> str:
    return f"{run_id}.probe"


def padded_bytes(nbytes: int) -> int:
    """Bytes on the wire for ``nbytes`` of payload (see ``pack_bytes``)."""
    return -(-nbytes // WIRE_WORD_BYTES) * WIRE_WORD_BYTES


def pack_bytes(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """Raw bytes as a tensor ``dht.wire`` can send.

    ``dht.wire`` allow-lists no uint8, so the bytes travel as int64 words, zero-padded to a
    multiple of 8; the header carries the true length (``unpack_bytes``). A writable buffer of a
    whole number of words is sent without a copy (the caller must not change it until sent);
    anything else is copied once.
    """
    view = memoryview(data)
    if len(view) and len(view) % WIRE_WORD_BYTES == 0 and view.contiguous and not view.readonly:
        return torch.frombuffer(view, dtype=torch.int64)
    padded = bytearray(padded_bytes(len(data)))
    padded[: len(data)] = data
    return torch.frombuffer(padded, dtype=torch.int64) if padded else _ZEROS[:0]


def unpack_bytes(tensors: list[torch.Tensor], nbytes: int) -> memoryview:
    """The ``nbytes`` payload bytes of a ``pack_bytes`` tensor; ProtocolError if it does not fit."""
    if len(tensors) != 1 or tensors[0].dtype != torch.int64 or tensors[0].dim() != 1:
        raise ProtocolError("expected one int64 word tensor of raw bytes")
    if nbytes < 0 or tensors[0].numel() * WIRE_WORD_BYTES != padded_bytes(nbytes):
        raise ProtocolError(f"{tensors[0].numel()} words do not carry {nbytes} bytes")
    return memoryview(tensors[0].numpy().view("u1"))[:nbytes]


def require_int(header: Mapping[str, Any], key: str, *, low: int = 0, high: int = 2**63 - 1) -> int:
    """``header[key]`` as an int in [low, high]; raises ProtocolError otherwise (bools are not ints)."""
    value = header.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"{key!r} must be an int in [{low}, {high}], got {value!r:.40}")
    return value


class VersionGoneError(Declined):
    """The version asked for was held here and evicted: ask for the newest manifest and pull again."""

    code = VERSION_GONE


@dataclasses.dataclass
class _Version:
    """One frozen version: its state bytes, and its manifests by shard size."""

    data: memoryview
    manifests: dict[int, Manifest]


class ReplicationServer:
    """Serves this peer's stage state to joiners (seed 003 §III, the neighbour's side), and the
    backup it keeps of another stage, if any (``backup_fn``).

    ``pins`` says which versions callers are pulling (kept beyond the newest ``max_cached``); by
    default a pin lasts ``PIN_TIMEOUT_FACTOR`` request timeouts and one extra version per stage is
    kept for pins (``replication/pins.py``).
    """

    def __init__(
        self,
        p2p: P2P,
        *,
        run_id: str,
        stage: int,
        snapshot_fn: SnapshotFn,
        request_timeout: float = 30.0,
        max_cached: int = 2,
        backup_fn: BackupFn = lambda stage: None,
        on_served: Callable[[str, int], None] = lambda peer_id, version: None,
        pins: VersionPins | None = None,
    ) -> None:
        if request_timeout <= 0 or max_cached < 1:
            raise ValueError("request_timeout must be > 0 and max_cached >= 1")
        self.pins = pins if pins is not None else VersionPins(hold_timeout=PIN_TIMEOUT_FACTOR * request_timeout)
        self.p2p, self.run_id, self.stage = p2p, run_id, stage
        self.snapshot_fn, self.request_timeout, self.max_cached = snapshot_fn, request_timeout, max_cached
        self.backup_fn, self.on_served = backup_fn, on_served  # on_served(caller, version): a piece of this stage sent
        self.num_refused = 0
        self.num_shards_served = 0
        self._cache: dict[int, OrderedDict[int, _Version]] = {stage: OrderedDict()}  # stage -> version -> bytes
        self._evicted: dict[int, deque[int]] = {}  # stage -> the latest versions it held and evicted
        self._build_lock = asyncio.Lock()
        self._send_locks: dict[Any, asyncio.Lock] = {}  # caller -> its shards leave in turn
        self._handlers: list[str] = []

    async def start(self) -> None:
        for name, handler in ((manifest_handler(self.run_id), self.rpc_manifest),
                              (shard_handler(self.run_id), self.rpc_shard),
                              (probe_handler(self.run_id), self.rpc_probe)):
            await self.p2p.add_binary_stream_handler(name, handler)
            self._handlers.append(name)

    async def shutdown(self) -> None:
        """Stops serving (idempotent); requests already being answered finish."""
        while self._handlers:
            await self.p2p.remove_binary_stream_handler(self._handlers.pop())

    async def __aenter__(self) -> ReplicationServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    async def rpc_manifest(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caller = getattr(info, "peer_id", None)
        await self._serve(reader, writer, functools.partial(self._process_manifest, caller=caller), what="manifest")

    async def rpc_shard(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caller = getattr(info, "peer_id", None)
        lock = self._send_locks.setdefault(caller, asyncio.Lock())
        try:
            await self._serve(reader, writer, functools.partial(self._process_shard, caller=caller), what="shard",
                              send_lock=lock)
        finally:
            if not lock.locked() and self._send_locks.get(caller) is lock:
                del self._send_locks[caller]  # no other answer to this caller is waiting

    async def rpc_probe(self, _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve(reader, writer, self._process_probe, what="probe")

    def cached_shard_sizes(self, version: int, *, stage: int | None = None) -> tuple[int, ...]:
        """The shard sizes a manifest of ``version`` (of this peer's stage, or of ``stage``) was built
        for and is still cached (for metrics)."""
        held = self._cache.get(self.stage if stage is None else stage, {}).get(version)
        return () if held is None else tuple(sorted(held.manifests))

    async def load_shard(
        self, version: int, shard_bytes: int, index: int, count: int = 1, *, stage: int | None = None
    ) -> bytes | bytearray | memoryview:
        """The bytes of shards ``index`` .. ``index + count - 1`` of a held version of this peer's
        stage (or of the backup of ``stage``); an override point for fault tests.

        Raises:
            VersionGoneError: the version was evicted.
            ValueError: the version was never held, or the range is out of range.
        """
        stage = self.stage if stage is None else stage
        versions = self._cache.get(stage, {})
        held = versions.get(version)
        if held is None:
            raise self._not_held(stage, version, f"version {version} is not held here (held: {list(versions)})")
        num_shards = count_shards(len(held.data), shard_bytes)
        if index >= num_shards or index + count > num_shards:
            raise ValueError(f"shard index {index} (+{count}) out of range 0..{num_shards - 1}")
        start = index * shard_bytes
        return held.data[start : start + count * shard_bytes]

    def _not_held(self, stage: int, version: int, message: str) -> Exception:
        """The refusal of a request for ``version`` of ``stage``, which is not cached: declined as gone
        if it was evicted (the caller re-plans), refused as bad input if it never was held."""
        if version in self._evicted.get(stage, ()):
            return VersionGoneError(f"{message}; it was evicted: ask for the newest manifest")
        return ValueError(message)

    def _pin(self, caller: Any, stage: int, version: int) -> None:
        """``caller`` pulls ``version`` of ``stage`` (held here): keep it while it does."""
        if caller is not None and version in self._cache.get(stage, {}):
            self.pins.touch(str(caller), stage, version)

    def _count(self, outcome: str) -> None:
        self.num_refused += outcome == "refused"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, process: Callable, *,
                     what: str, send_lock: asyncio.Lock | None = None) -> None:
        async def process_header(header: dict[str, Any], _tensors: list) -> tuple[dict[str, Any], list]:
            return await process(header)

        await serve_request(reader, writer, process_header, max_payload_bytes=0, timeout=self.request_timeout,
                            what=f"replication {what}", on_outcome=self._count, send_lock=send_lock)

    def _require_stage(self, header: Mapping[str, Any]) -> tuple[int, SnapshotFn]:
        """The stage asked for and its snapshot function: this peer's stage, or one it keeps a backup of."""
        stage = header.get("stage")
        # exactly an int: 1.0 == 1 and True == 1 in Python, but neither is a stage on the wire
        if type(stage) is int and stage == self.stage:
            return self.stage, self.snapshot_fn
        is_index = type(stage) is int
        backup = self.backup_fn(stage) if is_index else None
        if backup is None:
            if is_index and stage != self.stage and self._cache.pop(stage, None) is not None:
                self.pins.release(stage)  # a dropped backup: free its frozen versions
            raise ValueError(f"asked for stage {stage!r:.40}, this peer serves stage {self.stage} and keeps no backup of it")
        return stage, backup

    def _require_shard_bytes(self, header: Mapping[str, Any]) -> int:
        return require_int(header, "shard_bytes", low=MIN_REQUEST_SHARD_BYTES, high=MAX_REQUEST_SHARD_BYTES)

    async def _process_manifest(self, header: dict[str, Any], *, caller: Any = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        stage, snapshot_fn = self._require_stage(header)
        shard_bytes = self._require_shard_bytes(header)
        pinned = None if header.get("version") is None else require_int(header, "version")
        async with self._build_lock:  # concurrent joiners share one build
            manifest = await self._describe(stage, snapshot_fn, shard_bytes, pinned)
            self._pin(caller, stage, manifest.version)  # its pieces are asked for next
        logger.debug(f"replication: manifest of stage {stage} v{manifest.version} s={shard_bytes} served")
        return {"ok": True, "manifest": manifest.to_wire()}, []

    async def _describe(self, stage: int, snapshot_fn: SnapshotFn, min_piece_bytes: int, pinned: int | None) -> Manifest:
        """The manifest of ``pinned`` (or of a fresh snapshot) of ``stage`` at the piece size
        ``piece_size_for`` gives its state and ``min_piece_bytes``, built once."""
        versions = self._cache.setdefault(stage, OrderedDict())
        if pinned is None:
            version, state = await snapshot_fn()
            if version not in versions:
                total = sum(t.numel() * t.element_size() for t in state.values())
                manifest, data = await asyncio.to_thread(
                    build_manifest, state, run_id=self.run_id, stage=stage, version=version,
                    shard_bytes=piece_size_for(total, min_piece_bytes))
                # Served without a copy (pack_bytes): a writable view of the frozen snapshot, which
                # nothing writes to.
                writable = memoryview(data.obj) if isinstance(data.obj, bytearray) else data
                self._remember(stage, version, _Version(writable, {manifest.shard_bytes: manifest}))
        elif pinned in versions:
            version = pinned
        else:
            raise self._not_held(stage, pinned, f"version {pinned} is no longer held here (held: {list(versions)})")
        held = versions[version]
        versions.move_to_end(version)
        shard_bytes = piece_size_for(len(held.data), min_piece_bytes)
        if shard_bytes not in held.manifests:  # piece_size_for keeps it to MAX_PIECES digests
            base = next(iter(held.manifests.values()))
            hashes = await asyncio.to_thread(_hash_shards, held.data, shard_bytes)
            if len(held.manifests) >= _MAX_MANIFESTS_PER_VERSION:
                held.manifests.pop(next(iter(held.manifests)))
            held.manifests[shard_bytes] = dataclasses.replace(base, shard_bytes=shard_bytes, shard_hashes=hashes)
        return held.manifests[shard_bytes]

    def _remember(self, stage: int, version: int, held: _Version) -> None:
        """Cache a new version; evict all but the newest ``max_cached`` and those pinned (``self.pins``)."""
        versions = self._cache[stage]
        versions[version] = held
        keep = self.pins.keep(stage, list(versions), max_cached=self.max_cached)
        for evicted in [v for v in versions if v not in keep]:
            del versions[evicted]
            self._evicted.setdefault(stage, deque(maxlen=_EVICTED_REMEMBERED)).append(evicted)
            logger.info(f"replication: stage {stage} version {evicted} evicted from the serving cache")

    async def _process_shard(self, header: dict[str, Any], *, caller: Any = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        stage, _ = self._require_stage(header)
        version = require_int(header, "version")
        shard_bytes = self._require_shard_bytes(header)
        index = require_int(header, "index")
        count = 1 if header.get("count") is None else require_int(header, "count", low=1, high=MAX_REQUEST_SHARDS)
        if count * shard_bytes > MAX_REQUEST_SHARD_BYTES:
            raise ValueError(f"{count} shards of {shard_bytes} bytes exceed {MAX_REQUEST_SHARD_BYTES} bytes")
        self._pin(caller, stage, version)
        data = await self.load_shard(version, shard_bytes, index, count, stage=stage)
        self.num_shards_served += count
        if stage == self.stage and caller is not None:
            self.on_served(str(caller), version)
        logger.debug(f"replication: shards {index}+{count} of stage {stage} v{version} ({len(data)} bytes) served")
        return {"ok": True, "index": index, "nbytes": len(data)}, [pack_bytes(data)]

    async def _process_probe(self, header: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        nbytes = require_int(header, "nbytes", high=MAX_PROBE_BYTES)
        return {"ok": True, "nbytes": nbytes}, [_ZEROS[: padded_bytes(nbytes) // WIRE_WORD_BYTES]]


def _hash_shards(data: memoryview, shard_bytes: int) -> tuple[bytes, ...]:
    return tuple(hash_shard(data[start : start + shard_bytes]) for start in range(0, len(data), shard_bytes))
