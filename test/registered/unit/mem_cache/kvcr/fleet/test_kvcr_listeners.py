"""What a running linker listens on: its KVCR control port and UCX's data sockets
on the chosen device (``UCX_NET_DEVICES=lo`` here), nothing else.

kvcr 0.1.1 asks NIXL for its metadata listener, which binds every address and
hands this worker's agent metadata (the keys to its registered memory) to anyone
who connects; ``owner.kvcr_patches`` turns it off. These tests read the process's
own listening sockets, so a listener that comes back fails them.
"""

from __future__ import annotations

import psutil
import pytest

from cpu_harness.kvcr_pages import make_linker, make_pool

pytestmark = pytest.mark.kvcr


def _listening() -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }


def test_a_linker_listens_on_the_loopback_device_only():
    """The control port, and UCX's sockets on ``lo``; no wildcard listener."""
    before = _listening()
    lk = make_linker(make_pool())
    try:
        opened = _listening() - before
        control = ("127.0.0.1", int(lk.endpoint.rsplit(":", 1)[1]))
        assert control in opened, (opened, lk.endpoint)
        assert {ip for ip, _ in opened} == {"127.0.0.1"}, opened
    finally:
        lk.close()


def test_nixl_agents_kvcr_builds_have_no_listener():
    """The agent config kvcr asks for, as NIXL receives it."""
    import kvcr.progress as progress

    lk = make_linker(make_pool())
    try:
        seen = progress.nixl_agent_config(listen_port=0, enable_listen_thread=True)
        assert seen.enable_listen is False
        assert seen.sync_mode is not None  # kept thread-safe without a listener
    finally:
        lk.close()
