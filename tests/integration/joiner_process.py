"""A joiner in a process of its own, for tests that compare the memory of two joins.

It joins the DHT through ``--bootstrap``, builds stage 0 of :data:`SPEC` and pulls its state from
``--donors`` with the joiner's own function (``peer.join.pull_stage_state``, one agreeing donor
enough, as from backups' keepers), then prints one JSON line: what happened, the strikes each donor
got and the process's memory peaks from /proc/self/status (``VmHWM``: resident; ``VmPeak``: virtual,
which also shows an allocation never touched). Run as ``python -m tests.integration.joiner_process``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from dht.node import DHTNodeConfig, open_dht
from dht.records import ModelSpec, RunSpec
from dht.reputation import Reputation
from peer.config import PeerConfig
from peer.join import pull_stage_state
from replication.transfer import TransferError
from swarm.stage import Stage

SPEC = RunSpec(run_id="bounded", model=ModelSpec(d_model=128, num_layers=4, num_heads=4, seq_len=64),
               stage_layers=((0, 2), (2, 4)))
STAGE = 0


def memory_peaks_kib() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) for name in ("VmHWM", "VmPeak")}


async def join(bootstrap: tuple[str, ...], donors: list[str]) -> dict:
    dht, _ = await asyncio.to_thread(open_dht, DHTNodeConfig(initial_peers=bootstrap))
    stage = Stage(SPEC, STAGE, device=torch.device("cpu"))
    reputation = Reputation()
    try:
        p2p = await dht.replicate_p2p()
        config = PeerConfig(bootstrap=bootstrap, request_timeout=10.0)
        holders = [SimpleNamespace(peer_id=peer_id) for peer_id in donors]
        try:
            result = await pull_stage_state(p2p, stage, holders, config=config, min_agreeing_donors=1,
                                            reputation=reputation)
            outcome = {"ok": True, "version": result.version, "failed_donors": result.report.failed_donors,
                       "digest": await stage.run(stage.params_digest)}
        except TransferError as e:
            outcome = {"ok": False, "error": str(e), "failed_donors": e.report.failed_donors}
        outcome["strikes"] = {peer_id: reputation.num_strikes_of(peer_id) for peer_id in donors}
        return outcome | memory_peaks_kib()
    finally:
        stage.shutdown()
        dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", nargs="+", required=True)
    parser.add_argument("--donors", nargs="+", required=True)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(join(tuple(args.bootstrap), args.donors))), flush=True)


if __name__ == "__main__":
    main()
