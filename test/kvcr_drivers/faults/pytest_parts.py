"""The ``make faults`` parts that are opt-in pytest modules, each run under pytest
with its marker and judged from pytest's JUnit XML (each test's outcome and time;
the part passes only when every expected test ran and passed).

- ``multihost`` (``-m netns``, ``test_kvcr_multihost.py``): linker servers in Linux
  network namespaces on one bridge; peer reuse with the allowlist and with CURVE,
  a host off the allowlist refused (pages and NIXL metadata on every port), a peer
  killed mid-transfer. Needs root; without namespaces it fails, never skips.
- ``injection`` (``-m server_faults``, ``test_kvcr_fault_injection_e2e.py``): one
  CPU linker server with faults injected into KVCR and the linker's side threads;
  serving goes on and every answer equals the recompute.
- ``validate`` (``-m scenario``, ``test_kvcr_e2e.py``): the validation driver's
  local round trip and hinted peer reuse, outputs equal to a no-linker server.
- ``digest`` (``-m scenario``, ``test_kvcr_digest_e2e.py``): three linker servers;
  a hinted fetch restores only between workers whose KV bytes agree.
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
TESTS = REPO / "test/registered/unit/mem_cache/kvcr"
# part -> (marker, module under TESTS, how many tests it holds)
PARTS = {
    "multihost": ("netns", "fleet/test_kvcr_multihost.py", 5),
    "injection": ("server_faults", "e2e/test_kvcr_fault_injection_e2e.py", 5),
    "validate": ("scenario", "e2e/test_kvcr_e2e.py", 1),
    "digest": ("scenario", "e2e/test_kvcr_digest_e2e.py", 1),
}
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


def run_part(name: str, work: Path) -> dict[str, Any]:
    """Run part ``name`` of ``PARTS`` under pytest in ``work``."""
    marker, module, expected = PARTS[name]
    work.mkdir(parents=True, exist_ok=True)
    xml = work / f"{name}.xml"
    xml.unlink(missing_ok=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-m", marker, f"--junitxml={xml}", f"--basetemp={work / 'tmp'}",
            str(TESTS / module),
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
        out += f"\n[{name}] timed out after {TIMEOUT_S} s"
    rc, tail = proc.returncode, out[-4000:]
    tests = _outcomes(xml)
    return {
        "passed": rc == 0
        and len(tests) == expected
        and all(t["outcome"] == "passed" for t in tests.values()),
        "pytest_rc": rc,
        "tests": tests,
        "wall_s": round(time.monotonic() - started, 1),
        "tail": tail,
    }
