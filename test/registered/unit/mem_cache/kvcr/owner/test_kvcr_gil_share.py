"""The linker lowers the scheduler process's GIL switch interval, never raises it."""

from __future__ import annotations

import sys

import pytest

from sglang.srt.mem_cache.storage.kvcr.owner.gil_share import share_gil


@pytest.fixture
def interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_lowers_to_the_configured_bound(interval):
    assert share_gil(500) == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_never_raises_one_set_lower(interval):
    sys.setswitchinterval(0.0002)
    assert share_gil(500) == pytest.approx(0.0002)
    assert sys.getswitchinterval() == pytest.approx(0.0002)


def test_zero_leaves_it(interval):
    assert share_gil(0) == pytest.approx(0.005)
    assert sys.getswitchinterval() == pytest.approx(0.005)


@pytest.mark.kvcr
def test_a_built_linker_lowers_it_and_a_refused_build_does_not(interval):
    """Through ``build_linker``: untouched by a build its config refuses, lowered
    once a linker is built with the default config."""
    from cpu_harness.kvcr_pages import make_linker, make_pool
    from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError

    pool = make_pool()
    with pytest.raises(KVCRConfigError, match="gil_switch_interval_us"):
        make_linker(pool, gil_switch_interval_us=7)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    linker = make_linker(pool)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        linker.close()
