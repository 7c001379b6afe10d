"""``python -m peer.status <multiaddr>``: read a running peer's status over plain libp2p, no daemon.

The client is py-libp2p (trio, noise, yamux), an implementation independent of the go daemon that
hivemind runs; that it can talk to a peer at all is the proof that our wire protocol is standard
libp2p. It dials the address, runs the two standard protocols every libp2p host speaks, identify
(``/ipfs/id/1.0.0``: agent, protocols, addresses) and ping (``/ipfs/ping/1.0.0``: round-trip time),
then opens the project's own ``/murmuration/status/1.0.0`` (served by :mod:`peer.status.protocol`;
its frame: uint32 big-endian length + msgpack map) and prints the peer's status.

py-libp2p cannot share an interpreter with hivemind (both register the protobuf package
``crypto.pb``), and it needs protobuf < 7 while hivemind's side pins 7. It therefore lives in a
virtual environment of its own, ``.venv-libp2p`` (``scripts/setup.sh`` creates it), and this
module re-executes itself there when started from the main one. It imports nothing of ours but
this file, and nothing of torch or hivemind.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import secrets
import statistics
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
LIBP2P_PYTHON_ENV = "MURMURATION_LIBP2P_PYTHON"
STATUS_PROTOCOL = "/murmuration/status/1.0.0"  # as in peer.status.protocol (which imports hivemind)
IDENTIFY_PROTOCOL = "/ipfs/id/1.0.0"
PING_PROTOCOL = "/ipfs/ping/1.0.0"
MAX_REPLY_BYTES = 64 * 1024  # dht.wire's header limit: the server cannot send more
MAX_IDENTIFY_BYTES = 64 * 1024
NUM_PINGS = 3
_LENGTH = struct.Struct(">I")
_REEXECUTED = "MURMURATION_STATUS_CLIENT_REEXECUTED"


class StatusError(Exception):
    """A failure the user sees as one sentence; ``exit_code`` 2 for a bad or unreachable address."""

    def __init__(self, message: str, *, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class PeerReport:
    """What the client learned: identify's answer, ping round trips, and the peer's status."""

    peer_id: str
    address: str
    agent_version: str = ""
    protocol_version: str = ""
    protocols: list[str] = field(default_factory=list)
    listen_addrs: list[str] = field(default_factory=list)
    ping_ms: list[float] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "address": self.address,
                "identify": {"agent_version": self.agent_version, "protocol_version": self.protocol_version,
                             "protocols": self.protocols, "listen_addrs": self.listen_addrs},
                "ping_ms": self.ping_ms, "status": self.status}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peer.status", description=(
        "Dial a running peer with py-libp2p (no daemon), run identify and ping, and print its status "
        f"read over {STATUS_PROTOCOL}."))
    parser.add_argument("multiaddr", help="the peer's address with its id, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds for the whole exchange (default: 15)")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error("--timeout must be a positive number of seconds")
    _reexec_in_libp2p_env_if_needed(sys.argv[1:] if argv is None else argv)
    logging.disable(logging.CRITICAL)  # py-libp2p logs each failed dial itself; we say it once, below
    try:
        import trio

        report = trio.run(query_peer, args.multiaddr, args.timeout)
    except StatusError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report), flush=True)
    return 0


def _reexec_in_libp2p_env_if_needed(argv: list[str]) -> None:
    """Run this client in .venv-libp2p unless this interpreter can import py-libp2p safely."""
    if importlib.util.find_spec("libp2p") is not None and "hivemind" not in sys.modules:
        return
    python = os.environ.get(LIBP2P_PYTHON_ENV) or str(REPO_ROOT / ".venv-libp2p" / "bin" / "python")
    if not os.access(python, os.X_OK) or os.environ.get(_REEXECUTED):  # never loop between interpreters
        print("error: py-libp2p is not installed: run `bash scripts/setup.sh` (it creates .venv-libp2p) "
              f"or point {LIBP2P_PYTHON_ENV} at a Python that has the libp2p package.", file=sys.stderr, flush=True)
        raise SystemExit(2)
    env = {**os.environ, _REEXECUTED: "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    os.execve(python, [python, "-m", "peer.status.client", *argv], env)


async def query_peer(address: str, timeout: float) -> PeerReport:
    """Dial ``address``, identify, ping and read the status, all within ``timeout`` seconds.

    Raises:
        StatusError: a malformed address, an unreachable peer, or a peer that does not answer properly.
    """
    import trio
    from libp2p import new_host
    from libp2p.crypto.secp256k1 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
    from libp2p.stream_muxer.yamux.yamux import Yamux

    peer_info = _parse_address(address)
    key_pair = create_new_key_pair()
    # noise + yamux only: hivemind's go daemon speaks yamux only, and we want no plaintext fallback
    host = new_host(key_pair=key_pair,
                    sec_opt={TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(
                        key_pair, noise_privkey=create_new_x25519_key_pair().private_key)},
                    muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux})
    report = PeerReport(peer_id=peer_info.peer_id.to_base58(), address=address)
    step = "connect"
    try:
        with trio.fail_after(timeout):
            async with host.run(listen_addrs=[]):
                await host.connect(peer_info)
                step = "identify"
                await _identify(host, peer_info.peer_id, report)
                step = "ping"
                report.ping_ms = await _ping(host, peer_info.peer_id)
                step = "status"
                if STATUS_PROTOCOL not in report.protocols:
                    raise StatusError(
                        f"The peer at {address} answers identify and ping ({statistics.median(report.ping_ms):.2f} ms, "
                        f"{report.agent_version}) but does not serve {STATUS_PROTOCOL}: a bootstrap node does not, "
                        "and a run_peer.py peer does once it has chosen its stage.", exit_code=1)
                report.status = await _read_status(host, peer_info.peer_id)
                await host.close()
    except trio.TooSlowError as e:
        raise StatusError(f"The peer at {address} did not answer within {timeout:g} s ({step}); "
                          "check the address and that the peer is running.") from e
    except StatusError:
        raise
    except Exception as e:  # py-libp2p raises many kinds (and groups of them) for a failed dial
        if (ours := _find_status_error(e)) is not None:  # raised inside the host's nursery: grouped
            raise ours from None
        if step == "connect":
            raise StatusError(f"Cannot reach a peer at {address}: {_reason(e)}; check the address "
                              "(as the peer prints it) and that the peer is running.") from e
        raise StatusError(f"The peer at {address} failed during {step}: {_reason(e)}.", exit_code=1) from e
    return report


def _parse_address(address: str) -> Any:
    import multiaddr
    from libp2p.peer.peerinfo import info_from_p2p_addr

    try:
        maddr = multiaddr.Multiaddr(address)
        if "p2p" not in [p.name for p in maddr.protocols()]:
            raise ValueError("it has no /p2p/<peer id> part")
        return info_from_p2p_addr(maddr)
    except Exception as e:
        raise StatusError(f"'{address}' is not a peer multiaddr ({_reason(e)}); give one like "
                          "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW... as run_peer.py logs it.") from e


async def _identify(host: Any, peer_id: Any, report: PeerReport) -> None:
    import multiaddr
    from libp2p.identity.identify.identify import parse_identify_response

    stream = await host.new_stream(peer_id, [IDENTIFY_PROTOCOL])
    try:
        raw = await _read_to_end(stream, MAX_IDENTIFY_BYTES)
    finally:
        await stream.close()
    answer = parse_identify_response(raw)
    report.agent_version, report.protocol_version = answer.agent_version, answer.protocol_version
    report.protocols = sorted(answer.protocols)
    report.listen_addrs = [str(multiaddr.Multiaddr(a)) for a in answer.listen_addrs]


async def _ping(host: Any, peer_id: Any) -> list[float]:
    stream = await host.new_stream(peer_id, [PING_PROTOCOL])
    round_trips = []
    try:
        for _ in range(NUM_PINGS):
            payload = secrets.token_bytes(32)
            started = time.perf_counter()
            await stream.write(payload)
            if await _read_exactly(stream, len(payload)) != payload:
                raise StatusError("the peer's ping answer does not echo the ping", exit_code=1)
            round_trips.append(round((time.perf_counter() - started) * 1000, 3))
    finally:
        await stream.close()
    return round_trips


async def _read_status(host: Any, peer_id: Any) -> dict[str, Any]:
    import msgpack

    stream = await host.new_stream(peer_id, [STATUS_PROTOCOL])
    try:
        body = msgpack.packb({"want": "status", "tensors": []}, use_bin_type=True)
        await stream.write(_LENGTH.pack(len(body)) + body)
        (length,) = _LENGTH.unpack(await _read_exactly(stream, _LENGTH.size))
        if length > MAX_REPLY_BYTES:
            raise StatusError(f"the peer's status reply claims {length} bytes, over the {MAX_REPLY_BYTES} limit", exit_code=1)
        reply = msgpack.unpackb(await _read_exactly(stream, length), raw=False, strict_map_key=True)
    finally:
        await stream.close()  # the server hangs up once we did
    if not isinstance(reply, dict) or reply.get("ok") is not True or not isinstance(reply.get("status"), dict):
        error = reply.get("error") if isinstance(reply, dict) else None
        raise StatusError(f"the peer refused the status request: {error or 'malformed reply'}", exit_code=1)
    return reply["status"]


async def _read_exactly(stream: Any, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        chunk = await stream.read(num_bytes - len(data))
        if not chunk:
            raise StatusError(f"the peer hung up after {len(data)} of {num_bytes} bytes", exit_code=1)
        data += chunk
    return data


async def _read_to_end(stream: Any, limit: int) -> bytes:
    from libp2p.network.stream.exceptions import StreamEOF

    data = b""
    while len(data) <= limit:
        try:
            chunk = await stream.read(limit + 1 - len(data))
        except StreamEOF:
            break
        if not chunk:
            break
        data += chunk
    if len(data) > limit:
        raise StatusError(f"the peer's identify answer exceeds {limit} bytes", exit_code=1)
    return data


def _find_status_error(error: BaseException) -> StatusError | None:
    """Our own error inside a (nested) exception group, if there is one."""
    if isinstance(error, StatusError):
        return error
    for inner in getattr(error, "exceptions", ()):
        if (found := _find_status_error(inner)) is not None:
            return found
    return None


def _reason(error: BaseException) -> str:
    """The innermost message of a grouped or chained exception (the root cause), on one line."""
    seen: set[int] = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "exceptions", None) or getattr(error, "errors", None)
        if isinstance(inner, list | tuple) and inner and isinstance(inner[0], BaseException):
            error = inner[0]
        elif error.__cause__ is not None:
            error = error.__cause__
        else:
            break
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:200]


def format_report(report: PeerReport) -> str:
    """The human-readable form: who the peer is, how it answers, and what it does."""
    status = report.status
    stage = status.get("stage", -1)
    num_stages = status.get("num_stages")
    where = f"stage {stage} of {num_stages}" if stage is not None and stage >= 0 else "no stage yet"
    loss = status.get("loss")
    uptime = status.get("uptime_s")
    lines = [
        f"peer      {report.peer_id}",
        f"run       {status.get('run_id')}, {where}, {status.get('state')} ({status.get('role')})",
        f"step      {status.get('step')}",
        f"training  loss {'-' if loss is None else f'{loss:.3f}'} | {status.get('tokens_per_s', 0):,.0f} tokens/s"
        f" | {status.get('num_samples', 0):,} samples",
        f"uptime    {'-' if uptime is None else f'{uptime:.0f} s'}, software {status.get('software_version')}",
        f"libp2p    {report.agent_version or 'unknown agent'}, {len(report.protocols)} protocols"
        f" ({'with' if STATUS_PROTOCOL in report.protocols else 'without'} {STATUS_PROTOCOL} in identify)",
        f"ping      {statistics.median(report.ping_ms):.2f} ms (median of {len(report.ping_ms)})" if report.ping_ms else "ping      -",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
