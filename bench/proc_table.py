"""What Linux's /proc says about the processes a benchmark started: RSS of a process tree, leftovers, sockets.

bench/soak.py reads it every ~10 s while the swarm runs and once after it stopped everything. Only
/proc is read: no psutil (not a dependency of the project), no signals sent except by
:func:`kill_leftovers`, which SIGKILLs by PID exactly the processes :func:`find_leftovers` returned
after checking that each PID still names the same process (same start time), never by name.

Why both the parent chain and the session: a peer started by :class:`peer.harness.local_swarm.LocalSwarm`
leads a new session and process group (``start_new_session``); its hivemind DHT child (a fork) and the
DHT child's ``p2pd`` (hivemind starts it with ``create_subprocess_exec``, no new session) inherit
both. While the peer lives, its children are found through the parent chain. Once it exited, an
orphaned child is re-parented to init (or a subreaper) and the chain is gone, but its session id and
process group id still name the peer, so those catch a leftover whichever way it was orphaned. One
child escapes both: torch's ``torch_shm_manager`` calls setsid, so a ``killpg`` of the peer's group
misses it and only a sighting while its parent lived ties it to the peer (``seen`` below).
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TCP_LISTEN = "0A"  # the st column of /proc/net/tcp for a socket in LISTEN (include/net/tcp_states.h)


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/<pid>/stat the benches use (proc(5)); ``start_ticks``: start time in clock
    ticks after boot, which with the PID names a process uniquely (a PID alone can be reused)."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int
    sid: int
    start_ticks: int


def parse_stat(text: str) -> ProcStat:
    """Parses one /proc/<pid>/stat line. ``comm`` may hold spaces and parentheses: it runs from the
    first "(" to the last ")"."""
    head, _, rest = text.rpartition(")")
    pid, _, comm = head.partition(" (")
    fields = rest.split()  # fields[0] is field 3 (state) of proc(5)
    if len(fields) < 20:
        raise ValueError(f"a /proc stat line with {len(fields)} fields after comm: {text[:120]!r}")
    return ProcStat(pid=int(pid), comm=comm, state=fields[0], ppid=int(fields[1]), pgid=int(fields[2]),
                    sid=int(fields[3]), start_ticks=int(fields[19]))


def read_stat(pid: int) -> ProcStat | None:
    """None if the process is gone (or vanished while being read)."""
    try:
        return parse_stat((PROC / str(pid) / "stat").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return None


def process_table() -> dict[int, ProcStat]:
    """Every process visible now, by PID (threads are not listed: /proc/<pid> names thread-group leaders)."""
    table = {}
    for entry in os.scandir(PROC):
        if entry.name.isdigit() and (stat := read_stat(int(entry.name))) is not None:
            table[stat.pid] = stat
    return table


def parse_vm_rss_kib(status_text: str) -> int:
    """VmRSS of a /proc/<pid>/status, in KiB; 0 where the line is missing (a zombie, a kernel thread)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"VmRSS in unexpected unit {unit!r}")
            return int(value)
    return 0


def read_rss_kib(pid: int) -> int | None:
    """The process's VmRSS in KiB (kB in /proc is KiB); None if it is gone."""
    try:
        return parse_vm_rss_kib((PROC / str(pid) / "status").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return None


def parse_pss_kib(smaps_rollup_text: str) -> int:
    """Pss of a /proc/<pid>/smaps_rollup, in KiB: the process's resident pages, each shared page
    divided by the number of processes that map it, so a tree's Pss adds up to what it holds; 0
    where the line is missing (a kernel thread)."""
    for line in smaps_rollup_text.splitlines():
        if line.startswith("Pss:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"Pss in unexpected unit {unit!r}")
            return int(value)
    return 0


def read_pss_kib(pid: int) -> int | None:
    """The process's Pss in KiB (Linux >= 4.14); None if it is gone."""
    try:
        return parse_pss_kib((PROC / str(pid) / "smaps_rollup").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return None


def read_cmdline(pid: int) -> list[str]:
    """argv of the process; [] if it is gone or a zombie."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def descendants(root: int, table: Mapping[int, ProcStat]) -> list[int]:
    """PIDs of every process below ``root`` in ``table`` by the parent chain, breadth first (root excluded)."""
    children = defaultdict(list)
    for stat in table.values():
        children[stat.ppid].append(stat.pid)
    found, frontier = [], [root]
    while frontier:
        frontier = [child for pid in frontier for child in sorted(children.get(pid, ()))]
        found += frontier
    return found


def ancestors(pid: int, table: Mapping[int, ProcStat]) -> list[int]:
    """PIDs above ``pid`` by the parent chain, nearest first (ends at init or where the table does)."""
    found = []
    while (stat := table.get(pid)) is not None and stat.ppid > 0 and stat.ppid not in found:
        found.append(stat.ppid)
        pid = stat.ppid
    return found


def tree_rss_kib(root: int, table: Mapping[int, ProcStat]) -> dict[int, int]:
    """VmRSS in KiB of ``root`` and each of its descendants still alive, by PID. VmRSS counts a page
    shared between processes (a fork's copy-on-write pages, shared libraries) once per process, so
    the sum over a tree overstates its memory; it is the same overstatement at every sample."""
    rss = {}
    for pid in [root, *descendants(root, table)]:
        if (value := read_rss_kib(pid)) is not None:
            rss[pid] = value
    return rss


@dataclass(frozen=True)
class Spawned:
    """A process the bench started itself: its PID and start time (so a reused PID is not mistaken for it)."""

    pid: int
    start_ticks: int


def spawned(pid: int) -> Spawned | None:
    """The :class:`Spawned` record of a child just started; None if it already exited."""
    stat = read_stat(pid)
    return Spawned(pid, stat.start_ticks) if stat is not None else None


def find_leftovers(roots: Collection[Spawned], *, seen: Collection[ProcStat] = (), workdir: str | Path | None = None,
                   since_ticks: int, table: Mapping[int, ProcStat] | None = None,
                   exclude: Collection[int] = ()) -> list[ProcStat]:
    """Processes still alive that came from ``roots`` (the processes the bench started) or from
    ``seen`` (their descendants as observed while they ran): one of those itself (same PID and start
    time), a descendant of one by the parent chain, or a process in a session or process group that a
    root or a seen process led; and ``p2pd``/python processes whose command line mentions ``workdir``.

    ``seen`` matters for a descendant that starts a session of its own (torch's ``torch_shm_manager``
    does): once its parent died, neither the parent chain nor the bench's sessions lead to it. A leader
    whose PID now names another process (reused) leads nothing of ours. Only processes started at or
    after ``since_ticks`` (the bench's own start) count, and never those in ``exclude`` (the bench and
    its ancestors: a ``flock ... bench/soak.py --keep-dir DIR`` mentions the workdir too). Zombies are
    skipped: they hold no memory or socket and vanish when reaped.
    """
    table = process_table() if table is None else table
    known = {r.pid: r.start_ticks for r in roots} | {s.pid: s.start_ticks for s in seen}
    alive = [pid for pid, ticks in known.items() if (s := table.get(pid)) is not None and s.start_ticks == ticks]
    below = {pid for root in alive for pid in [root, *descendants(root, table)]}
    led = {r.pid for r in roots} | {s.pid for s in seen if s.sid == s.pid or s.pgid == s.pid}
    leaders = {pid for pid in led if pid not in table or table[pid].start_ticks == known[pid]}
    marker = os.path.join(str(workdir), "") if workdir is not None else None  # "/tmp/x/" does not match "/tmp/xy"
    found = []
    for stat in table.values():
        if stat.pid in exclude or stat.start_ticks < since_ticks or stat.state == "Z":
            continue
        came_from_ours = stat.pid in below or stat.sid in leaders or stat.pgid in leaders
        if came_from_ours or (marker is not None and mentions(stat, marker)):
            found.append(stat)
    return sorted(found, key=lambda s: s.pid)


def mentions(stat: ProcStat, marker: str) -> bool:
    """Whether a p2pd or python process has ``marker`` in an argument of its command line."""
    is_ours_kind = stat.comm == "p2pd" or stat.comm.startswith("python")
    return is_ours_kind and any(marker in arg for arg in read_cmdline(stat.pid))


def kill_leftovers(leftovers: Iterable[ProcStat]) -> list[int]:
    """SIGKILL, by PID, each process of ``leftovers`` whose PID still names it (same start time);
    returns the PIDs signalled."""
    killed = []
    for stat in leftovers:
        now = read_stat(stat.pid)
        if now is None or now.start_ticks != stat.start_ticks:
            continue
        try:
            os.kill(stat.pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.append(stat.pid)
    return killed


# ---- sockets -------------------------------------------------------------------------------------

def parse_tcp_listen_inodes(table_text: str) -> dict[int, int]:
    """{socket inode: local port} of the LISTEN sockets in a /proc/net/tcp or tcp6 table."""
    found = {}
    for line in table_text.splitlines()[1:]:  # the first line is the header
        fields = line.split()
        if len(fields) >= 10 and fields[3] == TCP_LISTEN:
            found[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
    return found


def listening_tcp_inodes() -> dict[int, int]:
    """{inode: port} of every TCP socket listening in this network namespace, IPv4 and IPv6."""
    found = {}
    for name in ("tcp", "tcp6"):
        try:
            found.update(parse_tcp_listen_inodes((PROC / "net" / name).read_text()))
        except FileNotFoundError:  # a kernel without IPv6
            pass
    return found


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets the process holds open (its fds that read ``socket:[inode]``)."""
    inodes = set()
    try:
        fds = os.listdir(PROC / str(pid) / "fd")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return inodes
    for fd in fds:
        try:
            target = os.readlink(PROC / str(pid) / "fd" / fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def listening_sockets(pids: Iterable[int]) -> dict[int, dict[int, int]]:
    """{pid: {socket inode: TCP port}} of the listening sockets each of ``pids`` holds, for those that
    hold any. A socket inherited across a fork is held by both processes: count distinct inodes."""
    listening = listening_tcp_inodes()
    held = {}
    for pid in pids:
        if mine := {inode: listening[inode] for inode in socket_inodes(pid) if inode in listening}:
            held[pid] = mine
    return held
