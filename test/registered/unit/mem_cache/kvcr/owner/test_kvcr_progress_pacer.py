"""The idle wait wrapped around kvcr's progress iteration (kvcr_patches/idle_wait.py).

An idle loop blocks on its wake descriptor and its control socket; anything in
flight keeps kvcr's 1 ms pace. The idle period here is 30 s, far past every
deadline, so a test that returns in time was woken, not timed out.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from cpu_harness.kvcr_pages import make_linker, make_pool
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import idle_wait

DEADLINE_S = 10.0  # far below the 30 s idle wait


class _Backend:
    """What kvcr's progress loop polls through: ``_poll.__self__._control``."""

    def __init__(self, control: object | None) -> None:
        self._control = control

    def poll_progress(self, *_: object) -> None:
        return None


def _loop_state(control: object | None = None, **kw):
    state = {
        "_in_flight_ops": {},
        "_completed_backlog": [],
        "_stop_requested": False,
        "_poll": _Backend(control).poll_progress,
    }
    return SimpleNamespace(**{**state, **kw})


@pytest.fixture
def paced(monkeypatch):
    monkeypatch.setattr(idle_wait, "_idle_s", 30.0)
    results: dict[str, object] = {"did": False, "during": None}

    def iteration(_self):
        if results["during"] is not None:
            results["during"]()
        return results["did"]

    return idle_wait._paced(iteration), results


def _run(step, state) -> tuple[threading.Thread, list[bool]]:
    out: list[bool] = []
    runner = threading.Thread(target=lambda: out.append(step(state)), daemon=True)
    runner.start()
    return runner, out


def _stop(step, state) -> None:
    """End the loop's wait descriptor as kvcr's last iteration does."""
    state._stop_requested = True
    step(state)


def test_idle_iteration_waits_until_woken(paced):
    step, _ = paced
    state = _loop_state()
    runner, out = _run(step, state)
    runner.join(0.2)
    assert runner.is_alive()  # idle: it waits instead of spinning every 1 ms
    idle_wait.wake()
    runner.join(DEADLINE_S)
    assert not runner.is_alive() and out == [True]
    _stop(step, state)


def test_work_kvcr_queues_for_the_loop_ends_its_wait(paced):
    """kvcr's owner thread queues progress work itself (a source write resumed
    in ``poll_completed``): the wrapped ``submit`` wakes that loop."""
    step, _ = paced
    state = _loop_state()
    queued: list[object] = []
    submit = idle_wait._waking(lambda loop, item: queued.append(item))
    runner, out = _run(step, state)
    runner.join(0.2)
    assert runner.is_alive()
    submit(state, "source write")
    runner.join(DEADLINE_S)
    assert not runner.is_alive() and out == [True] and queued == ["source write"]
    _stop(step, state)
    submit(state, "after stop")  # a loop without a descriptor: nothing written
    assert queued == ["source write", "after stop"]


def test_a_peer_message_on_the_control_socket_ends_the_wait(paced):
    """No wake: only a peer's message arrives, and the loop polls at once."""
    step, _ = paced
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.linger = push.linger = 0
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        state = _loop_state(SimpleNamespace(_socket=pull))
        runner, out = _run(step, state)
        runner.join(0.2)
        assert runner.is_alive()
        push.send(b"target_metadata")
        runner.join(DEADLINE_S)
        assert not runner.is_alive() and out == [True]
        assert pull.recv(zmq.NOBLOCK) == b"target_metadata"  # left for kvcr
        _stop(step, state)
    finally:
        pull.close()
        push.close()
        ctx.term()


def test_a_wake_during_the_iteration_is_not_lost(paced):
    """A command handed over while the iteration runs (after it drained its
    wakes): the wait that follows returns at once."""
    step, results = paced
    results["during"] = idle_wait.wake
    state = _loop_state()
    runner, out = _run(step, state)
    runner.join(DEADLINE_S)
    assert not runner.is_alive() and out == [True]
    results["during"] = None
    _stop(step, state)


@pytest.mark.parametrize(
    "busy",
    [
        {"_in_flight_ops": {1: object()}},
        {"_completed_backlog": [object()]},
        {"_stop_requested": True},
        {"_active_transfers": {1: object()}},
        {"_kvcr_pacer_active": float("inf")},  # worked within RECENT_S
        # A control channel without a socket to wait on: kvcr's own pace.
        {"_poll": _Backend(SimpleNamespace(_socket=None)).poll_progress},
    ],
)
def test_busy_loop_is_not_paced(paced, busy):
    step, _ = paced
    runner, out = _run(step, _loop_state(**busy))
    runner.join(DEADLINE_S)
    assert not runner.is_alive()
    assert out == [False]  # kvcr then sleeps its own 1 ms


def test_an_iteration_that_worked_returns_at_once(paced):
    step, results = paced
    results["did"] = True
    state = _loop_state()
    runner, out = _run(step, state)
    runner.join(DEADLINE_S)
    assert out == [True]
    _stop(step, state)


def test_a_stopped_loop_gives_its_descriptor_back(paced):
    step, results = paced
    results["did"] = True
    state = _loop_state()
    step(state)
    fd = state._kvcr_wake_fd
    assert fd in idle_wait._WAKE_FDS
    _stop(step, state)
    assert state._kvcr_wake_fd is None and fd not in idle_wait._WAKE_FDS
    idle_wait.wake()  # writes no descriptor that is not a paced loop's


def test_a_failing_iteration_gives_its_descriptor_back(paced):
    """kvcr's loop ends with the failure of an iteration: no descriptor stays."""
    step, results = paced
    state = _loop_state()

    def fail():
        raise RuntimeError("NIXL went away")

    results["did"] = True
    step(state)
    fd = state._kvcr_wake_fd
    results["during"] = fail
    with pytest.raises(RuntimeError, match="NIXL went away"):
        step(state)
    assert fd not in idle_wait._WAKE_FDS


@pytest.mark.kvcr
def test_a_real_kvcr_loop_waits_on_its_guarded_control_socket():
    """kvcr 0.1.1 as installed: the paced loop finds the channel's live PULL
    socket (the guarded one that replaced kvcr's), and gives its wake
    descriptor back when KVCR closes."""
    lk = make_linker(make_pool())
    try:
        progress = lk.session.adapter.call(lambda kv: kv._core._progress)
        deadline = time.monotonic() + DEADLINE_S
        while getattr(progress, "_kvcr_wake_fd", None) is None:
            assert time.monotonic() < deadline, "the paced loop never ran"
            time.sleep(0.01)
        fd = progress._kvcr_wake_fd
        assert fd in idle_wait._WAKE_FDS
        (sock,) = idle_wait._peer_socket(progress)
        assert isinstance(sock, zmq.Socket) and not sock.closed
        assert sock.type == zmq.PULL
        assert sock.getsockopt(zmq.MAXMSGSIZE) > 0  # the guarded socket
        assert hasattr(type(progress).submit, "__wrapped__")  # submits wake it
    finally:
        lk.close()
    assert fd not in idle_wait._WAKE_FDS


def test_a_loop_given_its_own_sleep_keeps_it_whatever_the_process_value(paced):
    """A loop's own sleep (``pace``) wins over the process-wide one: a loop told
    0 keeps kvcr's 1 ms pace while the process value is 30 s."""
    step, _ = paced
    state = _loop_state(_kvcr_idle_s=0.0)
    runner, out = _run(step, state)
    runner.join(DEADLINE_S)
    assert not runner.is_alive() and out == [False]  # returned, never waited
    _stop(step, state)


def test_each_real_kvcr_loop_sleeps_by_its_own_operation_timeout():
    """Two linkers in one process, operation timeouts 300 and 5000 ms (idle
    sleeps 75 and 100 ms, unset): each loop keeps its own, though the process
    value is the last one built's."""
    short = make_linker(make_pool(), operation_timeout_ms=300, abandon_timeout_ms=600)
    try:
        long = make_linker(make_pool())
        try:
            sleeps = [
                lk.session.adapter.call(lambda kv: kv._core._progress._kvcr_idle_s)
                for lk in (short, long)
            ]
            assert sleeps == [0.075, 0.1]
            assert idle_wait._idle_s == 0.1  # the process value: the last built
        finally:
            long.close()
    finally:
        short.close()
