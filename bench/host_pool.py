"""One fresh host of the emulated internet (peer/harness/internet.py) for every process a bench starts.

A bench whose processes come and go (bench/churn.py: crashes, leaves, rejoins) gives each process it
starts a host of its own, never reused: a rejoining peer comes back with a fresh address and its own
access link, as a volunteer does from another machine. The internet's namespaces and delay-line rules
are built once, in :meth:`HostPool.start`, so the caller counts its processes before: the bootstrap,
the initial peers and every rejoin. Needs root, as the internet does.
"""

from __future__ import annotations

from peer.harness.internet import Internet, Link


def parse_link(text: str) -> Link:
    """``RATE_MBIT/ONE_WAY_DELAY_MS`` (e.g. ``20/40``: 20 Mbit/s both ways, 40 ms from the host to the
    core, so 160 ms between two peers) as a :class:`Link`; ``ValueError`` for anything else."""
    try:
        rate, delay = (float(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"a link is RATE_MBIT/ONE_WAY_DELAY_MS, e.g. 20/40, not {text!r}") from None
    return Link(rate_mbit=rate, delay_ms=delay)


class HostPool:
    """``num_hosts`` hosts, each on its own ``link``; :meth:`next_placement` hands out the next unused one."""

    def __init__(self, link: Link, *, num_hosts: int, seed: int = 0) -> None:
        if num_hosts < 1:
            raise ValueError(f"a host pool needs at least one host, not {num_hosts}")
        self.internet = Internet(seed=seed)
        self.hosts = [self.internet.add_host(f"host{i}", link) for i in range(num_hosts)]
        self.num_used = 0

    def start(self) -> HostPool:
        self.internet.start()
        return self

    def next_placement(self) -> dict:
        """The keyword arguments of ``LocalSwarm.start_bootstrap`` / ``start_peer`` that run the next
        process on a host no process has used."""
        if self.num_used >= len(self.hosts):
            raise RuntimeError(f"all {len(self.hosts)} hosts are taken: count every process before start()")
        host = self.hosts[self.num_used]
        self.num_used += 1
        return {"host": host.address, "command_prefix": host.command_prefix}

    def shutdown(self) -> None:
        """Ends every process left on the hosts and deletes the namespaces (idempotent)."""
        self.internet.shutdown()

    def __enter__(self) -> HostPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
