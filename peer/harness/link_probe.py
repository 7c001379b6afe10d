"""Measure an emulated link from inside its namespaces: round trips (UDP echo) and goodput (TCP).

Run on the hosts of :class:`peer.harness.internet.Internet` (there is no ``ping`` or ``iperf3`` on
these machines)::

    python -m peer.harness.link_probe echo PORT                  # serves UDP echo (until killed)
    python -m peer.harness.link_probe ping ADDRESS PORT COUNT    # one JSON line: round trips in ms
    python -m peer.harness.link_probe sink PORT                  # accepts TCP streams, discards them
    python -m peer.harness.link_probe send ADDRESS PORT SECONDS  # one JSON line: Mbit/s that reached the sink
    python -m peer.harness.link_probe observe PORT               # answers each UDP datagram with its source
    python -m peer.harness.link_probe mapping PORT ADDRESS...    # one JSON line: the source each ADDRESS saw

``ping`` sends one 64-byte datagram at a time, 10 ms apart; a datagram that gets no answer within
2 s counts as lost. A TCP connection that cannot be made gives ``{"error": ...}`` and exit 1.
"""

from __future__ import annotations

import json
import socket
import sys
import time

PING_TIMEOUT = 2.0


def echo(port: int) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("0.0.0.0", port))
    print("ready", flush=True)
    while True:
        data, source = server.recvfrom(2048)
        server.sendto(data, source)


def ping(address: str, port: int, count: int) -> dict:
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(PING_TIMEOUT)
    round_trips = []
    for sequence in range(count):
        payload = sequence.to_bytes(4, "big") * 16
        started = time.perf_counter()
        client.sendto(payload, (address, port))
        try:
            while client.recvfrom(2048)[0] != payload:  # a late answer to an earlier datagram
                pass
            round_trips.append((time.perf_counter() - started) * 1000)
        except TimeoutError:
            pass
        time.sleep(0.01)
    round_trips.sort()
    if not round_trips:
        return {"sent": count, "answered": 0}
    return {"sent": count, "answered": len(round_trips), "min_ms": round_trips[0],
            "p50_ms": round_trips[len(round_trips) // 2], "max_ms": round_trips[-1]}


def observe(port: int) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("0.0.0.0", port))
    print("ready", flush=True)
    while True:
        _, (address, source_port) = server.recvfrom(2048)
        server.sendto(f"{address}:{source_port}".encode(), (address, source_port))


def mapping(port: int, addresses: list[str]) -> dict:
    """From one local UDP port, ask each ``observe`` server which source it saw (a NAT's mapping)."""
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.bind(("0.0.0.0", 0))
    client.settimeout(PING_TIMEOUT)
    seen = {}
    for address in addresses:
        client.sendto(b"?", (address, port))
        try:
            seen[address] = client.recvfrom(2048)[0].decode()
        except TimeoutError:
            seen[address] = None
    return {"local_port": client.getsockname()[1], "seen": seen}


def sink(port: int) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen()
    print("ready", flush=True)
    while True:
        connection, _ = server.accept()
        received = 0
        while data := connection.recv(1 << 20):
            received += len(data)
        connection.sendall(str(received).encode())  # the sender's clock stops when this arrives
        connection.close()


def send(address: str, port: int, seconds: float) -> dict:
    try:
        connection = socket.create_connection((address, port), timeout=10)
    except OSError as e:
        return {"error": f"cannot connect to {address}:{port}: {e}"}
    block, sent = b"x" * (1 << 16), 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        sent += connection.send(block)
    connection.shutdown(socket.SHUT_WR)
    connection.settimeout(60)
    received = int(connection.recv(64) or b"0")  # what reached the sink, once all of it did
    elapsed = time.perf_counter() - started
    connection.close()
    return {"mbit_per_s": received * 8 / elapsed / 1e6, "bytes": received, "seconds": elapsed}


def main(argv: list[str]) -> int:
    command, arguments = argv[0], argv[1:]
    if command == "echo":
        echo(int(arguments[0]))
    elif command == "sink":
        sink(int(arguments[0]))
    elif command == "observe":
        observe(int(arguments[0]))
    elif command == "mapping":
        print(json.dumps(mapping(int(arguments[0]), arguments[1:])))
    elif command == "ping":
        print(json.dumps(ping(arguments[0], int(arguments[1]), int(arguments[2]))))
    elif command == "send":
        result = send(arguments[0], int(arguments[1]), float(arguments[2]))
        print(json.dumps(result))
        return 1 if "error" in result else 0
    else:
        print(f"unknown command {command!r}: echo, ping, sink, send, observe or mapping", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
