"""Fuzz: ``test_kvcr_fuzz.py`` under pytest with ``KVCR_FUZZ_EXAMPLES`` examples a
target; each target reports its examples, failures and (where it counts them)
accepted inputs as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
FUZZ_TESTS = REPO / "test/registered/unit/mem_cache/kvcr/fuzz/test_kvcr_fuzz.py"


def run_fuzz(examples: int, work: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    report = work / "fuzz.jsonl"
    report.unlink(missing_ok=True)
    env = {
        **os.environ,
        "KVCR_FUZZ_EXAMPLES": str(examples),
        "KVCR_FUZZ_REPORT": str(report),
    }
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(FUZZ_TESTS),
        ],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = []
    if report.exists():
        rows = [json.loads(line) for line in report.read_text().splitlines() if line]
    meta = {
        "pytest_rc": proc.returncode,
        "wall_s": round(time.monotonic() - started, 1),
        "tail": proc.stdout[-1500:],
    }
    return rows, meta
