"""An emulated internet on one Linux host: home links with a rate, a delay and loss, and home NATs.

Needs root (network namespaces, ``tc``, ``nft``, a TUN device) and ``gcc`` for the delay line.
Nothing is created in the root namespace: every interface lives in a namespace made here, and the
namespaces have no link to the machine's own network, so the emulated internet reaches nothing real.

The layout, for hosts added with :meth:`Internet.add_host`::

    host ns ─ eth0 ══ link i ══ core ns (the internet: TUN delay line, routes)
    host ns ─ eth0 ── lan ─ home router ns ─ wan ══ link i ══ core ns          (nat=...)

- **Rate**: a ``tc tbf`` token bucket on both ends of the access link (``══``): the upload on the
  host's (or home router's) side, the download on the core's side, each with a queue of
  ``Link.queue_ms`` at that rate, as a home router's buffer.
- **Regions** (:meth:`Internet.connect_regions`): between two groups of hosts (two regions a
  continent apart) each host-to-host path gets more delay and, with a rate, a serial link of its own
  in the delay line (a bottleneck beyond both access links, per direction, with a queue of
  ``queue_ms``): hosts of one region reach each other over their access links alone.
- **Delay and loss**: the core routes every packet arriving from an access link into a TUN device
  read by ``delay_line`` (``delay_line.c``, compiled on first use), which holds it for the path's
  one-way delay (``delay_ms`` of the sender's link + ``delay_ms`` of the receiver's) and drops
  the fraction ``loss`` of each link, then writes it back; the core routes it on. This kernel has no
  ``netem``. A host-to-host round trip is therefore ``2 × (delay_a + delay_b)``.
- **Addresses**: site ``i`` is ``11.0.i.0/24`` (core ``.1``, host or home router ``.2``). libp2p
  treats 10/8 and the other private ranges as private and its NAT detection only trusts public
  addresses, so the core uses a public-looking range; no packet can leave the namespaces.
- **NAT** (``nft`` masquerade on the home router's ``wan``; the home LAN is ``192.168.i.0/24``,
  the host ``.2``, and the core blackholes ``192.168.0.0/16`` so a dial to a private address fails
  silently, as on the internet):
  - ``"port-restricted"``: Linux's masquerade keeps the source port where it can (the same mapping
    for every destination) and lets in only replies to a connection the host opened;
  - ``"symmetric"``: ``masquerade random``: a new random port per connection;
  - ``"full-cone"``: masquerade plus every packet to the router forwarded to the host (a "DMZ
    host"): anyone may dial in, as through a full-cone NAT or a port forward.

Processes started inside a host (``host.command_prefix``) are its own; :meth:`Internet.shutdown`
ends every process left in the namespaces it made (``ip netns pids``) and deletes them, also after a
test failed. :func:`sweep_leftovers` removes the namespaces of a run whose process died.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

NAME_PREFIX = "mwi"  # every namespace made here: mwi<pid>x<n>-<role>
NAT_KINDS = ("port-restricted", "symmetric", "full-cone")
DELAY_LINE_SOURCE = Path(__file__).with_name("delay_line.c")
HOME_PREFIX = "192.168.0.0/16"
_counter = itertools.count()


class InternetError(RuntimeError):
    """The host cannot build the emulated internet (not root, no nft, no gcc, ...): the message says what to do."""


@dataclass(frozen=True)
class Link:
    """A host's access link to the internet. ``rate_mbit`` None: unshaped; ``up_mbit`` overrides the upload."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0  # one way, between this host and the core
    loss: float = 0.0  # fraction of packets dropped each way
    up_mbit: float | None = None
    queue_ms: float = 100.0  # the buffer in front of the link, in time at its rate

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or not 0 <= self.loss < 1 or self.queue_ms <= 0:
            raise ValueError(f"a link needs delay_ms ≥ 0, 0 ≤ loss < 1 and queue_ms > 0, not {self}")
        for rate in (self.rate_mbit, self.up_mbit):
            if rate is not None and rate <= 0:
                raise ValueError(f"a link's rate must be positive, not {rate}")

    @property
    def upload_mbit(self) -> float | None:
        return self.up_mbit if self.up_mbit is not None else self.rate_mbit


@dataclass
class Host:
    """One machine of the emulated internet."""

    name: str
    index: int
    namespace: str
    link: Link
    nat: str | None
    address: str  # its own interface's address (what it listens on)
    public_address: str  # what others see: its own, or its home router's
    router_namespace: str | None = None
    extra_namespaces: list[str] = field(default_factory=list)

    @property
    def command_prefix(self) -> list[str]:
        """Prepend to a command to run it on this host (``ip netns exec`` execs it: the PID is the command's)."""
        return ["ip", "netns", "exec", self.namespace]

    def run(self, *command: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run a short command on this host and wait for it."""
        return _run(*self.command_prefix, *command, timeout=timeout, check=check)

    def spawn(self, *command: str, **popen: object) -> subprocess.Popen:
        """Start a long-running command on this host (ended at the latest by Internet.shutdown)."""
        return subprocess.Popen([*self.command_prefix, *command], start_new_session=True, **popen)

    def listen_maddr(self, port: int = 0) -> str:
        return f"/ip4/{self.address}/tcp/{port}"


class Internet:
    """Build with ``add_host`` (before ``start``), use the hosts, then ``shutdown`` (or use ``with``)."""

    def __init__(self, *, seed: int = 0, work_dir: Path | None = None) -> None:
        self.seed, self.work_dir = seed, work_dir
        self.tag = f"{NAME_PREFIX}{os.getpid()}x{next(_counter)}"
        self.core = f"{self.tag}-core"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        self._delay_line: subprocess.Popen | None = None
        self.delay_line_started: dict = {}
        self._paths: list[str] = []  # the delay line's path rules (connect_regions)

    def add_host(self, name: str, link: Link = Link(), *, nat: str | None = None) -> Host:
        if self._namespaces:
            raise InternetError("add every host before start()")
        if nat is not None and nat not in NAT_KINDS:
            raise ValueError(f"nat must be one of {NAT_KINDS} or None, not {nat!r}")
        index = len(self.hosts) + 1
        if index > 250:
            raise InternetError("an emulated internet holds at most 250 hosts")
        site = f"11.0.{index}.2"
        host = Host(name=name, index=index, namespace=f"{self.tag}-h{index}", link=link, nat=nat,
                    address=f"192.168.{index}.2" if nat else site, public_address=site,
                    router_namespace=f"{self.tag}-r{index}" if nat else None)
        self.hosts.append(host)
        return host

    def connect_regions(self, first: Sequence[Host], second: Sequence[Host], link: Link) -> None:
        """Put ``link`` between every host of ``first`` and every host of ``second`` (before ``start``):
        ``link.delay_ms`` more one way, and a serial link of ``link.rate_mbit`` (None: no limit but the
        access links) with a queue of ``link.queue_ms``, of its own for each pair and direction.
        A round trip between the regions is then ``2 × (delay_a + link.delay_ms + delay_b)``."""
        if self._namespaces:
            raise InternetError("connect regions before start()")
        if link.loss or link.up_mbit is not None:
            raise ValueError("a path between regions has a delay, a rate and a queue only (no loss, no up_mbit)")
        if set(h.index for h in first) & set(h.index for h in second):
            raise ValueError("a host cannot be in both regions")
        rate_kbit = round(link.rate_mbit * 1000) if link.rate_mbit is not None else 0
        for a, b in itertools.product(first, second):
            for source, destination in ((a, b), (b, a)):
                self._paths.append(f"path:11.0.{source.index}.0/24>11.0.{destination.index}.0/24,"
                                   f"{round(link.delay_ms * 1000)},{rate_kbit},{round(link.queue_ms * 1000)}")

    def start(self) -> Internet:
        check_can_build(nat=any(host.nat for host in self.hosts))
        binary = build_delay_line()
        try:
            self._make_namespace(self.core)
            for sysctl in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"):
                _in(self.core, "sysctl", "-qw", sysctl)
            _in(self.core, "ip", "tuntap", "add", "dev", "delay", "mode", "tun")
            _in(self.core, "ip", "link", "set", "delay", "mtu", "1500", "up")
            _in(self.core, "ip", "route", "add", "default", "dev", "delay", "table", "100")
            _in(self.core, "ip", "route", "add", "blackhole", HOME_PREFIX)
            for host in self.hosts:
                self._connect(host)
            self._start_delay_line(binary)
        except BaseException:
            self.shutdown()
            raise
        return self

    def set_rate(self, host: Host, rate_mbit: float | None, *, up_mbit: float | None = None) -> None:
        """Change a host's link rate now (None: unshaped), as a neighbour's download would squeeze it."""
        link = Link(rate_mbit=rate_mbit, delay_ms=host.link.delay_ms, loss=host.link.loss, up_mbit=up_mbit,
                    queue_ms=host.link.queue_ms)
        host.link = link
        self._shape(host)

    def link_bytes(self, host: Host) -> tuple[int, int]:
        """Bytes the host's access link has carried so far: (upload, download)."""
        edge = host.router_namespace or host.namespace
        up = _tx_bytes(edge, "wan" if host.nat else "eth0")
        return up, _tx_bytes(self.core, f"h{host.index}")

    def delay_line_stats(self) -> dict:
        """The delay line's counters since the last call (packets, drops, how late it wrote them)."""
        if self._delay_line is None or self._delay_line.poll() is not None:
            raise InternetError("the delay line is not running")
        self._delay_line.send_signal(signal.SIGUSR1)
        return json.loads(self._delay_line.stdout.readline())

    def shutdown(self) -> dict:
        """End every process in our namespaces, delete them; returns the delay line's last counters."""
        final: dict = {}
        if self._delay_line is not None:
            if self._delay_line.poll() is None:
                self._delay_line.terminate()
                try:
                    out, _ = self._delay_line.communicate(timeout=10)
                    final = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
                except (subprocess.TimeoutExpired, json.JSONDecodeError):
                    self._delay_line.kill()
                    self._delay_line.wait(10)
            self._delay_line = None
        for namespace in reversed(self._namespaces):
            remove_namespace(namespace)
        self._namespaces = []
        return final

    def __enter__(self) -> Internet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- building ----------------------------------------------------------------------------

    def _make_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        _in(name, "ip", "link", "set", "lo", "up")

    def _connect(self, host: Host) -> None:
        """The access link ``core:hN ══ wan|eth0``, and behind a NAT the home router and its LAN."""
        i = host.index
        edge = host.router_namespace or host.namespace
        edge_dev = "wan" if host.nat else "eth0"
        self._make_namespace(host.namespace)
        if host.nat:
            self._make_namespace(host.router_namespace)
        _in(self.core, "ip", "link", "add", f"h{i}", "type", "veth", "peer", "name", edge_dev, "netns", edge)
        _in(self.core, "ip", "addr", "add", f"11.0.{i}.1/24", "dev", f"h{i}")
        _in(self.core, "ip", "link", "set", f"h{i}", "up")
        _in(self.core, "sysctl", "-qw", f"net.ipv4.conf.h{i}.rp_filter=0")
        # everything that arrives from an access link goes through the delay line first
        _in(self.core, "ip", "rule", "add", "iif", f"h{i}", "table", "100", "pref", str(100 + i))
        _in(edge, "ip", "addr", "add", f"11.0.{i}.2/24", "dev", edge_dev)
        _in(edge, "ip", "link", "set", edge_dev, "up")
        _in(edge, "ip", "route", "add", "default", "via", f"11.0.{i}.1")
        if host.nat:
            self._home_router(host)
        self._shape(host)

    def _home_router(self, host: Host) -> None:
        i, router = host.index, host.router_namespace
        _in(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _in(router, "ip", "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        _in(router, "ip", "addr", "add", f"192.168.{i}.1/24", "dev", "lan")
        _in(router, "ip", "link", "set", "lan", "up")
        _in(host.namespace, "ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
        _in(host.namespace, "ip", "link", "set", "eth0", "up")
        _in(host.namespace, "ip", "route", "add", "default", "via", f"192.168.{i}.1")
        masquerade = "masquerade random" if host.nat == "symmetric" else "masquerade"
        rules = [
            "table ip nat {",
            "  chain post { type nat hook postrouting priority 100; oifname \"wan\" " + masquerade + "; }",
        ]
        if host.nat == "full-cone":
            rules.append(f"  chain pre {{ type nat hook prerouting priority -100; iifname \"wan\" dnat to {host.address}; }}")
        rules.append("}")
        _run(*["ip", "netns", "exec", router, "nft", "-f", "-"], stdin="\n".join(rules) + "\n")

    def _shape(self, host: Host) -> None:
        edge = host.router_namespace or host.namespace
        edge_dev = "wan" if host.nat else "eth0"
        for namespace, dev, rate in ((edge, edge_dev, host.link.upload_mbit), (self.core, f"h{host.index}", host.link.rate_mbit)):
            _in(namespace, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate is not None:
                _in(namespace, "tc", "qdisc", "add", "dev", dev, "root", *tbf_arguments(rate, host.link.queue_ms))

    def _start_delay_line(self, binary: Path) -> None:
        rules = []
        for host in self.hosts:
            delay_us = round(host.link.delay_ms * 1000)
            loss_ppm = round(host.link.loss * 1_000_000)
            for prefix in (f"11.0.{host.index}.0/24",):
                rules.append(f"{prefix},{delay_us},{delay_us},{loss_ppm},{loss_ppm}")
        self._delay_line = subprocess.Popen(["ip", "netns", "exec", self.core, str(binary), "delay", str(self.seed), *rules,
                                             *self._paths],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self._delay_line.stdout.readline()
        if not line:
            raise InternetError(f"the delay line did not start: {self._delay_line.stderr.read().strip()}")
        self.delay_line_started = json.loads(line)


def tbf_arguments(rate_mbit: float, queue_ms: float) -> list[str]:
    """A token bucket at ``rate_mbit`` with a burst of 4 ms at that rate (at least two packets)."""
    burst = max(3200, int(rate_mbit * 1e6 / 8 * 0.004))
    return ["tbf", "rate", f"{rate_mbit * 1000:.0f}kbit", "burst", str(burst), "latency", f"{queue_ms:.0f}ms"]


def check_can_build(*, nat: bool = True) -> None:
    """Raise InternetError with what to do when this machine cannot build the emulated internet."""
    if os.geteuid() != 0:
        raise InternetError("the emulated internet needs root (network namespaces, tc, nft, TUN): run as root")
    if not os.path.exists("/dev/net/tun"):
        raise InternetError("the emulated internet needs /dev/net/tun (the TUN driver) for its delay line")
    needed = ["ip", "tc", "gcc"] + (["nft"] if nat else [])
    missing = [tool for tool in needed if _which(tool) is None]
    if missing:
        raise InternetError(f"the emulated internet needs {', '.join(missing)}: run scripts/setup.sh "
                            "(it installs nftables) or install them")


def build_delay_line() -> Path:
    """Compile delay_line.c once per version of its source into the user's cache; returns the binary."""
    source = DELAY_LINE_SOURCE.read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "murmuration"
    binary = cache / f"delay_line-{hashlib.sha256(source).hexdigest()[:12]}"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{binary.name}.{os.getpid()}.partial")
    result = subprocess.run(["gcc", "-O2", "-Wall", "-o", str(partial), str(DELAY_LINE_SOURCE)],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise InternetError(f"gcc could not build the delay line: {result.stderr.strip()}")
    partial.replace(binary)  # atomic: a parallel test sees the whole binary or none
    return binary


def remove_namespace(name: str) -> None:
    """End every process inside a namespace of ours (they are ours: we started them there), delete it."""
    pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", name, check=False)


def sweep_leftovers() -> list[str]:
    """Delete the namespaces of an emulated internet whose creating process is gone; returns their names."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NAME_PREFIX):
            continue
        try:
            creator = int(name[len(NAME_PREFIX):].split("x", 1)[0])
        except ValueError:
            continue
        if not _alive(creator):
            remove_namespace(name)
            removed.append(name)
    return removed


def _tx_bytes(namespace: str, device: str) -> int:
    shown = json.loads(_in(namespace, "ip", "-s", "-j", "link", "show", "dev", device).stdout)
    return int(shown[0]["stats64"]["tx"]["bytes"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _which(tool: str) -> str | None:
    for directory in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/sbin", "/sbin"]:
        candidate = Path(directory) / tool
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _in(namespace: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", "netns", "exec", namespace, *command, check=check)


def _run(*command: str, timeout: float = 30.0, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, check=False, input=stdin)
    if check and result.returncode != 0:
        raise InternetError(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result
