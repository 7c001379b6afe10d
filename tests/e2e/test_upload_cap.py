"""--max-upload-mbps: a joiner's state download from capped donors takes at least bytes / cap."""

from __future__ import annotations

import pytest

from peer.harness.local_swarm import wait_for

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(420)]
CAP_MBPS = 8.0  # 1 MB/s; a stage's state is about 5 MB


def test_a_capped_donor_serves_no_faster_than_its_cap(local_swarm):
    local_swarm.start_bootstrap()
    donors = [local_swarm.start_peer("--num-threads", "1", "--max-upload-mbps", str(CAP_MBPS)) for _ in range(2)]
    # 240 s: on CI (2026-11-29) 150 s passed before both trained, cause not logged; a local run showed
    # capped peers answering pings behind their state uploads, declared down (fixed: UploadLimit.charge)
    wait_for(lambda: all(p.events("status") for p in donors), 240, "two capped peers to train")
    joiner = local_swarm.start_peer("--num-threads", "1")
    wait_for(lambda: joiner.events("state_download") or not joiner.is_alive(), 150, "the joiner's download")
    assert joiner.is_alive(), joiner.log_tail()
    download = joiner.events("state_download")[0]
    num_bytes = sum(download["bytes_by_donor"].values())
    assert list(download["bytes_by_donor"]) == [download["donor"]]  # its stage had one holder
    burst = max(CAP_MBPS * 1e6 / 8 * 0.25, 256 * 1024)
    assert num_bytes > 4e6
    assert download["seconds"] >= (num_bytes - burst) / (CAP_MBPS * 1e6 / 8) * 0.95, download
    wait_for(lambda: joiner.events("status"), 60, "the joiner to train")
