"""bench/churn.py's pure parts: the seeded trace and the metrics, on synthetic event lists."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from bench import churn
from bench.churn_metrics import (
    PeerLife, capacity_segments, choose_victim, completions, count_double, count_losses, detect_delays, integrate,
    false_suspicions, make_trace, per_peer_rates, pre_crash_ratios, recover_delays, spread, stage_counts,
)

T0 = 1_000.0  # the peers' unix times start here


def trace(seed: int, **overrides):
    kwargs = {"duration": 3600.0, "period": 30.0, "num_peers": 6, "min_peers": 4, "max_peers": 7, **overrides}
    return make_trace(seed, **kwargs)


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    assert trace(7) == trace(7)
    assert trace(7) != trace(8)
    assert [e.at for e in trace(7)] == [30.0 * k for k in range(1, 120)]  # every period, none at the end


def test_the_trace_keeps_the_planned_swarm_within_its_bounds_and_uses_every_kind():
    for seed in range(20):
        count, kinds = 6, set()
        for event in trace(seed):
            count += 1 if event.kind == "rejoin" else -1
            kinds.add(event.kind)
            assert 4 <= count <= 7, (seed, event)
            assert 0 <= event.pick < 1
        assert kinds == {"crash", "leave", "rejoin"}


def test_at_the_lower_bound_only_a_rejoin_is_drawn():
    events = trace(3, num_peers=4, min_peers=4, max_peers=5)
    assert events[0].kind == "rejoin"
    count = 4
    for event in events:
        if count == 4:
            assert event.kind == "rejoin"
        if count == 5:
            assert event.kind != "rejoin"
        count += 1 if event.kind == "rejoin" else -1


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        trace(0, num_peers=3, min_peers=4)
    with pytest.raises(ValueError):
        trace(0, period=0.0)


def test_a_victim_never_leaves_its_stage_without_a_training_peer():
    training = [("peer0", 0), ("peer1", 1), ("peer2", 1), ("peer3", 1)]
    picks = {choose_victim(k / 100, training) for k in range(100)}
    assert picks == {"peer1", "peer2", "peer3"}
    assert choose_victim(0.0, training) == "peer1" and choose_victim(0.999, training) == "peer3"
    assert choose_victim(0.5, [("peer0", 0), ("peer1", 1)]) is None
    mixed = [("peer0", 1), ("peer1", 0), ("peer2", 1), ("peer3", 0)]  # by stage, then start order
    assert [choose_victim(k / 4, mixed) for k in range(4)] == ["peer1", "peer3", "peer0", "peer2"]


# ---- synthetic peers -------------------------------------------------------------------------

def peer_events(peer_id: str, stage: int, *, trained_at: float, until: float, mb_every: float | None = None,
                samples: int = 16) -> list[dict]:
    events = [{"t": trained_at - 5.0, "event": "joined", "peer_id": peer_id, "stage": stage},
              {"t": trained_at + 1.0, "event": "status", "stage": stage}]  # the status loop sleeps 1 s first
    if mb_every:
        t, k = trained_at + mb_every, 0
        while t < until:
            events.append({"t": t, "event": "microbatch", "stage": stage, "mb_id": f"{peer_id}:{k}", "samples": samples})
            t, k = t + mb_every, k + 1
    return events


def life(name: str, events: list[dict], **kwargs) -> PeerLife:
    result = PeerLife(name, events, **kwargs)
    result.mark_training(1.0)
    return result


def test_capacity_follows_the_training_peers_of_the_bottleneck_stage():
    lives = [life(f"s0_{i}", peer_events(f"a{i}", 0, trained_at=T0, until=T0 + 100)) for i in range(3)]
    lives += [life("s1_0", peer_events("b0", 1, trained_at=T0, until=T0 + 100), gone_at=T0 + 50, crashed=True),
              life("s1_1", peer_events("b1", 1, trained_at=T0, until=T0 + 100)),
              life("s1_2", peer_events("b2", 1, trained_at=T0, until=T0 + 100)),
              life("late", peer_events("b3", 1, trained_at=T0 + 70, until=T0 + 100)),
              life("never", [{"t": T0 + 80, "event": "joined", "peer_id": "b4", "stage": 1}])]
    counts = stage_counts(lives, T0, T0 + 100, 2)
    assert [(a - T0, b - T0, c) for a, b, c in counts] == [(0, 50, [3, 3]), (50, 70, [3, 2]), (70, 100, [3, 3])]
    capacity = capacity_segments(counts, [10.0, 10.0])
    assert integrate(capacity, T0, T0 + 100) == pytest.approx(30 * 50 + 20 * 20 + 30 * 30)
    assert integrate(capacity, T0 + 40, T0 + 60) == pytest.approx(30 * 10 + 20 * 10)
    assert per_peer_rates(60.0, [(T0, T0 + 10, [3, 2]), (T0 + 10, T0 + 20, [3, 4])]) == pytest.approx([20.0, 20.0])


def test_losses_are_split_by_how_the_injecting_peer_ended():
    def stage0(peer_id: str, **kwargs) -> PeerLife:
        events = [{"t": T0, "event": "joined", "peer_id": peer_id, "stage": 0}]
        events += [{"t": T0 + k, "event": "injected", "mb_id": f"{peer_id}:{k}", "samples": 16} for k in range(5)]
        events += [{"t": T0 + k + 1, "event": "microbatch", "stage": 0, "mb_id": f"{peer_id}:{k}", "samples": 16}
                   for k in range(3)]  # two of five never finished
        events += [{"t": T0 + 9, "event": "replayed", "mb_id": f"{peer_id}:3", "attempt": 1, "reason": "x"}]
        return PeerLife(peer_id, events, **kwargs)

    held = stage0("e", gone_at=T0 + 6, drained=True)
    held.events.append({"t": T0 + 10, "event": "unfinished", "stage": 0, "mb_ids": ["e:4"], "samples": 16})
    losses = count_losses([stage0("a", drained=True), stage0("b", gone_at=T0 + 5, crashed=True), stage0("c"),
                           stage0("d", gone_at=T0 + 6, drained=True), held])
    assert (losses.lost, losses.lost_at_crashed_peers, losses.unfinished, losses.pending_at_stop) == (80, 32, 16, 32)
    assert (losses.num_injected, losses.num_replayed) == (25, 5)
    assert count_losses([PeerLife("x", [{"t": T0, "event": "microbatch", "stage": 0, "mb_id": "x:0"}])]) is None


def test_double_counts_are_per_stage_over_all_replicas():
    def acc(stage: int, mb_id: str, samples: int = 16) -> dict:
        return {"t": T0, "event": "accumulated", "stage": stage, "mb_id": mb_id, "samples": samples}

    lives = [PeerLife("p0", [acc(0, "a:0"), acc(0, "a:1")]),
             PeerLife("p1", [acc(1, "a:0"), acc(1, "a:1"), acc(1, "a:1")]),  # a:1 twice at one replica
             PeerLife("p2", [acc(1, "a:0")], crashed=True, gone_at=T0 + 1),  # a:0 again at a crashed one
             PeerLife("p3", [acc(1, "a:2", 8), acc(1, "a:2", 8), acc(1, "a:2", 8)])]
    assert count_double(lives) == 16 + 16 + 16
    assert count_double(lives, include_crashed=False) == 16 + 16
    assert count_double([PeerLife("p", [{"t": T0, "event": "status", "stage": 0}])]) is None


def test_detection_is_the_first_report_by_another_peer_after_the_kill():
    survivor = PeerLife("s", [{"t": T0 - 9, "event": "joined", "peer_id": "s", "stage": 0},
                              {"t": T0 - 5, "event": "peer_down", "peer_id": "v", "how": "gossip"},  # an earlier life
                              {"t": T0 + 0.7, "event": "peer_down", "peer_id": "v", "how": "call"}])
    other = PeerLife("o", [{"t": T0 - 9, "event": "joined", "peer_id": "o", "stage": 1},
                           {"t": T0 + 0.4, "event": "peer_down", "peer_id": "v", "how": "detector"}])
    assert detect_delays([(T0, "v"), (T0, "w")], [survivor, other]) == [pytest.approx(0.4), None]
    leave = PeerLife("n", [{"t": T0 - 9, "event": "joined", "peer_id": "n", "stage": 1},
                           {"t": T0 + 0.1, "event": "notice", "kind": "leave", "peer_id": "w"}])
    assert detect_delays([(T0, "w")], [survivor, leave]) == [None]  # crashes: "peer_down" only
    assert detect_delays([(T0, "w")], [survivor, leave], kinds=("peer_down", "notice")) == [pytest.approx(0.1)]
    assert spread([0.4, None, 1.0, 0.2]) == {"median": 0.4, "max": 1.0, "num": 4, "num_missing": 1}


def test_recovery_is_the_first_full_window_after_the_crash():
    capacity = [(T0, T0 + 100, 10.0)]  # 10 samples/s online throughout
    steady = [(T0 + k * 0.1, 1) for k in range(1000)]  # 10 samples/s
    assert recover_delays([T0 + 20], steady, capacity, window=5, threshold=0.9, end=T0 + 100) == [0.0]
    dip = [(t, n) for t, n in steady if not T0 + 20 <= t < T0 + 23]  # nothing finishes for 3 s
    # [s, s + 5) reaches 90 % once at most 0.5 s of the gap is left in it: s = T0 + 22.5
    assert recover_delays([T0 + 20], dip, capacity, window=5, threshold=0.9, end=T0 + 100) == [pytest.approx(2.5)]
    assert recover_delays([T0 + 20], dip, capacity, window=5, threshold=1.0, end=T0 + 100) == [pytest.approx(3.0)]
    dead = [(t, n) for t, n in steady if t < T0 + 20]
    assert recover_delays([T0 + 20], dead, capacity, window=5, threshold=0.9, end=T0 + 100) == [None]


def test_recovery_against_the_ratio_before_the_crash_on_a_slower_machine():
    capacity = [(T0, T0 + 100, 10.0)]
    slow = [(T0 + k * 0.125, 1) for k in range(800)]  # 8 samples/s: 80 % of the capacity, before and after
    assert recover_delays([T0 + 40], slow, capacity, window=5, threshold=0.9, end=T0 + 100) == [None]
    ratios = pre_crash_ratios([T0 + 40, T0 + 5], slow, capacity, before=20, start=T0 + 2)
    assert ratios == [pytest.approx(0.8), pytest.approx(0.8, abs=0.05)]
    assert recover_delays([T0 + 40], slow, capacity, window=5, threshold=0.9, end=T0 + 100, scales=ratios[:1]) == [0.0]
    fast = [(T0 + k * 0.05, 1) for k in range(2000) if not T0 + 40 <= T0 + k * 0.05 < T0 + 42]  # 2x the capacity
    ratios = pre_crash_ratios([T0 + 40], fast, capacity, before=20, start=T0)
    assert ratios == [pytest.approx(2.0)]
    assert recover_delays([T0 + 40], fast, capacity, window=5, threshold=0.9, end=T0 + 100) == [0.0]
    assert recover_delays([T0 + 40], fast, capacity, window=5, threshold=0.9, end=T0 + 100,
                          scales=ratios) == [pytest.approx(1.5)]  # the 2 s stall, less 10 % of the window


def test_a_mode_line_from_synthetic_peers():
    """summarize() end to end: 2 + 2 peers, a stage-1 crash at +30 s costs the window half of stage 1."""
    def peer(name, peer_id, stage, *, mb_every=None, gone_at=None, crashed=False, extra=()):
        events = peer_events(peer_id, stage, trained_at=T0 - 20, until=T0 + 60, mb_every=mb_every) + list(extra)
        return SimpleNamespace(name=name, events=sorted(events, key=lambda e: e["t"]), gone_at=gone_at,
                               crashed=crashed, drained=stage == 0)

    down = [{"t": T0 + 30.5, "event": "peer_down", "peer_id": "b1", "how": "detector"}]
    run = {"window": (T0, T0 + 60), "applied": [{"at": 30.0, "t": T0 + 30, "kind": "crash", "peer": "peer3", "stage": 1}],
           "peers": [peer("peer0", "a0", 0, mb_every=0.4, extra=down), peer("peer1", "a1", 0, mb_every=0.4),
                     peer("peer2", "b0", 1), peer("peer3", "b1", 1, gone_at=T0 + 30, crashed=True)]}
    args = argparse.Namespace(recover_window=5.0, peers=4, event_period=30.0, seed=0)
    reference = {"goodput": 80.0, "rates": [40.0, 40.0]}
    line = churn.summarize("ours", run, args, reference=reference, recovery="replay")
    assert line["bench"] == "churn" and line["mode"] == "ours"
    assert line["goodput_samples_per_s"] == pytest.approx(80.0, rel=0.02)  # 2 peers x 16 samples / 0.4 s
    assert line["capacity_samples_per_s"] == pytest.approx((80 * 30 + 40 * 30) / 60)
    assert line["goodput_ratio"] == pytest.approx(80.0 / 60.0, rel=0.02)
    assert line["detect_seconds"]["max"] == pytest.approx(0.5)
    assert line["recover_seconds"]["median"] == 0.0 and line["recover_seconds_vs_pre_crash"]["median"] == 0.0
    assert [e["stage"] for e in line["trace"]] == [1] and line["capacity_source"] == "no_churn run"
    assert line["samples_lost"] is None and line["samples_double_counted"] is None  # no such events here
    assert line["events"] == {"crash": 1} and line["peers_per_stage_at_end"] == [2, 1]
    assert line["died_unasked"] == []


def test_the_reported_trace_names_a_rejoiners_negotiated_stage():
    lives = [life("peer6", peer_events("c", 1, trained_at=T0, until=T0 + 10)), PeerLife("peer7", [])]
    assert churn.trace_entry({"at": 30.0, "t": T0, "kind": "rejoin", "peer": "peer6"}, lives) == \
        {"at": 30.0, "kind": "rejoin", "peer": "peer6", "stage": 1}
    assert churn.trace_entry({"at": 60.0, "t": T0, "kind": "rejoin", "peer": "peer7"}, lives)["stage"] is None
    assert churn.trace_entry({"at": 90.0, "t": T0, "kind": "crash", "skipped": "no stage"}, lives) == \
        {"at": 90.0, "kind": "crash", "skipped": True}


def test_a_kept_run_is_reanalyzed_into_the_same_lines(tmp_path, capsys):
    import json

    for mode in ("no_churn", "ours"):
        folder = tmp_path / mode
        folder.mkdir()
        peers = []
        for i, (peer_id, stage) in enumerate((("a0", 0), ("b0", 1), ("b1", 1))):
            events = peer_events(peer_id, stage, trained_at=T0 - 20, until=T0 + 60, mb_every=0.5 if stage == 0 else None)
            (folder / f"peer{i}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"t": 1')  # torn tail
            crashed = mode == "ours" and i == 2
            peers.append(SimpleNamespace(name=f"peer{i}", proc=SimpleNamespace(metrics_path=folder / f"peer{i}.jsonl"),
                                         gone_at=T0 + 30 if crashed else None, crashed=crashed, drained=stage == 0))
        applied = [{"at": 30.0, "t": T0 + 30, "kind": "crash", "peer": "peer2", "stage": 1}] if mode == "ours" else []
        churn.save_run({"window": (T0, T0 + 60), "applied": applied, "peers": peers,
                        "settings": {"peers": 3, "event_period": 30.0, "seed": 0, "recovery": "replay"}},
                       folder / "run.json")
    assert churn.main(["--reanalyze", str(tmp_path)]) == 0
    no_churn, ours = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert no_churn["mode"] == "no_churn" and no_churn["goodput_ratio"] == pytest.approx(1.0)
    assert ours["capacity_source"] == "no_churn run" and ours["events"] == {"crash": 1}
    assert ours["capacity_samples_per_s"] == pytest.approx(32 * (30 + 15) / 60, rel=0.02)  # stage 1 halved at +30 s


def test_a_peer_reported_down_while_it_was_up_is_a_false_suspicion():
    def down(t, suspect, how):
        return {"t": t, "event": "peer_down", "peer_id": suspect, "how": how}

    observer = PeerLife("o", [{"t": T0, "event": "joined", "peer_id": "o", "stage": 0},
                              down(T0 + 5, "up", "detector"), down(T0 + 12, "killed", "detector"),
                              down(T0 + 8, "killed", "gossip"), down(T0 + 13, "left", "notice"),
                              down(T0 + 14, "left", "detector"), down(T0 + 15, "stranger", "call")])
    lives = [observer, PeerLife("u", [{"t": T0, "event": "joined", "peer_id": "up", "stage": 1}]),
             PeerLife("k", [{"t": T0, "event": "joined", "peer_id": "killed", "stage": 1}], gone_at=T0 + 10, crashed=True),
             PeerLife("l", [{"t": T0, "event": "joined", "peer_id": "left", "stage": 1}], gone_at=T0 + 13)]
    assert [(f["suspect"], f["how"]) for f in false_suspicions(lives)] == [("up", "detector"), ("killed", "gossip")]
