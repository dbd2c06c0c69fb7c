"""Preparation and offload bookkeeping driven by plain ``OpDone`` values (no NIXL).

``Preparations``: fetch commands carry the hint once and charge only moved bytes;
landed claims become restorable boundaries; late, failed, foreign and stale
results release their claims exactly once; a dropped preparation's fetches count
as abandoned until they complete; a retried attempt never reads the older one.
``OffloadQueue``: one FIFO result per offload, settled only when every deposit
of it has completed, in order, with staging slots handed back.
"""

from __future__ import annotations

from types import SimpleNamespace

from sglang.srt.mem_cache.storage.kvcr.datapath.offload_queue import (
    OffloadOutcome,
    OffloadQueue,
)
from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import LinkerStats
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    ClaimsTaken,
    DiscardHint,
    EntryResult,
    EntryStatus,
    Fetch,
    OpDone,
    OpKind,
    Release,
)
from sglang.srt.mem_cache.storage.kvcr.requests.fetch_plan import (
    PoolFetch,
    plan_fetches,
)
from sglang.srt.mem_cache.storage.kvcr.requests.preparation import (
    Preparations,
    PrepState,
)
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
    PreparationHandle,
)

PAGES = ["p0", "p1", "p2"]


def _key(page: str, pool: str = "kv") -> bytes:
    return f"{page}|{pool}".encode()


def _parse(key: bytes) -> tuple[str, str] | None:
    page, sep, pool = key.decode().partition("|")
    return (page, pool) if sep else None


def _ok(claim: int) -> EntryResult:
    return EntryResult(
        EntryStatus.SUCCESS, (SimpleNamespace(element_index=claim),), claim
    )


def _begin(preps: Preparations, rid="r", attempt=0, hinted=True):
    ctx = LinkerRequestContext(rid, attempt)
    prep, commands = preps.begin(ctx, list(PAGES), 30.0, hinted)
    ids = iter(range(100 * (attempt + 1), 10**6))
    fetches = [
        PoolFetch((_key("p0"),), ("k", "v"), 10, moved=False),  # resident: a claim
        PoolFetch((_key("p1"), _key("p2")), ("k", "v"), 10, moved=True),
    ]
    return prep, commands, preps.fetch(prep, fetches, lambda: next(ids), {"hint": 1})


def test_fetches_carry_the_hint_once_and_charge_only_what_moves():
    preps = Preparations(LinkerStats())
    _, dropped, fetches = _begin(preps)
    assert dropped == []
    assert [type(c) for c in fetches] == [Fetch, Fetch]
    local, remote = fetches
    assert (local.nbytes, local.hint) == (0, None)
    assert (remote.nbytes, remote.hint) == (20, {"hint": 1})
    assert local.request_id == remote.request_id == "r#0"
    assert not preps.ready(PreparationHandle("r", 0))  # still fetching
    # A second chunk moving bytes goes without it (the adapter carries a refused
    # fetch's hint to the next one itself).
    prep = preps.get("r")
    more = [
        PoolFetch((_key("p1", "swa"),), ("w",), 4, moved=True),
        PoolFetch((_key("p2", "swa"),), ("w",), 4, moved=True),
    ]
    first, second = preps.fetch(prep, more, iter(range(900, 999)).__next__, {"h": 2})
    assert first.hint == {"h": 2} and second.hint is None


def test_landed_claims_make_boundaries_and_everything_else_is_released_once():
    stats = LinkerStats()
    preps = Preparations(stats)
    prep, _, (local, remote) = _begin(preps)
    out = preps.on_fetch_done(
        OpDone(local.op_id, OpKind.FETCH, {_key("p0"): _ok(1)}), _parse
    )
    assert out == []
    # p1 lands, p2 failed, and a key of nobody's comes back with a claim.
    done = OpDone(
        remote.op_id,
        OpKind.FETCH,
        {
            _key("p1"): _ok(2),
            _key("p2"): EntryResult(EntryStatus.FAILED, None, 3),
            b"foreign": _ok(4),
        },
    )
    assert preps.on_fetch_done(done, _parse) == [Release((3, 4))]
    assert prep.state is PrepState.READY and preps.ready(PreparationHandle("r", 0))
    assert prep.restorable(0, PAGES, frozenset({"kv"}), frozenset(), 3) == [1, 2]
    assert stats.late_claims_released == 2
    # The request ends: its two claims and the hint go, once.
    assert preps.release("r") == [Release((1, 2)), DiscardHint("r#0")]
    assert preps.release("r") == []
    # A duplicate completion of an op already settled releases what it carries.
    again = OpDone(local.op_id, OpKind.FETCH, {_key("p0"): _ok(9)})
    assert preps.on_fetch_done(again, _parse) == [Release((9,))]


def test_a_dropped_preparation_counts_its_fetches_abandoned_until_they_complete():
    preps = Preparations(LinkerStats())
    _, _, (_local, remote) = _begin(preps)
    assert preps.release("r")[-1] == DiscardHint("r#0")
    assert preps.abandoned_bytes() == 10 + 20  # the DRAM both fetches will claim
    late = OpDone(remote.op_id, OpKind.FETCH, {_key("p1"): _ok(5), _key("p2"): _ok(6)})
    assert preps.on_fetch_done(late, _parse) == [Release((5, 6))]
    assert preps.abandoned_bytes() == 10
    preps.reset()  # a flush: the old core's ops never complete
    assert preps.abandoned_bytes() == 0


def test_a_retried_attempt_never_reads_the_older_one():
    preps = Preparations(LinkerStats())
    first, _, (old_local, _) = _begin(preps, attempt=0)
    second, dropped, _ = _begin(preps, attempt=1)
    assert dropped == [DiscardHint("r#0")]  # nothing had landed for attempt 0
    assert first.state is PrepState.RELEASED
    # The old attempt's fetch lands now: released, not given to the new one.
    late = OpDone(old_local.op_id, OpKind.FETCH, {_key("p0"): _ok(7)})
    assert preps.on_fetch_done(late, _parse) == [Release((7,))]
    assert second.landed == {}
    assert preps.ready(PreparationHandle("r", 0))  # a stale handle holds nothing
    assert not preps.ready(PreparationHandle("r", 1))


def test_claims_taken_in_one_pass_land_at_their_planned_pages():
    """A fetch answered in one pass (``ClaimsTaken``: claims and slots in key
    order) lands each claim at the page index its plan gave it, in its pool;
    one that does not match its plan, or comes for a dropped preparation,
    releases every claim it carries."""
    stats = LinkerStats()
    preps = Preparations(stats)
    ctx = LinkerRequestContext("r", 0)
    prep, _ = preps.begin(ctx, list(PAGES), 30.0, False)
    ids = iter(range(10, 99)).__next__
    keys = (_key("p1"), _key("p2"))
    plan = [
        PoolFetch((_key("p0"),), ("k",), 10, False, 1, "kv", (0,)),
        PoolFetch(keys, ("k",), 10, False, 2, "kv", (1, 2)),
    ]
    first, second = preps.fetch(prep, plan, ids, None)
    assert (
        preps.on_fetch_done(ClaimsTaken(first.op_id, (_key("p0"),), [5], [7]), _parse)
        == []
    )
    assert (
        preps.on_fetch_done(ClaimsTaken(second.op_id, keys, [6, 8], [3, 4]), _parse)
        == []
    )
    assert prep.state is PrepState.READY
    assert {i: (o["kv"].claim, o["kv"].slots) for i, o in prep.landed.items()} == {
        0: (5, (7,)),
        1: (6, (6, 7)),  # two parts: the slot's rows of one span
        2: (8, (8, 9)),
    }
    assert prep.restorable(0, PAGES, frozenset({"kv"}), frozenset(), 3) == [1, 2, 3]
    assert preps.claimed_bytes() == 3 * 10  # the landed claims' bytes, counted
    # An answer that does not match its plan lands nothing.
    prep, _ = preps.begin(LinkerRequestContext("s", 0), list(PAGES), 30.0, False)
    (op,) = preps.fetch(prep, plan[1:], ids, None)
    short = ClaimsTaken(op.op_id, keys[:1], [11], [1])
    assert preps.on_fetch_done(short, _parse) == [Release((11,))]
    assert prep.landed == {} and stats.late_claims_released == 1
    # Nor one for other keys (here the planned ones in another order).
    (op,) = preps.fetch(prep, plan[1:], ids, None)
    swapped = ClaimsTaken(op.op_id, keys[::-1], [14, 15], [1, 2])
    assert preps.on_fetch_done(swapped, _parse) == [Release((14, 15))]
    assert prep.landed == {}
    # Nor one whose claims and slots do not cover its keys.
    (op,) = preps.fetch(prep, plan[1:], ids, None)
    uncovered = ClaimsTaken(op.op_id, keys, [16], [1])
    assert preps.on_fetch_done(uncovered, _parse) == [Release((16,))]
    assert prep.landed == {}
    # Nor does one for a preparation that is gone.
    prep, _ = preps.begin(LinkerRequestContext("t", 0), list(PAGES), 30.0, False)
    (op,) = preps.fetch(prep, plan[1:], ids, None)
    preps.release("t")
    late = ClaimsTaken(op.op_id, keys, [12, 13], [1, 2])
    assert preps.on_fetch_done(late, _parse) == [Release((12, 13))]


def test_a_plan_gives_each_key_its_page_index_and_pool():
    """``plan_fetches`` names each key's page index and pool, per chunk and
    per pool, resident keys apart from moved ones."""
    layout = SimpleNamespace(
        pools=[SimpleNamespace(name="kv", block_label="kv:b", spans=(0,))],
        window_pools=[],
        block_key=lambda h, pool: _key(h, pool),
    )
    resident = {_key("p0"), _key("p2")}
    pages = ["p0", "p1", "p2"]
    fetches = plan_fetches(pages, frozenset({"p1"}), resident, layout, {"kv": 10}, 2)
    assert [(f.keys, f.moved, f.pool, f.pages) for f in fetches] == [
        ((_key("p0"),), False, "kv", (0,)),
        ((_key("p1"),), True, "kv", (1,)),
        ((_key("p2"),), False, "kv", (2,)),
    ]


def test_one_fifo_result_per_offload_settled_when_all_its_deposits_are():
    queue = OffloadQueue()
    split, single = queue.push(), queue.push()
    split.pending, single.pending = 2, 1
    queue.track(1, split, (0, 1))
    queue.track(2, split)
    queue.track(3, single, (2,))
    ok = {b"k": EntryResult(EntryStatus.SUCCESS)}
    # The later offload completes first: nothing is reported out of order.
    assert queue.on_done(OpDone(3, OpKind.DEPOSIT, ok)) == (single, (2,))
    assert queue.completed() == 0
    assert queue.on_done(OpDone(1, OpKind.DEPOSIT, ok)) == (None, (0, 1))
    failed = {b"k": EntryResult(EntryStatus.FAILED)}
    assert queue.on_done(OpDone(2, OpKind.DEPOSIT, failed)) == (split, None)
    assert split.outcome is OffloadOutcome.FAILED  # one part failed: not stored
    assert queue.completed() == 2
    assert queue.pop() is False and queue.pop() is True
    assert len(queue) == 0


def test_a_withdrawn_offload_leaves_no_result_and_reset_returns_held_slots():
    queue = OffloadQueue()
    kept, withdrawn = queue.push(), queue.push()
    queue.track(1, kept, (4,))
    queue.track(2, withdrawn, (5,))
    queue.withdraw(withdrawn)
    assert len(queue) == 1
    assert queue.on_done(OpDone(2, OpKind.DEPOSIT, {}))[0] is None
    assert queue.reset() == [(4,)]
    assert len(queue) == 0 and queue.completed() == 0


def test_a_load_takes_each_claimed_page_once_and_its_bytes_off_the_ledger():
    """``plan_load`` takes the claims of its tail's pages out of the preparation
    in page order (a repeated page only once), the ledger loses their bytes, and
    a page without its claim makes the job incomplete, never a slot guessed."""
    import torch

    from sglang.srt.mem_cache.storage.kvcr.datapath.restore import plan_load
    from sglang.srt.mem_cache.storage.kvcr.requests.claimed_pages import ClaimedPage

    pool = SimpleNamespace(
        name="kv",
        trailing=False,
        indices_from="kv",
        device_pages=lambda idx, pages, size: idx[: pages * size : size] // size,
    )
    layout = SimpleNamespace(pools=[pool], window_groups=[])

    def job(keys, landed):
        preps = Preparations(LinkerStats())
        prep, _ = preps.begin(LinkerRequestContext("r", 0), list(PAGES), 30.0, False)
        prep.landed.add_pool(
            "kv", [(i, ClaimedPage(50 + i, (2 * i, 2 * i + 1), 10)) for i in landed]
        )
        kv = SimpleNamespace(keys=keys, device_indices=torch.arange(4 * len(keys)))
        return preps, prep, plan_load("r", prep, {"kv": kv}, layout, 4)

    preps, prep, whole = job(["p1", "p2"], [0, 1, 2])
    assert whole.complete and whole.claims == [51, 52]
    assert whole.slots == {"kv": [(2, 3), (4, 5)]}
    assert whole.dest_pages["kv"].tolist() == [0, 1]
    assert list(prep.landed) == [0] and preps.claimed_bytes() == 10  # p0 stays
    _, prep, twice = job(["p1", "p1"], [1])
    assert not twice.complete and twice.claims == [51] and prep.landed == {}
    preps, prep, gap = job(["p0", "p1", "p2"], [0, 2])
    assert not gap.complete and gap.claims == [50, 52]
    assert gap.dest_pages == {} and preps.claimed_bytes() == 0
    kv = SimpleNamespace(keys=["p0"], device_indices=torch.arange(4))
    orphan = plan_load("r", None, {"kv": kv}, layout, 4)
    assert not orphan.complete and orphan.claims == [] and orphan.slots == {"kv": []}
