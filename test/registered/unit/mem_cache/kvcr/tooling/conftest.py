"""Tests of the tooling, not of the plugin: the CPU harness (tiny model, start-up
hooks, torchvision stand-in), the bench's figures table and pictures, the GPU check
script, the Grafana dashboard and the install from a checkout.

``fake_python``: a stand-in interpreter for testing a script's own logic (it
prints its arguments, sleeps ``$FAKE_SLEEP`` s, exits ``$FAKE_RC``; with
``$FAKE_DETACH`` it leaves a process in its own session, as an SGLang server does,
and appends its pid there).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    fake = tmp_path / "fake-python"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "fake-python $* --device --quick"\n'
        'if [ -n "${FAKE_DETACH:-}" ]; then setsid sleep 300 & echo $! >> "$FAKE_DETACH"; fi\n'
        'sleep "${FAKE_SLEEP:-0}"\n'
        'exit "${FAKE_RC:-0}"\n'
    )
    fake.chmod(0o755)
    return fake
