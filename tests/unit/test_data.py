"""Training text: the built-in corpus, file datasets identified by hash, the sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm.data import (
    BUILTIN_PYDOC,
    VALIDATION_FRACTION,
    Corpus,
    DataError,
    TokenSampler,
    data_seed,
    files_dataset_id,
    load_corpus,
    read_shard_sidecar,
    write_token_shard,
)


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return load_corpus(BUILTIN_PYDOC).text()


def test_builtin_corpus_loads_and_is_large(corpus):
    assert isinstance(corpus, bytes)
    assert len(corpus) > 100_000
    assert b"def" in corpus and b"class" in corpus
    assert load_corpus(BUILTIN_PYDOC).text() == corpus  # deterministic


def test_sampler_shapes_dtypes_and_shift(corpus):
    sampler = TokenSampler(corpus, seq_len=32, seed=1)
    inputs, targets = sampler.sample(5)
    assert inputs.shape == targets.shape == (5, 32)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.min()) >= 0 and int(inputs.max()) < 256
    # each row is a real window of the training text
    train = bytes(sampler.train_tokens)
    for row_in, row_t in zip(inputs, targets):
        window = bytes(row_in.tolist()) + bytes([int(row_t[-1])])
        assert window in train


def test_validation_split_is_disjoint_and_held_out(corpus):
    sampler = TokenSampler(corpus, seq_len=16, seed=2)
    assert len(sampler.train_tokens) + len(sampler.val_tokens) == len(corpus)
    assert len(sampler.val_tokens) == pytest.approx(len(corpus) * VALIDATION_FRACTION, abs=2)
    assert bytes(sampler.train_tokens) + bytes(sampler.val_tokens) == corpus
    inputs, targets = sampler.sample(20, validation=True)
    val = bytes(sampler.val_tokens)
    for row_in, row_t in zip(inputs, targets):
        assert bytes(row_in.tolist()) + bytes([int(row_t[-1])]) in val


def test_validation_windows_never_cross_into_training_tokens():
    corpus = bytes(range(200)) * 5  # 1000 bytes: split at 950
    sampler = TokenSampler(corpus, seq_len=8, seed=0)
    for _ in range(20):
        inputs, targets = sampler.sample(16, validation=True)
        # positions of the windows: every token value in [150, 200) appears only in the last 50 bytes
        assert int(inputs.min()) >= 150 and int(targets.min()) >= 150
    assert sampler.train_tokens.size == 950


def test_same_seed_same_batches_other_seed_other_batches(corpus):
    a, b, c = (TokenSampler(corpus, seq_len=16, seed=s) for s in (7, 7, 8))
    first_a, first_b, first_c = a.sample(4), b.sample(4), c.sample(4)
    assert torch.equal(first_a[0], first_b[0]) and torch.equal(first_a[1], first_b[1])
    assert not torch.equal(first_a[0], first_c[0])
    assert not torch.equal(a.sample(4)[0], first_a[0])  # the stream moves on


def test_a_batch_position_draws_the_same_windows_whatever_the_samplers_own_seed(corpus):
    a, b = TokenSampler(corpus, seq_len=16, seed=7), TokenSampler(corpus, seq_len=16, seed=8)
    a.sample(4)  # the sampler's own stream does not move the positions' draws
    first = a.sample_slot(4, seed=0, batch=3, slot=1, slots=4)
    assert all(torch.equal(x, y) for x, y in zip(first, b.sample_slot(4, seed=0, batch=3, slot=1, slots=4)))
    others = [b.sample_slot(4, seed=s, batch=k, slot=j, slots=4) for s, k, j in ((1, 3, 1), (0, 4, 1), (0, 3, 0))]
    assert not any(torch.equal(first[0], other[0]) for other in others)  # run seed, batch, position each matter
    assert torch.equal(first[1][:, :-1], first[0][:, 1:])  # targets are the inputs shifted by one
    with pytest.raises(ValueError, match="must not be negative"):
        a.sample_slot(4, seed=0, batch=-1, slot=0, slots=4)
    with pytest.raises(ValueError, match="slot below slots"):
        a.sample_slot(4, seed=0, batch=0, slot=4, slots=4)


def windows_of(batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[int, ...]]:
    inputs, targets = batch
    return [tuple(row.tolist()) + (int(last),) for row, last in zip(inputs, targets[:, -1])]


@pytest.fixture(scope="module")
def distinct_tokens() -> np.ndarray:
    """Random ids (vocabulary 4,000): every window is its own content, so a common window is a
    common sample (real text repeats whole lines, and with them windows)."""
    return np.random.default_rng(0).integers(0, 4000, size=300_000).astype(np.uint16)


def test_two_stage0_peers_splitting_batches_draw_no_common_sample(distinct_tokens):
    """The default semantics (replica_sync "gradients"): two stage-0 replicas take alternate
    positions of every batch (as swarm.gradient_sync.batch_slots splits them), each with its own
    sampler seeded per peer, and never draw a common window over a whole epoch of draws, although
    they exchange nothing about data."""
    seq_len, microbatch, slots = 64, 16, 4
    peers = [TokenSampler(distinct_tokens, seq_len=seq_len, seed=data_seed(0, name)) for name in ("peerA", "peerB")]
    n = peers[0].windows_per_epoch
    drawn: list[list[tuple[int, ...]]] = [[], []]
    for batch in range(n // (microbatch * slots)):  # N = the epoch's windows, less a partial batch
        for slot in range(slots):
            drawn[slot % 2].extend(windows_of(peers[slot % 2].sample_slot(microbatch, seed=0, batch=batch, slot=slot,
                                                                           slots=slots)))
    assert len(drawn[0]) == len(drawn[1]) > 2000
    assert not set(drawn[0]) & set(drawn[1])
    assert len(set(drawn[0])) == len(drawn[0])  # nor does one peer draw a window twice in the epoch


def test_own_stream_never_repeats_a_window_within_an_epoch_and_moves_on_at_the_next(distinct_tokens):
    sampler = TokenSampler(distinct_tokens, seq_len=32, seed=5)
    n = sampler.windows_per_epoch
    epoch = [w for _ in range(n // 50) for w in windows_of(sampler.sample(50))]
    assert len(set(epoch)) == len(epoch)
    starts = {sampler._starts(5, draw, 1)[0] % 32 for draw in (0, n, 2 * n, 3 * n, 4 * n)}
    assert len(starts) > 1  # each epoch cuts the windows at its own shift


@pytest.mark.parametrize("size, seq_len", [(0, 4), (10, 4), (200, 64)])
def test_corpus_too_short_raises_data_error(size, seq_len):
    with pytest.raises(DataError):
        TokenSampler(b"x" * size, seq_len=seq_len, seed=0)


def test_data_seed_is_deterministic_and_differs_per_peer():
    assert data_seed(0, "peerA") == data_seed(0, "peerA")
    seeds = {data_seed(run, peer) for run in range(3) for peer in ("peerA", "peerB", "peerC")}
    assert len(seeds) == 9
    assert all(0 <= s < 2**64 for s in seeds)
    # fixed across processes and Python versions (no hash()): pin one value
    import hashlib

    assert data_seed(3, "p") == int.from_bytes(hashlib.sha256(b"3:p").digest()[:8], "big")
    np.random.default_rng(data_seed(0, "peerA"))  # usable as a numpy seed


def test_files_dataset_id_is_stable_and_content_addressed(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"hello world\n")
    b.write_bytes(b"second file\n")
    dataset = files_dataset_id([str(a), str(b)])
    assert dataset.startswith("files:") and len(dataset) == len("files:") + 64
    assert files_dataset_id([str(a), str(b)]) == dataset
    copy = tmp_path / "copy.txt"
    copy.write_bytes(a.read_bytes())
    assert files_dataset_id([str(copy), str(b)]) == dataset  # the name does not matter
    assert files_dataset_id([str(b), str(a)]) != dataset  # the order does
    # the file boundary is part of the hash
    joined = tmp_path / "joined.txt"
    joined.write_bytes(a.read_bytes() + b.read_bytes())
    assert files_dataset_id([str(joined)]) != dataset
    assert load_corpus(dataset, [str(a), str(b)]).text() == b"hello world\n\0second file\n"
    from dht.records import RunSpec

    RunSpec(run_id="d", dataset=dataset)  # a valid run spec dataset


def test_files_that_do_not_match_the_run_raise_data_error(tmp_path):
    a = tmp_path / "a.txt"
    a.write_bytes(b"original text")
    dataset = files_dataset_id([str(a)])
    a.write_bytes(b"edited text")
    with pytest.raises(DataError, match="not the run's dataset"):
        load_corpus(dataset, [str(a)])
    with pytest.raises(DataError):
        load_corpus(dataset, [])
    with pytest.raises(DataError):
        load_corpus("https://example.com/corpus")


def test_empty_or_missing_file_raises_data_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    missing = tmp_path / "missing.txt"
    for path in (empty, missing, tmp_path):  # a directory cannot be read either
        with pytest.raises(DataError):
            files_dataset_id([str(path)])
        with pytest.raises(DataError):
            load_corpus("files:" + "0" * 64, [str(path)])


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


def test_jsonl_parquet_and_text_files_load_as_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"text": "first doc"}\n\n{"text": "second", "id": 2}\n')
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": ["third", "fourth"], "n": [1, 2]}), parquet)
    text = tmp_path / "c.txt"
    text.write_text("fifth\n")
    paths = [str(jsonl), str(parquet), str(text)]
    corpus = load_corpus(files_dataset_id(paths), paths)
    assert corpus.documents == (b"first doc", b"second", b"third", b"fourth", b"fifth\n")


@pytest.mark.parametrize("line, match", [("not json", "line 1 is not JSON"), ('{"title": "x"}', "no 'text' string")])
def test_a_bad_jsonl_line_is_refused_with_its_number(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DataError, match=match):
        load_corpus(files_dataset_id([str(path)]), [str(path)])


def test_token_shards_load_memory_mapped_and_refuse_another_tokenizer(tmp_path):
    from swarm.tokenizer import ByteTokenizer

    tokens = np.arange(5000, dtype=np.int64) % 250
    shard = str(tmp_path / "train.bin")
    write_token_shard(shard, tokens, tokenizer="bytes", vocab_size=256)
    assert read_shard_sidecar(shard) == {"tokenizer": "bytes", "dtype": "uint16", "tokens": 5000}
    dataset = files_dataset_id([shard])
    corpus = load_corpus(dataset, [shard])
    assert isinstance(corpus.tokens, np.memmap) and np.array_equal(corpus.encode(ByteTokenizer()), tokens)
    with pytest.raises(DataError, match="no text"):
        corpus.text()
    other = Corpus(tokens=corpus.tokens, shard_tokenizer="bpe:" + "1" * 64)
    with pytest.raises(DataError, match="prepare them again with the run's tokenizer"):
        other.encode(ByteTokenizer())
    too_big = Corpus(tokens=np.array([1, 300], dtype=np.uint16))
    with pytest.raises(DataError, match="beyond the run tokenizer's 256"):
        too_big.encode(ByteTokenizer())
    # the sidecar is part of the dataset: editing it is another dataset
    (tmp_path / "train.bin.json").write_text('{"tokenizer": "bytes", "dtype": "uint32", "tokens": 2500}')
    assert files_dataset_id([shard]) != dataset


def test_shards_and_text_files_do_not_mix(tmp_path):
    shard, text = str(tmp_path / "a.bin"), tmp_path / "b.txt"
    write_token_shard(shard, np.arange(100), tokenizer="bytes", vocab_size=256)
    text.write_text("words")
    paths = [shard, str(text)]
    with pytest.raises(DataError, match="mixes token shards"):
        load_corpus(files_dataset_id(paths), paths)


def test_sampler_reads_a_token_array_of_any_width():
    tokens = (np.arange(20_000) % 4000).astype(np.uint16)
    inputs, targets = TokenSampler(tokens, seq_len=16, seed=0).sample(8)
    assert inputs.dtype == torch.int64 and int(inputs.max()) >= 256  # ids beyond a byte survive
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
