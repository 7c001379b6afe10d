#!/usr/bin/env python
"""Run tests N times in a row under the CPU hog; one JSON line per run.

    PYTHONPATH=. .venv/bin/python scripts/flake_check.py --runs 5 --timeout 900 \\
        tests/e2e/test_swarm.py tests/e2e/test_byzantine.py
    PYTHONPATH=. .venv/bin/python scripts/flake_check.py --gate --runs 5 --timeout 2400

With ``--gate`` each run is the gate as CI runs it: a fresh ``git clone`` of this checkout's HEAD, its
set-up (``scripts/setup.sh``, timed apart) and ``bash scripts/test.sh`` (``.ci/run``'s command) beside
one busy process per core for the whole run, not per test.

Each run is its own ``pytest`` process with ``MURMURATION_CPU_HOG=1`` (tests/e2e/cpu_hog.py: one busy
process per core beside the test), wrapped in ``timeout``. A line says the test, the run, pass or
fail, the seconds it took and the 1-minute load average before and after (/proc/loadavg); the
pytest output of each run goes to ``--log-dir``. Exit status 0 only if every run passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_1min() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_once(test: str, *, run: int, timeout: float, log_dir: Path, hog: bool) -> dict:
    log_path = log_dir / f"{test.replace('/', '_').replace('::', '__')}.run{run}.log"
    env = {**os.environ, "MURMURATION_CPU_HOG": "1" if hog else "0"}
    command = ["timeout", "--kill-after=30", str(int(timeout)),
               sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", test]
    load_before, started = load_1min(), time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - started
    return {"test": test, "run": run, "result": "pass" if rc == 0 else "fail", "rc": rc,
            "seconds": round(seconds, 1), "load_before": load_before, "load_after": load_1min(),
            "hog": hog, "log": str(log_path)}


def run_gate_once(*, run: int, timeout: float, log_dir: Path, hog: bool) -> dict:
    from tests.e2e.cpu_hog import open_cpu_hog

    clone = log_dir / f"gate-clone{run}"
    subprocess.run(["rm", "-rf", str(clone)], check=True)
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    log_path = log_dir / f"gate.run{run}.log"
    started = time.monotonic()
    with open(log_path, "w") as log:
        setup_rc = subprocess.run(["bash", "scripts/setup.sh"], cwd=clone, stdout=log, stderr=subprocess.STDOUT).returncode
        setup_seconds = time.monotonic() - started
        load_before, started = load_1min(), time.monotonic()
        env = {k: v for k, v in os.environ.items() if k != "MURMURATION_CPU_HOG"}
        command = ["timeout", "--kill-after=30", str(int(timeout)), "bash", "scripts/test.sh"]
        with open_cpu_hog(timeout + 60) if hog else contextlib.nullcontext():
            rc = setup_rc or subprocess.run(command, cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - started
    closing = [line for line in log_path.read_text(errors="replace").splitlines() if " in " in line and "passed" in line]
    return {"test": "gate", "commit": commit, "run": run, "result": "pass" if rc == 0 else "fail", "rc": rc,
            "setup_seconds": round(setup_seconds, 1), "seconds": round(seconds, 1), "load_before": load_before,
            "load_after": load_1min(), "hog": hog, "summary": closing[-1].strip("= ") if closing else "", "log": str(log_path)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="*", help="pytest node ids or files, run one after the other")
    parser.add_argument("--gate", action="store_true", help="run the whole gate on fresh clones instead of tests")
    parser.add_argument("--runs", type=int, default=5, help="runs of each test in a row")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a run is killed")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/flake_check"), help="pytest output of each run")
    parser.add_argument("--no-hog", action="store_true", help="the same runs without the CPU hog (a baseline)")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.gate == bool(args.tests):
        parser.error("name the tests to run, or --gate, not both")
    all_passed = True
    if args.gate:
        for run in range(1, args.runs + 1):
            record = run_gate_once(run=run, timeout=args.timeout, log_dir=args.log_dir, hog=not args.no_hog)
            print(json.dumps(record), flush=True)
            all_passed &= record["result"] == "pass"
    for test in args.tests:
        for run in range(1, args.runs + 1):
            record = run_once(test, run=run, timeout=args.timeout, log_dir=args.log_dir, hog=not args.no_hog)
            print(json.dumps(record), flush=True)
            all_passed &= record["result"] == "pass"
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
