"""KVCRAdapter over a real kvcr 0.1.1 + NIXL on CPU tensors (loopback only)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cpu_harness import kvcr_stack
from cpu_harness.kvcr_pages import wait_until
from sglang.srt.mem_cache.storage.kvcr.config.errors import (
    KVCRAdapterFailed,
    KVCRUnavailableError,
)
from sglang.srt.mem_cache.storage.kvcr.datapath.dram_copy import DramCopier
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import DeviceBinding
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_adapter import KVCRAdapter
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    AdapterLimits,
    Deposit,
    EntryStatus,
    Fetch,
    InventoryChange,
    OpDone,
    Release,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_executor import RELEASE_DEFER_S

pytestmark = pytest.mark.kvcr

BLOCK = 4096
SLOTS = 8
SPIED = ("fetch", "poll_completed", "query", "release", "close")


def _make(fw: torch.Tensor, store: torch.Tensor, name: str, *, offload_budget=1 << 30):
    copier = DramCopier(
        {"kv": [fw]}, lambda: {"kv": store}, DeviceBinding.of(torch.device("cpu"))
    )
    _COPIERS.append(copier)
    factory = kvcr_stack.small_kvcr_factory(name, store, BLOCK, copier=copier)
    limits = AdapterLimits(
        max_inflight_offload_bytes=offload_budget,
        max_inflight_prepare_bytes=1 << 30,
        wait_timeout_s=20.0,
    )
    return KVCRAdapter(factory, limits, name=name)


_COPIERS: list[DramCopier] = []


@pytest.fixture(autouse=True)
def _stop_copiers():
    """Each test's DRAM copiers stop with it (after its adapters closed)."""
    yield
    while _COPIERS:
        assert _COPIERS.pop().close(5)


def _ref(name: str, i: int) -> tuple[str, int]:
    """A deposit's source: framework row ``i`` into a ``kv:page`` block."""
    return ("kv:page", i)


def _key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def _wait_for(adapter: KVCRAdapter, op_id: int, timeout: float = 10.0) -> OpDone:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        for item in map(kvcr_stack.as_op_done, adapter.drain()):
            if isinstance(item, OpDone) and item.op_id == op_id:
                return item
            seen.append(item)
        time.sleep(0.001)
    raise AssertionError(f"op {op_id} did not complete in {timeout} s; saw {seen}")


def _release_all(adapter: KVCRAdapter, claims: list) -> None:
    """Release ``claims`` (the adapter's first releases); KVCR then counts exactly
    that many released (bounded wait)."""
    adapter.submit(Release(tuple(claims)))
    assert adapter.wait_idle(5.0)
    wait_until(
        lambda: adapter.stats().claims_released >= len(claims),
        timeout=5,
        what="claims released",
    )
    assert adapter.stats().claims_released == len(claims)


@pytest.fixture
def buffers():
    torch.manual_seed(0)
    fw = torch.randint(0, 256, (16, BLOCK), dtype=torch.uint8)
    store = torch.zeros(SLOTS * BLOCK, dtype=torch.uint8)
    return fw, store


def test_deposit_fetch_release_round_trip_is_byte_exact(buffers):
    """Pages deposited through the adapter come back claimed, bytes equal, then release."""
    fw, store = buffers
    adapter = _make(fw, store, "adapter-rt")
    try:
        op = adapter.next_op_id()
        adapter.submit(
            Deposit(
                op_id=op,
                blocks={_key(i): _ref("adapter-rt", i) for i in range(3)},
                nbytes=3 * BLOCK,
            )
        )
        done = _wait_for(adapter, op)
        assert {e.status for e in done.entries.values()} == {EntryStatus.SUCCESS}
        op = adapter.next_op_id()
        adapter.submit(
            Fetch(
                op_id=op,
                keys=tuple(_key(i) for i in range(3)) + (_key(99),),
                request_id="r1",
                expected_layout=("kv:page",),
                nbytes=4 * BLOCK,
            )
        )
        done = _wait_for(adapter, op)
        assert done.entries[_key(99)].status is EntryStatus.FAILED
        slots = store.view(SLOTS, BLOCK)
        for i in range(3):
            entry = done.entries[_key(i)]
            assert entry.status is EntryStatus.SUCCESS and entry.claim is not None
            assert torch.equal(slots[entry.slots[0].element_index], fw[i])
        _release_all(adapter, [done.entries[_key(i)].claim for i in range(3)])
    finally:
        adapter.close()


def test_every_kvcr_call_runs_on_the_owner_thread(buffers, monkeypatch):
    """A deposit's slot reservation, fetch, poll, query, release and close all
    run on the adapter's thread, each at least once, driven through the adapter's
    own commands; so do the claims of a fetch of pages resident here (one pass)
    and kvcr's own claims."""
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import local_claims

    fw, store = buffers
    adapter = _make(fw, store, "adapter-thread")
    calls: list[tuple[str, str]] = []
    try:
        kv = adapter.call(lambda kv: kv)
        for name in SPIED:
            original = getattr(kv, name)

            def spy(*a, _orig=original, _name=name, **k):
                calls.append((_name, threading.current_thread().name))
                return _orig(*a, **k)

            setattr(kv, name, spy)
        local = kv._core._local_dram  # a deposit allocates its slots here
        allocate = local._allocate_slots

        def spy_allocate(*a, **k):
            calls.append(("_allocate_slots", threading.current_thread().name))
            return allocate(*a, **k)

        local._allocate_slots = spy_allocate
        claim_one = local._acquire_claim  # kvcr's own fetch claims here ...

        def spy_claim(*a, **k):
            calls.append(("_acquire_claim", threading.current_thread().name))
            return claim_one(*a, **k)

        local._acquire_claim = spy_claim
        claim_all = local_claims.claim_all  # ... and one of them in one pass

        def spy_claim_all(*a, **k):
            out = claim_all(*a, **k)
            if out is not None:  # claimed in one pass (not declined)
                calls.append(("claim_all", threading.current_thread().name))
            return out

        monkeypatch.setattr(local_claims, "claim_all", spy_claim_all)
        op = adapter.next_op_id()
        adapter.submit(
            Deposit(op_id=op, blocks={_key(1): _ref("adapter-thread", 1)}, nbytes=BLOCK)
        )
        _wait_for(adapter, op)
        assert adapter.call(lambda kv: kv.query([_key(1)]))[0][0].name == "HIT"
        op = adapter.next_op_id()
        adapter.submit(
            Fetch(
                op_id=op,
                keys=(_key(1),),
                request_id="thread",
                expected_layout=("kv:page",),
                nbytes=BLOCK,
            )
        )
        entry = _wait_for(adapter, op).entries[_key(1)]
        assert entry.status is EntryStatus.SUCCESS and entry.claim is not None
        op = adapter.next_op_id()  # a page not resident: kvcr's own fetch
        adapter.submit(
            Fetch(
                op_id=op,
                keys=(_key(1), _key(2)),
                request_id="thread",
                expected_layout=("kv:page",),
                nbytes=2 * BLOCK,
            )
        )
        entries = _wait_for(adapter, op).entries
        assert entries[_key(2)].status is EntryStatus.FAILED
        _release_all(adapter, [entry.claim, entries[_key(1)].claim])
    finally:
        adapter.close()
    want = {*SPIED, "_allocate_slots", "_acquire_claim", "claim_all"}
    assert {name for name, _ in calls} == want, calls
    assert {thread for _, thread in calls} == {adapter.owner_thread.name}, calls
    assert threading.current_thread().name != adapter.owner_thread.name


def test_inventory_events_report_stores_and_evictions(buffers):
    """Filling past capacity evicts and both directions reach the drain."""
    fw, store = buffers
    adapter = _make(fw, store, "adapter-inv")
    events: list[InventoryChange] = []
    try:
        for i in range(SLOTS + 2):
            op = adapter.next_op_id()
            adapter.submit(
                Deposit(
                    op_id=op, blocks={_key(i): _ref("adapter-inv", i)}, nbytes=BLOCK
                )
            )
            deadline = time.monotonic() + 10
            done = None
            while done is None and time.monotonic() < deadline:
                for item in map(kvcr_stack.as_op_done, adapter.drain()):
                    if isinstance(item, InventoryChange):
                        events.append(item)
                    elif item.op_id == op:
                        done = item
                time.sleep(0.001)
            assert done is not None
    finally:
        adapter.close()
    stored = {k for e in events if not e.removed for k in e.keys}
    removed = {k for e in events if e.removed for k in e.keys}
    assert stored == {_key(i) for i in range(SLOTS + 2)}
    assert len(removed) == 2


def test_offload_over_budget_is_refused_at_once_and_counted(buffers):
    """A deposit beyond max_inflight_offload_bytes while another is in flight never
    reaches KVCR: REFUSED. One over the whole budget runs when it is alone."""
    fw, store = buffers
    adapter = _make(fw, store, "adapter-budget", offload_budget=2 * BLOCK)
    try:
        entered, gate = threading.Event(), threading.Event()

        def hold(_kvcr):
            entered.set()
            gate.wait(10)

        stall = threading.Thread(target=adapter.call, args=(hold, 15), daemon=True)
        stall.start()  # keeps the first deposit charged (in flight) meanwhile
        assert entered.wait(10)
        alone, over = adapter.next_op_id(), adapter.next_op_id()
        big = {_key(i): _ref("adapter-budget", i) for i in range(3)}
        adapter.submit(Deposit(op_id=alone, blocks=big, nbytes=3 * BLOCK))
        one = {_key(3): _ref("adapter-budget", 3)}
        adapter.submit(Deposit(op_id=over, blocks=one, nbytes=BLOCK))
        refused = _wait_for(adapter, over, timeout=1.0)
        assert {e.status for e in refused.entries.values()} == {EntryStatus.REFUSED}
        gate.set()
        stall.join(10)
        done = _wait_for(adapter, alone, timeout=10.0)
        assert {e.status for e in done.entries.values()} == {EntryStatus.SUCCESS}
        assert adapter.stats().refused_offload == 1
        assert adapter.stats().deposits == 1
    finally:
        gate.set()
        adapter.close()


def test_factory_failure_is_a_typed_startup_error():
    """A KVCR that cannot start raises KVCRUnavailableError naming the cause."""

    def broken(callbacks):
        raise RuntimeError("no DRAM for you")

    limits = AdapterLimits(1, 1, 5.0)
    with pytest.raises(KVCRUnavailableError, match="no DRAM for you"):
        KVCRAdapter(broken, limits)


def test_owner_thread_crash_fails_the_adapter_without_raising_on_the_scheduler():
    """A failure inside the owner loop marks the adapter FAILED: the scheduler's
    drain and submit go on (nothing raised there), while a synchronous call and
    close raise KVCRAdapterFailed with the cause."""

    class Exploding:
        def poll_completed(self):
            raise RuntimeError("progress thread died")

        def close(self):
            pass

    adapter = KVCRAdapter(lambda cb: Exploding(), AdapterLimits(1, 1, 5.0))
    deadline = time.monotonic() + 5
    while adapter.owner_thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert adapter.failed
    assert adapter.drain() == []
    adapter.submit(Release((1,)))  # dropped: the KVCR it was for is gone
    assert adapter.drain() == []
    assert adapter.wait_idle(0.1) is True
    assert adapter.claims_outstanding() == 0
    with pytest.raises(KVCRAdapterFailed) as info:
        adapter.call(lambda kv: None)
    assert "progress thread died" in repr(info.value.__cause__)
    with pytest.raises(KVCRAdapterFailed) as info:
        adapter.close()
    assert "progress thread died" in repr(info.value.__cause__)


def _deposit_and_claim(adapter: KVCRAdapter, name: str, keys: range) -> list:
    """Deposit framework rows ``keys`` and fetch them back: their claims."""
    op = adapter.next_op_id()
    blocks = {_key(i): _ref(name, i) for i in keys}
    adapter.submit(Deposit(op_id=op, blocks=blocks, nbytes=len(keys) * BLOCK))
    assert {e.status for e in _wait_for(adapter, op).entries.values()} == {
        EntryStatus.SUCCESS
    }
    op = adapter.next_op_id()
    adapter.submit(
        Fetch(
            op_id=op,
            keys=tuple(blocks),
            request_id=f"{name}-claims",
            expected_layout=("kv:page",),
            nbytes=len(keys) * BLOCK,
        )
    )
    entries = _wait_for(adapter, op).entries
    assert all(e.claim is not None for e in entries.values())
    return [e.claim for e in entries.values()]


def _stalled(adapter: KVCRAdapter) -> threading.Event:
    """Hold the owner thread in a call until the returned event is set, so that
    commands submitted meanwhile queue up behind it."""
    go, inside = threading.Event(), threading.Event()

    def hold(kv):
        inside.set()
        return go.wait(10)

    threading.Thread(target=adapter.call, args=(hold, 15), daemon=True).start()
    assert inside.wait(10)
    return go


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "kvcr-fetch"])
def test_a_fetch_queued_behind_a_release_runs_first(buffers, monkeypatch, one_pass):
    """A preparation's fetch of pages resident here does not wait out the
    release of earlier claims queued before it (kvcr's per-claim Python): it
    runs and is answered first (claimed in one pass, within the call); the
    claims are still released within the deferral. With that path off, kvcr's
    fetch may reserve slots the claims hold: they are released first."""
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import local_claims

    monkeypatch.setattr(local_claims, "ENABLED", one_pass)
    fw, store = buffers
    adapter = _make(fw, store, "adapter-defer")
    order: list[str] = []
    try:
        claims = _deposit_and_claim(adapter, "adapter-defer", range(3))
        kv = adapter.call(lambda kv: kv)
        claim_all = local_claims.claim_all

        def claim_spy(*a, **k):
            out = claim_all(*a, **k)
            if out is not None and "fetch" not in order:  # claimed in one pass
                order.append("fetch")
                time.sleep(2 * RELEASE_DEFER_S)  # outlasts the deferral
            return out

        monkeypatch.setattr(local_claims, "claim_all", claim_spy)
        for name in ("fetch", "release", "poll_completed"):
            original = getattr(kv, name)

            def spy(*a, _orig=original, _name=name, **k):
                out = _orig(*a, **k)
                if _name == "fetch":  # outlasts the deferral: still answered first
                    time.sleep(2 * RELEASE_DEFER_S)
                if _name != "poll_completed":
                    order.append(_name)
                elif out:  # a completion handed back: the fetch is answered
                    order.append("answered")
                return out

            setattr(kv, name, spy)
        go = _stalled(adapter)
        adapter.submit(Release(tuple(claims)))
        op = adapter.next_op_id()
        adapter.submit(
            Fetch(
                op_id=op,
                keys=(_key(0), _key(1)),
                request_id="after-release",
                expected_layout=("kv:page",),
                nbytes=0,  # resident here: nothing moves
            )
        )
        go.set()
        entries = _wait_for(adapter, op).entries
        assert {e.status for e in entries.values()} == {EntryStatus.SUCCESS}
        wait_until(
            lambda: adapter.stats().claims_released >= len(claims),
            timeout=5,
            what="deferred claims released",
        )
        # One pass answers within the call: no kvcr completion to poll.
        want = ["fetch", "release"] if one_pass else ["release", "fetch", "answered"]
        assert order == want, order
        _release_all_after(adapter, [e.claim for e in entries.values()], len(claims))
    finally:
        adapter.close()


def _release_all_after(adapter: KVCRAdapter, claims: list, before: int) -> None:
    adapter.submit(Release(tuple(claims)))
    wait_until(
        lambda: adapter.stats().claims_released >= before + len(claims),
        timeout=5,
        what="claims released",
    )
    assert adapter.stats().claims_released == before + len(claims)


def test_a_deposit_behind_a_release_gets_the_released_slots(buffers):
    """Every slot of the DRAM is claimed; their release and a deposit that needs
    them queue together. The deferred release runs before the deposit reserves,
    so the deposit evicts the released pages and lands."""
    fw, store = buffers
    adapter = _make(fw, store, "adapter-defer-dep")
    try:
        claims = _deposit_and_claim(adapter, "adapter-defer-dep", range(SLOTS))
        go = _stalled(adapter)
        adapter.submit(Release(tuple(claims)))
        op = adapter.next_op_id()
        fresh = range(SLOTS, SLOTS + 3)
        adapter.submit(
            Deposit(
                op_id=op,
                blocks={_key(i): _ref("adapter-defer-dep", i) for i in fresh},
                nbytes=len(fresh) * BLOCK,
            )
        )
        go.set()
        done = _wait_for(adapter, op)
        assert {e.status for e in done.entries.values()} == {EntryStatus.SUCCESS}
        assert adapter.stats().claims_released == SLOTS
    finally:
        adapter.close()


def test_a_call_and_a_close_see_every_release_before_them(buffers):
    """A call queued behind a release sees KVCR with the claims given back; a
    release queued just before close is still made (and counted)."""
    fw, store = buffers
    adapter = _make(fw, store, "adapter-defer-call")
    try:
        claims = _deposit_and_claim(adapter, "adapter-defer-call", range(4))
        assert adapter.claims_outstanding() == 4
        adapter.submit(Release(tuple(claims[:2])))
        assert adapter.claims_outstanding() == 2  # no wait: the call flushed them
        go = _stalled(adapter)
        adapter.submit(Release(tuple(claims[2:])))
        closer = threading.Thread(target=adapter.close, daemon=True)
        closer.start()
        wait_until(lambda: adapter._inbox.sealed or adapter._inbox.queued() >= 2, 5)
        go.set()
        closer.join(10)
        assert not closer.is_alive()
        assert adapter.stats().claims_released == 4
    finally:
        adapter.close()


def test_a_fetch_answered_in_its_call_leaves_kvcrs_progress_loop_asleep(
    buffers, monkeypatch
):
    """A fetch of pages resident here is answered inside kvcr's fetch call: the
    owner thread neither wakes KVCR's progress loop after running it nor after
    handing its answer back (the wake-up's Python would compete with the
    scheduler for the GIL), nor after releasing its claims: whatever a release
    hands kvcr's loop goes through the loop's own (waking) submit. A hinted
    fetch still wakes it (peer work)."""
    from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_patches

    fw, store = buffers
    adapter = _make(fw, store, "adapter-nowake")
    try:
        claims = _deposit_and_claim(adapter, "adapter-nowake", range(3))
        _release_all_after(adapter, claims, 0)
        wakes: list[str] = []
        real_wake = kvcr_patches.wake
        monkeypatch.setattr(
            kvcr_patches, "wake", lambda: (wakes.append("wake"), real_wake())
        )

        def fetch(hint):
            op = adapter.next_op_id()
            adapter.submit(
                Fetch(
                    op_id=op,
                    keys=(_key(0), _key(1), _key(9)),  # 9 was never deposited
                    request_id=f"nowake-{op}",
                    expected_layout=("kv:page",),
                    nbytes=0,
                    hint=hint,
                )
            )
            return _wait_for(adapter, op).entries

        entries = fetch(None)
        assert [e.status for e in entries.values()] == [
            EntryStatus.SUCCESS,
            EntryStatus.SUCCESS,
            EntryStatus.FAILED,
        ]
        assert wakes == []
        _release_all_after(adapter, [e.claim for e in entries.values() if e.claim], 3)
        assert wakes == []  # nor does releasing the claims (no peer work either)
        entries = fetch({"not": "a kv.fetch@1.0 hint"})  # kvcr refuses it; still woken
        assert wakes, "a hinted fetch may have started peer work"
        _release_all_after(adapter, [e.claim for e in entries.values() if e.claim], 5)
    finally:
        adapter.close()


def test_deferred_releases_wait_out_the_window_after_a_fetch(buffers, monkeypatch):
    """Claims given back just before a fetch are released a whole deferral
    window after that fetch (the scheduler is still taking its answer), not when
    their own window ends; and never later than the longest deferral."""
    from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_executor

    # Long enough that the VM's own delays cannot blur the order, short enough
    # to keep the test quick (the owner loop wakes at the due time, whatever its
    # idle poll).
    window = 0.04
    monkeypatch.setattr(kvcr_executor, "RELEASE_DEFER_S", window)
    monkeypatch.setattr(kvcr_executor, "RELEASE_DEFER_MAX_S", 10 * window)
    fw, store = buffers
    adapter = _make(fw, store, "adapter-window")
    try:
        claims = _deposit_and_claim(adapter, "adapter-window", range(2))
        kv = adapter.call(lambda kv: kv)
        released: list[float] = []
        real_release = kv.release

        def release(handles):
            released.append(time.monotonic())
            return real_release(handles)

        kv.release = release
        adapter.submit(Release(tuple(claims[:1])))
        time.sleep(window / 2)
        op = adapter.next_op_id()
        adapter.submit(
            Fetch(
                op_id=op,
                keys=(_key(0),),
                request_id="window",
                expected_layout=("kv:page",),
                nbytes=0,
            )
        )
        fetched = time.monotonic()
        entry = _wait_for(adapter, op).entries[_key(0)]
        assert entry.claim is not None
        wait_until(lambda: released, timeout=5, what="deferred claims released")
        assert released[0] - fetched >= window * 0.9, released[0] - fetched
        # The longest deferral bounds it under back-to-back fetches.
        monkeypatch.setattr(kvcr_executor, "RELEASE_DEFER_MAX_S", window / 2)
        adapter.submit(Release((entry.claim, *claims[1:])))
        since = time.monotonic()
        for i in range(12):  # a fetch every window / 8 keeps pushing it back
            adapter.submit(
                Fetch(
                    op_id=adapter.next_op_id(),
                    keys=(_key(1),),
                    request_id=f"window-{i}",
                    expected_layout=("kv:page",),
                    nbytes=0,
                )
            )
            time.sleep(window / 8)
        wait_until(lambda: len(released) > 1, timeout=5, what="bounded deferral")
        assert released[1] - since < window, released[1] - since
    finally:
        adapter.close()


def test_a_fetch_that_moves_pages_runs_after_the_deferred_releases(
    buffers, monkeypatch
):
    """A fetch that moves pages here (bytes charged: slots to reserve) first
    releases the deferred claims, whose slots it may need; one of pages all
    resident here (no bytes) runs first and leaves them deferred."""
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import local_claims

    fw, store = buffers
    adapter = _make(fw, store, "adapter-moves")
    order: list[str] = []
    later: list = []
    try:
        claims = _deposit_and_claim(adapter, "adapter-moves", range(4))
        kv = adapter.call(lambda kv: kv)
        real_release, real_fetch = kv.release, kv.fetch
        kv.release = lambda h: order.append("release") or real_release(h)
        kv.fetch = lambda *a, **k: order.append("fetch") or real_fetch(*a, **k)
        real_claim = local_claims.claim_all  # pages resident here: one pass

        def claim_spy(*a, **k):
            out = real_claim(*a, **k)
            if out is not None:
                order.append("claim")
            return out

        monkeypatch.setattr(local_claims, "claim_all", claim_spy)
        for moved, claim in ((False, claims[:2]), (True, claims[2:])):
            go = _stalled(adapter)  # both queued before the owner runs either
            adapter.submit(Release(tuple(claim)))
            op = adapter.next_op_id()
            adapter.submit(
                Fetch(
                    op_id=op,
                    keys=(_key(9),) if moved else (_key(0),),
                    request_id=f"moves-{moved}",
                    expected_layout=("kv:page",),
                    nbytes=BLOCK if moved else 0,
                )
            )
            go.set()
            entries = _wait_for(adapter, op).entries
            wait_until(lambda: "release" in order, timeout=5, what="released")
            later += [e.claim for e in entries.values() if e.claim is not None]
        # Resident pages are claimed without kvcr's fetch, before the release;
        # a page to move waits for it.
        assert order == ["claim", "release", "release", "fetch"], order
        adapter.submit(Release(tuple(later)))
        assert adapter.wait_idle(5.0)
    finally:
        adapter.close()


def test_a_deposit_ending_while_a_fetch_is_answered_wakes_kvcr(buffers, monkeypatch):
    """A deposit whose copy ends while a completion is being polled (so the
    first look at the fills missed it) may have resumed kvcr's capacity
    waiters: the progress loop is woken by that poll, although the fetch
    answered was one kvcr settled within its call. (The race is forced: the
    copy is reported over only once ``poll_completed`` ran.)"""
    from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_executor
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import local_claims

    monkeypatch.setattr(local_claims, "ENABLED", False)  # kvcr's fetch and poll
    fw, store = buffers
    adapter = _make(fw, store, "adapter-refill")
    events: list[str] = []
    ended = threading.Event()
    real_poll_fill = kvcr_executor.page_fills.poll

    def poll_fill(kv, fill):
        if not ended.is_set():
            return None  # its copy still runs, as far as anyone looks
        out = real_poll_fill(kv, fill)
        if out is not None:
            events.append("deposit answered")
        return out

    real_wake = kvcr_executor.kvcr_patches.wake
    try:
        kv = adapter.call(lambda kv: kv)
        real_poll = kv.poll_completed

        def poll_completed():
            out = real_poll()
            if out and "fetch" in events and not ended.is_set():
                # The copy ends while this completion is polled.
                jobs = [j for fill, _ in adapter._executor.fills for j in fill.jobs]
                wait_until(
                    lambda: all(j.poll() is not None for j in jobs),
                    timeout=5,
                    what="the deposit's copy over",
                )
                ended.set()
            return out

        kv.poll_completed = poll_completed
        real_fetch = kv.fetch
        kv.fetch = lambda *a, **k: events.append("fetch") or real_fetch(*a, **k)
        monkeypatch.setattr(kvcr_executor.page_fills, "poll", poll_fill)
        real_owner_poll = kvcr_executor.CommandExecutor.poll

        def owner_poll(self):
            real_owner_poll(self)
            events.append("polled")

        monkeypatch.setattr(kvcr_executor.CommandExecutor, "poll", owner_poll)
        monkeypatch.setattr(
            kvcr_executor.kvcr_patches,
            "wake",
            lambda: events.append("wake") or real_wake(),
        )
        go = _stalled(adapter)  # deposit and fetch run in one owner turn
        deposit = adapter.next_op_id()
        adapter.submit(
            Deposit(op_id=deposit, blocks={_key(3): _ref("", 3)}, nbytes=BLOCK)
        )
        fetch = adapter.next_op_id()
        adapter.submit(
            Fetch(
                op_id=fetch,
                keys=(_key(5),),  # resident nowhere: answered FAILED in the call
                request_id="refill",
                expected_layout=("kv:page",),
                nbytes=0,
            )
        )
        events.clear()
        go.set()
        _wait_for(adapter, fetch)
        wait_until(lambda: "deposit answered" in events, timeout=5, what="deposit")
        # Woken by that poll itself (the copier's wake-up does not wake it).
        at = events.index("deposit answered")
        assert events[at + 1 : at + 3] == ["wake", "polled"], events
    finally:
        adapter.close()


def test_a_deposit_copy_ending_wakes_kvcr_only_once_its_fill_completed(
    buffers, monkeypatch
):
    """The copier's wake-up runs the owner loop, which completes the fill; only
    then is kvcr's progress loop woken (what the fill resumed), not for the
    wake-up itself."""
    from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_executor

    fw, store = buffers
    adapter = _make(fw, store, "adapter-copy-wake")
    events: list[str] = []
    real_poll_fill = kvcr_executor.page_fills.poll
    real_wake = kvcr_executor.kvcr_patches.wake

    def poll_fill(kv, fill):
        out = real_poll_fill(kv, fill)
        if out is not None:
            events.append("deposit answered")
        return out

    try:
        adapter.call(lambda kv: kv)  # started, and its call's wake-up is over
        monkeypatch.setattr(kvcr_executor.page_fills, "poll", poll_fill)
        monkeypatch.setattr(
            kvcr_executor.kvcr_patches,
            "wake",
            lambda: events.append("wake") or real_wake(),
        )
        op = adapter.next_op_id()
        adapter.submit(Deposit(op_id=op, blocks={_key(2): _ref("", 2)}, nbytes=BLOCK))
        _wait_for(adapter, op)
        assert events[:2] == ["deposit answered", "wake"], events
    finally:
        adapter.close()


def test_background_releases_let_a_queued_fetch_run_between_chunks(
    buffers, monkeypatch
):
    """Deferred claims go back a chunk at a time once their window ends; a fetch
    queued meanwhile runs after the chunk in progress, not after all of them,
    and the rest are still released."""
    from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_executor
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import local_claims

    monkeypatch.setattr(kvcr_executor, "RELEASE_CHUNK", 2)
    fw, store = buffers
    adapter = _make(fw, store, "adapter-chunks")
    order: list[str] = []
    try:
        claims = _deposit_and_claim(adapter, "adapter-chunks", range(6))
        kv = adapter.call(lambda kv: kv)
        op = adapter.next_op_id()
        fetch = Fetch(
            op_id=op,
            keys=(_key(0),),  # resident here: claimed in one pass
            request_id="between-chunks",
            expected_layout=("kv:page",),
            nbytes=0,
        )
        real_release = kv.release
        real_claim = local_claims.claim_all

        def release(handles):
            order.append(f"release:{len(handles)}")
            if len(order) == 1:
                adapter.submit(fetch)  # queued while the first chunk runs
            return real_release(handles)

        def claim_spy(*a, **k):
            out = real_claim(*a, **k)
            if out is not None:  # claimed in one pass
                order.append("fetch")
            return out

        kv.release = release
        monkeypatch.setattr(local_claims, "claim_all", claim_spy)
        adapter.submit(Release(tuple(claims)))
        _wait_for(adapter, op)
        wait_until(
            lambda: adapter.stats().claims_released >= len(claims),
            timeout=5,
            what="every chunk released",
        )
        assert order == ["release:2", "fetch", "release:2", "release:2"], order
    finally:
        adapter.close()
