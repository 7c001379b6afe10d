#!/usr/bin/env python
"""Run tests N times in a row under the CPU hog; one JSON line per run.

    PYTHONPATH=. .venv/bin/python scripts/flake_check.py --runs 5 --timeout 900 \\
        tests/e2e/test_swarm.py tests/e2e/test_byzantine.py

Each run is its own ``pytest`` process with ``MURMURATION_CPU_HOG=1`` (tests/e2e/cpu_hog.py: one busy
process per core beside the test), wrapped in ``timeout``. A line says the test, the run, pass or
fail, the seconds it took and the 1-minute load average before and after (/proc/loadavg); the
pytest output of each run goes to ``--log-dir``. Exit status 0 only if every run passed.
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="+", help="pytest node ids or files, run one after the other")
    parser.add_argument("--runs", type=int, default=5, help="runs of each test in a row")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a run is killed")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/flake_check"), help="pytest output of each run")
    parser.add_argument("--no-hog", action="store_true", help="the same runs without the CPU hog (a baseline)")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    all_passed = True
    for test in args.tests:
        for run in range(1, args.runs + 1):
            record = run_once(test, run=run, timeout=args.timeout, log_dir=args.log_dir, hog=not args.no_hog)
            print(json.dumps(record), flush=True)
            all_passed &= record["result"] == "pass"
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
