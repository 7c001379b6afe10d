"""A call striped over several streams: its request and its answer each cut into ``count`` pieces,
piece ``i`` of both on stream ``i``, all streams at once.

Why: every libp2p stream has its own flow-control window (yamux's, 256 KiB here, which did not grow
on a reused stream: ``bench/wan_calls.py``), so one stream carries at most a window per round trip.
At 20 Mbit/s and a 160 ms round trip a 512 KiB activation took 1.04 s on one stream and 0.43 s as
four concurrent streams of 128 KiB, where its bytes and one round trip take 0.37 s (BENCHMARKS.md,
issue 16). On loopback the window never binds, so a call is striped only when the caller measured a
round trip long enough for it to (:func:`stripe_count`).

The wire: the whole message (``dht.wire.encode_message``) is cut into ``count`` contiguous ranges of
near-equal size (:func:`stripe_bounds`); stream ``i`` carries a message whose header is
``{"stripe": [call_id, i, count, total]}`` and whose one tensor is range ``i`` as int8. The server
gathers the pieces of one ``call_id`` (:class:`Assemblies`), serves the assembled request once, and
answers on stream ``i`` with ``{"ok": true, "stripe": [i, count, total]}`` and range ``i`` of its
encoded answer; a refusal is answered whole on every stream. ``dht.rpc`` does the calling and serving.

Every piece is checked before it is kept (its index, count and total against the call's, its length
against its range) and what is kept is bounded: pieces actually received, at most
:data:`MAX_PENDING_BYTES` and :data:`MAX_ASSEMBLIES` calls at once, each dropped when its pieces'
handlers time out. A caller can only complete its own call: call ids are 128 random bits it sends
only to the server, over an encrypted stream.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dht.wire import MAX_HEADER_BYTES, ProtocolError

STRIPE_KEY = "stripe"
MAX_STRIPES = 8
STRIPE_BYTES = 128 * 1024  # about the bytes one stream carries in a round trip before its window binds
STRIPE_MIN_RTT = 0.010  # seconds: below it one window per round trip is >= 200 Mbit/s, above a home link
MAX_ASSEMBLIES = 256  # striped calls being gathered at once, all handlers of the process together
MAX_PENDING_BYTES = 256 << 20  # bytes of their pieces held meanwhile
FRAME_OVERHEAD = 4 + MAX_HEADER_BYTES  # what a message adds to its tensors' bytes
_CALL_ID = re.compile(r"[0-9a-f]{32}")


class Busy(RuntimeError):
    """Too many striped calls are being gathered now: the caller should try again or elsewhere."""


def stripe_count(payload_bytes: int, rtt: float | None) -> int:
    """How many streams a call of ``payload_bytes`` should take to a peer ``rtt`` seconds away (None:
    not measured): 1 unless the round trip is long enough for a stream's window to bind, then a
    stream per :data:`STRIPE_BYTES`, at most :data:`MAX_STRIPES`."""
    if rtt is None or not rtt >= STRIPE_MIN_RTT or payload_bytes <= STRIPE_BYTES:
        return 1
    return min(MAX_STRIPES, math.ceil(payload_bytes / STRIPE_BYTES))


def stripe_bounds(total: int, count: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``count`` contiguous ranges of ``total`` bytes, the first
    ``total % count`` one byte longer."""
    base, extra = divmod(total, count)
    bounds, start = [], 0
    for index in range(count):
        end = start + base + (index < extra)
        bounds.append((start, end))
        start = end
    return bounds


def piece_tensor(blob: bytes, bounds: tuple[int, int]) -> torch.Tensor:
    start, end = bounds
    return torch.frombuffer(bytearray(blob[start:end]), dtype=torch.int8) if end > start else torch.empty(0, dtype=torch.int8)


def join_pieces(pieces: Sequence[torch.Tensor]) -> bytes:
    return b"".join(p.numpy().tobytes() for p in pieces)


def check_piece(tensors: Sequence[torch.Tensor], bounds: tuple[int, int]) -> torch.Tensor:
    """The one int8 tensor of a piece, of exactly its range's length."""
    if len(tensors) != 1 or tensors[0].dtype != torch.int8 or tensors[0].dim() != 1:
        raise ProtocolError("a stripe carries exactly one flat int8 tensor")
    if tensors[0].numel() != bounds[1] - bounds[0]:
        raise ProtocolError(f"a stripe of {tensors[0].numel()} bytes where its range holds {bounds[1] - bounds[0]}")
    return tensors[0]


def parse_request_stripe(header: dict[str, Any], *, max_total: int) -> tuple[str, int, int, int]:
    """``(call_id, index, count, total)`` of a request piece's header, checked."""
    value = header.get(STRIPE_KEY)
    if set(header) != {STRIPE_KEY} or not (isinstance(value, list) and len(value) == 4):
        raise ProtocolError("a stripe's header is exactly {'stripe': [call_id, index, count, total]}")
    call_id, index, count, total = value
    if not (isinstance(call_id, str) and _CALL_ID.fullmatch(call_id)):
        raise ProtocolError("a stripe's call id is 32 lowercase hex digits")
    _check_numbers(index, count, total, max_total=max_total)
    return call_id, index, count, total


def parse_answer_stripe(header: dict[str, Any], *, index: int, count: int, max_total: int) -> int:
    """The total of an answer piece's header ``{"ok": true, "stripe": [index, count, total]}``, checked
    against the piece it answers."""
    value = header.get(STRIPE_KEY)
    if set(header) != {"ok", STRIPE_KEY} or not (isinstance(value, list) and len(value) == 3):
        raise ProtocolError("a striped answer's header is exactly {'ok': true, 'stripe': [index, count, total]}")
    _check_numbers(*value, max_total=max_total)
    if value[0] != index or value[1] != count:
        raise ProtocolError(f"stripe {index} of {count} was answered as stripe {value[0]} of {value[1]}")
    return value[2]


def _check_numbers(index: Any, count: Any, total: Any, *, max_total: int) -> None:
    if not all(type(x) is int for x in (index, count, total)):
        raise ProtocolError("a stripe's index, count and total are integers")
    if not (2 <= count <= MAX_STRIPES and 0 <= index < count):
        raise ProtocolError(f"stripe {index} of {count}: a call takes 2 to {MAX_STRIPES} stripes")
    if not count <= total <= max_total:
        raise ProtocolError(f"a striped message of {total} bytes (at most {max_total} here)")


@dataclass
class Assembly:
    """The pieces of one striped request gathered so far, and (once served) its answer's pieces."""

    count: int
    total: int
    pieces: dict[int, torch.Tensor] = field(default_factory=dict)
    answer: asyncio.Future | None = None  # -> per stream index, (its answer's header, its tensors)
    seconds: float = 0.0  # the longest a piece's bytes took to arrive (they arrive side by side)
    waited_bytes: int = 0  # the pieces' bytes their streams waited for (dht.wire.ArrivalClock)

    @property
    def complete(self) -> bool:
        return len(self.pieces) == self.count

    @property
    def held_bytes(self) -> int:
        return sum(p.numel() for p in self.pieces.values())


class Assemblies:
    """The striped requests a process is gathering, bounded (see the module docstring)."""

    def __init__(self, *, max_calls: int = MAX_ASSEMBLIES, max_bytes: int = MAX_PENDING_BYTES) -> None:
        self.max_calls, self.max_bytes = max_calls, max_bytes
        self._calls: dict[str, Assembly] = {}
        self._held = 0

    def __len__(self) -> int:
        return len(self._calls)

    @property
    def held_bytes(self) -> int:
        return self._held

    def add(self, call_id: str, index: int, count: int, total: int, tensors: Sequence[torch.Tensor]) -> Assembly:
        """Keep piece ``index`` of ``call_id``; returns its assembly (``complete`` once all are in).

        Raises:
            ProtocolError: the piece disagrees with the call's other pieces, repeats one, or is not
                its range's length.
            Busy: too many calls or bytes are held already.
        """
        assembly = self._calls.get(call_id)
        if assembly is None:
            if len(self._calls) >= self.max_calls:
                raise Busy(f"{len(self._calls)} striped calls are being gathered already")
            assembly = Assembly(count=count, total=total)
        elif (assembly.count, assembly.total) != (count, total):
            raise ProtocolError(f"stripe {index} says {count} stripes of {total} bytes, its call "
                                f"{assembly.count} of {assembly.total}")
        if index in assembly.pieces:
            raise ProtocolError(f"stripe {index} of a call arrived twice")
        piece = check_piece(tensors, stripe_bounds(total, count)[index])
        if self._held + piece.numel() > self.max_bytes:
            raise Busy(f"{self._held} bytes of striped calls are held already")
        if call_id not in self._calls:
            assembly.answer = asyncio.get_running_loop().create_future()
            self._calls[call_id] = assembly
        assembly.pieces[index] = piece
        self._held += piece.numel()
        return assembly

    def take(self, call_id: str) -> bytes:
        """The complete request's bytes; its pieces are no longer held (the assembly stays known until
        :meth:`drop`, so a late repeat of a piece is refused)."""
        assembly = self._calls[call_id]
        blob = join_pieces([assembly.pieces[i] for i in range(assembly.count)])
        self._held -= assembly.held_bytes
        assembly.pieces = {i: torch.empty(0, dtype=torch.int8) for i in assembly.pieces}
        return blob

    def forget(self, call_id: str) -> None:
        """Forget an answered call (its streams hold its answer); idempotent."""
        assembly = self._calls.pop(call_id, None)
        if assembly is not None:
            self._held -= assembly.held_bytes

    def drop(self, call_id: str) -> None:
        """Give up on ``call_id`` (a piece's stream timed out or failed): the streams waiting for its
        answer end with a timeout; idempotent."""
        assembly = self._calls.get(call_id)
        self.forget(call_id)
        if assembly is not None and assembly.answer is not None and not assembly.answer.done():
            assembly.answer.set_exception(asyncio.TimeoutError(f"striped call {call_id[:8]} was given up"))
            assembly.answer.add_done_callback(lambda future: future.exception())  # retrieved: no warning if none waits


# Process-wide, like dht.rpc.REQUEST_OUTCOMES: a peer process hosts one peer.
ASSEMBLIES = Assemblies()
