"""A deposit's slots, reserved in one allocation and committed in one pass, end
as kvcr would leave them.

``kvcr_patches.batched_slots.reserve`` reserves every page of a deposit with one
``_allocate_slots`` call (kvcr's built-in FIFO or LRU policy, no disk tier: the
only ones the linker runs), instead of kvcr's ``reserve_fill`` (a policy call and
an allocation per key), and never evicts a page of the same deposit. When that
one allocation cannot be met whole it allocates key by key. Here the same seeded
run of deposits, held claims and releases, on real KVCRs of one configuration,
goes through: the one allocation against the key-by-key loop (both keeping the
deposit's pages), and, keeping only the keys being reserved, the one allocation
against kvcr's own ``reserve_fill``. After every step each pair holds the same
keys, in the same slots and states, in the same eviction order, with the same
free slots and the same evictions published, and reports the same outcomes. Both
comparisons must reach batches met by evicting and batches that could not be met
whole. Once a
chunk's copy landed, ``batched_slots.commit_landed`` marks it READY in one pass where kvcr's
``_apply_fill_result`` would do nothing more; the same runs compare it with
kvcr's own path, and a chunk some kvcr operation waits on is left to kvcr.
"""

from __future__ import annotations

import random
from contextlib import closing

import pytest

from cpu_harness.kvcr_pages import (
    PAGE_BYTES,
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    wait_until,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import (
    batched_slots,
)
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = pytest.mark.kvcr

SLOTS = 8
STEPS = 40
SEEDS = 3


def _state(lk, names) -> tuple:
    """Every resident key's slots and state, each pool's free slots in order, the
    order kvcr would evict in, its unscored keys and evictable-slot counts, and
    which of ``names`` the linker believes resident (from kvcr's inventory
    events: an eviction not published would show here)."""

    def read(kv):
        core = kv._core
        local = core._local_dram
        with core._state_lock:
            resident = sorted(
                (key, tuple(r.local_dram.slots), r.local_dram.state.name)
                for key, r in core._block_record_map.items()
                if r.local_dram is not None
            )
            free = {n: tuple(d) for n, d in local._free_slots.items()}
            with closing(local._evictable.candidates(set())) as order:
                evictable = list(order)  # the order kvcr would evict in
            counts = (sorted(local._unscored), sorted(local._evictable_slots.items()))
        return resident, free, evictable, counts

    believed = [n for n in names if lk.layout.block_key(n, "kv") in lk.residency]
    return lk._adapter.call(read), believed


def _run(policy: str, seed: int, pool) -> tuple[list, list]:
    """(state after every step, outcome of every step) of one seeded run."""
    rng = random.Random(seed)
    names = hashes_for(24, f"batched-{seed}")
    lk = make_linker(
        pool,
        local_dram_bytes_per_worker=SLOTS * PAGE_BYTES,
        eviction_policy=policy,
        max_inflight_offload_bytes=2 * SLOTS * PAGE_BYTES,
    )
    states, outcomes, held, recent = [], [], [], []
    try:
        for step in range(STEPS):
            if held and (len(held) > 3 or rng.random() < 0.15):
                lk.release_request(held.pop(0))
                outcomes.append("release")
            elif recent and rng.random() < 0.35:
                # Pages of the last stored offload (still resident, mostly):
                # held claims pin their slots against eviction.
                rid = f"claim-{step}"
                chosen = recent[: rng.randint(2, 7)]
                handle = lk.prepare_request(
                    LinkerRequestContext(rid), kv_transfer(chosen)
                )
                wait_until(lambda h=handle: lk.preparation_ready(h), what="prepared")
                held.append(rid)
                outcomes.append(("claim", lk.lookup(rid, kv_transfer(chosen))))
            else:
                chosen = rng.sample(names, rng.randint(2, 7))
                pages = list(range(1, 1 + len(chosen)))
                assert lk.offload(kv_transfer(chosen, pages)) is True
                wait_until(lambda: lk.num_completed_offloads() >= 1, what="offload")
                stored = lk.pop_completed_offload()
                recent = chosen if stored else recent
                outcomes.append(("offload", stored))
            states.append(_state(lk, names))
        for rid in held:
            lk.release_request(rid)
    finally:
        lk.close()
    return states, outcomes


def _kvcr_reserve_fill(core, keys, label, deadline, keep):
    """The reference: kvcr's own ``reserve_fill`` (it protects only ``keys``)."""
    from kvcr.types import CacheTier

    got, _ = core._local_dram.reserve_fill(
        keys,
        sources=dict.fromkeys(keys, CacheTier.FW_G2),
        required_local=False,
        deadline=deadline,
        layout=[label],
    )
    return set(got)


@pytest.mark.parametrize("policy", ["fifo", "lru"])
def test_one_allocation_gives_the_slots_and_victims_kvcr_would(monkeypatch, policy):
    """Per seed, five runs: one allocation (its victims chosen by the linker) vs
    key by key through kvcr's ``_allocate_slots`` and vs one kvcr
    ``_allocate_slots`` call for the batch (all keeping the deposit's own pages),
    and, keeping only the keys reserved as kvcr does, one allocation vs kvcr's
    ``reserve_fill`` itself."""
    from kvcr import local_dram

    pool = make_pool()
    fill_random(pool, list(range(1, 8)), seed=31)
    calls: list[tuple[int, bool, int]] = []  # (slots asked, met, victims)
    kvcr_batches: list[tuple[int, int]] = []  # kvcr's allocator: (asked, victims)
    allocate = local_dram._LocalDram._allocate_slots
    batched_allocate = batched_slots.allocate

    def counting(self, layout, protected, deadline):
        got = allocate(self, layout, protected, deadline)
        kvcr_batches.append((len(layout), len(got[1])))
        calls.append((len(layout), got[0] is not None, len(got[1])))
        return got

    def counting_batched(core, label, count, keep, deadline):
        got = batched_allocate(core, label, count, keep, deadline)
        calls.append((count, got[0] is not None, len(got[1])))
        return got

    reserve = batched_slots.reserve

    def as_kvcr(core, keys, label, deadline, keep):
        return reserve(core, keys, label, deadline, set(keys))

    monkeypatch.setattr(local_dram._LocalDram, "_allocate_slots", counting)
    monkeypatch.setattr(batched_slots, "allocate", counting_batched)
    used: list[tuple[int, bool, int]] = []  # the deposit's pages kept
    used_as_kvcr: list[tuple[int, bool, int]] = []  # only the reserved keys kept
    for seed in range(SEEDS):
        calls.clear()
        kvcr_batches.clear()
        batched = _run(policy, seed, pool)
        used += calls
        # kvcr's allocator evicted for no batch (only in the key-by-key fallback
        # of a batch that could not be met whole): the linker chose those.
        assert all(not out for asked, out in kvcr_batches if asked > 1), kvcr_batches
        with monkeypatch.context() as m:
            m.setattr(batched_slots, "ONE_ALLOCATION", False)
            calls.clear()
            per_key = _run(policy, seed, pool)
            assert all(asked == 1 for asked, _, _ in calls)
        with monkeypatch.context() as m:
            m.setattr(batched_slots, "ONE_EVICTION", False)
            kvcr_allocator = _run(policy, seed, pool)
        with monkeypatch.context() as m:
            m.setattr(batched_slots, "reserve", as_kvcr)
            calls.clear()
            batched_as_kvcr = _run(policy, seed, pool)
            used_as_kvcr += calls
        with monkeypatch.context() as m:
            m.setattr(batched_slots, "reserve", _kvcr_reserve_fill)
            kvcr_own = _run(policy, seed, pool)
        for name, one, other in (
            ("key by key", batched, per_key),
            ("kvcr's _allocate_slots", batched, kvcr_allocator),
            ("kvcr's reserve_fill", batched_as_kvcr, kvcr_own),
        ):
            assert one[1] == other[1], f"seed {seed}: outcomes differ from {name}"
            for step, (a, b) in enumerate(zip(one[0], other[0], strict=True)):
                assert a == b, f"seed {seed} step {step}: state differs from {name}"
    # Both comparisons reached what the one allocation must get right: batches
    # met by evicting, and batches that could not be met whole (key by key then).
    for name, seen in (("kept", used), ("as kvcr", used_as_kvcr)):
        evicting = [c for c in seen if c[0] > 1 and c[1] and c[2] > 0]
        refused = [c for c in seen if c[0] > 1 and not c[1]]
        assert len(evicting) >= 5, (name, seen)
        assert len(refused) >= 2, (name, seen)


def test_a_deposit_never_evicts_its_own_pages():
    """A full FIFO cache holds a..d; a deposit of (a, e) evicts b for e, not a (the
    oldest, which kvcr's own reservation would pick): the offload is stored and a
    stays resident."""
    pool = make_pool()
    fill_random(pool, list(range(1, 6)), seed=32)
    a, b, c, d, e = hashes_for(5, "own-pages")
    lk = make_linker(
        pool, local_dram_bytes_per_worker=4 * PAGE_BYTES, eviction_policy="fifo"
    )
    try:
        for name, page in ((a, 1), (b, 2), (c, 3), (d, 4)):
            assert lk.offload(kv_transfer([name], [page])) is True
            wait_until(lambda: lk.num_completed_offloads() >= 1, what="offload")
            assert lk.pop_completed_offload() is True
        assert lk.offload(kv_transfer([a, e], [1, 5])) is True
        wait_until(lambda: lk.num_completed_offloads() >= 1, what="offload")
        assert lk.pop_completed_offload() is True
        wait_until(
            lambda: lk.layout.block_key(e, "kv") in lk.residency, what="e resident"
        )
        resident = {
            n for n in (a, b, c, d, e) if lk.layout.block_key(n, "kv") in lk.residency
        }
        assert resident == {a, c, d, e}
    finally:
        lk.close()


@pytest.mark.parametrize("policy", ["fifo", "lru"])
def test_one_commit_leaves_the_state_kvcr_would(monkeypatch, policy):
    """Per seed, the same run with landed chunks marked READY by
    ``batched_slots.commit_landed`` and by kvcr's own ``_apply_fill_result``: the same
    outcomes, and after every step the same keys, slots, states, eviction order,
    evictable counts and published inventory. The batched commit must have done
    most of the run's commits (not fallen back to kvcr's path)."""
    pool = make_pool()
    fill_random(pool, list(range(1, 8)), seed=33)
    commit = batched_slots.commit_landed
    taken: list[bool] = []

    def counting(core, keys, slots, success):
        done = commit(core, keys, slots, success)
        taken.append(done)
        return done

    monkeypatch.setattr(batched_slots, "commit_landed", counting)
    for seed in range(SEEDS):
        taken.clear()
        batched = _run(policy, seed + 10, pool)
        assert sum(taken) >= 10 and sum(taken) == len(taken), taken
        with monkeypatch.context() as m:
            m.setattr(batched_slots, "ONE_COMMIT", False)
            taken.clear()
            kvcr_own = _run(policy, seed + 10, pool)
            assert taken and not any(taken)
        assert batched[1] == kvcr_own[1], f"seed {seed}: outcomes differ"
        for step, (a, b) in enumerate(zip(batched[0], kvcr_own[0], strict=True)):
            assert a == b, f"seed {seed} step {step}: state differs from kvcr's"


def test_one_commit_leaves_a_chunk_an_operation_waits_on_to_kvcr():
    """A FILLING key some kvcr operation waits on (a fetch of a page being
    filled), or kvcr's key history on: ``batched_slots.commit_landed`` changes nothing and
    says so, so kvcr's own path answers that operation; without either it marks
    the chunk READY and evictable."""
    from kvcr.local_dram import _LocalDramState

    pool = make_pool()
    (name,) = hashes_for(1, "one-commit-waiter")
    lk = make_linker(pool)
    key = lk.layout.block_key(name, "kv")
    label = lk.layout.pools[0].block_label

    def run(kv):
        core = kv._core
        with core._state_lock:
            deadline = core._operation_deadline()
            assert batched_slots.reserve(core, [key], label, deadline, {key}) == {key}
            record = core._block_record_map[key]
            slots = (tuple(record.local_dram.slots),)
            record.add_in_flight_op(("fetch", 987654))
            waited = batched_slots.commit_landed(core, (key,), slots, True)
            state_waited = record.local_dram.state
            record.discard_in_flight_op(("fetch", 987654))
            core._key_history_enabled, history = True, core._key_history_enabled
            logged = batched_slots.commit_landed(core, (key,), slots, True)
            core._key_history_enabled = history
            state_logged = record.local_dram.state
            done = batched_slots.commit_landed(core, (key,), slots, True)
            evictable = core._local_dram._evictable.score(key) is not None
            return (
                waited,
                state_waited,
                logged,
                state_logged,
                done,
                evictable,
                (record.local_dram.state),
            )

    try:
        waited, s1, logged, s2, done, evictable, s3 = lk._adapter.call(run)
    finally:
        lk.close()
    assert (waited, s1) == (False, _LocalDramState.FILLING)
    assert (logged, s2) == (False, _LocalDramState.FILLING)
    assert (done, s3, evictable) == (True, _LocalDramState.READY, True)


def test_victims_evicted_before_a_failed_allocation_are_published(monkeypatch):
    """The linker evicts a batch's victims, then kvcr's allocator hands out the
    slots; should that call raise, the offload fails and the victims, already
    gone from kvcr, are still published as removed: the linker never believes a
    page resident that kvcr dropped."""
    from kvcr import local_dram

    pool = make_pool()
    fill_random(pool, list(range(1, 7)), seed=34)
    names = hashes_for(6, "victims-published")
    lk = make_linker(
        pool, local_dram_bytes_per_worker=4 * PAGE_BYTES, eviction_policy="fifo"
    )
    allocate = local_dram._LocalDram._allocate_slots
    raised: list[int] = []

    def raising(self, layout, protected, deadline):
        if len(layout) > 1 and not raised:
            raised.append(len(layout))
            raise RuntimeError("allocator fault (test)")
        return allocate(self, layout, protected, deadline)

    def resident() -> set[str]:
        return {n for n in names if lk.layout.block_key(n, "kv") in lk.residency}

    try:
        for page, name in enumerate(names[:4], start=1):
            assert lk.offload(kv_transfer([name], [page])) is True
            wait_until(lambda: lk.num_completed_offloads() >= 1, what="offload")
            assert lk.pop_completed_offload() is True
        wait_until(lambda: resident() == set(names[:4]), what="four resident")
        monkeypatch.setattr(local_dram._LocalDram, "_allocate_slots", raising)
        assert lk.offload(kv_transfer(names[4:], [5, 6])) is True
        wait_until(lambda: lk.num_completed_offloads() >= 1, what="offload")
        assert lk.pop_completed_offload() is False
        assert raised == [2]
        wait_until(lambda: resident() == set(names[2:4]), what="victims published")
    finally:
        lk.close()
