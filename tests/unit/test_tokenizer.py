"""Tokenizers: bytes, and BPE trained offline on the run's corpus and pinned by the hash of its file."""

from __future__ import annotations

import numpy as np
import pytest

from dht.records import RunSpec
from peer.bootstrap import prepare_run
from peer.config import BootstrapConfig
from swarm.data import BUILTIN_PYDOC, DataError, files_dataset_id, load_corpus, write_token_shard
from swarm.tokenizer import (
    END_OF_TEXT,
    BpeTokenizer,
    ByteTokenizer,
    TokenizerError,
    load_tokenizer,
    read_tokenizer_file,
    tokenizer_id,
    train_bpe,
)


@pytest.fixture(scope="module")
def documents() -> tuple[bytes, ...]:
    return load_corpus(BUILTIN_PYDOC).documents


@pytest.fixture(scope="module")
def blob(documents) -> bytes:
    return train_bpe(documents, 1024)


def test_bpe_trains_offline_deterministically_and_round_trips_text(documents, blob):
    assert train_bpe(documents, 1024) == blob  # the same corpus, the same file, the same hash
    tokenizer = BpeTokenizer(blob)
    assert tokenizer.vocab_size == 1024 and tokenizer.end_of_text == 0
    text = "def f(x):\n    return x ** 2  # squares ünïcode"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()) / 1.5  # merges compress English and code


def test_documents_are_joined_by_the_end_of_text_token(blob):
    tokenizer = BpeTokenizer(blob)
    ids = tokenizer.encode_documents([b"first document", b"second"], b"\0")
    assert ids.dtype == np.uint16
    ends = np.flatnonzero(ids == tokenizer.end_of_text)
    assert len(ends) == 2 and ends[-1] == len(ids) - 1
    assert tokenizer.decode(ids[: ends[0]]) == "first document"
    assert ByteTokenizer().encode_documents([b"ab", b"c"], b"\0").tobytes() == b"ab\0c"


def test_a_tokenizer_file_of_another_hash_is_refused_with_one_sentence(blob, tmp_path):
    run = tokenizer_id(blob)
    assert load_tokenizer(run, blob).id == run
    other = train_bpe([b"some other text entirely " * 50], 300)
    with pytest.raises(TokenizerError, match=r"not the run's bpe:") as caught:
        load_tokenizer(run, other)
    assert str(caught.value).count(". ") == 0  # one sentence
    with pytest.raises(TokenizerError, match="no tokenizer file was given"):
        load_tokenizer(run, None)
    garbage = tmp_path / "tokenizer.json"
    garbage.write_bytes(b"{not json")
    with pytest.raises(TokenizerError, match="not a tokenizer.json"):
        BpeTokenizer(read_tokenizer_file(str(garbage)))
    with pytest.raises(TokenizerError, match="cannot read"):
        read_tokenizer_file(str(tmp_path / "missing.json"))
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


def test_the_run_spec_pins_the_tokenizer_and_keeps_byte_runs_wire_form():
    spec, tokenizer = prepare_run(BootstrapConfig(preset="tiny", tokenizer="bpe", vocab_size=512))
    assert spec.tokenizer == tokenizer.id and spec.model.vocab_size == 512 == tokenizer.vocab_size
    assert RunSpec.from_wire(spec.to_wire()) == spec
    byte_spec = RunSpec(run_id="r")
    assert "tokenizer" not in byte_spec.to_wire()  # the first round's spec, unchanged
    with pytest.raises(ValueError, match="tokenizer must be"):
        RunSpec(run_id="r", tokenizer="bpe:xyz")


def test_the_bootstrap_loads_a_given_tokenizer_file(blob, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(blob)
    spec, _ = prepare_run(BootstrapConfig(tokenizer=str(path)))
    assert spec.tokenizer == tokenizer_id(blob) and spec.model.vocab_size == 1024


def test_token_shards_of_another_tokenizer_are_refused_by_the_bootstrap(blob, tmp_path):
    shard = str(tmp_path / "train.bin")
    write_token_shard(shard, np.arange(4000) % 1000, tokenizer=tokenizer_id(blob), vocab_size=1024)
    with pytest.raises(DataError, match="prepare them again with the run's tokenizer"):
        prepare_run(BootstrapConfig(data=(shard,)))  # a byte-token run
    with pytest.raises(DataError, match="give the tokenizer.json they were prepared with"):
        prepare_run(BootstrapConfig(data=(shard,), tokenizer="bpe"))
    path = tmp_path / "tokenizer.json"
    path.write_bytes(blob)
    spec, _ = prepare_run(BootstrapConfig(data=(shard,), tokenizer=str(path)))
    assert spec.dataset == files_dataset_id([shard]) and spec.tokenizer == tokenizer_id(blob)


def test_the_end_of_text_token_is_the_first_special_token(blob):
    assert BpeTokenizer(blob).encode(END_OF_TEXT) == [0]
