#!/usr/bin/env bash
# What the emulated internet needs (peer/harness/internet.py; tests/e2e/test_internet.py, bench/wan.py):
# nftables for its home routers' NAT, iproute2 for namespaces, links and tc, gcc for its delay line.
# Run as root on Debian/Ubuntu it installs what is missing; elsewhere it says what to do. The tests
# fail (they are never skipped) when something is missing.
set -euo pipefail
missing=()
command -v nft >/dev/null 2>&1 || missing+=(nftables)
command -v tc >/dev/null 2>&1 || missing+=(iproute2)
command -v gcc >/dev/null 2>&1 || missing+=(gcc)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
else
    echo "setup_network.sh: install ${missing[*]} (as root) for the emulated internet's tests" >&2
fi
