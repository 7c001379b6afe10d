#!/usr/bin/env bash
# README command 2: set up (first time) and run every test, the slow multi-process ones included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_browser.sh  # chromium, for the health page's browser test
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=8 "$@"
