"""The options of what a volunteer sees: --status-port, --terminal-view, --quiet, --verbose."""

from __future__ import annotations

import io
import logging

import pytest

from peer.config import BootstrapConfig, PeerConfig
from peer.status.service import quiet_console_logs, terminal_for

BOOT = ("/ip4/127.0.0.1/tcp/31337/p2p/QmBoot",)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quiet_and_verbose_set_the_log_level():
    assert PeerConfig(bootstrap=BOOT).resolved_log_level == "INFO"
    assert PeerConfig(bootstrap=BOOT, log_level="debug").resolved_log_level == "DEBUG"
    assert PeerConfig(bootstrap=BOOT, quiet=True).resolved_log_level == "WARNING"
    assert PeerConfig(bootstrap=BOOT, verbose=True, log_level="WARNING").resolved_log_level == "DEBUG"
    with pytest.raises(ValueError, match="--quiet and --verbose"):
        PeerConfig(bootstrap=BOOT, quiet=True, verbose=True)


@pytest.mark.parametrize("port", [-1, 65536, True, 80.0])
def test_status_port_must_be_a_tcp_port(port):
    with pytest.raises(ValueError, match="--status-port"):
        PeerConfig(bootstrap=BOOT, status_port=port)
    with pytest.raises(ValueError, match="--status-port"):
        BootstrapConfig(status_port=port)


def test_status_port_defaults_to_off_on_loopback():
    for config in (PeerConfig(bootstrap=BOOT), BootstrapConfig()):
        assert config.status_port == 0 and config.status_host == "127.0.0.1"


def test_terminal_view_mode_is_checked():
    with pytest.raises(ValueError, match="--terminal-view"):
        PeerConfig(bootstrap=BOOT, terminal_view="sometimes")


@pytest.mark.parametrize(("mode", "quiet", "tty", "shown"), [
    ("auto", False, True, True), ("auto", False, False, False), ("on", False, False, True),
    ("off", False, True, False), ("on", True, True, False), ("auto", True, True, False),
])
def test_when_the_terminal_view_is_drawn(mode, quiet, tty, shown):
    stream = Tty() if tty else io.StringIO()
    view = terminal_for(mode, quiet=quiet, stream=stream)
    assert (view is not None) == shown
    if view is not None:
        assert view.stream is stream and view.is_tty == tty


def test_quiet_console_logs_keeps_warnings_only_on_stream_handlers(tmp_path):
    root = logging.getLogger()
    saved = root.handlers[:]
    console, file = logging.StreamHandler(io.StringIO()), logging.FileHandler(tmp_path / "log")
    root.handlers[:] = [console, file]
    try:
        quiet_console_logs()
        assert console.level == logging.WARNING and file.level == logging.NOTSET
    finally:
        root.handlers[:] = saved
        file.close()
