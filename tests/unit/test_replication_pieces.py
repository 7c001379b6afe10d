"""Pieces: the fixed hash granularity of a manifest, and the requests ("runs") built from them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replication.fetcher import Run, give_each_a_run, split_runs
from replication.manifest import MAX_PIECES, ManifestError, build_manifest, piece_size_for, restore_state
from replication.server import pack_bytes, unpack_bytes


@given(total=st.integers(0, 1 << 40), minimum=st.integers(1, 1 << 22))
@settings(max_examples=200, deadline=None)
def test_piece_size_is_the_minimum_doubled_until_the_manifest_is_small(total, minimum):
    piece = piece_size_for(total, minimum)
    assert piece >= minimum and (piece // minimum) & (piece // minimum - 1) == 0  # minimum x 2^k
    assert -(-total // piece) <= MAX_PIECES
    if piece > minimum:  # halving it would make too many pieces
        assert -(-total // (piece // 2)) > MAX_PIECES


def test_piece_size_rejects_nonsense():
    with pytest.raises(ManifestError):
        piece_size_for(-1, 4096)
    with pytest.raises(ManifestError):
        piece_size_for(10, 0)


@given(num_pieces=st.integers(1, 60), per_run=st.integers(1, 9), data=st.data())
@settings(max_examples=200, deadline=None)
def test_runs_cover_each_missing_piece_once_and_never_a_held_one(num_pieces, per_run, data):
    sizes = [1000] * (num_pieces - 1) + [data.draw(st.integers(1, 1000))]
    missing = sorted(data.draw(st.sets(st.integers(0, num_pieces - 1))))
    runs = split_runs(missing, sizes, per_run)
    covered = [piece for run in runs for piece in range(run.first, run.first + run.count)]
    assert covered == missing
    for run in runs:
        assert 1 <= run.count <= per_run
        assert run.nbytes == sum(sizes[run.first : run.first + run.count])
    # maximal: two consecutive runs are only split by a gap or by the per-run cap
    for left, right in zip(runs, runs[1:]):
        assert left.first + left.count < right.first or left.count == per_run


def test_a_fresh_download_is_cut_into_equal_runs_but_the_last():
    sizes = [4] * 10 + [3]
    assert split_runs(list(range(11)), sizes, 4) == [Run(0, 4, 16), Run(4, 4, 16), Run(8, 3, 11)]


def test_a_whole_number_of_words_from_a_writable_buffer_is_sent_without_a_copy():
    buffer = bytearray(range(256)) * 4
    view = memoryview(buffer)[64:192]
    tensor = pack_bytes(view)
    assert tensor.dtype == torch.int64 and tensor.numel() == 16
    buffer[64] ^= 0xFF  # shares memory: the change shows
    assert bytes(unpack_bytes([tensor], 128))[0] == buffer[64]
    copied = pack_bytes(memoryview(buffer).toreadonly()[64:192])  # read-only: copied
    buffer[65] ^= 0xFF
    assert bytes(unpack_bytes([copied], 128))[1] != buffer[65]
    odd = pack_bytes(memoryview(buffer)[0:13])  # not whole words: padded copy
    assert odd.numel() == 2 and bytes(unpack_bytes([odd], 13)) == bytes(buffer[0:13])


def test_restore_can_share_the_buffer_and_copies_what_is_misaligned():
    state = {"a": torch.arange(3, dtype=torch.float32), "b": torch.arange(4, dtype=torch.int64),
             "c": torch.tensor([True, False])}
    manifest, data = build_manifest(state, run_id="r", stage=0, version=1, shard_bytes=8)
    buffer = bytearray(data)
    restored = restore_state(manifest, buffer, share=True)
    for name, tensor in state.items():
        assert torch.equal(restored[name], tensor)
    # "a" starts at 0 (aligned: shared); "b" at 12, not a multiple of 8 (copied)
    assert restored["a"].data_ptr() == torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    buffer[12] ^= 0x01
    assert torch.equal(restored["b"], state["b"])
    copied = restore_state(manifest, bytearray(data))  # the default: always a copy
    assert all(torch.equal(copied[name], state[name]) for name in state)


def test_the_first_plan_gives_a_donor_it_left_out_one_run_from_the_busiest():
    plan = {"fast": [0, 1, 2, 3], "medium": [4, 5], "slow": []}  # the slow one's probe caught a busy host
    give_each_a_run(plan, ["fast", "medium", "slow"])
    assert plan == {"fast": [0, 1, 2], "medium": [4, 5], "slow": [3]}
    few = {"a": [0], "b": []}  # one run: the donor that has it keeps it
    give_each_a_run(few, ["a", "b"])
    assert few == {"a": [0], "b": []}
