"""A failed owner thread leaves nothing unanswered and raises nothing on the
scheduler path (issue 24, finding 1).

The KVCR here is a stand-in (like ``Exploding`` in test_kvcr_adapter.py): the
failure is injected where kvcr's own would surface, in ``poll_completed`` or in a
call the owner thread makes, so every path is deterministic.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import types

import pytest

from cpu_harness import kvcr_stack
from cpu_harness.kvcr_pages import wait_until
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRAdapterFailed
from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_executor
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_adapter import KVCRAdapter
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    AdapterLimits,
    Deposit,
    DiscardHint,
    EntryStatus,
    Fetch,
    OpDone,
    OpKind,
    Release,
)

pytestmark = pytest.mark.kvcr

BOOM = b"boom"


@pytest.fixture(autouse=True)
def stand_in_fills(monkeypatch):
    """Deposits reach the stand-in's ``deposit`` (the real path reserves slots in
    kvcr's core, which a stand-in has not) and their copies never finish."""
    fills = kvcr_executor.page_fills

    def new_fill(kv):
        return types.SimpleNamespace(handle=None, waiting=set(), jobs=[])

    def begin(kv, fill, blocks, wake):
        fill.handle = kv.deposit(blocks)

    monkeypatch.setattr(fills, "new_fill", new_fill)
    monkeypatch.setattr(fills, "begin", begin)
    monkeypatch.setattr(fills, "poll", lambda kv, fill: None)
    monkeypatch.setattr(fills, "abandon", lambda kv, fill: True)


class FlakyKVCR:
    """Takes deposits and fetches and never completes them; ``poll_completed``
    raises once ``armed``; a deposit of the key ``BOOM`` raises."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.handles = itertools.count(1)
        self.started: list[object] = []
        self.callbacks = None

    def deposit(self, blocks):
        if BOOM in blocks:
            raise RuntimeError("deposit refused by a broken core")
        self.started.append(blocks)
        return next(self.handles)

    def fetch(self, keys, request_id, expected_layout):
        self.started.append(keys)
        return next(self.handles)

    def poll_completed(self):
        if self.armed.is_set():
            raise RuntimeError("progress thread died")
        return []

    def close(self):
        pass


def _adapter(kv: FlakyKVCR) -> KVCRAdapter:
    def factory(callbacks):
        kv.callbacks = callbacks
        return kv

    return KVCRAdapter(factory, AdapterLimits(1 << 20, 1 << 20, 5.0), name="flaky")


def _deposit(adapter: KVCRAdapter, *keys: bytes) -> Deposit:
    blocks = {k: [object()] for k in keys}
    return Deposit(op_id=adapter.next_op_id(), blocks=blocks, nbytes=100 * len(keys))


def _fetch(adapter: KVCRAdapter, *keys: bytes) -> Fetch:
    return Fetch(adapter.next_op_id(), tuple(keys), "r", ("kv",), 50 * len(keys))


def _results(adapter: KVCRAdapter, want: int) -> dict[int, OpDone]:
    got: dict[int, OpDone] = {}

    def more() -> bool:
        got.update(
            {
                d.op_id: d
                for d in map(kvcr_stack.as_op_done, adapter.drain())
                if isinstance(d, OpDone)
            }
        )
        return len(got) >= want

    wait_until(more, timeout=5, what=f"{want} results")
    return got


def _park(adapter: KVCRAdapter):
    """Park the owner thread in a call; returns (entered, gate, thread)."""
    entered, gate = threading.Event(), threading.Event()

    def hold(_kv):
        entered.set()
        gate.wait(5)

    t = threading.Thread(target=lambda: adapter.call(hold, timeout_s=10), daemon=True)
    t.start()
    assert entered.wait(5)
    return gate, t


def _failed_as(done: OpDone, kind: OpKind, keys: tuple[bytes, ...]) -> bool:
    return (
        done.kind is kind
        and tuple(done.entries) == keys
        and all(e.status is EntryStatus.FAILED for e in done.entries.values())
    )


def test_queued_in_flight_and_later_commands_all_complete_failed():
    """The owner thread dies with one deposit in flight and a deposit and a fetch
    queued: all three come back FAILED with their keys, and so does a deposit,
    a split offload and a fetch submitted afterwards; releases are dropped,
    nothing raises on the scheduler path and every budget byte comes back."""
    kv = FlakyKVCR()
    adapter = _adapter(kv)
    inflight = _deposit(adapter, b"a", b"b")
    adapter.submit(inflight)
    wait_until(lambda: len(kv.started) == 1, timeout=5, what="deposit started")
    gate, parker = _park(adapter)
    queued = _deposit(adapter, b"c")
    fetch = _fetch(adapter, b"a")
    adapter.submit(queued)
    adapter.submit(fetch)
    kv.armed.set()  # the poll after the parked call raises
    gate.set()
    parker.join(5)
    wait_until(lambda: adapter.failed, timeout=5, what="adapter failed")

    got = _results(adapter, 3)
    assert _failed_as(got[inflight.op_id], OpKind.DEPOSIT, (b"a", b"b"))
    assert _failed_as(got[queued.op_id], OpKind.DEPOSIT, (b"c",))
    assert _failed_as(got[fetch.op_id], OpKind.FETCH, (b"a",))
    assert kv.started == [{b"a": inflight.blocks[b"a"], b"b": inflight.blocks[b"b"]}]

    later, halves = _deposit(adapter, b"d"), [_deposit(adapter, b"e", b"f")]
    later_fetch = _fetch(adapter, b"d")
    adapter.submit(later)
    adapter.submit_together(halves)
    adapter.submit(later_fetch)
    adapter.submit(Release((7,)))
    adapter.submit(DiscardHint("r"))
    got = {
        d.op_id: d
        for d in map(kvcr_stack.as_op_done, adapter.drain())
        if isinstance(d, OpDone)
    }  # at once
    assert _failed_as(got[later.op_id], OpKind.DEPOSIT, (b"d",))
    assert _failed_as(got[halves[0].op_id], OpKind.DEPOSIT, (b"e", b"f"))
    assert _failed_as(got[later_fetch.op_id], OpKind.FETCH, (b"d",))
    assert len(got) == 3 and adapter.drain() == []
    stats = adapter.stats()
    assert stats.inflight_offload_bytes == 0 and stats.inflight_prepare_bytes == 0
    assert adapter.wait_idle(1.0) is True
    assert adapter.claims_outstanding() == 0
    with pytest.raises(KVCRAdapterFailed):
        adapter.close()


def test_commands_taken_but_not_run_when_a_command_raises_are_answered():
    """A deposit that raises inside KVCR kills the owner thread in the middle of
    a batch: it and the deposit behind it in the same batch come back FAILED."""
    kv = FlakyKVCR()
    adapter = _adapter(kv)
    gate, parker = _park(adapter)
    broken = _deposit(adapter, BOOM)
    behind = _deposit(adapter, b"x")
    adapter.submit(broken)
    adapter.submit(behind)  # both taken as one batch once the owner is free
    gate.set()
    parker.join(5)
    got = _results(adapter, 2)
    assert adapter.failed
    assert _failed_as(got[broken.op_id], OpKind.DEPOSIT, (BOOM,))
    assert _failed_as(got[behind.op_id], OpKind.DEPOSIT, (b"x",))
    assert kv.started == []


def test_source_writes_off_until_restart_asks_for_a_restart(caplog):
    """kvcr's "new source writes disabled until restart" resilience event sets
    restart_wanted, and its log line names the fix for a starved progress loop;
    any other resilience event is only counted."""
    kv = FlakyKVCR()
    adapter = _adapter(kv)
    try:
        event = kv.callbacks.on_resilience_event
        adapter.call(lambda _kv: event(RuntimeError("peer transfer failed")))
        assert adapter.restart_wanted is False
        stalled = kvcr_stack.kvcr_stall_error(timeout_ms=1000, gap_s=1.2)
        with caplog.at_level(logging.ERROR):
            adapter.call(lambda _kv: event(stalled))
        assert adapter.restart_wanted is True
        [line] = [r.getMessage() for r in caplog.records if "restart" in r.getMessage()]
        assert str(stalled) in line
        assert "--sleep-on-idle" in line and "operation_timeout_ms" in line
        assert adapter.stats().resilience_events == 2
        assert not adapter.failed
    finally:
        adapter.close()


def test_a_submit_racing_the_failure_is_answered_exactly_once():
    """Deposits submitted from another thread while the owner thread dies are
    each answered once (run-then-failed, answered by the shutdown, or answered
    by the caller), none lost and none twice."""
    kv = FlakyKVCR()
    adapter = _adapter(kv)
    sent: list[Deposit] = []

    def spray():
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            d = _deposit(adapter, b"k%d" % len(sent))
            sent.append(d)
            adapter.submit(d)

    t = threading.Thread(target=spray)
    t.start()
    time.sleep(0.05)
    kv.armed.set()
    t.join(5)
    seen: list[int] = []
    wait_until(
        lambda: (
            seen.extend(
                d.op_id
                for d in map(kvcr_stack.as_op_done, adapter.drain())
                if isinstance(d, OpDone)
            )
            or len(seen) >= len(sent)
        ),
        timeout=5,
        what="every deposit answered",
    )
    assert sorted(seen) == sorted(d.op_id for d in sent)
    assert adapter.stats().inflight_offload_bytes == 0
