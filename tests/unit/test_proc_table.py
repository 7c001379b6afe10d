"""bench/proc_table.py on real /proc entries: the test process itself and child processes it starts.

No fake /proc tree: each helper reads what the kernel says about processes this test owns (plain
``python -c`` children, no peers, so no lock is needed), and every child is killed by PID in ``finally``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.proc_table import (
    Spawned,
    ancestors,
    descendants,
    find_leftovers,
    kill_leftovers,
    listening_sockets,
    parse_stat,
    process_table,
    read_cmdline,
    read_pss_kib,
    read_rss_kib,
    read_stat,
    spawned,
    tree_rss_kib,
)

MIB = 1024  # KiB


@contextmanager
def child(code: str, *args: str, new_session: bool = False) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """A python child running ``code``; yields it and the lines it printed before "ready" (its readiness)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                            start_new_session=new_session)
    try:
        lines = []
        while (line := proc.stdout.readline().strip()) != "ready":
            assert line, f"the child exited before it was ready (status {proc.wait()})"
            lines.append(line)
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_the_stat_of_this_process_agrees_with_the_os():
    stat = read_stat(os.getpid())
    assert stat.pid == os.getpid() and stat.ppid == os.getppid()
    assert stat.pgid == os.getpgrp() and stat.sid == os.getsid(0)
    assert stat.state == "R"  # it is reading its own stat
    assert stat.comm == Path("/proc/self/comm").read_text().rstrip("\n")
    boot_ticks = float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK")
    assert 0 < stat.start_ticks <= boot_ticks
    assert read_cmdline(os.getpid()) == sys.orig_argv
    assert read_rss_kib(os.getpid()) > 10 * MIB  # an interpreter with pytest loaded


def test_a_name_with_spaces_and_parentheses_is_parsed_from_a_real_stat_line():
    rename = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'x) (y z', 0, 0, 0); print('ready', flush=True); time.sleep(60)"
    with child(rename) as (proc, _):
        stat = parse_stat(Path(f"/proc/{proc.pid}/stat").read_text())
        assert stat.comm == "x) (y z" and stat.ppid == os.getpid() and stat.state in "SR"
        assert stat.start_ticks >= read_stat(os.getpid()).start_ticks


def test_a_childs_memory_counts_in_its_parents_tree():
    hold = "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); time.sleep(60)"
    with child(hold) as (proc, _):
        assert read_rss_kib(proc.pid) >= 64 * MIB
        rss = tree_rss_kib(os.getpid(), process_table())
        assert rss[os.getpid()] > 10 * MIB and rss[proc.pid] >= 64 * MIB
    assert read_rss_kib(proc.pid) is None  # gone and reaped


def test_a_page_only_one_process_holds_counts_whole_in_its_pss():
    hold = "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); time.sleep(60)"
    with child(hold) as (proc, _):
        pss, rss = read_pss_kib(proc.pid), read_rss_kib(proc.pid)
        assert 64 * MIB <= pss <= rss  # its own 64 MiB whole, the interpreter's shared pages in part
    assert read_pss_kib(proc.pid) is None


GRANDPARENT = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(grandchild.pid, flush=True)
print("ready", flush=True)
if sys.argv[1] == "orphan":
    import os; os._exit(0)  # leaves the grandchild running, re-parented away from this tree
time.sleep(60)
"""


def test_descendants_and_ancestors_follow_the_parent_chain():
    with child(GRANDPARENT, "stay") as (proc, lines):
        grandchild = int(lines[0])
        try:
            table = process_table()
            below = descendants(os.getpid(), table)
            assert below.index(proc.pid) < below.index(grandchild)  # breadth first
            assert descendants(proc.pid, table) == [grandchild]
            assert ancestors(grandchild, table)[:2] == [proc.pid, os.getpid()]
        finally:
            kill_pid(grandchild)


def test_an_orphaned_grandchild_is_found_by_its_session_and_killed_by_pid():
    since = read_stat(os.getpid()).start_ticks
    with child(GRANDPARENT, "orphan", new_session=True) as (proc, lines):
        grandchild = int(lines[0])
        try:
            root = spawned(proc.pid)  # a zombie until waited for: its stat is still there
            assert root is not None
            proc.wait(10)
            table = process_table()
            assert table[grandchild].ppid != proc.pid and table[grandchild].sid == proc.pid  # orphaned, same session
            found = find_leftovers([root], since_ticks=since, exclude={os.getpid()})
            assert [s.pid for s in found] == [grandchild]
            assert find_leftovers([Spawned(os.getpid() + 10**7, 0)], since_ticks=since) == []  # nothing of a stranger
            assert kill_leftovers(found) == [grandchild]
            wait_until(lambda: find_leftovers([root], since_ticks=since) == [])  # dead (or a zombie, which is skipped)
        finally:
            kill_pid(grandchild)


SESSION_LEADER = """
import os, signal, subprocess, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
grandchild = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(60)"])
print(grandchild.pid, flush=True)
while os.getsid(grandchild.pid) != grandchild.pid:  # until it left this session
    time.sleep(0.01)
print("ready", flush=True)
signal.sigwait([signal.SIGUSR1])  # the test has sighted the grandchild
os._exit(0)
"""


def test_a_grandchild_with_a_session_of_its_own_is_found_only_through_a_sighting():
    """Like torch's torch_shm_manager: it calls setsid, so once its parent died nothing ties it to the root."""
    since = read_stat(os.getpid()).start_ticks
    with child(SESSION_LEADER, new_session=True) as (proc, lines):
        grandchild = int(lines[0])
        try:
            root = spawned(proc.pid)
            sighting = process_table()[grandchild]  # what a sample taken while the parent lived recorded
            assert sighting.ppid == proc.pid and sighting.sid == grandchild
            os.kill(proc.pid, signal.SIGUSR1)
            proc.wait(10)
            assert find_leftovers([root], since_ticks=since, exclude={os.getpid()}) == []
            found = find_leftovers([root], seen=[sighting], since_ticks=since, exclude={os.getpid()})
            assert [s.pid for s in found] == [grandchild] and found[0].ppid != proc.pid
            stranger = dataclasses.replace(sighting, start_ticks=sighting.start_ticks - 1)  # the PID reused since
            assert find_leftovers([root], seen=[stranger], since_ticks=since, exclude={os.getpid()}) == []
        finally:
            kill_pid(grandchild)


def test_a_process_is_found_by_the_workdir_on_its_command_line(tmp_path):
    since = read_stat(os.getpid()).start_ticks
    workdir = tmp_path / "work"
    code = "import time; print('ready', flush=True); time.sleep(60)"
    with child(code, f"--metrics-file={workdir}/peer0.jsonl") as (proc, _):
        mine = find_leftovers([], workdir=workdir, since_ticks=since, exclude={os.getpid()})
        assert [s.pid for s in mine] == [proc.pid]
        assert find_leftovers([], workdir=tmp_path / "wor", since_ticks=since) == []  # a prefix of the name is not it
        assert find_leftovers([], workdir=workdir, since_ticks=since, exclude={proc.pid}) == []
        later = read_stat(proc.pid).start_ticks + 1
        assert find_leftovers([], workdir=workdir, since_ticks=later) == []  # older than the bench: not its own


def test_a_reused_pid_is_not_killed():
    code = "import time; print('ready', flush=True); time.sleep(60)"
    with child(code) as (proc, _):
        record = spawned(proc.pid)
        impostor = dataclasses.replace(read_stat(proc.pid), start_ticks=record.start_ticks + 1)
        assert kill_leftovers([impostor]) == []
        assert proc.poll() is None and read_stat(proc.pid).state in "SR"
        assert find_leftovers([Spawned(proc.pid, record.start_ticks + 1)], since_ticks=0, exclude={os.getpid()}) == []


def test_a_listening_socket_is_attributed_to_its_process():
    listen = ("import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
              "c = socket.create_connection(s.getsockname()); print(s.getsockname()[1], flush=True); "
              "print('ready', flush=True); time.sleep(60)")
    with child(listen) as (proc, lines):
        port = int(lines[0])
        held = listening_sockets([proc.pid, os.getpid()])
        assert list(held) == [proc.pid]  # the connected client socket of the child is not listening
        assert list(held[proc.pid].values()) == [port]
    assert listening_sockets([proc.pid]) == {}
