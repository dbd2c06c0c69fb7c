"""A built linker has SGLang's native page hash loaded before the first insert.

With a linker, SGLang's insert hashes every new page through a native extension
that is built (a C++ compile on a fresh host) and loaded on first use.
``build_linker`` loads it, so the first request does not wait for it; a load that
fails is logged and the build goes on (the first insert retries).
"""

from __future__ import annotations

import logging

import pytest
from sglang.srt.mem_cache.cpp_utils import native_hash

from cpu_harness.kvcr_pages import make_linker, make_pool

pytestmark = pytest.mark.kvcr


def test_build_loads_the_native_page_hash():
    native_hash._load_native_hash_module.cache_clear()
    linker = make_linker(make_pool())
    try:
        assert native_hash._load_native_hash_module.cache_info().currsize == 1
    finally:
        linker.close()


def test_a_page_hash_that_fails_to_load_is_logged_not_fatal(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("Failed to load HiCache native hash extension (injected)")

    monkeypatch.setattr(native_hash, "get_native_hash", broken)
    monkeypatch.setattr("sglang.srt.mem_cache.utils.get_native_hash", broken)
    with caplog.at_level(logging.WARNING):
        linker = make_linker(make_pool())
    try:
        assert "native page hash did not load" in caplog.text
        assert "injected" in caplog.text
    finally:
        linker.close()
