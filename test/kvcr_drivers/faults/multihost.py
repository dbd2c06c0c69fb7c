"""Multi-host: ``test_kvcr_multihost.py`` under pytest (``-m netns``): linker
servers in Linux network namespaces on one bridge; peer reuse with the allowlist
and with CURVE, a host off the allowlist refused (pages and NIXL metadata on every
port), a peer killed mid-transfer. Needs root; without namespaces it fails, never
skips. Returns each test's outcome and time from pytest's JUnit XML.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
TESTS = REPO / "test/registered/unit/mem_cache/kvcr/fleet/test_kvcr_multihost.py"
EXPECTED = 5  # tests in TESTS
TIMEOUT_S = 1800
INTERRUPT_GRACE_S = 180


def _outcomes(xml: Path) -> dict[str, dict[str, Any]]:
    tests: dict[str, dict[str, Any]] = {}
    if not xml.exists():
        return tests
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests[case.get("name", "?")] = {
            "outcome": bad[0] if bad else "passed",
            "time_s": round(float(case.get("time", 0.0)), 1),
            **props,
        }
    return tests


def run_multihost(work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    xml = work / "multihost.xml"
    xml.unlink(missing_ok=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-m", "netns", f"--junitxml={xml}", f"--basetemp={work / 'tmp'}",
            str(TESTS),
        ],
        cwd=str(REPO),
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGINT: pytest still runs the teardown that removes the namespaces.
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=30)
        out += f"\n[multihost] timed out after {TIMEOUT_S} s"
    rc, tail = proc.returncode, out[-4000:]
    tests = _outcomes(xml)
    return {
        "passed": rc == 0
        and len(tests) == EXPECTED
        and all(t["outcome"] == "passed" for t in tests.values()),
        "pytest_rc": rc,
        "tests": tests,
        "wall_s": round(time.monotonic() - started, 1),
        "tail": tail,
    }
