#!/usr/bin/env bash
# Creates .venv (once) with everything Murmuration needs. torch==2.13.0 is installed before the
# project: a bare torch requirement with nothing installed would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, hivemind, msgpack, uvloop, matplotlib, tokenizers, transformers, pyarrow, pytest, pytest_timeout, xdist, hypothesis" 2>/dev/null; then
    .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
    .venv/bin/pip install --quiet --disable-pip-version-check -e ".[test]"
fi
# py-libp2p (python -m peer.status) in an environment of its own: see the status-client extra
if ! .venv-libp2p/bin/python -c "import libp2p, msgpack" 2>/dev/null; then
    "${PYTHON:-python3}" -m venv .venv-libp2p
    .venv-libp2p/bin/pip install --quiet --disable-pip-version-check $(.venv/bin/python -c \
        'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["status-client"]))')
fi
