"""python -m peer.prepare_data: files become one token shard (and a tokenizer, if asked) that a run
trains on, with a progress bar; mistakes end in one sentence."""

from __future__ import annotations

import io
import json

import numpy as np

from peer.bootstrap import prepare_run
from peer.config import BootstrapConfig
from peer.prepare_data import main, prepare
from swarm.data import files_dataset_id, load_corpus, read_shard_sidecar
from swarm.tokenizer import BpeTokenizer


def corpus_files(tmp_path) -> list[str]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    jsonl, text = tmp_path / "topics.jsonl", tmp_path / "more.txt"
    jsonl.write_text("".join(json.dumps({"text": topics[name]}) + "\n" for name in sorted(topics)[:40]))
    text.write_text("\n\n".join(topics[name] for name in sorted(topics)[40:60]))
    return [str(jsonl), str(text)]


def test_files_become_a_shard_a_run_trains_on(tmp_path):
    files, out, bar = corpus_files(tmp_path), tmp_path / "data" / "train.bin", io.StringIO()
    result = prepare(files, out, tokenizer_file=None, train_vocab=600, progress=bar)
    tokenizer = BpeTokenizer((tmp_path / "data" / "tokenizer.json").read_bytes())
    assert result["tokenizer"] == tokenizer.id and result["dtype"] == "uint16" and result["tokens"] > 10_000
    assert read_shard_sidecar(str(out)) == {"tokenizer": tokenizer.id, "dtype": "uint16", "tokens": result["tokens"]}
    assert "[" + "#" * 30 + "] 2/2 files" in bar.getvalue()
    shard = load_corpus(files_dataset_id([str(out)]), [str(out)])
    text = load_corpus(files_dataset_id(files), files)
    # the same ids as tokenizing the text at join (the separator inside a file differs, not the ids)
    first_doc = tokenizer.encode_documents(text.documents[:1], b"\n\n")
    assert np.array_equal(shard.encode(tokenizer)[: first_doc.size], first_doc)
    spec, _ = prepare_run(BootstrapConfig(preset="tiny", data=(str(out),), tokenizer=str(tmp_path / "data" / "tokenizer.json")))
    assert spec.tokenizer == tokenizer.id and spec.model.vocab_size == 600
    # a second shard with the run's tokenizer file is the same data
    again = tmp_path / "again.bin"
    prepare(files, again, tokenizer_file=str(tmp_path / "data" / "tokenizer.json"), train_vocab=None, progress=io.StringIO())
    assert again.read_bytes() == out.read_bytes()


def test_mistakes_are_one_sentence_and_exit_2(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "x.bin"), "--train-bpe", str(tmp_path / "missing.txt")]) == 2
    assert main(["--out", str(tmp_path / "x.bin"), str(tmp_path)]) == 2
    (tmp_path / "a.txt").write_text("some text")
    assert main(["--out", str(tmp_path / "x.bin"), str(tmp_path / "a.txt")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines), lines
    assert "cannot read data file" in lines[0] and "Give --tokenizer" in lines[2]
    assert not (tmp_path / "x.bin").exists()
