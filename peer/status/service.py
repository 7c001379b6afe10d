"""What a volunteer sees: the status port (health page, ``/status.json``, ``/metrics``) and the
terminal view, for a peer or for the bootstrap.

:class:`StatusService` samples the swarm every ``sample_period`` seconds into a short history (the
plots), serves the status port if asked, and redraws the terminal view if asked. It reads the swarm
through a :class:`StatusSource`, so the same service runs inside a peer (its own view of the swarm
and its own snapshot) and inside the bootstrap (a view of its own, no local status).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dht.records import PeerRecord, RunSpec
from peer.errors import UserError
from peer.status.page import render_health_page
from peer.status.http import Response, StatusHTTPServer
from peer.status.prometheus import CONTENT_TYPE, HTTPCollector, PeerCollector, SwarmCollector, make_registry, render_metrics
from peer.status.local import StatusHistory, local_status
from peer.status.snapshot import PeerSnapshot
from peer.status.swarm import SwarmHistory, swarm_status
from peer.status.terminal import TerminalView
from swarm.model import stage_flops_per_sample
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
SAMPLE_PERIOD = 2.0


@dataclass(frozen=True)
class StatusSource:
    """Where the service reads the swarm from.

    Attributes:
        run_id: the run shown.
        spec: the run spec, or None until it is known (a peer still joining).
        records: the live peer records (the caller's swarm view).
        snapshot: this peer's newest :class:`PeerSnapshot`, or None on a bootstrap.
        history: this peer's recent counters (its rates), or None.
        owned_view: a swarm view the service starts and shuts down with itself (the bootstrap's).
        sample: the newest sample of the model's text (``peer.model_sample.SampleLoop.document``), or None.
    """

    run_id: str
    spec: Callable[[], RunSpec | None]
    records: Callable[[], list[PeerRecord]]
    snapshot: Callable[[], PeerSnapshot] | None = None
    history: Callable[[], StatusHistory | None] = lambda: None
    owned_view: SwarmView | None = None
    sample: Callable[[], dict[str, Any] | None] = lambda: None

    def local(self) -> dict[str, Any] | None:
        """This peer's :func:`peer.status.local.local_status`, or None on a bootstrap."""
        return local_status(self.snapshot(), self.history()) if self.snapshot is not None else None


class StatusService:
    """Owns the status port's server, the swarm history sampler and the terminal view.

    Args:
        source: what to show.
        host, port: where to serve; ``port`` 0 serves nothing.
        terminal: the terminal view to redraw, or None.
        view_period: seconds between redraws of the terminal view.
        sample_period: seconds between samples of the swarm history.
    """

    def __init__(self, source: StatusSource, *, host: str = "127.0.0.1", port: int = 0,
                 terminal: TerminalView | None = None, view_period: float = 5.0,
                 sample_period: float = SAMPLE_PERIOD) -> None:
        self.source = source
        self.host, self.port = host, port
        self.terminal, self.view_period = terminal, view_period
        self.sample_period = sample_period
        self.history = SwarmHistory()
        self.server: StatusHTTPServer | None = None
        self._stage_flops: tuple[RunSpec, list[float]] | None = None
        self._tasks: list[asyncio.Task] = []

    def status_document(self) -> dict[str, Any]:
        """The ``/status.json`` document now."""
        spec = self.source.spec()
        stage_flops = self._flops_of(spec) if spec is not None else []
        return swarm_status(
            run_id=self.source.run_id, records=self.source.records(), stage_flops=stage_flops,
            seq_len=spec.model.seq_len if spec is not None else 0, history=self.history,
            local=self.source.local(), now=time.time(), sample=self.source.sample())

    async def start(self) -> None:
        if not self.port and self.terminal is None:
            return  # nothing to show: no server, no history to keep
        if self.port:
            self.server = StatusHTTPServer({}, host=self.host, port=self.port)
            self.server.routes.update(self._routes(self.server))  # /metrics counts the server's own requests
            try:
                await self.server.start()
            except OSError as e:
                self.server = None
                raise UserError(f"Cannot serve the status page on {self.host}:{self.port}: {e.strerror or e}; "
                                f"choose another --status-port (or 0 for none).") from e
            logger.info(f"status page at http://{self.host}:{self.server.port}/ (also /status.json, /metrics)")
        if self.source.owned_view is not None:
            self.source.owned_view.start()
        self._tasks.append(asyncio.create_task(self._sample_loop(), name="status-history"))
        if self.terminal is not None:
            self._tasks.append(asyncio.create_task(self._view_loop(), name="terminal-view"))

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.server is not None:
            await self.server.shutdown()
            self.server = None
        if self.source.owned_view is not None:
            await self.source.owned_view.shutdown()

    async def __aenter__(self) -> StatusService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def _routes(self, server: StatusHTTPServer) -> dict[str, Callable[[], Any]]:
        collectors = [SwarmCollector(self._swarm_only), HTTPCollector(server)]
        if self.source.snapshot is not None:
            collectors.insert(0, PeerCollector(self.source.snapshot, self.source.history))
        registry = make_registry(*collectors)

        async def page() -> Response:
            return Response(render_health_page(self.status_document()).encode(), "text/html; charset=utf-8")

        async def status_json() -> Response:
            body = json.dumps(self.status_document(), allow_nan=False).encode()
            return Response(body, "application/json")

        async def metrics() -> Response:
            return Response(render_metrics(registry), CONTENT_TYPE)

        return {"/": page, "/index.html": page, "/status.json": status_json, "/metrics": metrics}

    def _swarm_only(self) -> dict[str, Any]:
        doc = self.status_document()
        return {"stages": doc["stages"], "bottleneck": doc["bottleneck"], "totals": doc["totals"]}

    def _flops_of(self, spec: RunSpec) -> list[float]:
        if self._stage_flops is None or self._stage_flops[0] is not spec:
            self._stage_flops = (spec, [stage_flops_per_sample(spec, k) for k in range(spec.num_stages)])
        return self._stage_flops[1]

    async def _sample_loop(self) -> None:
        while True:
            try:
                doc = self.status_document()
                if doc["num_stages"]:
                    self.history.record(doc["time"], doc["totals"], doc["stages"])
            except Exception:  # the view must never take the peer down
                logger.exception("sampling the swarm status failed")
            await asyncio.sleep(self.sample_period * random.uniform(0.9, 1.1))

    async def _view_loop(self) -> None:
        while True:
            await asyncio.sleep(self.view_period)
            try:
                self.terminal.draw(self.status_document())
            except Exception:
                logger.exception("drawing the terminal view failed")


def terminal_for(mode: str, *, quiet: bool, stream: Any = None) -> TerminalView | None:
    """The terminal view for ``--terminal-view`` (auto/on/off) and ``--quiet``, or None."""
    stream = stream or sys.stdout
    if quiet or mode == "off":
        return None
    if mode == "auto" and not stream.isatty():
        return None
    return TerminalView(stream)


def open_status(source: StatusSource, *, host: str, port: int, terminal_view: str, quiet: bool = False,
                verbose: bool = False, view_period: float = 5.0) -> StatusService:
    """The status service of a peer or a bootstrap, as its options ask (``--status-host``,
    ``--status-port``, ``--terminal-view``, ``--quiet``, ``--verbose``)."""
    terminal = terminal_for(terminal_view, quiet=quiet)
    if terminal is not None and terminal.is_tty and not verbose:
        quiet_console_logs()  # the view redraws the screen; INFO lines would scroll it away
    return StatusService(source, host=host, port=port, terminal=terminal, view_period=view_period)


def quiet_console_logs() -> None:
    """Show only warnings on the console handlers (the JSONL metrics file still gets every event)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)
