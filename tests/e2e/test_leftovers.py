"""The soak bench's leftover search (bench/proc_table.py) on real peers.

A peer stopped with Ctrl+C leaves no process behind. A peer killed alone with SIGKILL to its PID (not
to its process group, as the bench's crashes do) cannot stop its hivemind DHT process, that process's
p2pd or torch's torch_shm_manager (which leads a session of its own): the search must find what of
them is left, re-parented away from the peer, with p2pd's listening TCP socket, and kill them by PID.
"""

from __future__ import annotations

import os
import signal

import pytest

from bench.proc_table import (
    descendants,
    find_leftovers,
    kill_leftovers,
    listening_sockets,
    process_table,
    read_stat,
    spawned,
)
from peer.harness.local_swarm import wait_for

pytestmark = [pytest.mark.smoke, pytest.mark.timeout(300)]


def tree_of(pid: int) -> dict:
    table = process_table()
    return {child: table[child] for child in descendants(pid, table)}


def still_alive(tree: dict) -> set[int]:
    return {pid for pid, stat in tree.items()
            if (now := read_stat(pid)) is not None and now.start_ticks == stat.start_ticks and now.state != "Z"}


def test_a_clean_stop_leaves_nothing_and_a_lone_kill_leaves_orphans_that_are_found(local_swarm):
    since, own = read_stat(os.getpid()).start_ticks, {os.getpid()}
    local_swarm.start_bootstrap()
    clean, killed = [local_swarm.start_peer("--num-threads", "1") for _ in range(2)]
    wait_for(lambda: clean.events("status") and killed.events("status"), 150, "both peers to train")
    roots = {p.name: spawned(p.pid) for p in (clean, killed)}
    clean_tree, tree = tree_of(clean.pid), tree_of(killed.pid)
    p2pd = [pid for pid, stat in tree.items() if stat.comm == "p2pd"]
    assert len(p2pd) == 1 and len(tree) >= 2, tree  # at least the DHT process and its p2pd
    assert listening_sockets(p2pd)  # p2pd listens on 127.0.0.1 for the swarm

    clean.process.send_signal(signal.SIGINT)
    assert clean.process.wait(60) == 0
    wait_for(lambda: find_leftovers([roots["peer0"]], seen=clean_tree.values(), since_ticks=since, exclude=own) == [],
             30, "the stopped peer's processes to exit")

    os.kill(killed.pid, signal.SIGKILL)
    killed.process.wait(10)
    try:
        left = {s.pid for s in find_leftovers([roots["peer1"]], seen=tree.values(), since_ticks=since, exclude=own)}
        alive = still_alive(tree)
        assert alive <= left <= set(tree), (tree, left)  # (an orphan may be exiting meanwhile)
        assert p2pd[0] in alive and listening_sockets(p2pd)  # p2pd outlives its peer, holding its port
        own_session = {pid for pid in alive if tree[pid].sid == pid}  # torch_shm_manager, if torch started one
        without_sightings = {s.pid for s in find_leftovers([roots["peer1"]], since_ticks=since, exclude=own)}
        assert not own_session & without_sightings  # only the sighting ties such a process to the peer
        killed_now = set(kill_leftovers(find_leftovers([roots["peer1"]], seen=tree.values(), since_ticks=since,
                                                       exclude=own)))
        assert p2pd[0] in killed_now and killed_now <= set(tree)
        wait_for(lambda: find_leftovers([roots["peer1"]], seen=tree.values(), since_ticks=since, exclude=own) == [],
                 30, "the orphans to die")
    finally:
        for pid in still_alive(tree):  # in case an assert failed before kill_leftovers
            os.kill(pid, signal.SIGKILL)
