#!/usr/bin/env bash
# README command 2: set up (first time) and run the gate: unit, simulation, integration, decoder
# fuzzing and the real-process smoke tests (tests marked scenario are deselected).
#   bash scripts/test.sh --all    the scenario tier too: long swarms, the emulated internet's and NAT
#                                 swarms, Byzantine swarms, the live fuzz, the memory measurement
# Other arguments go to pytest (a folder, -k, -x ...). README, "Tests", says what each tier runs.
set -euo pipefail
cd "$(dirname "$0")/.."
tiers=(-m "not scenario")
if [ "${1:-}" = "--all" ]; then
    tiers=()
    shift
fi
bash scripts/setup.sh
bash scripts/setup_browser.sh  # chromium, for the health page's browser test
bash scripts/setup_network.sh  # nftables (and gcc, iproute2), for the emulated internet's tests
# two workers (MURMURATION_TEST_WORKERS): one e2e test leaves much of two cores idle (its peers wait on
# one another and on the network), so two side by side finish sooner (README, "Tests"); tests marked
# xdist_group("one_at_a_time") run one at a time on one worker while the other runs the rest (loadgroup; needs
# pytest 8, pinned), and a file lock in tests/e2e/conftest.py holds them apart even where it does not
# --tb=native: pytest 8.4's own traceback formatting hit a frame without a line number (tb_lineno None)
# in a failing e2e test and crashed its worker with an INTERNALERROR, hiding the failure
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${MURMURATION_TEST_WORKERS:-2}" --dist loadgroup \
    --tb=native --durations=8 "${tiers[@]}" "$@"
