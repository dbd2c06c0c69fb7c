"""End to end on CPU servers: local round trip and hinted peer reuse (the demo driver).

Opt-in (``-m scenario``, run by ``make faults``, and the same driver runs in
``make demo`` and ``make validate``): two minutes of three server start-ups on 2
cores. ``make test`` covers most of it in smaller server tests: the local replay
(against the same server's first answer) in ``test_kvcr_server_smoke``, the
hinted peer restore in ``test_kvcr_event_hints_e2e`` and
``test_kvcr_kv_event_router``. Only here are both compared with a server
without the linker, and a peer without a hint shown to restore nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cpu_harness.server import REPO

pytestmark = [pytest.mark.server, pytest.mark.kvcr, pytest.mark.scenario]

DRIVER = REPO / "test" / "manual" / "kvcr_direct_linker" / "kvcr_validate.py"


def test_local_round_trip_and_hinted_peer_reuse_match_the_control(tmp_path):
    """Both restore >= 90% of the prompt from KVCR with output equal to no-linker."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(DRIVER),
            "--checks",
            "local_round_trip,peer_reuse,no_hint_control",
            "--prompt-len",
            "256",
            "--report",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1] == f"REPORT {report}", (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    body = json.loads(report.read_text())
    checks = {c["name"]: c for c in body["checks"]}
    assert set(checks) == {"local_round_trip", "peer_reuse", "no_hint_control"}
    for name in ("local_round_trip", "peer_reuse"):
        check = checks[name]
        assert check["output_matches_control"], check
        assert check["external_cached_tokens"] >= 0.9 * check["expected_tokens"] > 0, (
            check
        )
        assert check["passed"], check
    assert checks["no_hint_control"]["external_cached_tokens"] == 0
    assert checks["no_hint_control"]["passed"]
    assert proc.returncode == 0
