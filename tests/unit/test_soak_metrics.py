"""bench/soak.py's pure parts: the spared peers, RSS growth, and a line from a hand-made run."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from bench import soak
from bench.churn_metrics import choose_victim
from bench.soak_metrics import choose_protected, max_growth, peer_growth, rss_growth

T0 = 1_000.0  # window start (unix s)


def test_the_protected_peers_hold_one_peer_of_every_stage_first():
    training = [("peer0", 1), ("peer1", 1), ("peer2", 0), ("peer3", 0), ("peer4", 1)]
    assert choose_protected(training, 3) == ["peer2", "peer0", "peer1"]
    assert choose_protected(training, 1) == ["peer2"]
    assert choose_protected(training, 0) == []
    assert choose_protected(training, 9) == ["peer2", "peer0", "peer1", "peer3", "peer4"]
    three = [("a", 2), ("b", 0), ("c", 1), ("d", 0)]
    assert choose_protected(three, 3) == ["b", "c", "a"]
    with pytest.raises(ValueError):
        choose_protected(training, -1)


def test_no_draw_hits_a_protected_peer_and_every_other_peer_stays_eligible():
    training = [("peer0", 0), ("peer1", 0), ("peer2", 1), ("peer3", 1), ("peer4", 0), ("peer5", 1)]
    protected = choose_protected(training, 3)
    hit = {choose_victim(k / 100, training, exclude=protected) for k in range(100)}
    assert hit == {"peer3", "peer4", "peer5"} and not hit & set(protected)
    # the last unprotected peer of a stage is still eligible: a protected peer keeps the stage alive
    assert choose_victim(0.0, [("peer0", 0), ("peer1", 0), ("peer2", 1)], exclude=["peer0"]) == "peer1"
    assert choose_victim(0.5, [("peer0", 0), ("peer2", 1)], exclude=["peer0"]) is None


def test_a_flat_series_does_not_grow_and_a_steady_climb_does():
    flat = [(T0 + t, 500_000) for t in range(0, 601, 10)]
    assert rss_growth(flat, start=T0, end=T0 + 600) == 0.0
    climb = [(T0 + t, 500_000 + 100 * t) for t in range(0, 601, 10)]  # +60 MB over 600 s
    first, last = 500_000 + 100 * 30, 500_000 + 100 * 570  # medians of t in [0, 60] and [540, 600]
    assert rss_growth(climb, start=T0, end=T0 + 600) == pytest.approx(last / first - 1)


def test_the_warm_up_before_the_window_and_a_transient_spike_do_not_count():
    warm_up = [(T0 - 60 + t, 200_000 + 5_000 * t) for t in range(0, 60, 10)]  # the one-off climb of a fresh peer
    window = [(T0 + t, 500_000) for t in range(0, 601, 10)]
    spiky = [(t, v * 2 if t == T0 + 590 else v) for t, v in window]  # a state download served near the end
    assert rss_growth(warm_up + spiky, start=T0, end=T0 + 600) == 0.0
    assert rss_growth(warm_up + window, start=T0 - 60, end=T0 + 600) > 0.4  # what counting the warm-up would say


def test_growth_is_none_without_samples_at_either_end():
    assert rss_growth([(T0 + 300, 1)], start=T0, end=T0 + 600) is None
    assert rss_growth([], start=T0, end=T0 + 600) is None
    assert rss_growth([(T0, 0), (T0 + 600, 5)], start=T0, end=T0 + 600) is None
    with pytest.raises(ValueError):
        rss_growth([], start=T0, end=T0 + 600, fraction=0.0)
    with pytest.raises(ValueError):
        rss_growth([], start=T0, end=T0)


def test_a_peers_growth_is_split_by_process():
    samples = [(T0 + t, {"peer": 400_000 + 100 * t, "children": 100_000, "p2pd": 64_000}) for t in range(0, 601, 10)]
    growth = peer_growth(samples, start=T0, end=T0 + 600)
    assert growth["by_process"]["children"] == 0.0 and growth["by_process"]["p2pd"] == 0.0
    assert growth["by_process"]["peer"] == pytest.approx((400_000 + 57_000) / (400_000 + 3_000) - 1, abs=1e-4)
    assert growth["growth"] == pytest.approx((564_000 + 57_000) / (564_000 + 3_000) - 1, abs=1e-4)
    assert growth["mib_first"] == pytest.approx(567_000 / 1024, abs=0.1) and growth["num_samples"] == 61
    assert max_growth({"a": growth, "b": {"growth": None}, "c": {"growth": 0.5}}) == 0.5
    assert max_growth({"b": {"growth": None}}) is None


def test_p2pd_socket_files_come_from_its_listen_argument():
    cmdline = ["/x/p2pd", "-b=1", "-listen=/unix/tmp/hivemind-p2pd-AbC_12.sock", "-tls=1"]
    assert soak.p2pd_socket_files(cmdline) == {"/tmp/hivemind-p2pd-AbC_12.sock", "/tmp/hivemind-p2pclient-AbC_12.sock"}
    assert soak.p2pd_socket_files(["/x/p2pd", "-listen=/ip4/127.0.0.1/tcp/5000"]) == set()


def test_a_soak_line_from_a_hand_made_run(tmp_path):
    """summarize(): 3 initial peers and two rejoiners; the bench crashes peer2, peer3 dies unasked, peer4
    leaves but does not exit cleanly."""
    def peer(name, peer_id, stage, *, gone_at=None, crashed=False, left=False):
        events = [{"t": T0 - 30, "event": "joined", "peer_id": peer_id, "stage": stage},
                  {"t": T0 - 29, "event": "status", "stage": stage}]
        if stage == 0:
            events += [{"t": T0 + k, "event": e, "stage": 0, "mb_id": f"{peer_id}:{k}", "samples": 16}
                       for k in range(10) for e in ("injected", "microbatch")]
            events.append({"t": T0 + 11, "event": "injected", "stage": 0, "mb_id": f"{peer_id}:lost", "samples": 16})
        return SimpleNamespace(name=name, events=events, gone_at=gone_at, crashed=crashed, drained=stage == 0, left=left)

    left_behind = tmp_path / "hivemind-p2pd-a.sock"
    left_behind.write_text("")
    samples = {"peer0": [(T0 + t, {"peer": 100_000 + (t // 500) * 10_000}) for t in range(0, 601, 10)],
               "peer1": [(T0 + t, {"peer": 100_000}) for t in range(0, 601, 10)]}
    run = {"window": (T0, T0 + 600), "protected": ["peer0", "peer1"],
           "applied": [{"at": 30.0, "t": T0 + 30, "kind": "crash", "peer": "peer2", "stage": 1},
                       {"at": 60.0, "t": T0 + 60, "kind": "rejoin", "peer": "peer3"},
                       {"at": 90.0, "t": T0 + 90, "kind": "leave", "skipped": "no stage has two training peers"},
                       {"at": 120.0, "t": T0 + 120, "kind": "leave", "peer": "peer4", "stage": 1}],
           "peers": [peer("peer0", "a", 0), peer("peer1", "b", 1), peer("peer2", "c", 1, gone_at=T0 + 30, crashed=True),
                     peer("peer3", "d", 1, gone_at=T0 + 70, crashed=True),
                     peer("peer4", "e", 1, gone_at=T0 + 120, left=True)],
           "stop": {"hung_at_stop": [], "unclean_stops": []}, "bootstrap_exited": False,
           "leftovers": {"processes": [{"pid": 7, "comm": "p2pd"}], "listening": {"7": [4242]}, "num_sockets": 1},
           "samples": samples,
           "socket_files": {"peer0": [str(left_behind), str(tmp_path / "gone.sock")], "peer2": [str(left_behind)]}}
    args = argparse.Namespace(peers=3, stages=2, event_period=30.0, seed=0, warmup=60.0, rss_period=10.0)
    line = soak.summarize(run, args)
    assert line["bench"] == "soak" and line["minutes"] == 10.0 and line["peers"] == 3
    assert line["events"] == {"crash": 1, "rejoin": 1, "leave": 1} and line["num_skipped"] == 1
    assert line["survivor_crashes"] == 1 and line["crashed_unasked"] == ["peer3"] and line["unclean_leaves"] == ["peer4"]  # it did not exit 0
    assert line["samples_lost"] == 16  # peer0 drained cleanly and never finished "a:lost"
    assert line["survivors"] == ["peer0", "peer1"]  # peer2 was crashed; peer3 is no initial peer
    assert line["rss_growth"] == pytest.approx(0.1) and line["rss_growth_per_peer"]["peer1"]["growth"] == 0.0
    assert line["leaked_processes"] == 1 and line["leaked_sockets"] == 1
    assert line["stale_socket_files"] == 1 and line["stale_socket_files_of_killed"] == 1
