"""What one pipeline call costs on an emulated home link: a request of N bytes and an answer of N bytes
over hivemind's P2P (a fresh libp2p stream per call, as every call of ours opens one), against the
link's own round trip and rate.

    python bench/wan_calls.py [--link 20/40] [--sizes 65536 262144 524288 1048576 4194304] [--repeats 5]

Needs root (peer/harness/internet.py). Two hosts on the same kind of link (R Mbit/s, D ms one way: a
4·D ms round trip); one serves an echo handler (``dht.rpc.serve_request``: read the request, answer with
as many bytes), the other calls it ``--repeats`` times per size, one call at a time, and then two at a
time, and then as ``--split`` K calls of N/K bytes at once (one activation sent in K pieces, each on its
own stream with its own window), and then as one call striped over K streams (``--split`` K again:
``dht.striping``, what the pipeline's forward calls do on a long round trip), and then on streams
kept open and reused, one call after another on each (``kept_s``: does a stream's window grow?). One JSON line per size: the median seconds of a call, its round trips (÷ 4·D) and what pure
transfer at the link's rate would take (2 N bytes at R, plus one round trip). A call that costs many
round trips more than its bytes explain is bound by windows (TCP's congestion window after idle, the
stream multiplexer's per-stream window), not by the link's rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HANDLER = "wan_calls.echo"
KEPT_HANDLER = "wan_calls.kept"
MAX_PAYLOAD = 64 << 20


async def serve(address: str) -> None:
    import torch
    from hivemind.p2p import P2P

    from dht.rpc import serve_request

    p2p = await P2P.create(host_maddrs=[f"/ip4/{address}/tcp/0"])

    async def echo(header, tensors):
        return {"ok": True}, [torch.zeros(int(header["size"]) // 4)]  # float32: 4 bytes each

    async def handler(info, reader, writer):
        await serve_request(reader, writer, echo, max_payload_bytes=MAX_PAYLOAD, timeout=120, what="echo")

    async def kept_handler(info, reader, writer):  # request after request on one stream, until the caller hangs up
        from dht.wire import read_message, write_message
        try:
            while True:
                header, _ = await read_message(reader, max_payload_bytes=MAX_PAYLOAD, timeout=600)
                await write_message(writer, *(await echo(header, [])))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(HANDLER, handler)
    await p2p.add_binary_stream_handler(KEPT_HANDLER, kept_handler)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs() if address in str(m)]
    print(json.dumps({"maddrs": maddrs}), flush=True)
    await asyncio.Event().wait()


async def call(maddr: str, sizes: list[int], repeats: int, splits: list[int]) -> None:
    import torch
    from hivemind.p2p import P2P, PeerID

    from dht.rpc import call_peer
    from dht.wire import read_message, write_message

    p2p = await P2P.create(initial_peers=[maddr])
    peer_id = maddr.rsplit("/", 1)[-1]

    async def one(size: int, stripes: int = 1) -> float:
        started = time.monotonic()
        await call_peer(p2p, peer_id, HANDLER, {"size": size}, [torch.zeros(size // 4)],
                        timeout=120, max_payload_bytes=MAX_PAYLOAD, stripes=stripes)
        return time.monotonic() - started

    kept = [await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), KEPT_HANDLER) for _ in range(2)]

    async def on_kept(size: int) -> float:
        started = time.monotonic()
        _, reader, writer = kept[0]
        await write_message(writer, {"size": size}, [torch.zeros(size // 4)])
        await read_message(reader, max_payload_bytes=MAX_PAYLOAD, timeout=120)
        return time.monotonic() - started

    await one(1024)  # the connection (dial, security, muxer) is not part of a call
    await on_kept(1024)
    for size in sizes:
        alone = [await one(size) for _ in range(repeats)]
        pairs = [max(await asyncio.gather(one(size), one(size))) for _ in range(repeats)]
        split = {k: [max(await asyncio.gather(*(one(size // k) for _ in range(k)))) for _ in range(repeats)]
                 for k in splits}
        striped = {k: [await one(size, stripes=k) for _ in range(repeats)] for k in splits}
        reused = [await on_kept(size) for _ in range(repeats)]
        print(json.dumps({"size": size, "alone_s": alone, "two_at_once_s": pairs, "split_s": split,
                          "striped_s": striped, "kept_s": reused}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="20/40", help="RATE_MBIT/ONE_WAY_DELAY_MS of both hosts' links")
    parser.add_argument("--sizes", type=int, nargs="+", default=[65536, 262144, 524288, 1048576, 4194304])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--split", type=int, nargs="*", default=[2, 4],
                        help="also send each size as K calls of size/K at once (each on its own stream)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--call", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    if args.call:
        asyncio.run(call(args.call, args.sizes, args.repeats, args.split))
        return
    from peer.harness.internet import Internet, Link

    rate, delay = (float(x) for x in args.link.split("/"))
    internet = Internet(seed=11)
    a = internet.add_host("a", Link(rate_mbit=rate, delay_ms=delay))
    b = internet.add_host("b", Link(rate_mbit=rate, delay_ms=delay))
    with internet:
        server = a.spawn(sys.executable, __file__, "--serve", a.address, stdout=subprocess.PIPE, text=True)
        maddr = json.loads(server.stdout.readline())["maddrs"][0]
        client = b.run(sys.executable, __file__, "--call", maddr, "--sizes", *map(str, args.sizes),
                       "--repeats", str(args.repeats), "--split", *map(str, args.split), timeout=1800)
        rtt = 4 * delay / 1000
        for line in client.stdout.splitlines():
            row = json.loads(line)
            size, alone, pairs = row["size"], statistics.median(row["alone_s"]), statistics.median(row["two_at_once_s"])
            transfer = 2 * size * 8 / (rate * 1e6) + rtt
            print(json.dumps({"bench": "wan_calls", "rate_mbit": rate, "delay_ms": delay, "rtt_s": rtt, "bytes_each_way": size,
                              "call_s_p50": round(alone, 3), "call_round_trips": round(alone / rtt, 1),
                              "rate_bound_s": round(transfer, 3), "two_at_once_s_p50": round(pairs, 3),
                              **{f"split_{k}_s_p50": round(statistics.median(v), 3) for k, v in row["split_s"].items()},
                              **{f"striped_{k}_s_p50": round(statistics.median(v), 3) for k, v in row["striped_s"].items()},
                              "kept_stream_s_p50": round(statistics.median(row["kept_s"]), 3)}),
                  flush=True)


if __name__ == "__main__":
    main()
