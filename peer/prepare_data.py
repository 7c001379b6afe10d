"""Prepare data once: text, JSON Lines or Parquet files become one pre-tokenized token shard.

    .venv/bin/python -m peer.prepare_data --out data/train.bin --tokenizer tokenizer.json FILE ...
    .venv/bin/python -m peer.prepare_data --out data/train.bin --train-bpe [--vocab-size 4096] FILE ...

Writes ``train.bin`` (a flat array of token ids, ``uint16`` while the vocabulary fits, the nanoGPT
layout) and ``train.bin.json`` (the tokenizer's hash, the dtype, the token count). With
``--train-bpe`` it first trains a byte-level BPE tokenizer on the files and writes it as
``tokenizer.json`` beside the shard. Then start the run with ``run_bootstrap.py --data train.bin
--tokenizer tokenizer.json``: the run spec pins both by hash, and stage-0 peers memory-map the
shard instead of tokenizing text at every join. The files are read one at a time, and the shard is
written as it grows; a progress bar on standard error counts files and tokens.

A mistake (a file missing or unreadable, a tokenizer that cannot be read) ends in one sentence and
exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from peer.errors import UserError
from peer.training_data import TOKENIZER_FILE, save_tokenizer
from swarm.data import SIDECAR_SUFFIX, DataError, file_documents, write_shard_sidecar
from swarm.tokenizer import DEFAULT_BPE_VOCAB, BpeTokenizer, TokenizerError, read_tokenizer_file, token_dtype, train_bpe

BAR_WIDTH = 30


def prepare(paths: Sequence[str], out: Path, *, tokenizer_file: str | None, train_vocab: int | None,
            progress=sys.stderr) -> dict:
    """Tokenize ``paths`` into the shard ``out`` (and its sidecar); returns what was written."""
    if not paths:
        raise UserError("Give the files to prepare (text, .jsonl or .parquet).")
    try:
        if train_vocab is not None:
            blob = train_bpe((d for path in paths for d in file_documents(path)), train_vocab)
            save_tokenizer(str(out.parent), blob)
        elif tokenizer_file:
            blob = read_tokenizer_file(tokenizer_file)
        else:
            raise UserError("Give --tokenizer tokenizer.json (the run's), or --train-bpe to train one on these files.")
        tokenizer = BpeTokenizer(blob)
        out.parent.mkdir(parents=True, exist_ok=True)
        dtype, partial, total = token_dtype(tokenizer.vocab_size), str(out) + ".partial", 0
        with open(partial, "wb") as shard:
            for done, path in enumerate(paths):
                ids = tokenizer.encode_documents(file_documents(path), b"\n\n").astype(dtype, copy=False)
                shard.write(ids.tobytes())
                total += int(ids.size)
                _draw_bar(progress, done + 1, len(paths), total)
        os.replace(partial, out)
        write_shard_sidecar(str(out), tokenizer=tokenizer.id, dtype=dtype, tokens=total)
    except (DataError, TokenizerError, ValueError) as e:
        raise UserError(f"Cannot prepare the data: {e}.") from None
    return {"tokens": total, "tokenizer": tokenizer.id, "dtype": dtype.name, "out": str(out),
            "trained_tokenizer": str(out.parent / TOKENIZER_FILE) if train_vocab is not None else None}


def _draw_bar(stream, done: int, of: int, tokens: int) -> None:
    filled = BAR_WIDTH * done // of
    end = "\n" if done == of or not stream.isatty() else ""
    stream.write(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{of} files, {tokens:,} tokens{end}")
    stream.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peer.prepare_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="text, JSON Lines (.jsonl, a \"text\" field) or Parquet (.parquet) files")
    parser.add_argument("--out", required=True, help="the token shard to write (e.g. data/train.bin)")
    parser.add_argument("--tokenizer", help="the tokenizer.json to tokenize with")
    parser.add_argument("--train-bpe", action="store_true", help="train a BPE tokenizer on the files first")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_BPE_VOCAB, help="with --train-bpe (default: %(default)s)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        result = prepare(args.files, Path(args.out), tokenizer_file=args.tokenizer,
                         train_vocab=args.vocab_size if args.train_bpe else None)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    trained = f"; trained tokenizer: {result['trained_tokenizer']}" if result["trained_tokenizer"] else ""
    print(f"wrote {result['tokens']:,} tokens ({result['dtype']}) to {result['out']} and its {SIDECAR_SUFFIX} sidecar in "
          f"{time.monotonic() - started:.1f}s{trained}; start the run with --data {result['out']} --tokenizer "
          f"{result['trained_tokenizer'] or args.tokenizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
