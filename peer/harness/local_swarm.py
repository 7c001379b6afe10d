"""A real swarm on this machine: run_bootstrap.py and run_peer.py as separate processes on 127.0.0.1.

Used by the demo, the end-to-end tests and the benchmarks. Every process starts in its own process
group (so its DHT child and p2pd go with it), reports readiness through files rather than sleeps,
and is stopped by PID in :meth:`LocalSwarm.shutdown`: first SIGINT (a graceful leave), then SIGKILL
of its group for anything still alive after the grace period.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# seconds a Ctrl+C'd peer may take to leave before it is killed: a leave waits for in-flight work and
# for its services up to peer.session.LEAVE_TIMEOUT each, then stops its averager and DHT node (a few
# seconds each); under load, with every peer leaving at once, that took over 30 s in CI
LEAVE_GRACE = 60.0


def listen_maddr(host: str) -> str:
    """Listen on ``host`` at a port the OS picks."""
    return f"/ip4/{host}/tcp/0"


@dataclass
class LocalProcess:
    name: str
    process: subprocess.Popen
    log_path: Path
    metrics_path: Path | None = None
    log_file: object = field(default=None, repr=False)
    _records: list = field(default_factory=list, repr=False)  # parsed so far: the file is only appended to
    _parsed_bytes: int = field(default=0, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def events(self, event: str | None = None) -> list[dict]:
        """Parsed lines of the peer's metrics file (optionally only one kind of event).

        Read on from where the last call stopped, whole lines only (tests poll this many times a
        second, and re-parsing a file of thousands of lines each time cost a core's tenth)."""
        if self.metrics_path is None:
            return []
        try:
            with open(self.metrics_path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._parsed_bytes:  # replaced: start over
                    self._records, self._parsed_bytes = [], 0
                f.seek(self._parsed_bytes)
                new = f.read()
        except FileNotFoundError:
            return []
        complete = new[:new.rfind(b"\n") + 1]  # a line being written right now waits for the next call
        self._parsed_bytes += len(complete)
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn line (a process killed mid-write)
            if isinstance(record, dict):
                self._records.append(record)
        return [r for r in self._records if event is None or r.get("event") == event]


class LocalSwarm:
    """Starts and stops a bootstrap node and peers as child processes, all logs under ``workdir``.

    Every process listens on ``host`` (loopback by default); a test of network faults gives the
    root-namespace end of a veth pair here, and starts a peer inside the namespace with
    ``start_peer(..., host=<the namespace's address>, command_prefix=["ip", "netns", "exec", ...])``.
    """

    def __init__(self, workdir: str | Path, *, run_id: str = "demo", python: str = sys.executable,
                 host: str = "127.0.0.1") -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.run_id, self.python, self.host = run_id, python, host
        self.bootstrap: LocalProcess | None = None
        self.peers: list[LocalProcess] = []
        self.maddrs: list[str] = []

    def start_bootstrap(self, *args: str, timeout: float = 60.0, host: str | None = None,
                        command_prefix: Sequence[str] = ()) -> list[str]:
        """Start run_bootstrap.py (listening on ``host``, default the swarm's, under ``command_prefix``)
        and wait until it wrote its multiaddrs; returns them."""
        maddrs_file = self.workdir / "bootstrap.maddrs"
        maddrs_file.unlink(missing_ok=True)
        self.bootstrap = self._spawn("bootstrap", "run_bootstrap.py", "--host-maddrs", listen_maddr(host or self.host),
                                     "--maddrs-file", str(maddrs_file), "--run-id", self.run_id, *args,
                                     command_prefix=command_prefix)
        wait_for(lambda: maddrs_file.exists() or not self.bootstrap.is_alive(), timeout, "the bootstrap to start")
        if not self.bootstrap.is_alive():
            raise RuntimeError(f"the bootstrap exited:\n{self.bootstrap.log_tail()}")
        self.maddrs = maddrs_file.read_text().split()
        return self.maddrs

    def run_owner(self, timeout: float = 30.0) -> str:
        """The owner key the bootstrap logs just after it wrote its multiaddrs (``--run-owner``)."""
        pattern = re.compile(r"is owned by key ([0-9a-f]{32})")
        wait_for(lambda: pattern.search(self.bootstrap.log_path.read_text()) or not self.bootstrap.is_alive(), timeout,
                 "the bootstrap to name its run's owner")
        found = pattern.search(self.bootstrap.log_path.read_text())
        if found is None:
            raise RuntimeError(f"the bootstrap exited:\n{self.bootstrap.log_tail()}")
        return found.group(1)

    def start_peer(self, *args: str, bootstrap: Sequence[str] | None = None, run_id: str | None = None,
                   env: Mapping[str, str] | None = None, host: str | None = None,
                   command_prefix: Sequence[str] = ()) -> LocalProcess:
        """Start run_peer.py joined through the bootstrap (or the given multiaddrs), listening on
        ``host`` (default: the swarm's), run under ``command_prefix`` (e.g. ``ip netns exec <ns>``);
        ``env`` adds to this process's environment (e.g. the test-only fault injection of peer/faults.py)."""
        index = len(self.peers)
        metrics = self.workdir / f"peer{index}.jsonl"
        metrics.unlink(missing_ok=True)  # the peer appends; a previous run's events must not count
        peer = self._spawn(f"peer{index}", "run_peer.py", "--bootstrap", *(bootstrap or self.maddrs),
                           "--run-id", run_id or self.run_id, "--host-maddrs", listen_maddr(host or self.host),
                           "--metrics-file", str(metrics), *args, env=env, command_prefix=command_prefix)
        peer.metrics_path = metrics
        self.peers.append(peer)
        return peer

    def stop(self, proc: LocalProcess, *, graceful: bool = True, timeout: float = 30.0) -> int | None:
        """SIGINT (graceful) or SIGKILL of the process group; returns the exit code."""
        if proc.is_alive():
            if graceful:
                proc.process.send_signal(signal.SIGINT)
                try:
                    return proc.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            _kill_group(proc.process)
        try:
            return proc.process.wait(10)
        finally:
            if proc.log_file is not None:
                proc.log_file.close()
                proc.log_file = None

    def shutdown(self, *, timeout: float = LEAVE_GRACE) -> None:
        """SIGINT every peer at once, then the bootstrap; kill any process group still alive after that."""
        for proc in self.peers:
            if proc.is_alive():
                proc.process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout
        for proc in self.peers:
            try:
                proc.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if self.bootstrap is not None:
            self.stop(self.bootstrap, timeout=10.0)
        for proc in self.all_processes():
            _kill_group(proc.process)  # whatever is left of each group (DHT children, p2pd)
            if proc.process.poll() is None:
                proc.process.wait(10)
            if proc.log_file is not None:
                proc.log_file.close()
                proc.log_file = None

    def all_processes(self) -> Iterator[LocalProcess]:
        yield from self.peers
        if self.bootstrap is not None:
            yield self.bootstrap

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} (pid {p.pid}, exit {p.process.poll()})\n{p.log_tail()}" for p in self.all_processes())

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _spawn(self, name: str, script: str, *args: str, env: Mapping[str, str] | None = None,
               command_prefix: Sequence[str] = ()) -> LocalProcess:
        log_path = self.workdir / f"{name}.log"
        log_file = open(log_path, "w")
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen([*command_prefix, self.python, str(REPO_ROOT / script), *args], stdout=log_file,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=env,
                                   start_new_session=True)
        return LocalProcess(name=name, process=process, log_path=log_path, log_file=log_file)


def wait_for(condition, timeout: float, what: str, *, period: float = 0.2) -> None:
    """Poll ``condition`` until it holds; ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(period)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
