"""Network faults for e2e tests: a peer in its own network namespace, on a link we can cut or throttle.

A :class:`NamespaceLink` creates a network namespace and a veth pair joining it to the root
namespace, with a /24 of its own (``10.77.<n>.1`` on the root side, ``10.77.<n>.2`` inside). A
process started with :meth:`NamespaceLink.command_prefix` runs inside; processes in the root
namespace reach it (and it them) only across the veth pair, and only if they listen on
``root_address`` (a local address of the root namespace, so root-namespace processes still talk to
each other over loopback whatever happens to the link).

Faults act on the egress qdisc of both ends of the pair (``tc``; this kernel has no netem, no
iptables, no prio/matchall/gact, but it has pfifo and tbf):

- :meth:`partition`: ``pfifo limit 0`` on both ends, a queue that holds nothing, so every packet
  either way is dropped silently. The links stay up: nobody gets a "network unreachable", TCP
  retransmits into the void, exactly what a cut cable between two routers looks like.
- :meth:`throttle`: ``tbf`` at the given rate on both ends (each direction its own budget).
- :meth:`restore`: the qdiscs removed, the link as before.

Everything is removed in :meth:`shutdown` (idempotent; the class is a context manager), and a
leftover from a test that was killed is recognisable by its name prefix (``mnf``).
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess

NAME_PREFIX = "mnf"  # namespaces and veth ends created here; interface names are at most 15 characters
_counter = itertools.count()


class NamespaceError(RuntimeError):
    """The host cannot give a test a network namespace (not root, no ``ip``, no veth, ...)."""


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip``/``tc``-style commands; ``args[0]`` is the program. Raises NamespaceError on failure."""
    command = [*(("ip", "netns", "exec", netns) if netns else ()), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    if check and result.returncode != 0:
        raise NamespaceError(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _free_subnet() -> int:
    """A third octet ``n`` such that no address of the root namespace is in 10.77.n.0/24."""
    used = ip("ip", "-4", "-o", "addr", "show").stdout
    free = [n for n in range(1, 255) if f" 10.77.{n}." not in used]
    if not free:
        raise NamespaceError("every 10.77.n.0/24 is in use in the root namespace")
    return random.choice(free)  # other tests (or other test runs) on this machine pick others


class NamespaceLink:
    """A network namespace joined to the root namespace by a veth pair whose traffic we control."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}{next(_counter)}"
        self.name = f"{NAME_PREFIX}{tag}"  # the namespace
        self.root_dev, self.ns_dev = f"{NAME_PREFIX}{tag}r", f"{NAME_PREFIX}{tag}n"
        self.subnet = 0
        self.root_address = self.ns_address = ""
        self._created_ns = self._created_link = False

    def start(self) -> NamespaceLink:
        if os.geteuid() != 0:
            raise NamespaceError("network-fault tests need root (network namespaces and tc); run them as root")
        try:
            ip("ip", "netns", "add", self.name)
            self._created_ns = True
            ip("ip", "link", "add", self.root_dev, "type", "veth", "peer", "name", self.ns_dev)
            self._created_link = True
            ip("ip", "link", "set", self.ns_dev, "netns", self.name)
            for _ in range(5):  # another test may take the subnet between our look and our claim
                self.subnet = _free_subnet()
                if ip("ip", "addr", "add", f"10.77.{self.subnet}.1/24", "dev", self.root_dev, check=False).returncode == 0:
                    break
            else:
                raise NamespaceError("could not claim a free 10.77.n.0/24")
            self.root_address, self.ns_address = f"10.77.{self.subnet}.1", f"10.77.{self.subnet}.2"
            ip("ip", "link", "set", self.root_dev, "up")
            ip("ip", "addr", "add", f"{self.ns_address}/24", "dev", self.ns_dev, netns=self.name)
            ip("ip", "link", "set", self.ns_dev, "up", netns=self.name)
            ip("ip", "link", "set", "lo", "up", netns=self.name)
        except BaseException:
            self.shutdown()
            raise
        return self

    def command_prefix(self) -> list[str]:
        """Prepend to a command to run it inside the namespace (``ip netns exec`` execs it: same PID)."""
        return ["ip", "netns", "exec", self.name]

    def partition(self) -> None:
        """Drop every packet across the link, both ways, silently (the links stay up)."""
        self._set_qdisc("pfifo", "limit", "0")

    def throttle(self, rate_mbit: float, *, burst_bytes: int = 16384, latency_ms: float = 200.0) -> None:
        """Shape each direction to ``rate_mbit`` Mbit/s (a token bucket; a queue of ``latency_ms``)."""
        self._set_qdisc("tbf", "rate", f"{rate_mbit * 1000:.0f}kbit", "burst", str(burst_bytes),
                        "latency", f"{latency_ms:.0f}ms")

    def restore(self) -> None:
        """Remove whatever fault is set: the link carries everything again at full speed."""
        for dev, netns in ((self.root_dev, None), (self.ns_dev, self.name)):
            ip("tc", "qdisc", "del", "dev", dev, "root", netns=netns, check=False)  # none set: fine

    def qdiscs(self) -> str:
        """``tc qdisc show`` of both ends (for test output)."""
        return "\n".join(ip("tc", "qdisc", "show", "dev", dev, netns=netns).stdout.strip()
                         for dev, netns in ((self.root_dev, None), (self.ns_dev, self.name)))

    def _set_qdisc(self, *qdisc: str) -> None:
        for dev, netns in ((self.root_dev, None), (self.ns_dev, self.name)):
            ip("tc", "qdisc", "replace", "dev", dev, "root", *qdisc, netns=netns)

    def shutdown(self) -> None:
        """Delete the veth pair and the namespace (idempotent; what is already gone is skipped)."""
        if self._created_link:
            ip("ip", "link", "del", self.root_dev, check=False)  # takes its peer end with it
            self._created_link = False
        if self._created_ns:
            ip("ip", "netns", "del", self.name, check=False)
            self._created_ns = False

    def exists(self) -> bool:
        """Whether the namespace is still there (a test checks that it cleaned up)."""
        return self.name in ip("ip", "netns", "list").stdout.split()

    def __enter__(self) -> NamespaceLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

