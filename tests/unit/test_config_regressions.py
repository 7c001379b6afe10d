"""Regression tests for bugs found in peer/config.py by review (all fixed).

1. ``PeerConfig.__post_init__`` checks ``settle_delay``, ``max_memory_mb`` and ``run_for`` with
   ``value < 0``, which is False for NaN: ``--settle-delay nan`` (argparse's ``float`` parses it)
   is accepted and later used as a sleep duration.
2. ``BootstrapConfig.__post_init__`` checks ``spec_refresh_period <= 0``: NaN is accepted as the
   re-publication period. Its ``log_level`` is not checked at all (``--log-level LOUD`` passes),
   unlike PeerConfig's.
"""

from __future__ import annotations

import math

import pytest

from peer.config import BootstrapConfig, PeerConfig

BOOT = ("/ip4/127.0.0.1/tcp/31337/p2p/QmBoot",)


@pytest.mark.parametrize("name", ["settle_delay", "max_memory_mb", "run_for"])
def test_nan_peer_setting_is_rejected(name):
    with pytest.raises(ValueError):
        PeerConfig(bootstrap=BOOT, **{name: math.nan})


def test_nan_spec_refresh_period_is_rejected():
    with pytest.raises(ValueError):
        BootstrapConfig(spec_refresh_period=math.nan)


def test_bad_bootstrap_log_level_is_rejected():
    with pytest.raises(ValueError):
        BootstrapConfig(log_level="LOUD")
