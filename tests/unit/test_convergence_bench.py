"""bench/convergence.py's pure parts on synthetic event lists, and a tiny single-mode run."""

from __future__ import annotations

import math

import pytest

from bench.convergence import (
    CODEC_MODES, DEFAULT_MODES, MODES, Curve, boundary_ratio, cumulative_samples_at, curve_from_events, interpolate,
    is_run_done, markdown_table, merge_points, relative_gap, result_rows, throughput, train_single, window_mean,
)

T0 = 1_000.0  # the peers' unix times start here


def microbatch(t: float, stage: int, *, loss: float | None = None, samples: int = 16) -> dict:
    return {"event": "microbatch", "t": T0 + t, "stage": stage, "samples": samples, "loss": loss,
            "tokens": samples * 64}


def evaluation(t: float, val_loss: float, *, samples: int = 0) -> dict:
    return {"event": "eval", "t": T0 + t, "stage": 0, "samples": samples, "val_loss": val_loss, "num_sequences": 16}


def test_swarm_samples_at_a_time_sum_every_peers_events_up_to_and_including_it():
    times = [3.0, 1.0, 2.0, 2.0]  # two peers' events, unsorted, one tie
    samples = [16, 16, 8, 4]
    assert cumulative_samples_at(times, samples, [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 9.0]) == [0, 16, 16, 28, 28, 44, 44]
    assert cumulative_samples_at([], [], [5.0]) == [0]


def test_interpolate_is_linear_between_points_exact_on_them_and_none_outside():
    xs, ys = [0.0, 1000.0, 3000.0], [5.0, 3.0, 2.0]
    assert interpolate(xs, ys, 0.0) == 5.0
    assert interpolate(xs, ys, 1000.0) == 3.0
    assert interpolate(xs, ys, 500.0) == pytest.approx(4.0)
    assert interpolate(xs, ys, 2500.0) == pytest.approx(2.25)
    assert interpolate(xs, ys, 3000.0) == 2.0
    assert interpolate(xs, ys, 3000.5) is None
    assert interpolate(xs, ys, -1.0) is None
    assert interpolate([], [], 0.0) is None


def test_equal_positions_merge_into_their_mean_and_points_come_out_sorted():
    assert merge_points([2048, 0, 2048, 1024], [2.0, 5.0, 3.0, 4.0]) == ([0, 1024, 2048], [5.0, 4.0, 2.5])


def test_window_mean_takes_the_samples_after_end_minus_width_up_to_end():
    positions = [16 * k for k in range(1, 201)]  # 16 .. 3200
    values = [float(p) for p in positions]
    inside = [float(p) for p in positions if 1000 < p <= 3000]
    assert window_mean(positions, values, end=3000, width=2000) == pytest.approx(sum(inside) / len(inside))
    assert window_mean(positions, values, end=32, width=16) == 32.0  # only the microbatch ending at 32
    assert window_mean(positions, values, end=3201, width=2000) is None  # the run never got there
    assert window_mean([], [], end=10) is None


def test_the_gap_is_relative_to_single_and_missing_when_either_is():
    assert relative_gap(2.2, 2.0) == pytest.approx(0.1)
    assert relative_gap(1.8, 2.0) == pytest.approx(-0.1)
    assert relative_gap(None, 2.0) is None
    assert relative_gap(2.0, None) is None


def test_throughput_counts_what_was_done_after_the_first_event():
    assert throughput([T0, T0 + 1, T0 + 2], [1024, 1024, 1024]) == pytest.approx(1024.0)
    assert throughput([T0 + 2, T0, T0 + 1], [1024, 512, 1024]) == pytest.approx(1024.0)  # the earliest is dropped
    assert throughput([T0], [1024]) is None
    assert throughput([T0, T0], [1, 1]) is None


def pipeline_events() -> tuple[list[dict], list[dict]]:
    """A 16-sample microbatch every 0.5 s, reported by the last stage (1) with a loss falling 0.01 each
    time and 0.1 s later by stage 0; two evaluations, at 10.55 s and 20.55 s."""
    microbatches, loss = [], 4.0
    for k in range(40):
        t = k * 0.5
        microbatches.append(microbatch(t + 0.1, 0))
        microbatches.append(microbatch(t, 1, loss=loss))  # the last stage finishes first
        loss -= 0.01
    evals = [evaluation(10.55, 3.0, samples=336), evaluation(20.55, 2.0, samples=640)]
    return microbatches, evals


def test_a_curve_places_each_evaluation_at_the_swarm_samples_of_its_event_time():
    microbatches, evals = pipeline_events()
    curve = curve_from_events("pipeline", microbatches, evals, last_stage=1, wall_s=30.0)
    assert curve.eval_samples == [21 * 16, 40 * 16]  # stage-0 events at 0.1, 0.6, ..., 10.1; 10.6 is later
    assert curve.val_losses == [3.0, 2.0]
    assert curve.loss_samples == [16 * (k + 1) for k in range(40)]
    assert curve.losses[0] == 4.0 and curve.losses[-1] == pytest.approx(3.61)
    assert curve.tokens_per_s == pytest.approx(39 * 16 * 64 / 19.5)
    assert curve.wall_s == 30.0


def test_stage_zero_losses_are_not_training_losses_of_a_two_stage_run():
    microbatches = [microbatch(0, 0, loss=9.0), microbatch(1, 1, loss=1.0), microbatch(2, 0, loss=9.0)]
    curve = curve_from_events("pipeline", microbatches, [], last_stage=1, wall_s=1.0)
    assert curve.losses == [1.0] and curve.loss_samples == [16]
    assert curve.eval_samples == [] and curve.val_losses == []


def test_a_run_is_done_once_it_counted_the_target_and_evaluated_past_it():
    microbatches, evals = pipeline_events()  # 640 samples; evaluations at 336 and 640
    assert is_run_done(microbatches, evals, 640)
    assert not is_run_done(microbatches, evals, 641)  # not enough samples
    assert not is_run_done(microbatches, evals[:1], 600)  # enough samples, no evaluation past them
    assert is_run_done(microbatches, evals[:1], 336)


def curve(mode: str, val_losses: list[float], *, tokens_per_s: float | None = 100.0) -> Curve:
    positions = [16 * k for k in range(1, 1001)]
    return Curve(mode=mode, eval_samples=[0, 8000, 16000], val_losses=val_losses, loss_samples=positions,
                 losses=[1.0] * len(positions), tokens_per_s=tokens_per_s, wall_s=10.0)


def test_rows_report_every_mode_and_mark_with_the_gap_against_single():
    rows = result_rows([curve("single", [5.0, 3.0, 2.0]), curve("swarm", [5.0, 3.3, 2.4], tokens_per_s=None)],
                       [4000, 16000, 20000])
    by_key = {(r["mode"], r["samples"]): r for r in rows}
    assert len(rows) == 6 and {r["bench"] for r in rows} == {"convergence"}
    assert by_key["single", 4000]["val_loss"] == 4.0 and by_key["single", 4000]["loss_gap_vs_single"] == 0.0
    assert by_key["swarm", 4000]["val_loss"] == pytest.approx(4.15)
    assert by_key["swarm", 4000]["loss_gap_vs_single"] == pytest.approx(0.0375)
    assert by_key["swarm", 16000]["loss_gap_vs_single"] == pytest.approx(0.2)
    assert by_key["swarm", 16000]["loss"] == 1.0
    assert by_key["swarm", 20000]["val_loss"] is None and by_key["swarm", 20000]["loss"] is None
    assert by_key["swarm", 4000]["tokens_per_s"] is None


def test_without_single_there_is_no_gap():
    rows = result_rows([curve("replicas", [5.0, 3.0, 2.0])], [8000])
    assert rows[0]["val_loss"] == 3.0 and rows[0]["loss_gap_vs_single"] is None


def test_codec_modes_report_their_compression_and_the_gap_against_the_uncompressed_swarm():
    curves = [curve("swarm", [5.0, 3.0, 2.0]), curve("swarm_int8", [5.0, 3.3, 2.4]), curve("replicas", [5.0, 3.0, 2.0])]
    ratios = {"swarm": boundary_ratio("swarm"), "swarm_int8": boundary_ratio("swarm_int8"), "replicas": boundary_ratio("replicas")}
    rows = {r["mode"]: r for r in result_rows(curves, [8000], ratios=ratios)}
    assert rows["swarm_int8"]["compression_ratio"] == 3.76  # 4 x 64 / 68
    assert rows["swarm"]["compression_ratio"] == 1.0 and rows["replicas"]["compression_ratio"] is None  # no boundary
    assert rows["swarm_int8"]["loss_gap_vs_uncompressed"] == pytest.approx(0.1)
    assert "loss_gap_vs_uncompressed" not in rows["swarm"] and "loss_gap_vs_uncompressed" not in rows["replicas"]
    assert result_rows(curves[1:2], [8000])[0]["loss_gap_vs_uncompressed"] is None  # no swarm run to compare with
    assert markdown_table(list(rows.values())).splitlines()[-1] == "| bytes ÷ fp32 | 1/1.00 | 1/3.76 | — |"
    assert {"swarm_bf16", "swarm_fp16", "swarm_int8"} <= set(MODES) and not set(CODEC_MODES) & set(DEFAULT_MODES)
    # ids included, both ways: (2 x 512 KiB + 8 KiB of targets) / (2 x 136 KiB + 8 KiB), and a subspace run's
    # 8 int8 values (+ 1/2 scale) per token each way beside its 16 x 65 int32 window
    assert rows["swarm_int8"]["compression_ratio_with_ids"] == pytest.approx((2 * 524288 + 8192) / (2 * 139264 + 8192), abs=0.01)
    assert boundary_ratio("swarm_subspace8_int8") == pytest.approx((512 / 8.5, (2 * 524288 + 8192) / (2 * 8704 + 4160)))
    assert boundary_ratio("swarm_subspace8_int8")[1] >= 32  # issue 16's floor, counting everything but headers


def test_the_table_has_a_row_per_mark_a_column_per_mode_and_the_gap_in_each_cell():
    rows = result_rows([curve("single", [5.0, 3.0, 2.0]), curve("pipeline", [5.0, 3.3, 2.4])], [8000, 20000])
    lines = markdown_table(rows).splitlines()
    assert lines[0] == "| samples | single | pipeline |"
    assert lines[2] == "| 8,000 | 3.000 | 3.300 (+10.0%) |"
    assert lines[3] == "| 20,000 | — | — |"
    assert lines[4] == "| tokens/s | 100 | 100 |"


def test_a_short_single_run_evaluates_at_zero_and_every_period_and_learns():
    result = train_single(max_samples=192, eval_every=128, eval_sequences=32)
    assert result.eval_samples == [0, 128, 192]  # steps of 64: 128 is a multiple, 192 is the end
    assert result.loss_samples == [16 * k for k in range(1, 13)]
    assert all(math.isfinite(v) for v in result.val_losses + result.losses)
    assert result.val_losses[0] == pytest.approx(math.log(256), abs=0.3)  # untrained: near chance
    assert result.val_losses[-1] < result.val_losses[0]
    assert result.tokens_per_s is not None and result.tokens_per_s > 0
