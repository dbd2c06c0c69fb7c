"""End to end: real ``sglang.launch_server`` processes on CPU with the KVCR linker
(``server`` marker; slow), and the demo driver: local round trips, hinted peer
reuse, model families, the digest between workers, metrics, KV-event hints, the
example router, bad configs refused at launch, and faults injected into a serving
worker (``kvcr_fault_hook``) that must leave it answering.

``tiny_model``: the tiny random-weight Llama the servers here serve, built once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpu_harness.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model()
