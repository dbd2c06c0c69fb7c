"""Hostile-input fuzzing (hypothesis) of the parsers that read untrusted text: the
router hint and the startup config. ``make faults`` runs these modules with more
examples (``KVCR_FUZZ_EXAMPLES``).

``quiet_hint_warnings`` (every module here): each fresh hint parser warns once per
reason; over thousands of examples that is noise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module", autouse=True)
def quiet_hint_warnings() -> Iterator[None]:
    hint_logger = logging.getLogger(
        "sglang.srt.mem_cache.storage.kvcr.fleet.router_hint"
    )
    level = hint_logger.level
    hint_logger.setLevel(logging.ERROR)
    yield
    hint_logger.setLevel(level)
