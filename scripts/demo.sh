#!/usr/bin/env bash
# README command 1: set up (first time) and run a local swarm that trains the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m peer.harness.demo "$@"
