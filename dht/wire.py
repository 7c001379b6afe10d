"""Messages on hivemind binary streams: a msgpack header followed by raw tensor bytes.

Frame layout (all lengths big-endian uint32)::

    [header length][msgpack header]  [tensor 0 bytes][tensor 1 bytes]...

The header is a map; its ``"tensors"`` entry lists ``[dtype, shape]`` per tensor, from which the
receiver computes each payload size and checks it against its limit *before* reading or
allocating. No pickle anywhere: a hostile peer can send only bytes that parse as msgpack and
tensors of allow-listed dtypes. Binary streams are used rather than unary protobuf calls because
they stream megabytes without the 4 MiB cap and at about 1.5× the throughput (FIELD-NOTES).
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from dht.clock import SYSTEM_CLOCK, Clock

MAX_HEADER_BYTES = 64 * 1024
MAX_DIMS = 8
MAX_TENSORS = 4096  # a stage's full state: parameters and optimizer moments
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,  # a subspace run's token ids (swarm.subspace.request_ids)
    "int8": torch.int8,  # the int8 boundary codec's values (swarm.boundary_codec)
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_LENGTH = struct.Struct(">I")
READ_CHUNK = 64 * 1024  # a payload is read in pieces this large, each timed (ArrivalClock)
WAITED_S = 0.002  # a piece whose read took longer waited for the network; a faster one was buffered already


@dataclass
class ArrivalClock:
    """The payload bytes a reader waited for, and over how long: the sender's goodput.

    Timed from the payload's header, a payload already buffered when its handler ran (the p2p daemon
    takes in a whole yamux window while this peer's loop is busy) read as a burst: goodputs of
    3-6 MB/s over a 10 Mbit/s path and up to 334 MB/s inside a 50 Mbit/s region, on a loaded
    2-core host (the e2e global plan, 2026-11-28), which the planner believed. Only the bytes from
    the first read that waited on count, over the time since that read began; a payload that was
    all buffered says nothing (0 bytes)."""

    clock: Callable[[], float] = SYSTEM_CLOCK
    started: float | None = None
    num_bytes: int = 0
    ended: float = 0.0

    async def read(self, reader: asyncio.StreamReader, nbytes: int) -> bytearray:
        """``nbytes`` from ``reader`` (``readexactly``), read in ``READ_CHUNK`` pieces and timed."""
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        for offset in range(0, nbytes, READ_CHUNK):
            size = min(READ_CHUNK, nbytes - offset)
            before = self.clock()
            view[offset:offset + size] = await reader.readexactly(size)
            self.ended = self.clock()
            if self.started is None and self.ended - before > WAITED_S:
                self.started = before
            if self.started is not None:
                self.num_bytes += size
        return buffer

    @property
    def seconds(self) -> float:
        return 0.0 if self.started is None else self.ended - self.started


class ProtocolError(ValueError):
    """A message that does not follow the protocol: malformed, oversized or of the wrong kind."""


@dataclass
class Traffic:
    """Bytes of our messages written and read (headers and tensors; not hivemind's DHT or averaging)."""

    bytes_sent: int = 0
    bytes_received: int = 0


# Process-wide: a peer process hosts one peer, so this is that peer's traffic (pipeline, state
# transfer, notices). Several peers in one test process share it.
TRAFFIC = Traffic()

UPLOAD_CHUNK_BYTES = 256 * 1024  # tensor bytes are metered and written in pieces of this size
CONTROL_MESSAGE_BYTES = 16 * 1024  # a message this small is charged to --max-upload-mbps but never waits for it


class UploadLimit:
    """A token bucket on the bytes our messages write: ``rate`` bytes/s on average, bursts up to
    ``burst`` bytes. Off (no waiting) while ``rate`` is 0. Covers the pipeline, state shards and
    notices; hivemind's DHT and averaging traffic is not ours to meter.
    """

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.rate = 0.0
        self.burst = 0.0
        self._tokens = 0.0
        self._stamp = 0.0
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def configure(self, rate_bytes_per_s: float, *, burst_seconds: float = 0.25) -> None:
        """Cap uploads at ``rate_bytes_per_s`` (0: no cap); bursts of ``burst_seconds`` of it."""
        if not (math.isfinite(rate_bytes_per_s) and rate_bytes_per_s >= 0):
            raise ValueError(f"upload rate must be a number >= 0, got {rate_bytes_per_s!r}")
        self.rate = float(rate_bytes_per_s)
        self.burst = max(self.rate * burst_seconds, float(UPLOAD_CHUNK_BYTES))
        self._tokens, self._stamp = self.burst, 0.0

    async def acquire(self, nbytes: int) -> None:
        """Waits until ``nbytes`` may be sent (at once when off). Callers take turns, so one large
        reply cannot starve the others for longer than its own share."""
        if self.rate <= 0 or nbytes <= 0:
            return
        loop = asyncio.get_running_loop()
        if self._lock is None or self._loop is not loop:  # a lock belongs to one event loop
            self._lock, self._loop = asyncio.Lock(), loop
        async with self._lock:
            now = self.clock()
            if self._stamp:
                self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= nbytes
            if self._tokens < 0:
                debt = -self._tokens
                await self.clock.sleep(debt / self.rate)
                # the debt is paid, no credit for the wait; what was charged meanwhile stays owed
                self._tokens, self._stamp = self._tokens + debt, self.clock()

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` already sent without waiting: a control message (a ping's answer, a
        notice) must not queue behind bulk transfers, or a capped peer serving its state answers
        pings late and its neighbours declare it down. The next bulk write pays for it."""
        if self.rate > 0 and nbytes > 0:
            self._tokens -= nbytes


# Process-wide, like TRAFFIC: the peer's --max-upload-mbps.
UPLOAD_LIMIT = UploadLimit()


def encode_header(header: dict[str, Any], tensors: Sequence[torch.Tensor]) -> bytes:
    described = dict(header)
    described["tensors"] = [[DTYPE_NAMES[t.dtype], list(t.shape)] for t in tensors]
    packed = msgpack.packb(described, use_bin_type=True)
    if len(packed) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(packed)} bytes exceeds {MAX_HEADER_BYTES}")
    return _LENGTH.pack(len(packed)) + packed


def _sendable(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the CPU, contiguous, each of a dtype the wire carries."""
    tensors = [t.detach().to("cpu").contiguous() for t in tensors]
    for t in tensors:
        if t.dtype not in DTYPE_NAMES:
            raise ProtocolError(f"dtype {t.dtype} cannot be sent")
    return tensors


async def write_message(
    writer: asyncio.StreamWriter, header: dict[str, Any], tensors: Sequence[torch.Tensor] = ()
) -> None:
    """Send one message; tensors are moved to CPU and sent as their raw bytes."""
    tensors = _sendable(tensors)
    encoded = encode_header(header, tensors)
    total = len(encoded) + sum(t.numel() * t.element_size() for t in tensors)
    metered = UPLOAD_LIMIT.rate > 0 and total > CONTROL_MESSAGE_BYTES
    if metered:
        await UPLOAD_LIMIT.acquire(len(encoded))
    else:
        UPLOAD_LIMIT.charge(total)
    writer.write(encoded)
    for t in tensors:
        if not t.numel():
            continue
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        if not metered:
            writer.write(data)
            continue
        for start in range(0, len(data), UPLOAD_CHUNK_BYTES):
            chunk = data[start : start + UPLOAD_CHUNK_BYTES]
            await UPLOAD_LIMIT.acquire(len(chunk))
            writer.write(chunk)
            await writer.drain()
    TRAFFIC.bytes_sent += total
    await writer.drain()


async def read_message(
    reader: asyncio.StreamReader, *, max_payload_bytes: int, timeout: float,
    on_payload: Callable[[int, float], None] | None = None, clock: Callable[[], float] = SYSTEM_CLOCK,
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Receive one message within ``timeout`` seconds; ``on_payload(bytes, seconds)`` is told how
    many of its tensors' bytes this reader waited for and over how long (:class:`ArrivalClock`, on
    ``clock``: the sender's goodput, for large payloads).

    Raises:
        ProtocolError: malformed header, unknown dtype, bad shape, or payload over ``max_payload_bytes``.
        asyncio.TimeoutError, asyncio.IncompleteReadError: the peer stalled or hung up.
    """
    async with asyncio.timeout(timeout):
        (header_bytes,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if header_bytes > MAX_HEADER_BYTES:
            raise ProtocolError(f"header of {header_bytes} bytes exceeds {MAX_HEADER_BYTES}")
        header = decode_header(await reader.readexactly(header_bytes))
        TRAFFIC.bytes_received += _LENGTH.size + header_bytes
        layouts = parse_tensor_layouts(header.pop("tensors", None), max_payload_bytes=max_payload_bytes)
        tensors, arrival = [], ArrivalClock(clock)
        for dtype, shape, nbytes in layouts:
            buffer = await arrival.read(reader, nbytes) if nbytes else bytearray()
            TRAFFIC.bytes_received += nbytes
            flat = torch.frombuffer(buffer, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
            tensors.append(flat.view(shape))
    if on_payload is not None:
        on_payload(arrival.num_bytes, arrival.seconds)
    return header, tensors


def encode_message(header: dict[str, Any], tensors: Sequence[torch.Tensor] = ()) -> bytes:
    """One message as the bytes :func:`write_message` would send (a striped call sends them in pieces:
    ``dht.striping``)."""
    tensors = _sendable(tensors)
    parts = [encode_header(header, tensors)]
    parts.extend(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors if t.numel())
    return b"".join(parts)


def decode_message(blob: bytes | bytearray, *, max_payload_bytes: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The inverse of :func:`encode_message`, with :func:`read_message`'s checks: the header's size, its
    tensor layouts against ``max_payload_bytes`` (before anything is allocated), and the blob's length
    against what the header describes, exactly."""
    if len(blob) < _LENGTH.size:
        raise ProtocolError(f"a message of {len(blob)} bytes is too short for its header's length")
    (header_bytes,) = _LENGTH.unpack_from(blob)
    if header_bytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {header_bytes} bytes exceeds {MAX_HEADER_BYTES}")
    start = _LENGTH.size + header_bytes
    if len(blob) < start:
        raise ProtocolError(f"a message of {len(blob)} bytes ends inside its header")
    header = decode_header(bytes(blob[_LENGTH.size:start]))
    layouts = parse_tensor_layouts(header.pop("tensors", None), max_payload_bytes=max_payload_bytes)
    if len(blob) - start != sum(nbytes for _, _, nbytes in layouts):
        raise ProtocolError(f"a message's tensors take {sum(n for _, _, n in layouts)} bytes, "
                            f"but {len(blob) - start} follow its header")
    tensors, offset = [], start
    for dtype, shape, nbytes in layouts:  # a buffer each, as read_message's: aligned, and its own
        flat = torch.frombuffer(bytearray(blob[offset:offset + nbytes]), dtype=dtype) if nbytes \
            else torch.empty(0, dtype=dtype)
        tensors.append(flat.view(shape))
        offset += nbytes
    return header, tensors


def decode_header(packed: bytes) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(packed, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.UnpackException) as e:
        raise ProtocolError(f"header is not valid msgpack: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    return header


def parse_tensor_layouts(described: Any, *, max_payload_bytes: int) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    """Check the header's tensor list; return (dtype, shape, nbytes) per tensor."""
    if described is None:
        return []
    if not isinstance(described, list) or len(described) > MAX_TENSORS:
        raise ProtocolError(f"'tensors' must be a list of at most {MAX_TENSORS} [dtype, shape] pairs")
    layouts, total = [], 0
    for item in described:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and item[0] in DTYPES
                and isinstance(item[1], list)):
            raise ProtocolError(f"bad tensor description {item!r:.100}")
        shape = item[1]
        if len(shape) > MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ProtocolError(f"bad tensor shape {shape!r:.100}")
        dtype = DTYPES[item[0]]
        nbytes = math.prod(shape) * dtype.itemsize
        total += nbytes
        if total > max_payload_bytes:
            raise ProtocolError(f"payload exceeds the limit of {max_payload_bytes} bytes")
        layouts.append((dtype, tuple(shape), nbytes))
    return layouts


def require_tensor(
    tensors: Sequence[torch.Tensor], index: int, *, dtype: torch.dtype, shape: tuple[int, ...], name: str
) -> torch.Tensor:
    """The ``index``-th tensor, checked against the dtype and shape the run spec implies."""
    if index >= len(tensors):
        raise ProtocolError(f"missing tensor {name}")
    tensor = tensors[index]
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise ProtocolError(f"{name} must be {DTYPE_NAMES[dtype]}{list(shape)}, got {tensor.dtype}{list(tensor.shape)}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ProtocolError(f"{name} holds NaN or Inf")
    return tensor
