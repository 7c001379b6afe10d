"""The py-libp2p status client's pure parts: it agrees with the server on the protocol, and what it prints."""

from __future__ import annotations

import sys

from dht.wire import MAX_HEADER_BYTES
from peer.status import client as status_client, protocol as status_server
from peer.status.client import PeerReport, StatusError, _find_status_error, _reason, format_report


def test_client_and_server_agree_on_protocol_and_limit():
    assert status_client.STATUS_PROTOCOL == status_server.STATUS_PROTOCOL == "/murmuration/status/1.0.0"
    assert status_client.MAX_REPLY_BYTES == MAX_HEADER_BYTES  # the server's reply is one header


def test_the_client_module_imports_neither_hivemind_nor_libp2p_at_import_time():
    source = open(status_client.__file__).read()
    top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in top_level if "hivemind" in line or "libp2p" in line or "torch" in line]
    assert "libp2p" not in sys.modules


def test_format_report():
    report = PeerReport(peer_id="12D3KooWabc", address="/ip4/127.0.0.1/tcp/1/p2p/12D3KooWabc",
                        agent_version="p2pd/0.1", protocols=["/ipfs/ping/1.0.0", "/murmuration/status/1.0.0"],
                        ping_ms=[0.5, 0.3, 0.9],
                        status={"run_id": "demo", "stage": 1, "num_stages": 2, "state": "paused", "role": "reliable",
                                "step": 42, "loss": 2.5, "tokens_per_s": 12345.6, "num_samples": 1600,
                                "uptime_s": 61.2, "software_version": "0.1.0"})
    text = format_report(report)
    assert "run       demo, stage 1 of 2, paused (reliable)" in text
    assert "step      42" in text and "loss 2.500 | 12,346 tokens/s | 1,600 samples" in text
    assert "with /murmuration/status/1.0.0 in identify" in text and "0.50 ms (median of 3)" in text
    joining = format_report(PeerReport(peer_id="x", address="a", status={"stage": -1, "loss": None, "state": "joining"}))
    assert "no stage yet, joining" in joining and "loss -" in joining and "ping      -" in joining


def test_reason_finds_the_root_cause():
    try:
        try:
            raise ConnectionRefusedError("[Errno 111] Connection refused")
        except OSError as e:
            raise RuntimeError("unable to connect") from ExceptionGroup("dial", [e])
    except RuntimeError as outer:
        assert _reason(outer) == "[Errno 111] Connection refused"


def test_our_own_error_is_found_inside_nested_groups():
    ours = StatusError("the peer does not serve it", exit_code=1)
    grouped = ExceptionGroup("host", [ValueError("x"), ExceptionGroup("nursery", [ours])])
    assert _find_status_error(grouped) is ours
    assert _find_status_error(ExceptionGroup("host", [ValueError("x")])) is None
