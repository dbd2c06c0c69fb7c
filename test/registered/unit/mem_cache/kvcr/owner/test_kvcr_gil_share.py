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
