#!/usr/bin/env bash
# Chromium for the browser test of the health page (tests/e2e/test_status_page.py), from Debian's
# packages. Run as root on Debian/Ubuntu it installs what is missing; elsewhere it says what to do.
# The test fails (it is never skipped) when there is no chromium.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # fonts-dejavu-core: without any font the page's text renders as empty boxes
    apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
else
    echo "setup_browser.sh: install Chromium (Debian: apt-get install chromium) for the health page's browser test" >&2
fi
