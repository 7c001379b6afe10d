"""Bounded transfers over real hivemind P2P: a donor claiming a 200 GiB state makes a joiner allocate nothing.

Two donors serve stage 0 of ``joiner_process.SPEC`` from this process: an honest one, and a liar whose
manifest (36 KB, well-formed) claims 200 GiB at a newer version, so that it would win where one
agreeing donor is enough (a stage pulled from its backups' keepers). Each join runs in a process of its
own (``tests/integration/joiner_process.py``, the joiner's ``pull_stage_state``) so that its memory
peaks are its own: an honest join, a join offered both donors, and a join offered the liar alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from dht.node import visible_maddrs
from replication.layout import StateLayout
from replication.server import ReplicationServer
from replication.transfer import REFUSED_MANIFEST_STRIKES
from swarm.stage import Stage
from swarm.stage_state import served_state_template
from tests.conftest import open_dht_nodes
from tests.forged_manifest import HUGE_BYTES, forged_wire, grown
from tests.integration.joiner_process import SPEC, STAGE

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
HONEST_VERSION, FORGED_VERSION = 5, 99
JOIN_TIMEOUT = 120.0  # backs up a joiner process that hangs; never reached when the code is right
RSS_MARGIN = 0.10  # a join offered the liar may peak at most 10 % above an honest one, resident
# ...and at most this much above it in virtual size, which moves with the threads and malloc arenas a
# process happened to start (so a margin in bytes, not a ratio); a buffer sized from the forged
# manifest, even untouched, would add 200 GiB there
VIRTUAL_MARGIN_BYTES = 2**30


class ForgedManifestServer(ReplicationServer):
    """Answers every manifest request with a well-formed manifest of a 200 GiB state it does not have."""

    async def _process_manifest(self, header: dict, **kwargs) -> tuple[dict, list]:
        layout = StateLayout.from_tensors(served_state_template(SPEC, STAGE))
        wire = forged_wire(grown(layout, HUGE_BYTES), run_id=self.run_id, stage=self.stage,
                           min_piece_bytes=header["shard_bytes"], version=FORGED_VERSION)
        return {"ok": True, "manifest": wire}, []


async def run_joiner(bootstrap: list[str], donors: list[str]) -> dict:
    """One join in a process of its own; its JSON line (the process is killed if it outlives JOIN_TIMEOUT)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.integration.joiner_process", "--bootstrap", *bootstrap, "--donors", *donors,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), JOIN_TIMEOUT)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    lines = stdout.decode().strip().splitlines()
    assert process.returncode == 0 and lines, f"the joiner failed:\n{stderr.decode()[-4000:]}"
    return json.loads(lines[-1])


def test_a_donor_claiming_200_gib_is_refused_and_the_joiner_peaks_as_an_honest_join_does():
    with open_dht_nodes(2) as nodes:
        (honest_dht, _), (liar_dht, _) = nodes
        bootstrap = visible_maddrs(honest_dht)[:1] + visible_maddrs(liar_dht)[:1]
        honest_id, liar_id = honest_dht.peer_id.to_base58(), liar_dht.peer_id.to_base58()
        stage = Stage(SPEC, STAGE, device=torch.device("cpu"))
        stage.keep_snapshot(HONEST_VERSION)
        digest = stage.params_digest()

        async def snapshot():
            return stage.snapshot

        async def main() -> tuple[dict, dict, dict]:
            honest = ReplicationServer(await honest_dht.replicate_p2p(), run_id=SPEC.namespace, stage=STAGE,
                                       snapshot_fn=snapshot)
            liar = ForgedManifestServer(await liar_dht.replicate_p2p(), run_id=SPEC.namespace, stage=STAGE,
                                        snapshot_fn=snapshot)
            async with honest, liar:
                return (await run_joiner(bootstrap, [honest_id]), await run_joiner(bootstrap, [honest_id, liar_id]),
                        await run_joiner(bootstrap, [liar_id]))

        try:
            baseline, offered_both, offered_liar = asyncio.run(main())
        finally:
            stage.shutdown()

    # the honest join: the honest state, nobody dropped
    assert baseline["ok"] and baseline["failed_donors"] == {}, baseline
    assert (baseline["version"], baseline["digest"]) == (HONEST_VERSION, digest)
    # offered both: the liar's newer "version" is refused unread, the honest state is pulled
    assert offered_both["ok"] and (offered_both["version"], offered_both["digest"]) == (HONEST_VERSION, digest)
    assert list(offered_both["failed_donors"]) == [liar_id], offered_both
    for outcome in (offered_both, offered_liar):
        reason = outcome["failed_donors"][liar_id]
        assert reason.startswith("manifest refused: the manifest claims") and str(HUGE_BYTES) in reason, reason
        assert outcome["strikes"][liar_id] == REFUSED_MANIFEST_STRIKES, outcome
    assert offered_both["strikes"][honest_id] == 0
    # offered the liar alone: no state, said in one sentence
    assert not offered_liar["ok"] and offered_liar["error"] == "no donor sent a usable manifest", offered_liar
    # and no join allocated more than an honest one: resident (VmHWM) or merely reserved (VmPeak), KiB
    for outcome in (offered_both, offered_liar):
        assert outcome["VmHWM"] <= (1 + RSS_MARGIN) * baseline["VmHWM"], (baseline, outcome)
        assert outcome["VmPeak"] <= baseline["VmPeak"] + VIRTUAL_MARGIN_BYTES // 1024, (baseline, outcome)
