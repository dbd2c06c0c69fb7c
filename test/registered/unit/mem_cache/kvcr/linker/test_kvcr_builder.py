"""``builder.build_linker``: what a refused build leaves behind (nothing).

The builder registers the layer counter where SGLang waits on it before it
takes any memory or starts KVCR, so a refusal there leaves no thread, no port
and no page-locked buffer behind (a retry in the same process, as ``Engine``
users do, finds the control port free).
"""

from __future__ import annotations

import threading

import psutil
import pytest

from cpu_harness.kvcr_pages import make_linker, make_pool
from sglang.srt.mem_cache.storage.kvcr import rank_setup

pytestmark = pytest.mark.kvcr


def _listening() -> set[int]:
    return {
        c.laddr.port
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }


def _kvcr_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if "kvcr" in t.name.lower()}


def test_a_refused_counter_registration_leaves_nothing_running(monkeypatch):
    pool = make_pool()
    threads, ports = _kvcr_threads(), _listening()

    def refuse(params, layout, counter):
        raise TypeError("this request pool takes no layer counter")

    monkeypatch.setattr(rank_setup, "register_state_counter", refuse)
    with pytest.raises(TypeError, match="layer counter"):
        make_linker(pool)
    assert _kvcr_threads() <= threads
    assert _listening() <= ports
    monkeypatch.undo()
    lk = make_linker(pool)  # the same process builds one afterwards
    try:
        assert lk.endpoint.startswith("tcp://127.0.0.1:")
    finally:
        lk.close()
