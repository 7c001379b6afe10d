"""Hostile peer records against a real swarm (issue #7, "Signed, bounded records").

The hostile party is this test process: a real hivemind DHT node on 127.0.0.1 with its own libp2p
identity and RSA record key, so every record it writes is correctly signed and stored by the DHT.

* A forger writes heartbeats that claim other peers' peer ids: a live peer's (with another stage and
  huge figures) and a peer killed with kill -9 (to keep it "alive"). The peers' status pages show
  neither, the dead peer leaves every view once its own heartbeat expired, and no microbatch is
  routed to it.
* A liar, under its own bound identity, claims stage 1 with optimizer step 10**9, 10**9 samples/s,
  1e18 FLOP/s and a backup of stage 0 at version 10**9; it answers pings and serves a state of its
  own (freshly initialised) for stage 1 and for that backup. No peer reloads anything, a joiner of
  stage 1 takes the honest holders' state, and when stage 0's only holder is killed the stage comes
  back from the honest keeper's backup, not from the liar's; training goes on and the loss falls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch

from dht.identity import PeerIdentity, identity_of
from dht.node import DHTNodeConfig, open_dht
from dht.records import PeerRecord, RunSpec, peers_key
from dht.clock import SYSTEM_CLOCK
from dht.registry import declare_peer
from peer.harness.local_swarm import wait_for
from replication.server import ReplicationServer
from swarm.membership import MembershipNotices
from swarm.stage import Stage
from swarm.view import SwarmView

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(420)]
RUN_ID = "demo"
ARGS = ("--num-threads", "1", "--rebalance-period", "0")
HUGE = 10**9


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=10) as response:
        return json.loads(response.read())


def peer_id_of(peer) -> str:
    return peer.events("joined")[0]["peer_id"]


def events_after(peer, event: str, since: float) -> list[dict]:
    return [e for e in peer.events(event) if e["t"] > since]


def rows(port: int) -> dict[str, dict]:
    return {row["peer_id"]: row for row in status(port)["peers"]}


class HostileNode:
    """A DHT node of this test process with an event loop of its own (a thread), so that it can serve
    p2p handlers and write records while the test polls the swarm."""

    def __init__(self, maddrs: list[str], *, identity_path: str | None = None) -> None:
        self.dht, self.validator = open_dht(DHTNodeConfig(initial_peers=tuple(maddrs), identity_path=identity_path))
        self.peer_id = self.dht.peer_id.to_base58()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hostile", daemon=True)
        self.thread.start()
        self.tasks: list[Any] = []

    def run(self, coro: Coroutine, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine) -> concurrent.futures.Future:
        task = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self.tasks.append(task)
        return task

    async def store(self, record: PeerRecord, *, ttl: float, bind_as_self: bool) -> bool:
        """Store ``record`` under this node's record key, bound to this node's identity (which holds for
        a record claiming this node's own peer id, and is a forgery for one claiming anybody else's)."""
        if bind_as_self:
            peer_key, signature = identity_of(self.dht).bind(RUN_ID, self.validator.local_public_key)
            record = dataclasses.replace(record, peer_key=peer_key, peer_signature=signature)
        return bool(await self.dht.store(peers_key(RUN_ID), record.to_wire(), SYSTEM_CLOCK.dht_time() + ttl,
                                         subkey=self.validator.local_public_key, return_future=True))

    def shutdown(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.dht.shutdown()


async def repeat(period: float, until: float, action) -> list:
    """``action()`` every ``period`` seconds until the wall clock reaches ``until``; its results."""
    results = []
    while time.time() < until:
        results.append(await action())
        await asyncio.sleep(period)
    return results


def test_forged_records_claiming_other_peers_are_ignored(local_swarm):
    local_swarm.start_bootstrap()
    ports = [free_port() for _ in range(3)]
    first = local_swarm.start_peer("--stage", "0", "--status-port", str(ports[0]), *ARGS)
    live, doomed = (local_swarm.start_peer("--stage", "1", "--status-port", str(port), *ARGS) for port in ports[1:])
    peers = [first, live, doomed]
    wait_for(lambda: all(p.events("status") for p in peers), 150, "three peers to train")
    wait_for(lambda: all(len(rows(port)) == 3 for port in ports), 30, "every status page to list the three peers")
    live_id, doomed_id = peer_id_of(live), peer_id_of(doomed)
    forger = HostileNode(local_swarm.maddrs)
    try:
        # 1. a live peer's id, with another stage and role, step 10**9, huge rates, a newer announcement
        lie = PeerRecord(peer_id=live_id, role="unreliable", state="training", stage=0, flops=1e18,
                         samples_per_s=1e9, version=HUGE, num_samples=HUGE, announced_at=SYSTEM_CLOCK.dht_time() + 60,
                         backup_stage=0, backup_version=HUGE, maddrs=("/ip4/127.0.0.1/tcp/9",))
        # (a short TTL, refreshed: the DHT keeps the later-expiring entry of a key, and part 2 replaces it)
        assert any(forger.run(repeat(1.0, time.time() + 8, lambda: forger.store(lie, ttl=3, bind_as_self=True))))
        for port in ports:
            shown = rows(port)
            assert set(shown) == {peer_id_of(p) for p in peers}
            assert (shown[live_id]["stage"], shown[live_id]["role"]) == (1, "reliable")
            assert shown[live_id]["step"] < HUGE and shown[live_id]["flops"] < 1e18
        assert f"refused a peer record: a record claiming peer id {live_id}" in first.log_path.read_text()

        # 2. kill -9 a peer, then keep "heartbeating" for it, fresher every second
        killed_at = time.time()
        os.killpg(doomed.pid, signal.SIGKILL)
        ghost = PeerRecord(peer_id=doomed_id, role="reliable", state="training", stage=1, flops=1e9,
                           samples_per_s=1e3, announced_at=SYSTEM_CLOCK.dht_time())

        async def heartbeat() -> bool:
            return await forger.store(dataclasses.replace(ghost, announced_at=SYSTEM_CLOCK.dht_time()), ttl=6, bind_as_self=True)
        forged = forger.spawn(repeat(1.0, killed_at + 32, heartbeat))
        survivors = [(first, ports[0]), (live, ports[1])]
        wait_for(lambda: all(doomed_id not in rows(port) for _, port in survivors), 20,
                 "the killed peer to leave every view although its heartbeats are forged")
        gone_at = time.time()
        assert gone_at - killed_at < 6.0 + 5.0  # its own last heartbeat's TTL, plus a refresh or two
        done = len(first.events("microbatch"))
        deadline = killed_at + 30
        while time.time() < deadline:  # forgeries keep coming: the peer stays gone
            assert all(doomed_id not in rows(port) for _, port in survivors)
            time.sleep(1.0)
        assert len(first.events("microbatch")) >= done + 10, "training stalled"
        routed = [e for e in first.events("microbatch") if e["t"] > gone_at + 2]
        assert routed and not any(hop[0] == doomed_id for e in routed for hop in e["route"])
        assert not [e for e in first.events("replayed") if e["t"] > gone_at + 2 and doomed_id[-6:] in e["reason"]]
        assert f"claiming peer id {doomed_id}" in first.log_path.read_text()
        assert sum(forged.result(30)) >= 20, "the forged heartbeats were not stored"
    finally:
        forger.shutdown()
    assert first.is_alive() and live.is_alive()


def hostile_identity(peer_ids: list[str], directory: Path) -> str:
    """An identity file whose peer id sorts after ``peer_ids``: the liar is then not the peer the
    backup rule names the keeper of stage 0 (the first peer of stage 1), which would make it the
    legitimate keeper rather than a liar about one."""
    identity = PeerIdentity.generate()
    while identity.peer_id <= max(peer_ids):
        identity = PeerIdentity.generate()
    path = directory / "hostile.id"
    path.write_bytes(identity.to_bytes())
    return str(path)


def test_a_peer_claiming_a_huge_version_and_rates_forces_no_reload(local_swarm, tmp_path):
    local_swarm.start_bootstrap()
    backups = ("--backup-period", "3")
    first = local_swarm.start_peer("--stage", "0", *ARGS, *backups)
    # --first-stage, not --stage: one of them rescues stage 0 below, and a peer pinned with --stage never moves
    holders = [local_swarm.start_peer("--first-stage", "1", *ARGS, *backups) for _ in range(2)]
    honest = [first, *holders]
    wait_for(lambda: all(p.events("status") for p in honest), 150, "three peers to train")
    wait_for(lambda: all(p.events("averaged") for p in holders) and holders[0].events("averaged")[-1]["digest"]
             == holders[1].events("averaged")[-1]["digest"], 90, "stage 1's holders to average")

    spec = RunSpec(run_id=RUN_ID)
    fake_states = {k: Stage(spec, k, device=torch.device("cpu")) for k in (0, 1)}  # states of its own

    def snapshot_of(stage: int):
        async def snapshot():
            state = fake_states[stage].state_tensors()
            del state["counters.num_steps"]
            return HUGE, state
        return snapshot

    liar = HostileNode(local_swarm.maddrs,
                       identity_path=hostile_identity([peer_id_of(p) for p in holders], Path(tempfile.mkdtemp())))
    started_at = time.time()
    try:
        async def serve() -> list:
            p2p = await liar.dht.replicate_p2p()
            notices = MembershipNotices(p2p, SwarmView(liar.dht, RUN_ID), run_id=RUN_ID, peer_id=liar.peer_id)
            await notices.start()  # it answers pings: the failure detectors keep it in their views
            server = ReplicationServer(p2p, run_id=RUN_ID, stage=1, snapshot_fn=snapshot_of(1),
                                       backup_fn=lambda stage: snapshot_of(0) if stage == 0 else None)
            await server.start()
            return [p2p, notices, server]
        services = liar.run(serve())  # noqa: F841 (kept alive while it lies)
        claim = PeerRecord(peer_id=liar.peer_id, role="reliable", state="training", stage=1, flops=1e18,
                           samples_per_s=1e9, version=HUGE, num_samples=HUGE, announced_at=SYSTEM_CLOCK.dht_time(),
                           backup_stage=0, backup_version=HUGE)

        async def heartbeat() -> bool:
            return await declare_peer(liar.dht, liar.validator, RUN_ID, claim, ttl=6)
        claims = liar.spawn(repeat(1.0, started_at + 400, heartbeat))
        wait_for(lambda: all(any(e["peer_id"] == liar.peer_id for e in p.events("primitive")) for p in holders),
                 30, "stage 1's holders to see the liar join their stage")

        # a joiner of stage 1 takes the state the two honest holders agree on, not the liar's
        joiner = local_swarm.start_peer("--stage", "1", *ARGS, *backups)
        wait_for(lambda: joiner.events("state_download") or not joiner.is_alive(), 120, "the joiner's download")
        download = joiner.events("state_download")[0]
        assert liar.peer_id not in download["bytes_by_donor"] and download["version"] != HUGE, download
        assert "disagrees" in download["failed_donors"][liar.peer_id], download  # it was asked, and outvoted
        assert any(int(e["at"]) == download["version"] for p in holders for e in p.events("averaged"))
        stage1 = [*holders, joiner]
        wait_for(lambda: joiner.events("status"), 60, "the joiner to train")

        # stage 0's only holder dies; the peer named its keeper (the first honest holder of stage 1) has a
        # fresh backup; the liar claims a newer one. The stage comes back from the keeper's.
        keeper = min(stage1, key=peer_id_of)
        wait_for(lambda: any(e["t"] > joiner.events("status")[0]["t"] for e in keeper.events("backup")), 60,
                 "a backup taken by the keeper after the joiner arrived")
        refresh_from = time.time()
        wait_for(lambda: any(e["t"] > refresh_from for e in keeper.events("backup")), 60, "one more backup refresh")
        killed_at = time.time()
        os.killpg(first.pid, signal.SIGKILL)
        backup = [e for e in keeper.events("backup") if e["t"] < killed_at][-1]
        assert backup["holder"] == peer_id_of(first)
        wait_for(lambda: any(p.events("rescue") for p in stage1), 90, "stage 0 to be rescued")
        rescuer = next(p for p in stage1 if p.events("rescue"))
        rescue = rescuer.events("rescue")[0]
        assert rescue["stage"] == 0 and rescue["digest"] == backup["digest"], (rescue, backup)
        initial = Stage(spec, 0, device=torch.device("cpu")).params_digest()
        assert rescue["digest"] != initial  # neither re-initialised nor the liar's fresh state

        wait_for(lambda: len([e for p in stage1 for e in p.events("microbatch")
                              if e["t"] > rescue["t"] and e["stage"] == 1]) >= 40, 120,
                 "40 microbatches through the rescued pipeline")
        assert not claims.done(), "the liar stopped heartbeating"
    finally:
        liar.shutdown()

    # nothing any honest peer did was caused by the liar: no reload, no move, no pull from it
    for peer in [*honest, joiner]:
        downloads = events_after(peer, "state_download", started_at)
        assert all(liar.peer_id not in e["bytes_by_donor"] for e in downloads), downloads
        if peer is not joiner and peer is not rescuer:
            assert not downloads and not events_after(peer, "moving", started_at), peer.name
            assert not events_after(peer, "rescuing", started_at), peer.name
    assert not any(e.get("holder") == liar.peer_id for p in stage1 for e in p.events("backup"))
    losses = [e["loss"] for p in stage1 for e in sorted(p.events("microbatch"), key=lambda e: e["t"])
              if e["stage"] == 1 and e.get("loss") is not None]
    assert len(losses) > 80
    assert statistics.mean(losses[-30:]) < statistics.mean(losses[:30]) - 0.3, "the loss should fall"
    assert all(p.is_alive() for p in stage1)
