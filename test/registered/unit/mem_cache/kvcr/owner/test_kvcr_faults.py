"""Fault injection on the real kvcr + NIXL: the fast scenarios of ``make faults``.

Each test but the last runs one scenario of ``kvcr_drivers.faults`` (what
``make faults`` runs) and fails with the scenario's failed checks.
Every scenario asserts that no wrong KV was admitted (bytes compared; a lookup
reports only claimed pages), that the linker and KVCR hold no claim at the end,
that no thread outlives ``close()`` and that RSS stayed bounded; the docstrings
say what each fault is. The peer linkers run in spawned child processes, started
when the module starts so their imports overlap with the in-process scenarios.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cpu_harness.kvcr_pages import wait_until
from kvcr_drivers.faults import common as faults
from kvcr_drivers.faults import local
from kvcr_drivers.faults.peer_scenarios import run_peer_scenarios
from kvcr_drivers.faults.peers import PeerChildren
from kvcr_drivers.faults.suite import IN_PROCESS

pytestmark = pytest.mark.kvcr


def verdict(sc: faults.Scenario) -> str:
    return (
        f"{sc.name}: failed checks {sc.failed_checks()}; outcome {sc.outcome!r}; "
        f"details {sc.details}\n{sc.error}"
    )


@pytest.fixture(scope="module")
def peer_children() -> Iterator[PeerChildren]:
    children = PeerChildren.spawn()
    try:
        yield children
    finally:
        children.close()


@pytest.fixture(scope="module")
def peer_results(peer_children: PeerChildren) -> dict[str, faults.Scenario]:
    faults.warm_up()
    return {sc.name: sc for sc in run_peer_scenarios(peer_children)}


def run(name: str) -> faults.Scenario:
    sc = faults.run_scenario(name, IN_PROCESS[name])
    assert sc.passed, verdict(sc)
    return sc


@pytest.mark.usefixtures("peer_children")
def test_stale_hint_restores_only_pages_the_peer_still_holds():
    """The hint names pages the peer evicted or never had: the hit stops at the
    first of them, the one restored page equals the peer's bytes, and the
    failure is fast (the linker declines source pins at once)."""
    sc = run("stale_hint")
    assert sc.details["mixed_prepare_s"] < faults.STALE_TIMEOUT_MS / 2000.0


def test_late_completions_after_the_preparation_deadline_are_released():
    """A fetch landing after the deadline is released at once when its request
    already ended, and held then released by a request that is still alive."""
    run("preparation_deadline_late_completions")


def test_failed_restore_copy_on_one_layer_aborts_only_that_request():
    """Layer 1's copy raises: SGLang aborts the request ('External KV cache load
    failed'), layer 1 is never written, claims are released, and later requests
    are clean misses instead of restores."""
    sc = run("failed_device_copy_mid_layer")
    assert "External KV cache load failed" in sc.outcome


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_flush_with_offload_and_preparation_in_flight_leaves_nothing_behind(path):
    """reset() while KVCR still has a deposit and a fetch queued: no claim, no
    stale FIFO result, old pages miss, and the rebuilt KVCR restores exactly."""
    run("reset_during_inflight" + ("_staged" if path == "staged" else ""))


def test_exhausted_kvcr_capacity_fails_deposits_in_position():
    """With every slot claimed or filling, deposits fail; a fast failure waits
    behind a slower success in the FIFO; capacity returns after the release."""
    sc = run("capacity_exhausted")
    assert sc.details["results"] == [True, False, False, False]


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_offload_backpressure_refuses_instead_of_queueing(path):
    """Offloads beyond max_inflight_offload_bytes fail at once and in position;
    the owner's command queue never holds more than the budget allows."""
    sc = run("offload_backpressure" + ("_staged" if path == "staged" else ""))
    fits = local.BACKPRESSURE_BUDGET_PAGES  # one-page offloads inside the budget
    assert sc.details["stored"] == fits
    assert sc.details["refused"] == sc.details["submitted"] - fits


def test_peer_frozen_then_resumed(peer_results):
    """SIGSTOP shorter than the operation timeout: the fetch waits and lands
    exact; longer: a clean miss; after SIGCONT the peer serves again."""
    sc = peer_results["peer_frozen_resumed"]
    assert sc.passed, verdict(sc)


@pytest.mark.leaks_kvcr  # B's KVCR keeps the dead peer's quarantined operation
def test_peer_killed_mid_fetch_is_a_miss_and_the_worker_keeps_serving(peer_results):
    """SIGKILL with two fetches in flight: both requests miss, nothing is
    claimed, KVCR reports the quarantine, and local offload/restore still work."""
    sc = peer_results["peer_killed_mid_fetch"]
    assert sc.passed, verdict(sc)


@pytest.mark.leaks_kvcr
def test_peer_restarted_on_the_same_endpoint_serves_its_own_bytes(peer_results):
    """A new peer on the dead one's endpoint: both workers get its bytes (one
    refused attempt at most), the dead peer's pages miss, and the worker whose
    request was still queued closes cleanly."""
    sc = peer_results["peer_restarted_same_endpoint"]
    assert sc.passed, verdict(sc)


@pytest.mark.leaks_kvcr
def test_flush_with_a_quarantined_peer_operation_quarantines_the_old_dram(
    peer_results,
):
    """reset() on the worker still holding the dead peer's operation: bounded,
    the old DRAM is quarantined exactly when the old KVCR could not close, and
    the rebuilt KVCR stores, restores byte-exact and closes cleanly."""
    sc = peer_results["flush_with_quarantined_peer_op"]
    assert sc.passed, verdict(sc)


def test_unreachable_peer_leaves_only_kvcrs_documented_retained_state(peer_results):
    """In a child process: a peer that never answers gives a miss with no claim;
    KVCR keeps the operation quarantined, close() returns within its bound and
    the adapter retains the instance; no Python thread is left."""
    sc = peer_results["unreachable_peer_close_retained"]
    assert sc.passed, verdict(sc)


def test_hint_outside_the_allowlist_never_opens_a_connection(peer_results):
    """Listeners on 127.0.0.2, behind a host name, and outside an allowed port
    range see no connection while the request is prepared and looked up; each
    rejection is counted; the same kind of hint inside the allowlist connects."""
    control = peer_results["unreachable_peer_close_retained"].details
    assert control.get("connected") is True, control
    sc = faults.run_scenario(
        "hint_outside_allowlist",
        lambda sc: local.scenario_hint_outside_allowlist(sc, control),
    )
    assert sc.passed, verdict(sc)


def test_control_port_chosen_by_the_os_is_never_released_before_use():
    """control_port 0: the channel adopts a listener the OS bound, so no other
    process can take the port between choosing and binding it (the old
    pick-close-rebind raced and failed startup with 'Address already in use')."""
    import socket

    from kvcr.control_channels import ZmqPeerControlChannel

    from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_factory

    channel = kvcr_factory._channel_on_own_port(
        ZmqPeerControlChannel, "127.0.0.1", "127.0.0.1"
    )
    try:
        port = int(channel.endpoint.rsplit(":", 1)[1])
        with socket.socket() as intruder, pytest.raises(OSError):
            intruder.bind(("127.0.0.1", port))
        channel.initialize()  # binds ZMQ on the adopted listener
    finally:
        channel.close()

    def released() -> bool:  # ZMQ closes its descriptor on its own I/O thread
        with socket.socket() as later:
            later.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                later.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    wait_until(released, timeout=10.0, what="port released by close()")
