"""Fixtures the KVCR test folders share (each folder's own are in its conftest.py):
a small real CPU KV pool and a bare KVCR linker over it (``cpu_harness.kvcr_pages``),
closed after each test (layout/, fleet/, observability/, linker/), and
``plugin_hooks``: SGLang's plugin loader run once per module, with every hook of
ours checked installed (config/, layout/, sglang_hooks/).

A module changes what it gets by overriding ``pool`` (another pool) or
``linker_options`` (``kvcr_pages.make_linker`` keyword arguments: components,
model, linker config fields); the linker itself is always built and closed here.
"""

from __future__ import annotations

from typing import Any

import pytest

from cpu_harness import kvcr_pages


@pytest.fixture
def pool() -> Any:
    return kvcr_pages.make_pool()


@pytest.fixture
def linker_options() -> dict[str, Any]:
    return {}


@pytest.fixture
def linker(pool: Any, linker_options: dict[str, Any]) -> Any:
    lk = kvcr_pages.make_linker(pool, **linker_options)
    yield lk
    lk.close()


@pytest.fixture(scope="module")
def plugin_hooks() -> None:
    from sglang.srt.plugins import load_plugins

    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

    load_plugins()
    missing = [t for t, ok in integration.installed_hooks().items() if not ok]
    assert not missing, f"load_plugins() left {missing} unhooked"
